//! The many-row path of [`super::gemm_nt`]: `C = A · Bᵀ` as outer products with rows of `A`
//! across the vector lanes and one weight value broadcast per step, in f32 FMA for both f32 and
//! bf16 operands.
//!
//! `A` (the activations, small) is packed once per call into tiles of up to [`MT`] rows laid
//! out `[k][rows]` (bf16 widened to f32, rows padded with zeros to whole vectors). `B` (the
//! weight) is read in its stored layout: a micro-tile broadcasts `NR` weight rows' values at
//! each `k` step and multiplies them into `V` vectors of the packed tile, keeping `V x NR`
//! accumulators over a block of `k`. They are stored as they are, a column of `C` per vector,
//! into a transposed buffer for the thread's block of columns, which is turned into rows of `C`
//! when the tile is done. (Scattering straight into `C` measured up to 1.5x slower, most at
//! short `k`; the sixteen rows of a column of a 1024-wide `C` map to one L1 set.) bf16 weight
//! rows are widened to f32 a
//! micro-tile at a time into a small buffer, so that the inner loop runs at f32's FMA rate
//! (this CPU's `vdpbf16ps` issues at half of it: 80 against 164 GFLOP/s a core, measured).
//! Columns of `C` are split in blocks across rayon's threads.

use super::gemm_nt::Elem;
use super::Shared;
use rayon::prelude::*;

/// Rows of `A` per tile: four 16-lane vectors.
pub const MT: usize = 64;
/// Widest micro-tile (columns of `C` per micro-tile, for one vector of rows).
const NR_MAX: usize = 16;
/// `k` per block, for f32 weights: the packed tile's block (`KC x 64` f32, 512 KB) stays in
/// L2 while every micro-tile of the column block passes over it, and each weight row is read
/// in runs of 8 KB, long enough for the prefetchers. Against 256, with the weights streaming
/// from memory (OLMoE's experts at 512 tokens): 5-10% faster; 128 measured the same as 256. It
/// keeps long `k` (Mixtral's 14336) out of L3.
const KC: usize = 2048;
/// `k` per block for bf16 weights, which are widened a micro-tile at a time: the widened
/// micro-tile (`16 x 256` f32, 16 KB) stays in L1.
const KC_WIDENED: usize = 256;

/// `k` per block for weights of type `W`.
fn kc_for<W: Elem>() -> usize {
    if W::IS_F32 {
        KC
    } else {
        KC_WIDENED
    }
}

/// Columns of `C` per micro-tile for a tile of `v` vectors of rows: 24 accumulators at most
/// (16 for one vector, where each step is one load and sixteen broadcasts).
const fn nr_for(v: usize) -> usize {
    match v {
        4 => 6,
        3 => 8,
        2 => 12,
        _ => 16,
    }
}

/// Vectors (of 16 rows) in the tile of `rows` rows.
fn vectors(rows: usize) -> usize {
    rows.div_ceil(16)
}

/// `A` `[m, k]` packed tile by tile: tile `t` (rows `MT * t ..`) starts at `MT * t * k` and
/// holds `[k][16 * vectors(rows)]`, zero past its last row. Tiles and blocks of 256 `k` are
/// packed in parallel (one tile packed on one thread measured 8-16% of a 64-row product on two).
fn pack_a<T: Elem>(a: &[T], m: usize, k: usize) -> Vec<f32> {
    let tiles = m.div_ceil(MT);
    let last = m - (tiles - 1) * MT;
    let len = (tiles - 1) * MT * k + 16 * vectors(last) * k;
    let mut packed = vec![0f32; len];
    let ptr = Shared(packed.as_mut_ptr());
    let chunks = k.div_ceil(KC_WIDENED);
    let task = |task: usize| {
        let (t, chunk) = (task / chunks, task % chunks);
        let rows = MT.min(m - t * MT);
        let width = 16 * vectors(rows);
        let dst = ptr.at(t * MT * k);
        let (k0, k1) = (chunk * KC_WIDENED, ((chunk + 1) * KC_WIDENED).min(k));
        // Along `k`, a row of the packed tile at a time: its writes are contiguous, and the
        // rows' reads stay in L1 from one `k` to the next (the other order, a row of `A` at a
        // time, wrote with a stride of the tile's width: 13% of a small-model prefill).
        let rows_at = &a[t * MT * k..(t * MT + rows) * k];
        for kk in k0..k1 {
            // SAFETY: tasks write disjoint elements of `packed`, within its length.
            let out = unsafe { std::slice::from_raw_parts_mut(dst.add(kk * width), rows) };
            for (i, o) in out.iter_mut().enumerate() {
                *o = rows_at[i * k + kk].to_f32();
            }
        }
    };
    let tasks = tiles * chunks;
    if tasks > 1 && rayon::current_num_threads() > 1 {
        (0..tasks).into_par_iter().for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
    packed
}

/// Width of the column blocks handed to threads: about four per thread, a whole number of
/// every micro-tile width (48 columns).
fn block_width(n: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    n.div_ceil(4 * threads).div_ceil(48).max(1) * 48
}

/// `c[m, n] = a[m, k] · b[n, k]ᵀ`, accumulated in f32.
///
/// # Safety
/// AVX-512 F; slices of `m * k`, `n * k` and `m * n` elements.
pub unsafe fn gemm<A: Elem, W: Elem>(
    a: &[A],
    b: &[W],
    c: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    let packed = pack_a(a, m, k);
    let (pa, pb, pc) = (
        Shared(packed.as_ptr()),
        Shared(b.as_ptr()),
        Shared(c.as_mut_ptr()),
    );
    let width = block_width(n);
    let blocks = n.div_ceil(width);
    let block = |blk: usize| {
        let c0 = blk * width;
        let c1 = (c0 + width).min(n);
        // The block's output, transposed (`[column][row]`), for one tile at a time.
        let mut ct = vec![0f32; (c1 - c0) * MT];
        // Widened (bf16) or zero-padded (a tail) weight rows of one micro-tile, `k` block long.
        // (Allocated on first use: f32 weights need it only for a tail.)
        let kc_max = kc_for::<W>();
        let mut wbuf = Vec::new();
        for t in 0..m.div_ceil(MT) {
            let rows = MT.min(m - t * MT);
            let v = vectors(rows);
            let nr = nr_for(v);
            let tile = pa.at(t * MT * k);
            let mut kb = 0;
            while kb < k {
                let kc = kc_max.min(k - kb);
                let mut j = c0;
                while j < c1 {
                    let cols = nr.min(c1 - j);
                    // f32 rows are read in place (copying them measured slower); bf16 rows
                    // are widened, and a tail is padded with zero rows, with the buffer's row
                    // stride off a multiple of 4 KB so that its rows do not share L1 sets.
                    let (w, ldw) = if W::IS_F32 && cols == nr {
                        (pb.at(j * k + kb) as *const f32, k)
                    } else {
                        let ldw = kc + 16;
                        wbuf.resize(NR_MAX * (kc_max + 16), 0f32);
                        for r in 0..nr {
                            let dst = &mut wbuf[r * ldw..r * ldw + kc];
                            if r < cols {
                                let src = std::slice::from_raw_parts(pb.at((j + r) * k + kb), kc);
                                W::widen(src, dst);
                            } else {
                                dst.fill(0.0);
                            }
                        }
                        (wbuf.as_ptr(), ldw)
                    };
                    #[cfg(target_arch = "x86_64")]
                    x86::micro(
                        v,
                        tile.add(kb * 16 * v),
                        w,
                        ldw,
                        kc,
                        ct.as_mut_ptr().add((j - c0) * 16 * v),
                        cols,
                        kb == 0,
                    );
                    #[cfg(not(target_arch = "x86_64"))]
                    unreachable!("AVX-512 kernels on a CPU without them ({w:?} {ldw})");
                    j += cols;
                }
                kb += kc;
            }
            // Rows of the tile into `c`, from the transposed block.
            let width16 = 16 * v;
            for i in 0..rows {
                let dst = pc.at((t * MT + i) * n + c0);
                for (jj, col) in ct.chunks_exact(width16).take(c1 - c0).enumerate() {
                    *dst.add(jj) = col[i];
                }
            }
        }
    };
    if blocks > 1 && rayon::current_num_threads() > 1 {
        (0..blocks).into_par_iter().for_each(block);
    } else {
        (0..blocks).for_each(block);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The micro-tiles, one instantiation per vector count.
    use super::nr_for;
    use std::arch::x86_64::*;

    /// How far ahead (in f32) each weight row is prefetched, a line each 16 steps: measured
    /// 5-10% off the f32 experts of a 512-token OLMoE-shaped prefill, whose weights stream
    /// from memory (64 and 256 ahead, and the next micro-tile's rows, measured the same).
    const PF: usize = 128;

    /// The micro-tile for a tile of `v` vectors of rows: `nr_for(v)` weight rows from `w`
    /// (row stride `ldw`, `kc` long), of which the first `cols` are real, into the transposed
    /// output `ct` (`[column][16 v]`; overwritten when `first`, else added to).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn micro(
        v: usize,
        a: *const f32,
        w: *const f32,
        ldw: usize,
        kc: usize,
        ct: *mut f32,
        cols: usize,
        first: bool,
    ) {
        match v {
            4 => micro_const::<4, { nr_for(4) }>(a, w, ldw, kc, ct, cols, first),
            3 => micro_const::<3, { nr_for(3) }>(a, w, ldw, kc, ct, cols, first),
            2 => micro_const::<2, { nr_for(2) }>(a, w, ldw, kc, ct, cols, first),
            1 => micro_const::<1, { nr_for(1) }>(a, w, ldw, kc, ct, cols, first),
            _ => unreachable!("tile of {v} vectors"),
        }
    }

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro_const<const V: usize, const NR: usize>(
        a: *const f32,
        w: *const f32,
        ldw: usize,
        kc: usize,
        ct: *mut f32,
        cols: usize,
        first: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NR]; V];
        for kk in 0..kc {
            if kk % 16 == 0 {
                for j in 0..NR {
                    _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(j * ldw + kk + PF) as *const i8);
                }
            }
            let mut av = [_mm512_setzero_ps(); V];
            for (i, x) in av.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(a.add(kk * V * 16 + i * 16));
            }
            // One broadcast per weight row, used by every vector of rows: `j` indexes the
            // accumulators' inner dimension.
            #[allow(clippy::needless_range_loop)]
            for j in 0..NR {
                let b = _mm512_set1_ps(*w.add(j * ldw + kk));
                for (i, x) in av.iter().enumerate() {
                    acc[i][j] = _mm512_fmadd_ps(*x, b, acc[i][j]);
                }
            }
        }
        for j in 0..cols.min(NR) {
            for (i, row) in acc.iter().enumerate() {
                let p = ct.add(j * V * 16 + i * 16);
                let x = if first {
                    row[j]
                } else {
                    _mm512_add_ps(row[j], _mm512_loadu_ps(p))
                };
                _mm512_storeu_ps(p, x);
            }
        }
    }
}
