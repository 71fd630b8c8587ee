//! `C = A · Bᵀ` on slices, the shape of every linear layer (`A` rows `[m, k]`, `B` a weight
//! `[n, k]` in its stored layout, `C` `[m, n]`, accumulated in f32), with AVX-512 and AVX2
//! kernels ([`Simd`]) for f32 and bf16 operands. One row of `A` (decode) runs
//! [`Kernel::Rows`] ([`super::gemv`]: weight rows streamed one after another); for more,
//! there are two:
//!
//! - [`Kernel::Dot`], for few rows (small experts, batched decode): both operands are read along `k`,
//!   where they are contiguous, so nothing is packed. A tile of `MR` rows of `A` and `NR` rows
//!   of `B` keeps `MR x NR` vector accumulators over the whole of `k` and reduces each to one
//!   output at the end (a tail of `k` is read with a masked load); bf16 multiplies with
//!   `vdpbf16ps` on AVX-512 BF16; on AVX2, eight lanes, bf16 widened in registers, and a tile
//!   of `MR x NR` outputs computed two columns at a time (eight accumulators: AVX2 has sixteen
//!   vector registers). Columns of `C` are split in blocks across rayon's threads; a single
//!   row streams each weight row once.
//! - [`Kernel::Outer`] ([`super::outer`]), from [`OUTER_MIN_ROWS_F32`] rows (f32 weights) or
//!   [`OUTER_MIN_ROWS`] (bf16): outer products with rows of `A` across the lanes, at f32's FMA
//!   rate for both dtypes; for bf16 by bf16 at the `avx512bf16` level, from
//!   [`OUTER_DP_MIN_ROWS`], with `vdpbf16ps` instead ([`Kernel::OuterDp`], [`super::outer_dp`]).
//!
//! Callers check [`super::Isa::simd_for`] first; the functions here are only sound on a CPU
//! that has the instructions they name.

use super::elem::Elem;
use super::gemv::RowDot;
use super::isa::Simd;
use super::shared::Shared;
use half::bf16;
use rayon::prelude::*;

/// Rows of `A` per tile.
const MR: usize = 4;
/// Rows of `B` (columns of `C`) per tile.
const NR: usize = 4;
/// From this many rows on, [`Kernel::Outer`] runs for bf16 weights (without AMX). Measured side
/// by side on OLMoE's expert shapes (2 threads, the same weights each call): the dot tiles win
/// at 2 to 8 rows (1.8-3.8x), the two are even at 16, and from 24 rows the outer kernel is even
/// or ahead (0.94-1.35x at 24-40 rows, 1.2-1.9x from 64).
pub const OUTER_MIN_ROWS: usize = 24;
/// From this many rows on, [`Kernel::Outer`] runs for f32 weights. A model's weights stream
/// from memory (each expert's are read once a forward), and then the outer kernel, which
/// reads each weight row once per 64 rows of `A`, wins from 6 rows. Measured on OLMoE's gate
/// (1024 x 2048) on 64 distinct weights: dot ahead at 2 and 4 rows (1.15-1.2x), outer ahead
/// at 6 (1.2x), 8 (1.05-1.25x), 12 (1.45x), 16 (1.5-1.75x) and 20 rows (1.4x). (With the
/// same weights each call, in cache, the dot tiles win up to 16 rows.)
pub const OUTER_MIN_ROWS_F32: usize = 6;
/// From this many rows on, [`Kernel::Amx`] runs where it can. Measured on an OLMoE gate
/// projection (1024 x 2048, 2 threads): AMX ahead of the dot tiles by 1.35x at 8 rows and
/// 1.3x at 4, even at 2, and either way at 1 from run to run; from 16 rows 1.8-4x ahead of
/// the better AVX-512 kernel.
pub const AMX_MIN_ROWS: usize = 8;
/// From this many rows on, [`Kernel::OuterDp`] runs for bf16 weights where it can (without
/// AMX). Measured on OLMoE's gate (1024 x 2048, 2 threads, AMD EPYC at
/// `avx512bf16`): the dot tiles ahead at 4 to 16 rows (4.1x to 1.1x), `vdpbf16ps` outer
/// products from 24 (1.33x at 24, 1.64x at 32, 1.94x at 64 rows).
pub const OUTER_DP_MIN_ROWS: usize = 24;
/// Columns of `C` per parallel task, unless fewer are needed to keep every thread busy.
const NB: usize = 64;

/// Splits the `n` columns into blocks, at most [`NB`] wide, and at least two per thread when
/// `n` allows (so that a short `n` still uses every core).
fn column_blocks(n: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_width = n.div_ceil(NB);
    let by_threads = (2 * threads).min(n.div_ceil(NR));
    let blocks = by_width.max(by_threads).max(1);
    // Round block width up to a whole number of tiles.
    let width = n.div_ceil(blocks).div_ceil(NR) * NR;
    width.max(NR)
}

/// Runs `tile(row0, rows, col0, cols)` over every tile of an `m x n` output, in parallel over
/// column blocks.
fn for_each_tile(m: usize, n: usize, tile: impl Fn(usize, usize, usize, usize) + Sync) {
    if m == 0 || n == 0 {
        return;
    }
    let width = column_blocks(n);
    let blocks = n.div_ceil(width);
    let block = |b: usize| {
        let c0 = b * width;
        let c1 = (c0 + width).min(n);
        let mut r = 0;
        while r < m {
            let rows = MR.min(m - r);
            let mut c = c0;
            while c < c1 {
                let cols = NR.min(c1 - c);
                tile(r, rows, c, cols);
                c += cols;
            }
            r += rows;
        }
    };
    // One thread or one block: no hand-off to the pool (its wake-up costs more than a decode
    // step's block).
    if blocks <= 1 || rayon::current_num_threads() <= 1 {
        (0..blocks).for_each(block);
    } else {
        (0..blocks).into_par_iter().for_each(block);
    }
}

/// Which kernel computes a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// One activation row against weight rows streamed one after another
    /// ([`super::gemv`]): decode's products.
    Rows,
    /// Dot-product tiles over `k`: few rows.
    Dot,
    /// Outer products over a packed `A`: many rows.
    Outer,
    /// AMX tile multiplies, for bf16 weights where the CPU has AMX ([`super::amx`]; products
    /// of bf16 values, f32 sums); elsewhere, and for f32 weights, [`Kernel::Outer`].
    Amx,
    /// Outer products with `vdpbf16ps`, for bf16 weights where the CPU has AVX-512 BF16
    /// ([`super::outer_dp`]; f32 activations rounded to bf16, as AMX rounds them); elsewhere
    /// [`Kernel::Outer`].
    OuterDp,
}

impl Kernel {
    /// The faster kernel for `m` rows of `A` and weights in bf16 or f32, where `amx` says
    /// whether [`Kernel::Amx`] can run (bf16 weights on a CPU with AMX) and `dp` whether
    /// [`Kernel::OuterDp`] can (bf16 weights with AVX-512 BF16).
    pub fn pick(m: usize, bf16_weights: bool, amx: bool, dp: bool) -> Kernel {
        let outer_from = if bf16_weights {
            OUTER_MIN_ROWS
        } else {
            OUTER_MIN_ROWS_F32
        };
        if amx && m >= AMX_MIN_ROWS {
            Kernel::Amx
        } else if dp && m >= OUTER_DP_MIN_ROWS {
            Kernel::OuterDp
        } else if m >= outer_from {
            Kernel::Outer
        } else if m == 1 {
            Kernel::Rows
        } else {
            Kernel::Dot
        }
    }
}

/// Activations of type `Self` times weights of type `W` in a dot-product tile: f32 by f32 and
/// bf16 by bf16, and f32 activations by bf16 weights (weights widened as they are read).
pub trait Dot<W: Elem>: Elem {
    /// One tile of `rows x cols` outputs, at `simd`.
    ///
    /// # Safety
    /// The instructions of the pair's kernel at `simd`; `a`, `b` and `c` valid for the tile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn dot_tile(
        simd: Simd,
        rows: usize,
        cols: usize,
        a: *const Self,
        b: *const W,
        c: *mut f32,
        k: usize,
        ldc: usize,
    );
}

/// The tile for a pair, on x86-64 (the kernels exist nowhere else).
macro_rules! dot_pair {
    ($a:ty, $w:ty, $tile:ident, $pa:ty, $pw:ty) => {
        impl Dot<$w> for $a {
            unsafe fn dot_tile(
                simd: Simd,
                rows: usize,
                cols: usize,
                a: *const $a,
                b: *const $w,
                c: *mut f32,
                k: usize,
                ldc: usize,
            ) {
                #[cfg(target_arch = "x86_64")]
                match simd {
                    Simd::Avx512 => {
                        x86::$tile(rows, cols, a as *const $pa, b as *const $pw, c, k, ldc)
                    }
                    Simd::Avx2 => {
                        avx2::$tile(rows, cols, a as *const $pa, b as *const $pw, c, k, ldc)
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!(
                    "x86 kernels on another CPU ({simd:?} {rows} {cols} {a:?} {b:?} {c:?} {k} {ldc})"
                );
            }
        }
    };
}
dot_pair!(f32, f32, tile_f32, f32, f32);
dot_pair!(bf16, bf16, tile_bf16, u16, u16);
dot_pair!(f32, bf16, tile_f32_bf16, f32, u16);

/// `c[m, n] = a[m, k] · b[n, k]ᵀ`, accumulated in f32, by `kernel` at `simd`.
///
/// # Safety
/// The CPU must support `simd` for the pair ([`super::Isa::simd_for`]): at [`Simd::Avx512`],
/// AVX-512 F, and BF16 for bf16 by bf16, BW and VL for f32 by bf16; at [`Simd::Avx2`], AVX2
/// and FMA.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_nt<A: Dot<W> + RowDot<W>, W: Elem>(
    a: &[A],
    b: &[W],
    c: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    kernel: Kernel,
    simd: Simd,
) {
    check_lengths(a.len(), b.len(), c.len(), m, n, k);
    match kernel {
        Kernel::Outer | Kernel::Amx | Kernel::OuterDp => {
            return super::outer::gemm(a, b, c, m, n, k, simd)
        }
        // `simd` is AVX2 or AVX-512, and every CPU with AVX-512 has AVX2 and FMA.
        Kernel::Rows => return super::gemv::gemv(a, b, c, m, n, k),
        Kernel::Dot => {}
    }
    let (pa, pb, out) = (
        Shared(a.as_ptr()),
        Shared(b.as_ptr()),
        Shared(c.as_mut_ptr()),
    );
    for_each_tile(m, n, |r, rows, col, cols| {
        A::dot_tile(
            simd,
            rows,
            cols,
            pa.at(r * k),
            pb.at(col * k),
            out.at(r * n + col),
            k,
            n,
        );
    });
}

pub(super) fn check_lengths(a: usize, b: usize, c: usize, m: usize, n: usize, k: usize) {
    assert!(
        a == m * k && b == n * k && c == m * n,
        "gemm_nt: operand lengths {a}, {b}, {c} do not match m={m} n={n} k={k}"
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The tiles: `ROWS x COLS` accumulators over all of `k`, one instantiation per tile shape.
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// Dispatches a tile of `rows <= MR` by `cols <= NR` to its instantiation.
    macro_rules! dispatch {
        ($f:ident, $rows:expr, $cols:expr, $($arg:expr),*) => {
            match ($rows, $cols) {
                (4, 4) => $f::<4, 4>($($arg),*),
                (4, 3) => $f::<4, 3>($($arg),*),
                (4, 2) => $f::<4, 2>($($arg),*),
                (4, 1) => $f::<4, 1>($($arg),*),
                (3, 4) => $f::<3, 4>($($arg),*),
                (3, 3) => $f::<3, 3>($($arg),*),
                (3, 2) => $f::<3, 2>($($arg),*),
                (3, 1) => $f::<3, 1>($($arg),*),
                (2, 4) => $f::<2, 4>($($arg),*),
                (2, 3) => $f::<2, 3>($($arg),*),
                (2, 2) => $f::<2, 2>($($arg),*),
                (2, 1) => $f::<2, 1>($($arg),*),
                (1, 4) => $f::<1, 4>($($arg),*),
                (1, 3) => $f::<1, 3>($($arg),*),
                (1, 2) => $f::<1, 2>($($arg),*),
                (1, 1) => $f::<1, 1>($($arg),*),
                (r, c) => unreachable!("tile {r}x{c} larger than {MR}x{NR}"),
            }
        };
    }

    pub unsafe fn tile_f32(
        rows: usize,
        cols: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        k: usize,
        ldc: usize,
    ) {
        dispatch!(tile_f32_const, rows, cols, a, b, c, k, ldc)
    }

    pub unsafe fn tile_bf16(
        rows: usize,
        cols: usize,
        a: *const u16,
        b: *const u16,
        c: *mut f32,
        k: usize,
        ldc: usize,
    ) {
        dispatch!(tile_bf16_const, rows, cols, a, b, c, k, ldc)
    }

    pub unsafe fn tile_f32_bf16(
        rows: usize,
        cols: usize,
        a: *const f32,
        b: *const u16,
        c: *mut f32,
        k: usize,
        ldc: usize,
    ) {
        dispatch!(tile_f32_bf16_const, rows, cols, a, b, c, k, ldc)
    }

    /// Sixteen bf16 from `p` (`mask` of them) as f32.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn widen16(p: *const u16, mask: __mmask16) -> __m512 {
        let h = _mm256_maskz_loadu_epi16(mask, p as *const i16);
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    }

    /// [`tile_f32_const`] with bf16 weights, widened as they are read.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn tile_f32_bf16_const<const R: usize, const C: usize>(
        a: *const f32,
        b: *const u16,
        c: *mut f32,
        k: usize,
        ldc: usize,
    ) {
        const W: usize = 16;
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let mut p = 0;
        while p < k {
            let lanes = W.min(k - p);
            let mask: __mmask16 = ((1u32 << lanes) - 1) as __mmask16;
            let mut bv = [_mm512_setzero_ps(); C];
            for (j, v) in bv.iter_mut().enumerate() {
                *v = widen16(b.add(j * k + p), mask);
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let av = _mm512_maskz_loadu_ps(mask, a.add(i * k + p));
                for (j, s) in row.iter_mut().enumerate() {
                    *s = _mm512_fmadd_ps(av, bv[j], *s);
                }
            }
            p += W;
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, s) in row.iter().enumerate() {
                *c.add(i * ldc + j) = _mm512_reduce_add_ps(*s);
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn tile_f32_const<const R: usize, const C: usize>(
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        k: usize,
        ldc: usize,
    ) {
        const W: usize = 16;
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let full = k / W * W;
        let mut p = 0;
        while p < full {
            let mut bv = [_mm512_setzero_ps(); C];
            for (j, v) in bv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(b.add(j * k + p));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let av = _mm512_loadu_ps(a.add(i * k + p));
                for (j, s) in row.iter_mut().enumerate() {
                    *s = _mm512_fmadd_ps(av, bv[j], *s);
                }
            }
            p += W;
        }
        if p < k {
            let mask: __mmask16 = ((1u32 << (k - p)) - 1) as __mmask16;
            let mut bv = [_mm512_setzero_ps(); C];
            for (j, v) in bv.iter_mut().enumerate() {
                *v = _mm512_maskz_loadu_ps(mask, b.add(j * k + p));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let av = _mm512_maskz_loadu_ps(mask, a.add(i * k + p));
                for (j, s) in row.iter_mut().enumerate() {
                    *s = _mm512_fmadd_ps(av, bv[j], *s);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, s) in row.iter().enumerate() {
                *c.add(i * ldc + j) = _mm512_reduce_add_ps(*s);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn tile_bf16_const<const R: usize, const C: usize>(
        a: *const u16,
        b: *const u16,
        c: *mut f32,
        k: usize,
        ldc: usize,
    ) {
        // 32 bf16 per vector; vdpbf16ps adds the products of each adjacent pair into one f32
        // lane, so every lane sums its own pairs and the final reduction sums the lanes.
        const W: usize = 32;
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let full = k / W * W;
        let mut p = 0;
        while p < full {
            let mut bv = [_mm512_setzero_si512(); C];
            for (j, v) in bv.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(b.add(j * k + p) as *const _);
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let av: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(a.add(i * k + p) as *const _));
                for (j, s) in row.iter_mut().enumerate() {
                    *s = _mm512_dpbf16_ps(*s, av, std::mem::transmute::<__m512i, __m512bh>(bv[j]));
                }
            }
            p += W;
        }
        if p < k {
            let mask: __mmask32 = ((1u64 << (k - p)) - 1) as __mmask32;
            let mut bv = [_mm512_setzero_si512(); C];
            for (j, v) in bv.iter_mut().enumerate() {
                *v = _mm512_maskz_loadu_epi16(mask, b.add(j * k + p) as *const i16);
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let av: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(
                    mask,
                    a.add(i * k + p) as *const i16,
                ));
                for (j, s) in row.iter_mut().enumerate() {
                    *s = _mm512_dpbf16_ps(*s, av, std::mem::transmute::<__m512i, __m512bh>(bv[j]));
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, s) in row.iter().enumerate() {
                *c.add(i * ldc + j) = _mm512_reduce_add_ps(*s);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The eight-lane tiles on AVX2 and FMA: `ROWS x COLS` accumulators over all of `k`, bf16
    //! widened in registers (a shift into the high half). A tail of `k` is read through a
    //! zero-padded copy (AVX2 has no masked 16-bit loads).
    use crate::kernels::elem::avx2::{hsum, load_bf16, load_f32};
    use std::arch::x86_64::*;

    /// A tile function for one operand pair: `$load_a` and `$load_b` read eight elements of
    /// each as f32. Columns go in chunks of four for up to two rows (at most 8 accumulators, 4
    /// weight vectors and 1 activation vector) and of two for three or four rows (sixteen
    /// vector registers in all).
    macro_rules! tiles {
        ($name:ident, $inner:ident, $ta:ty, $load_a:ident, $tb:ty, $load_b:ident) => {
            pub unsafe fn $name(
                rows: usize,
                cols: usize,
                a: *const $ta,
                b: *const $tb,
                c: *mut f32,
                k: usize,
                ldc: usize,
            ) {
                let chunk = if rows <= 2 { 4 } else { 2 };
                let mut j = 0;
                while j < cols {
                    let cc = chunk.min(cols - j);
                    let (bj, cj) = (b.add(j * k), c.add(j));
                    match (rows, cc) {
                        (1, 4) => $inner::<1, 4>(a, bj, cj, k, ldc),
                        (1, 3) => $inner::<1, 3>(a, bj, cj, k, ldc),
                        (1, 2) => $inner::<1, 2>(a, bj, cj, k, ldc),
                        (1, 1) => $inner::<1, 1>(a, bj, cj, k, ldc),
                        (2, 4) => $inner::<2, 4>(a, bj, cj, k, ldc),
                        (2, 3) => $inner::<2, 3>(a, bj, cj, k, ldc),
                        (2, 2) => $inner::<2, 2>(a, bj, cj, k, ldc),
                        (2, 1) => $inner::<2, 1>(a, bj, cj, k, ldc),
                        (3, 2) => $inner::<3, 2>(a, bj, cj, k, ldc),
                        (3, 1) => $inner::<3, 1>(a, bj, cj, k, ldc),
                        (4, 2) => $inner::<4, 2>(a, bj, cj, k, ldc),
                        (4, 1) => $inner::<4, 1>(a, bj, cj, k, ldc),
                        (r, c) => unreachable!("avx2 tile {r}x{c}"),
                    }
                    j += cc;
                }
            }

            #[target_feature(enable = "avx2,fma")]
            unsafe fn $inner<const R: usize, const C: usize>(
                a: *const $ta,
                b: *const $tb,
                c: *mut f32,
                k: usize,
                ldc: usize,
            ) {
                let mut acc = [[_mm256_setzero_ps(); C]; R];
                // One step of eight `k` (`lanes` of them real).
                let mut step = |p: usize, lanes: usize| {
                    let mut bv = [_mm256_setzero_ps(); C];
                    for (j, v) in bv.iter_mut().enumerate() {
                        *v = $load_b(b.add(j * k + p), lanes);
                    }
                    for (i, row) in acc.iter_mut().enumerate() {
                        let av = $load_a(a.add(i * k + p), lanes);
                        for (j, s) in row.iter_mut().enumerate() {
                            *s = _mm256_fmadd_ps(av, bv[j], *s);
                        }
                    }
                };
                let full = k / 8 * 8;
                let mut p = 0;
                while p < full {
                    step(p, 8);
                    p += 8;
                }
                if p < k {
                    step(p, k - p);
                }
                for (i, row) in acc.iter().enumerate() {
                    for (j, s) in row.iter().enumerate() {
                        *c.add(i * ldc + j) = hsum(*s);
                    }
                }
            }
        };
    }
    tiles!(tile_f32, tile_f32_const, f32, load_f32, f32, load_f32);
    tiles!(tile_bf16, tile_bf16_const, u16, load_bf16, u16, load_bf16);
    tiles!(
        tile_f32_bf16,
        tile_f32_bf16_const,
        f32,
        load_f32,
        u16,
        load_bf16
    );
}
