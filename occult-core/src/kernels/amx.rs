//! The bf16-weight path of [`super::gemm_nt`] on Intel AMX (Sapphire Rapids and later):
//! `C = A · Bᵀ` with bf16 weights `B`, as tile multiplies (`tdpbf16ps`) that accumulate in f32.
//!
//! The roles are swapped so that the weight, the big operand, is read in its stored layout:
//! `Cᵀ = B · Aᵀ`. A weight tile is 16 weight rows by 32 `k` (64 bytes a row), loaded straight
//! from the weight with its row stride. `A` (the activations, small) is packed once per call
//! into the pair-interleaved tiles the instruction takes (`[16 k pairs][16 rows][2]`), rounded
//! to bf16 where it is f32: on this path the products are of bf16 values (as in PyTorch's bf16
//! matmul), and only the sums are f32. Each step multiplies two weight tiles by two activation
//! tiles into four f32 accumulator tiles (`tmm0`-`tmm3`; weights in `tmm4`, `tmm5`, activations
//! in `tmm6`, `tmm7`), over the whole of `k`; the results, 32 columns by 32 rows of `Cᵀ`, are
//! stored to a small buffer and gathered into rows of `C`. Blocks of columns are split across
//! rayon's threads, and each task configures the tiles itself (tile state is per thread).
//! Within a task the rows are walked in blocks of about 512 KB of packed activations, outside
//! the columns, so that a block stays in L2 while the task's weights stream past it.
//!
//! While a column pair computes, the next pair's weight rows (contiguous in memory) are
//! prefetched into L2, a share per step. A `k` that is not a multiple of 32, and a last column
//! pair of fewer than 32 weight rows, are read through a zero-padded copy of the pair's rows.
//! Activations are packed with AVX-512 (`vcvtne2ps2bf16` rounds f32 to nearest even), every
//! CPU with AMX has it.
//!
//! Linux hands the tile registers to a process only after it asks (`arch_prctl`); [`super::isa::Isa::detect`] (which asks for them)
//! asks, and says no if the CPU lacks the instructions or the kernel refuses. Rust has no
//! stable AMX intrinsics, so the instructions are written as inline assembly.

use super::elem::Elem;
use super::shared::Shared;
use half::bf16;
use rayon::prelude::*;

/// `k` per step: 32 bf16 (one 64-byte tile row).
const KSTEP: usize = 32;
/// Rows of a tile (16 weight rows, 16 `k` pairs) and f32 columns of an accumulator.
const T: usize = 16;
/// u32 per packed activation tile (`[16 pairs][16 rows]` of bf16 pairs, 1 KB).
const XTILE: usize = T * T;

/// An activation type the AMX path packs: its rows become bf16 pairs.
pub trait AmxRow: Elem {
    /// Packs 16 rows (`rows` of them real) of `[.., k]` starting at `src` into `dst`, the
    /// row tile's `steps` tiles.
    ///
    /// # Safety
    /// AVX-512 F, BW and BF16; `src` holds `rows * k` elements, `dst` `steps * XTILE`.
    unsafe fn pack_tile(src: *const Self, rows: usize, k: usize, dst: *mut u32, steps: usize);
}

impl AmxRow for f32 {
    unsafe fn pack_tile(src: *const f32, rows: usize, k: usize, dst: *mut u32, steps: usize) {
        #[cfg(target_arch = "x86_64")]
        x86::pack_f32(src, rows, k, dst, steps);
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("AMX on a CPU without it ({src:?} {rows} {k} {dst:?} {steps})");
    }
}

impl AmxRow for bf16 {
    unsafe fn pack_tile(src: *const bf16, rows: usize, k: usize, dst: *mut u32, steps: usize) {
        #[cfg(target_arch = "x86_64")]
        x86::pack_bf16(src as *const u16, rows, k, dst, steps);
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("AMX on a CPU without it ({src:?} {rows} {k} {dst:?} {steps})");
    }
}

/// `A` `[m, k]` as bf16 pair tiles, each `[16 k pairs][16 rows]` of u32 (a pair's first
/// value in the low half): tile `t` (rows `16 t ..`), step `s` starts at `(t * steps + s) *
/// XTILE` u32, and within a tile the pair `p` of row `r` is at `16 p + r`. Zero past `m` and
/// `k`. Row tiles are packed in parallel.
///
/// Returns the buffer and where in it the tiles start, on a 64-byte boundary (each row of a
/// tile load is then one cache line).
unsafe fn pack_a<A: AmxRow>(a: &[A], m: usize, k: usize, steps: usize) -> (Vec<u32>, usize) {
    let tiles = m.div_ceil(T);
    let len = tiles * steps * XTILE;
    let mut buf = vec![0u32; len + 15];
    let at = buf.as_ptr().align_offset(64);
    let packed = &mut buf[at..at + len];
    let src = Shared(a.as_ptr());
    let pack_tile = |(t, dst): (usize, &mut [u32])| {
        // SAFETY: the caller's CPU check; `a` holds the tile's rows, `dst` its steps.
        unsafe {
            A::pack_tile(
                src.at(t * T * k),
                T.min(m - t * T),
                k,
                dst.as_mut_ptr(),
                steps,
            )
        }
    };
    let tile_len = steps * XTILE;
    if tiles > 1 && rayon::current_num_threads() > 1 {
        packed
            .par_chunks_mut(tile_len)
            .enumerate()
            .for_each(pack_tile);
    } else {
        packed.chunks_mut(tile_len).enumerate().for_each(pack_tile);
    }
    (buf, at)
}

/// Column blocks (of 32 columns, two weight tiles) per parallel task: one task per thread, each
/// walking one run of weight rows (as in [`super::outer`]; against four per thread, a
/// 512-token bf16 prefill of OLMoE's layer measured 1-3% faster over three rounds).
fn pairs_per_task(pairs: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    pairs.div_ceil(threads).max(1)
}

/// Row tiles per row block: an even number whose packed rows (1 KB a tile per step) come to
/// about 512 KB, a quarter of L2, so that they are read from L2 by every column of a task
/// rather than from memory (measured on 512 rows: the whole of `A` is 2 MB at k = 2048).
fn row_block_tiles(steps: usize) -> usize {
    (512 / steps.max(1)).max(2) & !1
}

/// `c[m, n] = a[m, k] · b[n, k]ᵀ` with the products in bf16 and the sums in f32.
///
/// # Safety
/// [`super::isa::Isa::detect`] (which asks for them) returned true in this process; slices of `m * k`, `n * k` and `m * n` elements.
pub unsafe fn gemm<A: AmxRow>(a: &[A], b: &[bf16], c: &mut [f32], m: usize, n: usize, k: usize) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    let steps = k.div_ceil(KSTEP);
    let kp = steps * KSTEP;
    let (packed, at) = pack_a(a, m, k, steps);
    let (pa, pb, pc) = (
        Shared(packed.as_ptr().add(at)),
        Shared(b.as_ptr() as *const u16),
        Shared(c.as_mut_ptr()),
    );
    let pairs = n.div_ceil(2 * T);
    let per_task = pairs_per_task(pairs);
    let tasks = pairs.div_ceil(per_task);
    let row_tiles = m.div_ceil(T);
    let block_tiles = row_block_tiles(steps);
    let task = |task: usize| {
        // Accumulators of one (column pair, row pair) block: tile `2 i + j` is weight block `i`
        // by row tile `j`, `[16 columns][16 rows]` f32.
        let mut ct = [0f32; 4 * T * T];
        // Weight rows that cannot be read in place, zero-padded to 32 rows by `kp`.
        let mut wbuf: Vec<u16> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        x86::configure();
        // Row blocks outer, so that a block's packed rows stay in L2 while the task's
        // columns stream past them.
        for rb in (0..row_tiles).step_by(block_tiles) {
            let rb_end = (rb + block_tiles).min(row_tiles);
            for pair in task * per_task..((task + 1) * per_task).min(pairs) {
                let n0 = pair * 2 * T;
                let cols = (2 * T).min(n - n0);
                let wblocks = cols.div_ceil(T);
                let (w, ldw) = if k == kp && cols == 2 * T {
                    (pb.at(n0 * k), k)
                } else {
                    wbuf.clear();
                    wbuf.resize(2 * T * kp, 0);
                    for r in 0..cols {
                        let src = std::slice::from_raw_parts(pb.at((n0 + r) * k), k);
                        wbuf[r * kp..r * kp + k].copy_from_slice(src);
                    }
                    (wbuf.as_ptr(), kp)
                };
                let row_pairs = (rb_end - rb).div_ceil(2);
                // The next column pair's weight rows (contiguous when read in place), prefetched
                // into L2 a share per step: measured 5-10% off a bf16 prefill whose expert weights
                // stream from memory (prefetching each row a few steps ahead gained nothing).
                let next_len = if pair + 1 < pairs && k == kp {
                    (2 * T).min(n - n0 - 2 * T) * k * 2
                } else {
                    0
                };
                let share = next_len.div_ceil(64 * row_pairs) * 64;
                let next = pb.at((n0 + 2 * T) * k) as *const u8;
                let mut t0 = rb;
                while t0 < rb_end {
                    let rtiles = 2.min(rb_end - t0);
                    let start = ((t0 - rb) / 2 * share).min(next_len);
                    let block = Block {
                        wblocks,
                        rtiles,
                        w,
                        ldw,
                        x: pa.at(t0 * steps * XTILE),
                        steps,
                        prefetch: next.wrapping_add(start),
                        prefetch_end: next.wrapping_add((start + share).min(next_len)),
                        prefetch_lines: share.div_ceil(64 * steps),
                    };
                    #[cfg(target_arch = "x86_64")]
                    x86::block(&block, ct.as_mut_ptr());
                    #[cfg(not(target_arch = "x86_64"))]
                    unreachable!("AMX on a CPU without it ({:?})", block.w);
                    for j in 0..rtiles {
                        let rows = T.min(m - (t0 + j) * T);
                        for i in 0..wblocks {
                            #[cfg(target_arch = "x86_64")]
                            x86::store_transposed(
                                ct.as_ptr().add((2 * i + j) * T * T),
                                pc.at((t0 + j) * T * n + n0 + i * T),
                                n,
                                rows,
                                T.min(cols - i * T),
                            );
                        }
                    }
                    t0 += rtiles;
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        x86::release();
    };
    if tasks > 1 && rayon::current_num_threads() > 1 {
        (0..tasks).into_par_iter().for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
}

/// One block of the product: `steps` steps of `wblocks` (1 or 2) weight tiles (rows of `w`,
/// stride `ldw` u16) by `rtiles` (1 or 2) packed row tiles (`x`, `steps` tiles apart), while
/// the bytes from `prefetch` to `prefetch_end` are prefetched, `prefetch_lines` lines a step.
struct Block {
    wblocks: usize,
    rtiles: usize,
    w: *const u16,
    ldw: usize,
    x: *const u32,
    steps: usize,
    prefetch: *const u8,
    prefetch_end: *const u8,
    prefetch_lines: usize,
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The tile instructions, as inline assembly (no stable intrinsics).
    use super::{Block, KSTEP, T, XTILE};
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// Offsets of one row's 16 pairs in a packed tile (pair `p` at `16 p`), and of a row's 16
    /// columns in an accumulator tile.
    #[target_feature(enable = "avx512f")]
    unsafe fn pair_offsets() -> __m512i {
        _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(T as i32),
        )
    }

    /// Lanes of the `k` step at `k0` that are within `k`.
    fn step_mask(k0: usize, k: usize) -> u32 {
        let n = KSTEP.min(k - k0);
        if n == 32 {
            u32::MAX
        } else {
            (1u32 << n) - 1
        }
    }

    /// f32 rows rounded to bf16 pairs (`vcvtne2ps2bf16`, round to nearest even) and scattered
    /// into the tile's pair-major layout.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn pack_f32(src: *const f32, rows: usize, k: usize, dst: *mut u32, steps: usize) {
        let idx = pair_offsets();
        for r in 0..rows {
            let row = src.add(r * k);
            for s in 0..steps {
                let k0 = s * KSTEP;
                let mask = step_mask(k0, k);
                let lo = _mm512_maskz_loadu_ps(mask as u16, row.add(k0));
                let hi = _mm512_maskz_loadu_ps((mask >> 16) as u16, row.add(k0 + 16));
                let pairs: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_i32scatter_epi32::<4>(dst.add(s * XTILE + r) as *mut _, idx, pairs);
            }
        }
    }

    /// bf16 rows: each 32-value step is already 16 pairs.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn pack_bf16(src: *const u16, rows: usize, k: usize, dst: *mut u32, steps: usize) {
        let idx = pair_offsets();
        for r in 0..rows {
            let row = src.add(r * k);
            for s in 0..steps {
                let k0 = s * KSTEP;
                let pairs = _mm512_maskz_loadu_epi16(step_mask(k0, k), row.add(k0) as *const i16);
                _mm512_i32scatter_epi32::<4>(dst.add(s * XTILE + r) as *mut _, idx, pairs);
            }
        }
    }

    /// Stores an accumulator tile `ct` (`[16 columns][16 rows]`) as the first `rows` rows and
    /// `cols` columns of `C` at `dst` (row stride `ldc`): one gather of a row's columns each.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn store_transposed(
        ct: *const f32,
        dst: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
    ) {
        let idx = pair_offsets();
        let mask = if cols >= T {
            u16::MAX
        } else {
            (1u16 << cols) - 1
        };
        for r in 0..rows {
            let row = _mm512_i32gather_ps::<4>(idx, ct.add(r));
            _mm512_mask_storeu_ps(dst.add(r * ldc), mask, row);
        }
    }

    /// The tile configuration (`ldtilecfg`'s 64-byte operand), palette 1: every tile 16 rows of
    /// 64 bytes.
    #[repr(C, align(64))]
    struct Config {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        colsb: [u16; 16],
        rows: [u8; 16],
    }

    /// Configures this thread's tiles `tmm0`-`tmm7` as 16 x 64 bytes.
    pub unsafe fn configure() {
        let mut cfg = Config {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            cfg.colsb[t] = 64;
            cfg.rows[t] = T as u8;
        }
        asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly));
    }

    /// Returns this thread's tile state to the initial state.
    pub unsafe fn release() {
        asm!("tilerelease", options(nostack, nomem));
    }

    /// Zeroes the accumulators, runs the block's steps, and stores the accumulators to `ct`
    /// (tile `2 i + j`, weight tile `i` by row tile `j`, at `(2 i + j) * 256`).
    pub unsafe fn block(b: &Block, ct: *mut f32) {
        let (wblocks, rtiles, w, ldw, x, steps) = (b.wblocks, b.rtiles, b.w, b.ldw, b.x, b.steps);
        let wstride = ldw * 2;
        let w1 = w.wrapping_add(T * ldw);
        let x1 = x.wrapping_add(steps * XTILE);
        let mut pf = b.prefetch;
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
        for s in 0..steps {
            let (wa, wb) = (w.add(s * 32), w1.wrapping_add(s * 32));
            let (xa, xb) = (x.add(s * XTILE), x1.wrapping_add(s * XTILE));
            for _ in 0..b.prefetch_lines {
                if pf >= b.prefetch_end {
                    break;
                }
                _mm_prefetch::<_MM_HINT_T1>(pf as *const i8);
                pf = pf.wrapping_add(64);
            }
            match (wblocks, rtiles) {
                (2, 2) => asm!(
                    "tileloadd tmm4, [{wa} + {ws}*1]",
                    "tileloadd tmm6, [{xa} + {xs}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{xb} + {xs}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{wb} + {ws}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    wa = in(reg) wa, wb = in(reg) wb, xa = in(reg) xa, xb = in(reg) xb,
                    ws = in(reg) wstride, xs = in(reg) 64usize,
                    options(nostack, readonly)
                ),
                (2, 1) => asm!(
                    "tileloadd tmm4, [{wa} + {ws}*1]",
                    "tileloadd tmm6, [{xa} + {xs}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm5, [{wb} + {ws}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    wa = in(reg) wa, wb = in(reg) wb, xa = in(reg) xa,
                    ws = in(reg) wstride, xs = in(reg) 64usize,
                    options(nostack, readonly)
                ),
                (1, 2) => asm!(
                    "tileloadd tmm4, [{wa} + {ws}*1]",
                    "tileloadd tmm6, [{xa} + {xs}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{xb} + {xs}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    wa = in(reg) wa, xa = in(reg) xa, xb = in(reg) xb,
                    ws = in(reg) wstride, xs = in(reg) 64usize,
                    options(nostack, readonly)
                ),
                (1, 1) => asm!(
                    "tileloadd tmm4, [{wa} + {ws}*1]",
                    "tileloadd tmm6, [{xa} + {xs}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    wa = in(reg) wa, xa = in(reg) xa,
                    ws = in(reg) wstride, xs = in(reg) 64usize,
                    options(nostack, readonly)
                ),
                (i, j) => unreachable!("AMX block of {i} x {j} tiles"),
            }
        }
        asm!(
            "tilestored [{c0} + {cs}*1], tmm0",
            "tilestored [{c1} + {cs}*1], tmm1",
            "tilestored [{c2} + {cs}*1], tmm2",
            "tilestored [{c3} + {cs}*1], tmm3",
            c0 = in(reg) ct,
            c1 = in(reg) ct.add(T * T),
            c2 = in(reg) ct.add(2 * T * T),
            c3 = in(reg) ct.add(3 * T * T),
            cs = in(reg) 64usize,
            options(nostack)
        );
    }
}
