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
//!
//! On AVX2 ([`Simd::Avx2`]) the blocks are the same; a micro-tile covers sixteen rows (two
//! eight-lane vectors) by [`NR_AVX2`] weight rows, 12 accumulators of AVX2's sixteen
//! registers, and walks the tile's groups of sixteen rows one after another over the same
//! weight rows, which a shorter `k` block ([`KC_AVX2`]) keeps in L1. The tile is packed group
//! by group (`[group][k][16]`), so that each micro-tile reads its rows as one contiguous run
//! (3-5% over reading them 64 floats apart from the AVX-512 layout, `occult bench kernels`).

use super::elem::Elem;
use super::isa::Simd;
use super::shared::Shared;
use rayon::prelude::*;

/// Rows of `A` per tile: four 16-lane vectors (four groups of sixteen rows on AVX2).
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

/// `k` per block on AVX2, where a micro-tile's weight rows are read once per sixteen rows of
/// the tile: [`NR_AVX2`] rows of 512 f32 (12 KB) stay in L1 across them.
const KC_AVX2: usize = 512;
/// Columns of `C` per micro-tile on AVX2.
const NR_AVX2: usize = 6;

/// `k` per block for weights of type `W` at `simd`.
fn kc_for<W: Elem>(simd: Simd) -> usize {
    match simd {
        Simd::Avx512 if W::IS_F32 => KC,
        Simd::Avx512 => KC_WIDENED,
        Simd::Avx2 => KC_AVX2.min(if W::IS_F32 { KC } else { KC_WIDENED }),
    }
}

/// Columns of `C` per micro-tile for a tile of `v` vectors of rows: 24 accumulators at most
/// (16 for one vector, where each step is one load and sixteen broadcasts).
pub(super) const fn nr_for(v: usize) -> usize {
    match v {
        4 => 6,
        3 => 8,
        2 => 12,
        _ => 16,
    }
}

/// Vectors (of 16 rows) in the tile of `rows` rows.
pub(super) fn vectors(rows: usize) -> usize {
    rows.div_ceil(16)
}

/// `A` `[m, k]` packed tile by tile: tile `t` (rows `MT * t ..`) starts at `MT * t * k` and
/// holds `[k][16 * vectors(rows)]` at AVX-512, or `[vectors(rows)][k][16]` at AVX2, zero past
/// its last row. Tiles are packed in parallel, each
/// on one thread (a 64-row tile split in blocks of `k` across two threads measured 1.7-2.7x
/// slower to pack than on one: the second thread's wake-up costs more than the work). Returns
/// the buffer and where in it the packed tiles start (on a 64-byte boundary: the micro-tiles'
/// loads of unaligned rows straddled two cache lines each).
///
/// # Safety
/// `simd`'s instructions.
unsafe fn pack_a<T: Elem>(a: &[T], m: usize, k: usize, simd: Simd) -> (Vec<f32>, usize) {
    let tiles = m.div_ceil(MT);
    let last = m - (tiles - 1) * MT;
    let len = (tiles - 1) * MT * k + 16 * vectors(last) * k;
    // Every element is written below (padding rows as zeros).
    let (mut packed, at) = super::scratch::take_aligned(len);
    let ptr = Shared(packed.as_mut_ptr().wrapping_add(at));
    let whole = k / 16 * 16;
    let task = |t: usize| {
        let rows = MT.min(m - t * MT);
        let width = 16 * vectors(rows);
        let dst = ptr.at(t * MT * k);
        let rows_at = &a[t * MT * k..(t * MT + rows) * k];
        // Sixteen rows by sixteen `k` at a time, transposed in registers: each row's line is
        // read once. (Element by element, the rows' reads, `k` apart, met in a few L1 sets and
        // evicted each other: 13% of a 64-row product.)
        for i0 in (0..rows).step_by(16) {
            let group = 16.min(rows - i0);
            let mut block = [[0f32; 16]; 16];
            for kk in (0..whole).step_by(16) {
                // SAFETY: `simd`'s instructions (the caller's promise); the block's sixteen
                // columns land in this tile, within its width.
                unsafe {
                    for (r, row) in block.iter_mut().take(group).enumerate() {
                        T::widen(&rows_at[(i0 + r) * k + kk..][..16], row, simd);
                    }
                    let (to, stride) = match simd {
                        Simd::Avx512 => (dst.add(kk * width + i0), width),
                        Simd::Avx2 => (dst.add(i0 * k + kk * 16), 16),
                    };
                    transpose16(simd, block.as_ptr().cast(), 16, to, stride);
                }
            }
        }
        for kk in whole..k {
            for i in 0..width {
                let at = match simd {
                    Simd::Avx512 => kk * width + i,
                    Simd::Avx2 => i / 16 * 16 * k + kk * 16 + i % 16,
                };
                let v = if i < rows {
                    rows_at[i * k + kk].to_f32()
                } else {
                    0.0
                };
                // SAFETY: tasks write disjoint tiles of `packed`, within its length.
                unsafe { *dst.add(at) = v };
            }
        }
    };
    if tiles > 1 && rayon::current_num_threads() > 1 {
        (0..tiles).into_par_iter().for_each(task);
    } else {
        (0..tiles).for_each(task);
    }
    (packed, at)
}

/// `dst[c * dst_stride + r] = src[r * src_stride + c]` for sixteen rows and sixteen columns.
///
/// # Safety
/// `simd`'s instructions; both ranges in bounds.
unsafe fn transpose16(
    simd: Simd,
    src: *const f32,
    src_stride: usize,
    dst: *mut f32,
    dst_stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    match simd {
        Simd::Avx512 => x86::transpose16(src, src_stride, dst, dst_stride),
        Simd::Avx2 => {
            // Four 8 x 8 blocks, each to its mirrored place.
            for (r, c) in [(0, 0), (0, 8), (8, 0), (8, 8)] {
                avx2::transpose8(
                    src.add(r * src_stride + c),
                    src_stride,
                    dst.add(c * dst_stride + r),
                    dst_stride,
                );
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = simd;
        for r in 0..16 {
            for c in 0..16 {
                *dst.add(c * dst_stride + r) = *src.add(r * src_stride + c);
            }
        }
    }
}

/// Rows `0..rows` of a tile into `c` (row stride `n`, from its first column of the block),
/// from the block's transposed output `ct` (`[column][16 v]`, `cols` columns): sixteen by
/// sixteen where whole, element by element at the edges.
///
/// # Safety
/// `simd`'s instructions; `c` valid for `rows` rows of `cols` columns at stride `n`.
pub(super) unsafe fn store_tile(
    simd: Simd,
    ct: &[f32],
    rows: usize,
    cols: usize,
    c: *mut f32,
    n: usize,
) {
    let width16 = 16 * vectors(rows);
    let (whole_rows, whole_cols) = (rows / 16 * 16, cols / 16 * 16);
    for i0 in (0..whole_rows).step_by(16) {
        for j0 in (0..whole_cols).step_by(16) {
            transpose16(
                simd,
                ct.as_ptr().add(j0 * width16 + i0),
                width16,
                c.add(i0 * n + j0),
                n,
            );
        }
    }
    for i in 0..rows {
        let dst = c.add(i * n);
        let from = if i < whole_rows { whole_cols } else { 0 };
        for jj in from..cols {
            *dst.add(jj) = ct[jj * width16 + i];
        }
    }
}

/// Width of the column blocks handed to threads: one per thread, a whole number of every
/// micro-tile width (48 columns). Against four per thread, paired over four rounds with the
/// weights streaming from memory: 6-9% faster at 64 rows (OLMoE's experts) and 7-10% at 512
/// (a dense projection); each thread then walks one run of weight rows.
pub(super) fn block_width(n: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    n.div_ceil(threads).div_ceil(48).max(1) * 48
}

/// `c[m, n] = a[m, k] · b[n, k]ᵀ`, accumulated in f32.
///
/// # Safety
/// `simd`'s instructions; slices of `m * k`, `n * k` and `m * n` elements.
pub unsafe fn gemm<A: Elem, W: Elem>(
    a: &[A],
    b: &[W],
    c: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    simd: Simd,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    let (packed, at) = pack_a(a, m, k, simd);
    let (pa, pb, pc) = (
        Shared(packed.as_ptr().add(at)),
        Shared(b.as_ptr()),
        Shared(c.as_mut_ptr()),
    );
    let width = block_width(n);
    let blocks = n.div_ceil(width);
    let block = |blk: usize| {
        let c0 = blk * width;
        let c1 = (c0 + width).min(n);
        // The block's output, transposed (`[column][row]`), for one tile at a time.
        // (Each micro-tile's first `k` block overwrites its part.)
        let (mut ct_buf, ct_at) = super::scratch::take_aligned((c1 - c0) * MT);
        let ct = &mut ct_buf[ct_at..ct_at + (c1 - c0) * MT];
        // Widened (bf16) or zero-padded (a tail) weight rows of one micro-tile, `k` block long.
        // (Allocated on first use: f32 weights need it only for a tail.)
        let kc_max = kc_for::<W>(simd);
        let mut wbuf = Vec::new();
        for t in 0..m.div_ceil(MT) {
            let rows = MT.min(m - t * MT);
            let v = vectors(rows);
            let nr = match simd {
                Simd::Avx512 => nr_for(v),
                Simd::Avx2 => NR_AVX2,
            };
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
                                W::widen(src, dst, simd);
                            } else {
                                dst.fill(0.0);
                            }
                        }
                        (wbuf.as_ptr(), ldw)
                    };
                    let (at, out) = (
                        tile.add(kb * 16 * v),
                        ct.as_mut_ptr().add((j - c0) * 16 * v),
                    );
                    #[cfg(target_arch = "x86_64")]
                    match simd {
                        Simd::Avx512 => x86::micro(v, at, w, ldw, kc, out, cols, kb == 0),
                        Simd::Avx2 => {
                            for g in 0..v {
                                let a = tile.add(16 * g * k + 16 * kb);
                                let o = out.add(16 * g);
                                avx2::micro(a, 16 * v, w, ldw, kc, o, cols, kb == 0);
                            }
                        }
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    unreachable!("x86 kernels on another CPU ({at:?} {out:?} {w:?} {ldw})");
                    j += cols;
                }
                kb += kc;
            }
            store_tile(simd, ct, rows, c1 - c0, pc.at(t * MT * n + c0), n);
        }
        super::scratch::give(ct_buf);
    };
    if blocks > 1 && rayon::current_num_threads() > 1 {
        (0..blocks).into_par_iter().for_each(block);
    } else {
        (0..blocks).for_each(block);
    }
    super::scratch::give(packed);
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    //! The micro-tiles, one instantiation per vector count.
    use super::nr_for;
    use std::arch::x86_64::*;

    /// [`super::transpose16`] in four rounds of lane shuffles.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn transpose16(src: *const f32, src_stride: usize, dst: *mut f32, stride: usize) {
        let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(src.add(i * src_stride)));
        // Pairs of rows interleaved within each 128-bit lane.
        let t: [__m512; 16] = std::array::from_fn(|i| {
            let (x, y) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_ps(x, y)
            } else {
                _mm512_unpackhi_ps(x, y)
            }
        });
        // `u[4g + q]`, lane `j`: column `4j + q` of rows `4g .. 4g + 4`.
        let u: [__m512; 16] = std::array::from_fn(|i| {
            let (g, q) = (i / 4, i % 4);
            let (x, y) = (t[4 * g + q / 2], t[4 * g + 2 + q / 2]);
            if q % 2 == 0 {
                _mm512_shuffle_ps::<0x44>(x, y)
            } else {
                _mm512_shuffle_ps::<0xEE>(x, y)
            }
        });
        for q in 0..4 {
            let (a, b, c, d) = (u[q], u[4 + q], u[8 + q], u[12 + q]);
            let (x0, x1) = (
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xEE>(a, b),
            );
            let (y0, y1) = (
                _mm512_shuffle_f32x4::<0x44>(c, d),
                _mm512_shuffle_f32x4::<0xEE>(c, d),
            );
            let cols = [
                _mm512_shuffle_f32x4::<0x88>(x0, y0),
                _mm512_shuffle_f32x4::<0xDD>(x0, y0),
                _mm512_shuffle_f32x4::<0x88>(x1, y1),
                _mm512_shuffle_f32x4::<0xDD>(x1, y1),
            ];
            for (j, col) in cols.into_iter().enumerate() {
                _mm512_storeu_ps(dst.add((4 * j + q) * stride), col);
            }
        }
    }

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
        let rows: [*const f32; NR] = std::array::from_fn(|j| w.add(j * ldw));
        for kk in 0..kc {
            if kk % 16 == 0 {
                for r in rows {
                    _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(kk + PF) as *const i8);
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
                let b = _mm512_set1_ps(*rows[j].add(kk));
                for (i, x) in av.iter().enumerate() {
                    acc[i][j] = _mm512_fmadd_ps(*x, b, acc[i][j]);
                }
            }
        }
        store_acc(&acc, ct, cols, first);
    }

    /// A micro-tile's accumulators (`V` vectors of rows by `NR` columns, of which the first
    /// `cols` are real) into the transposed output `ct` (`[column][16 V]`; overwritten when
    /// `first`, else added to). Shared with [`super::super::outer_dp`].
    #[target_feature(enable = "avx512f")]
    pub(in crate::kernels) unsafe fn store_acc<const V: usize, const NR: usize>(
        acc: &[[__m512; NR]; V],
        ct: *mut f32,
        cols: usize,
        first: bool,
    ) {
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The eight-lane micro-tile and transpose.
    use super::NR_AVX2;
    use std::arch::x86_64::*;

    /// `dst[c * dst_stride + r] = src[r * src_stride + c]` for eight rows and eight columns.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn transpose8(src: *const f32, src_stride: usize, dst: *mut f32, stride: usize) {
        let mut r = [_mm256_setzero_ps(); 8];
        for (i, v) in r.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(src.add(i * src_stride));
        }
        // Pairs of rows interleaved within each 128-bit lane.
        let mut t = [_mm256_setzero_ps(); 8];
        for i in 0..4 {
            t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // `u[4g + q]`, lane `j` of each half: column `4h + q` of rows `4g .. 4g + 4`.
        let mut u = [_mm256_setzero_ps(); 8];
        for g in 0..2 {
            for q in 0..4 {
                let (x, y) = (t[4 * g + q / 2], t[4 * g + 2 + q / 2]);
                u[4 * g + q] = if q % 2 == 0 {
                    _mm256_shuffle_ps::<0x44>(x, y)
                } else {
                    _mm256_shuffle_ps::<0xEE>(x, y)
                };
            }
        }
        // Column q from the low halves, column q + 4 from the high halves.
        for q in 0..4 {
            let lo = _mm256_permute2f128_ps::<0x20>(u[q], u[4 + q]);
            let hi = _mm256_permute2f128_ps::<0x31>(u[q], u[4 + q]);
            _mm256_storeu_ps(dst.add(q * stride), lo);
            _mm256_storeu_ps(dst.add((q + 4) * stride), hi);
        }
    }

    /// How far ahead (in f32) each weight row is prefetched, a line each 16 steps.
    const PF: usize = 128;

    /// Sixteen rows of the packed tile from `a` (sixteen f32 a `k` step: the tile's group of
    /// sixteen rows, packed `[k][16]`) by [`NR_AVX2`] weight rows from `w` (row stride `ldw`,
    /// `kc` long), of which the first `cols` are real, into the transposed output `ct` (column
    /// stride `ldc`; overwritten when `first`, else added to).
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn micro(
        a: *const f32,
        ldc: usize,
        w: *const f32,
        ldw: usize,
        kc: usize,
        ct: *mut f32,
        cols: usize,
        first: bool,
    ) {
        let mut acc = [[_mm256_setzero_ps(); NR_AVX2]; 2];
        let rows: [*const f32; NR_AVX2] = std::array::from_fn(|j| w.add(j * ldw));
        for kk in 0..kc {
            if kk % 16 == 0 {
                for r in rows {
                    _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(kk + PF) as *const i8);
                }
            }
            let a0 = _mm256_loadu_ps(a.add(kk * 16));
            let a1 = _mm256_loadu_ps(a.add(kk * 16 + 8));
            for (j, r) in rows.iter().enumerate() {
                let b = _mm256_broadcast_ss(&*r.add(kk));
                acc[0][j] = _mm256_fmadd_ps(a0, b, acc[0][j]);
                acc[1][j] = _mm256_fmadd_ps(a1, b, acc[1][j]);
            }
        }
        for j in 0..cols.min(NR_AVX2) {
            for (h, half) in acc.iter().enumerate() {
                let p = ct.add(j * ldc + 8 * h);
                let x = if first {
                    half[j]
                } else {
                    _mm256_add_ps(half[j], _mm256_loadu_ps(p))
                };
                _mm256_storeu_ps(p, x);
            }
        }
    }
}
