//! Which implementation computes `x · wᵀ`: our kernels where the CPU and the dtypes allow, or
//! candle's matmul (the portable path); the one this process uses, and what it runs in words.

use super::gemm_nt::Kernel;
use super::isa::{isa, process_level, Isa, Level, Simd};
use candle::DType;

/// Which implementation computes a [`super::linear`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// Our kernels where the instruction sets and dtypes allow, else [`Path::Portable`].
    Auto,
    /// candle's matmul, in f32 for bf16 operands.
    Portable,
    /// One of our kernels at every row count where the CPU and dtype allow, else
    /// [`Path::Portable`] (tests and benchmarks hold the kernels to each other with this).
    Kernel(Kernel),
}

/// The path this process uses: the portable one where `OCCULT_KERNELS=portable` (or the CPU
/// has no level above it), else [`Path::Auto`].
pub fn process_path() -> Path {
    if process_level() == Level::Portable {
        Path::Portable
    } else {
        Path::Auto
    }
}

/// What [`super::linear`] runs for operands of `dtype` in this process, in words (for bench output).
pub fn describe(dtype: DType) -> String {
    describe_on(isa(), dtype)
}

/// What [`super::linear_on`] runs for operands of `dtype` with `isa`, in words.
pub fn describe_on(isa: Isa, dtype: DType) -> String {
    let bf16 = dtype == DType::BF16;
    let simd = match dtype {
        DType::F32 | DType::BF16 => isa.simd_for(bf16, bf16),
        _ => None,
    };
    let what = match (simd, bf16) {
        (None, true) => "portable (candle matmul, widened to f32)",
        (None, false) => "portable (candle matmul)",
        (Some(Simd::Avx512), true) if isa.amx => {
            "avx512-bf16 with amx (bf16 in memory, f32 accumulation: amx tile multiplies from 8 rows, vdpbf16ps tiles below)"
        }
        (Some(Simd::Avx512), true) => {
            "avx512-bf16 (bf16 in memory, f32 accumulation: vdpbf16ps tiles and outer products)"
        }
        (Some(Simd::Avx512), false) => "avx512-f32 (fma)",
        (Some(Simd::Avx2), true) => {
            "avx2-bf16 (bf16 in memory, widened in registers, f32 fma accumulation)"
        }
        (Some(Simd::Avx2), false) => "avx2-f32 (fma)",
    };
    what.to_string()
}
