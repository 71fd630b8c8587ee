//! One row of activations against every weight row (decode's products, `m = 1`):
//! [`Kernel::Rows`](super::Kernel::Rows). Each parallel task takes a contiguous run of weight
//! rows and streams them one after another, each row's dot product over `k` in four
//! independent accumulators, so a thread reads its weights as one sequential stream (as
//! llama.cpp's `vec_dot` loop does). The dot tiles of [`super::gemm_nt`] read four
//! weight rows side by side instead, as many streams 4 to 8 KB apart.
//!
//! The row kernels are eight lanes wide at every level (AVX2 and FMA; bf16 widened in
//! registers, a shift into the high half), for f32 by f32, bf16 by bf16, and f32 activations
//! by bf16 weights. On AMD EPYC (Zen 4, 2 threads, the 1-layer OLMoE-shaped model's expert
//! products on distinct weights each step, `docs/kernels.md`), eight lanes streamed faster
//! than sixteen in every pair: 1.15x for f32, and for bf16 weights 1.03x to 1.06x against
//! `vdpbf16ps` on the activations rounded to bf16 (llama.cpp's form) and 1.3x to 1.45x against
//! sixteen widened lanes. Against the dot tiles the row kernels read 1.0x (both at the read
//! rate) to 1.6x as fast. More than
//! one row of activations runs row after row (tests force the kernel at every shape; the
//! picker takes it for one row only).
//!
//! Callers check that the CPU has AVX2 and FMA first; the functions here are only sound where
//! it does.

use super::elem::Elem;
use super::shared::Shared;
use half::bf16;
use rayon::prelude::*;

/// Weight rows per parallel task, unless fewer are needed to keep every thread busy: 64 rows
/// of 2048 bf16 are 256 KB.
const ROWS_PER_TASK: usize = 64;

/// A dot product of one activation row with one weight row, for a pair of element types.
pub trait RowDot<W: Elem>: Elem {
    /// `Σ a[p] · b[p]` over `p < k`, accumulated in f32.
    ///
    /// # Safety
    /// AVX2 and FMA; `a` and `b` valid for `k` elements.
    unsafe fn row_dot(a: *const Self, b: *const W, k: usize) -> f32;
}

/// The row kernel for a pair, on x86-64 (the kernels exist nowhere else).
macro_rules! row_pair {
    ($a:ty, $w:ty, $dot:ident, $pa:ty, $pw:ty) => {
        impl RowDot<$w> for $a {
            unsafe fn row_dot(a: *const $a, b: *const $w, k: usize) -> f32 {
                #[cfg(target_arch = "x86_64")]
                return avx2::$dot(a as *const $pa, b as *const $pw, k);
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("x86 kernels on another CPU ({a:?} {b:?} {k})");
            }
        }
    };
}
row_pair!(f32, f32, dot_f32, f32, f32);
row_pair!(bf16, bf16, dot_bf16, u16, u16);
row_pair!(f32, bf16, dot_f32_bf16, f32, u16);

/// Elements a task reads at the least: fewer are not worth handing to another thread (an
/// attention head's cached keys, 128 features a position, go in runs of 256 positions).
const MIN_TASK: usize = 32 << 10;

/// Weight rows per task for `n` rows of `k`: at most [`ROWS_PER_TASK`] (or [`MIN_TASK`]
/// elements where rows are short), and at least two tasks per thread where `n` allows.
fn task_rows(n: usize, k: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let min_rows = (MIN_TASK / k.max(1)).max(1);
    let tasks = n
        .div_ceil(ROWS_PER_TASK)
        .max(2 * threads)
        .min(n.div_ceil(min_rows))
        .max(1);
    n.div_ceil(tasks)
}

/// `c[m, n] = a[m, k] · b[n, k]ᵀ`, accumulated in f32: each row of `a` against every row of
/// `b`, weight rows streamed in contiguous runs across rayon's threads.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
///
/// # Panics
/// If the slices are not of `m * k`, `n * k` and `m * n` elements.
pub unsafe fn gemv<A: RowDot<W>, W: Elem>(
    a: &[A],
    b: &[W],
    c: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) {
    super::gemm_nt::check_lengths(a.len(), b.len(), c.len(), m, n, k);
    if n == 0 {
        return;
    }
    let (pa, pb) = (Shared(a.as_ptr()), Shared(b.as_ptr()));
    let width = task_rows(n, k);
    for (i, row) in c.chunks_exact_mut(n).enumerate() {
        let task = |(t, dst): (usize, &mut [f32])| {
            for (j, out) in dst.iter_mut().enumerate() {
                // SAFETY: row `i` of `a` and weight row `t * width + j < n` lie in the slices
                // (lengths checked above); the caller vouches for the instructions.
                *out = unsafe { A::row_dot(pa.at(i * k), pb.at((t * width + j) * k), k) };
            }
        };
        // One task or one thread: no hand-off to the pool.
        if width >= n || rayon::current_num_threads() <= 1 {
            row.chunks_mut(width).enumerate().for_each(task);
        } else {
            row.par_chunks_mut(width).enumerate().for_each(task);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Eight f32 lanes: four accumulators over `k`, bf16 widened in registers; a tail shorter
    //! than a vector through a zero-padded copy (AVX2 has no masked 16-bit loads).
    use crate::kernels::elem::avx2::{hsum, load_bf16, load_f32};
    use std::arch::x86_64::*;

    /// A row kernel for one operand pair: `$load_a` and `$load_b` read eight elements of each
    /// as f32 (`n` of them, zeros after).
    macro_rules! row_dot {
        ($name:ident, $ta:ty, $load_a:ident, $tb:ty, $load_b:ident) => {
            #[target_feature(enable = "avx2,fma")]
            pub unsafe fn $name(a: *const $ta, b: *const $tb, k: usize) -> f32 {
                let mut acc = [_mm256_setzero_ps(); 4];
                let full = k / 32 * 32;
                let mut p = 0;
                while p < full {
                    for (j, s) in acc.iter_mut().enumerate() {
                        let q = p + 8 * j;
                        *s = _mm256_fmadd_ps($load_a(a.add(q), 8), $load_b(b.add(q), 8), *s);
                    }
                    p += 32;
                }
                while p < k {
                    let n = (k - p).min(8);
                    acc[0] = _mm256_fmadd_ps($load_a(a.add(p), n), $load_b(b.add(p), n), acc[0]);
                    p += 8;
                }
                hsum(_mm256_add_ps(
                    _mm256_add_ps(acc[0], acc[1]),
                    _mm256_add_ps(acc[2], acc[3]),
                ))
            }
        };
    }
    row_dot!(dot_f32, f32, load_f32, f32, load_f32);
    row_dot!(dot_bf16, u16, load_bf16, u16, load_bf16);
    row_dot!(dot_f32_bf16, f32, load_f32, u16, load_bf16);
}
