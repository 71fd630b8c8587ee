//! CPU kernels for the linear layers that dominate a MoE forward and backward: every expert
//! projection and every dense projection is `x · wᵀ`, and [`linear`] computes it.
//!
//! On x86-64 it runs our own kernels ([`gemm_nt`]) at the highest [`Level`] the CPU has
//! ([`isa`]: AVX2 with FMA, AVX-512, AVX-512 with BF16, or AVX-512 with AMX): bf16 operands
//! stay bf16 in memory (half the traffic) and accumulate in f32. One row (decode) streams the
//! weight rows one after another ([`gemv`]), few rows run dot-product
//! tiles (bf16 with `vdpbf16ps` at the `avx512bf16` level, widened in registers below it),
//! many rows outer products at f32's FMA rate ([`outer`]), or for bf16 by bf16 at the
//! `avx512bf16` level with `vdpbf16ps` ([`outer_dp`]); with bf16 weights on a CPU with AMX,
//! from 8 rows, tile multiplies ([`amx`]). `OCCULT_KERNELS` caps the level (`amx`,
//! `avx512bf16`, `avx512`, `avx2`, `portable`), to compare or to test a lower level on a CPU
//! that has a higher one. The op is
//! a candle `CustomOp2` with its own backward ([`linear_op`]), so training goes through it too.
//! Every kernel takes f32 or bf16 operands ([`elem`]).
//! At the portable level (other CPUs, ARM among them) it runs candle's matmul in f32 (bf16
//! operands are widened to f32 first: candle's bf16 CPU matmul measured 1.2x slower than its
//! f32 at 512 rows and 4x at one row). Every path accumulates in f32 and rounds once.
//!
//! [`grouped_linear`] runs rows grouped by expert against a stack of expert weights as one
//! differentiable op, so that training the experts writes the stack's gradient once.
//!
//! The inference paths that own their buffers (the experts', attention's and RoPE's on CPU) call
//! the same kernels on slices through [`linear_rows`], take their buffers from [`scratch`], and
//! do their element-wise math (`exp`, softmax, SiLU, bf16 rounding) in [`vmath`]; decode's
//! attention sums the cached values weighted by a row's probabilities with
//! [`weighted_rows`]. [`bench`]
//! times the kernels against candle's matmul (`occult bench kernels`).

mod amx;
pub mod bench;
pub mod elem;
pub mod gemm_nt;
pub mod gemv;
pub mod grouped_linear;
pub mod isa;
mod linear_op;
mod outer;
mod outer_dp;
mod path;
pub mod scratch;
mod shared;
pub mod vmath;
pub mod weighted_rows;

use crate::Result;
use candle::{Layout, Storage, Tensor};
pub use gemm_nt::Kernel;
pub use isa::{isa, process_level, Isa, Level, Simd};
pub use linear_op::{linear_on, Operand};
pub use path::{describe, describe_on, process_path, Path};

/// `x · wᵀ` for `x` `[.., K]` and a weight `w` `[N, K]` in its stored layout: `[.., N]`, in
/// `x`'s dtype. Differentiable in both operands. `x` and `w` share a dtype, or `x` is f32 and
/// `w` bf16 (activations kept in f32 with bf16 weights: half the weight traffic; the AMX kernel
/// rounds them to bf16 for its products, the others do not).
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    linear_with(x, w, process_path())
}

/// [`linear`] on a chosen path (tests hold the paths to each other with this).
pub fn linear_with(x: &Tensor, w: &Tensor, path: Path) -> Result<Tensor> {
    linear_on(x, w, path, isa())
}

/// [`linear`] straight on slices, for code that owns its buffers (the inference paths of the
/// experts and of attention): `c[m, n] = a[m, k] · wᵀ` in f32 on the kernel `linear` runs for
/// the same operands, so with the same bits (before `linear` rounds a bf16 result). Returns
/// false, with `c` untouched, where `linear` would take the portable path
/// (`OCCULT_KERNELS=portable`, or no kernel on this CPU for the pair).
///
/// # Panics
/// If the slices' lengths do not match `m`, `n` and `k`.
pub fn linear_rows(
    a: Operand<'_>,
    w: Operand<'_>,
    c: &mut [f32],
    mnk: (usize, usize, usize),
) -> bool {
    linear_op::rows(a, w, c, mnk, Path::Auto, isa())
}

/// [`linear_rows`] on `path` with the instruction sets `isa` (at most this CPU's): benchmarks
/// hold one kernel against another with it ([`Path::Kernel`]).
///
/// # Panics
/// As [`linear_rows`].
pub fn linear_rows_on(
    a: Operand<'_>,
    w: Operand<'_>,
    c: &mut [f32],
    mnk: (usize, usize, usize),
    path: Path,
    isa: Isa,
) -> bool {
    linear_op::rows(a, w, c, mnk, path, isa)
}

/// A tensor's contiguous f32 or bf16 CPU elements as an [`Operand`] (from
/// `Tensor::storage_and_layout`), or `None` (another device or dtype, or not contiguous).
pub fn operand_of<'a>(storage: &'a Storage, layout: &Layout) -> Option<Operand<'a>> {
    match storage {
        Storage::Cpu(s) => Operand::of_cpu(s, layout),
        _ => None,
    }
}
