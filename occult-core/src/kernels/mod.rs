//! CPU kernels for the linear layers that dominate a MoE forward and backward: every expert
//! projection and every dense projection is `x · wᵀ`, and [`linear`] computes it.
//!
//! On x86-64 it runs our own kernels ([`gemm_nt`]) at the highest [`Level`] the CPU has
//! ([`isa`]: AVX2 with FMA, AVX-512, or AVX-512 with AMX): bf16 operands stay bf16 in memory
//! (half the traffic) and accumulate in f32. Few rows run dot-product tiles (bf16 with
//! `vdpbf16ps` on AVX-512 BF16, widened in registers below it), many rows outer products at
//! f32's FMA rate ([`outer`]); with bf16 weights on a CPU with AMX, from 8 rows, tile
//! multiplies ([`amx`]). `OCCULT_KERNELS` caps the level (`amx`, `avx512`, `avx2`,
//! `portable`), to compare or to test a lower level on a CPU that has a higher one. The op is
//! a candle `CustomOp2` with its own backward ([`linear_op`]), so training goes through it too.
//! Every kernel takes f32 or bf16 operands ([`elem`]).
//! At the portable level (other CPUs, ARM among them) it runs candle's matmul in f32 (bf16
//! operands are widened to f32 first: candle's bf16 CPU matmul measured 1.2x slower than its
//! f32 at 512 rows and 4x at one row). Every path accumulates in f32 and rounds once.
//!
//! The inference paths that own their buffers (the experts', attention's and RoPE's on CPU) call
//! the same kernels on slices through [`linear_rows`], take their buffers from [`scratch`], and
//! do their element-wise math (`exp`, softmax, SiLU, bf16 rounding) in [`vmath`].

mod amx;
pub mod bench;
pub mod elem;
pub mod gemm_nt;
pub mod isa;
mod linear_op;
mod outer;
pub mod scratch;
pub mod vmath;

use crate::Result;
use candle::{DType, Device, Layout, Storage, Tensor};
pub use gemm_nt::Kernel;
pub use isa::{isa, process_level, Isa, Level, Simd};
pub use linear_op::Operand;

/// A raw pointer shared by the parallel tasks of a kernel, which only read through it or write
/// disjoint elements. A method gives the address, so that closures capture the `Sync` wrapper
/// rather than the pointer field.
#[derive(Clone, Copy)]
struct Shared<P>(P);
unsafe impl<P> Send for Shared<P> {}
unsafe impl<P> Sync for Shared<P> {}

impl<T> Shared<*const T> {
    fn at(&self, offset: usize) -> *const T {
        self.0.wrapping_add(offset)
    }
}

impl<T> Shared<*mut T> {
    fn at(&self, offset: usize) -> *mut T {
        self.0.wrapping_add(offset)
    }
}

/// Which implementation computes a [`linear`].
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

/// What [`linear`] runs for operands of `dtype` in this process, in words (for bench output).
pub fn describe(dtype: DType) -> String {
    describe_on(isa(), dtype)
}

/// What [`linear_on`] runs for operands of `dtype` with `isa`, in words.
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
            "avx512-bf16 (bf16 in memory, f32 accumulation: vdpbf16ps tiles, fma outer products)"
        }
        (Some(Simd::Avx512), false) => "avx512-f32 (fma)",
        (Some(Simd::Avx2), true) => {
            "avx2-bf16 (bf16 in memory, widened in registers, f32 fma accumulation)"
        }
        (Some(Simd::Avx2), false) => "avx2-f32 (fma)",
    };
    what.to_string()
}

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

/// [`linear_with`] with the instruction sets `isa` (at most this CPU's): tests run every level
/// the CPU supports in one process with this.
pub fn linear_on(x: &Tensor, w: &Tensor, path: Path, isa: Isa) -> Result<Tensor> {
    let (n, k) = w.dims2()?;
    let dims = x.dims().to_vec();
    let Some((&kx, lead)) = dims.split_last() else {
        return Err(candle::Error::Msg("linear of a scalar".into()).into());
    };
    if kx != k {
        return Err(candle::Error::ShapeMismatchBinaryOp {
            lhs: x.shape().clone(),
            rhs: w.shape().clone(),
            op: "linear",
        }
        .into());
    }
    let rows: usize = lead.iter().product();
    let x2 = x.reshape((rows, k))?;
    let mixed = x.dtype() == DType::F32 && w.dtype() == DType::BF16;
    if x.dtype() != w.dtype() && !mixed {
        return Err(candle::Error::DTypeMismatchBinaryOp {
            lhs: x.dtype(),
            rhs: w.dtype(),
            op: "linear",
        }
        .into());
    }
    let y = if runs_fast(x, w, path, isa) {
        x2.contiguous()?
            .apply_op2(&w.contiguous()?, linear_op::LinearNt { path, isa })?
    } else {
        portable(&x2, w)?
    };
    let mut out = lead.to_vec();
    out.push(n);
    Ok(y.reshape(out)?)
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

/// A tensor's contiguous f32 or bf16 CPU elements as an [`Operand`] (from
/// `Tensor::storage_and_layout`), or `None` (another device or dtype, or not contiguous).
pub fn operand_of<'a>(storage: &'a Storage, layout: &Layout) -> Option<Operand<'a>> {
    match storage {
        Storage::Cpu(s) => Operand::of_cpu(s, layout),
        _ => None,
    }
}

/// Whether `x · wᵀ` runs on our kernels (else on [`portable`]); the dtypes are checked.
fn runs_fast(x: &Tensor, w: &Tensor, path: Path, isa: Isa) -> bool {
    let bf16 = |t: &Tensor| match t.dtype() {
        DType::F32 => Some(false),
        DType::BF16 => Some(true),
        _ => None,
    };
    let (Some(a), Some(b)) = (bf16(x), bf16(w)) else {
        return false;
    };
    path != Path::Portable && matches!(x.device(), Device::Cpu) && isa.simd_for(a, b).is_some()
}

/// candle's matmul. On the CPU, bf16 is widened to f32 (and rounded back once for bf16
/// activations). On a GPU, bf16 operands go to cuBLAS as they are: its bf16 products
/// accumulate in f32 (candle's default compute type) and round the result once, as the CPU path
/// does, without a widened copy of the weights in every call.
fn portable(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() && x.dtype() == w.dtype() {
        // cuBLAS takes the transpose of a row-major weight as it is (a no-op copy for one).
        return Ok(x.matmul(&w.contiguous()?.t()?)?);
    }
    if x.dtype() == DType::F32 && w.dtype() == DType::BF16 {
        return Ok(x.matmul(&w.to_dtype(DType::F32)?.t()?)?);
    }
    if x.dtype() == DType::BF16 && w.dtype() == DType::BF16 {
        let y = x
            .to_dtype(DType::F32)?
            .matmul(&w.to_dtype(DType::F32)?.t()?)?;
        return Ok(y.to_dtype(DType::BF16)?);
    }
    Ok(x.matmul(&w.t()?)?)
}
