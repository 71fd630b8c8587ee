//! `x · wᵀ` on a chosen path ([`linear_on`]): as a candle `CustomOp2` over
//! [`super::gemm_nt`], with its backward (`dx = dy · w`, `dw = dyᵀ · x`, themselves computed
//! through [`linear_on`]), or candle's matmul on the portable path.

use super::amx;
use super::gemm_nt::{check_lengths, gemm_nt, Dot, Kernel};
use super::gemv::RowDot;
use super::isa::{Isa, Simd};
use super::path::Path;
use crate::Result;
use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor};
use half::bf16;

/// The op; [`linear_on`] applies it only to contiguous f32 or bf16 operands of one dtype,
/// or f32 activations with bf16 weights, where `isa` has a kernel for the pair. `path` is
/// [`Path::Kernel`] to force one kernel (tests and benchmarks), else the kernel is picked by
/// rows; the backward runs on the same path and instruction sets.
pub(super) struct LinearNt {
    pub path: Path,
    pub isa: Isa,
}

/// `c = a · bᵀ` with bf16 weights: on AMX if `amx`, else by `kernel` at `simd`.
///
/// # Safety
/// As [`gemm_nt`] for the pair, and [`amx::gemm`] when `amx`.
#[allow(clippy::too_many_arguments)]
unsafe fn bf16_weights_gemm<A: Dot<bf16> + RowDot<bf16> + amx::AmxRow>(
    a: &[A],
    b: &[bf16],
    c: &mut [f32],
    (m, n, k): (usize, usize, usize),
    kernel: Kernel,
    simd: Simd,
    amx: bool,
) {
    if amx {
        amx::gemm(a, b, c, m, n, k)
    } else {
        gemm_nt(a, b, c, m, n, k, kernel, simd)
    }
}

/// An operand of a [`super::linear_rows`] product, as stored: activations `[m, k]` or weights `[n, k]`.
#[derive(Clone, Copy, Debug)]
pub enum Operand<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl<'a> Operand<'a> {
    /// A CPU storage's elements in `layout`, if they are contiguous f32 or bf16.
    pub fn of_cpu(storage: &'a CpuStorage, layout: &Layout) -> Option<Self> {
        let (start, end) = layout.contiguous_offsets()?;
        match storage {
            CpuStorage::F32(v) => Some(Operand::F32(&v[start..end])),
            CpuStorage::BF16(v) => Some(Operand::Bf16(&v[start..end])),
            _ => None,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Operand::F32(v) => v.len(),
            Operand::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `len` elements from `from` (an expert's block of a stack, a group's rows).
    ///
    /// # Panics
    /// If they run past the operand.
    pub fn part(self, from: usize, len: usize) -> Self {
        match self {
            Operand::F32(v) => Operand::F32(&v[from..from + len]),
            Operand::Bf16(v) => Operand::Bf16(&v[from..from + len]),
        }
    }
}

/// The kernel for `m` rows on `path`, and whether it is the AMX kernel (bf16 weights where
/// `isa` has AMX); `dp` says whether [`Kernel::OuterDp`] can run (bf16 weights where `isa` has
/// `vdpbf16ps`).
fn kernel_for(path: Path, isa: Isa, m: usize, bf16_weights: bool, dp: bool) -> (Kernel, bool) {
    let amx_here = bf16_weights && isa.amx;
    let kernel = match path {
        Path::Kernel(Kernel::OuterDp) if !dp => Kernel::Outer,
        Path::Kernel(k) => k,
        _ => Kernel::pick(m, bf16_weights, amx_here, dp),
    };
    // The row kernels are AVX2's (which every CPU with AVX-512 has).
    let kernel = if kernel == Kernel::Rows && !isa.avx2 {
        Kernel::Dot
    } else {
        kernel
    };
    (kernel, kernel == Kernel::Amx && amx_here)
}

/// `c[m, n] = a[m, k] · wᵀ` in f32, on the kernel `path` picks for the operands with the
/// instruction sets `isa` (the kernel [`super::linear_on`] runs for the same operands, so the
/// same bits before its rounding of a bf16 result). Returns false, with `c` untouched, on the
/// portable path or where `isa` has no kernel for the pair (bf16 activations take bf16
/// weights).
///
/// # Panics
/// If the slices' lengths do not match `m`, `n` and `k`.
pub(crate) fn rows(
    a: Operand<'_>,
    w: Operand<'_>,
    c: &mut [f32],
    (m, n, k): (usize, usize, usize),
    path: Path,
    isa: Isa,
) -> bool {
    let w_bf16 = matches!(w, Operand::Bf16(_));
    let Some(simd) = isa.simd_for(matches!(a, Operand::Bf16(_)), w_bf16) else {
        return false;
    };
    if path == Path::Portable {
        return false;
    }
    let dp = w_bf16 && isa.avx512bf16;
    let (kernel, amx) = kernel_for(path, isa, m, w_bf16, dp);
    check_lengths(a.len(), w.len(), c.len(), m, n, k);
    // SAFETY (each arm): `simd_for` found the instructions of the pair's kernel at `simd` in
    // `isa` (at most this CPU's), and AMX's where `amx` says so; the lengths were checked.
    match (a, w) {
        (Operand::F32(a), Operand::F32(b)) => unsafe { gemm_nt(a, b, c, m, n, k, kernel, simd) },
        (Operand::F32(a), Operand::Bf16(b)) if kernel == Kernel::OuterDp && !amx => unsafe {
            super::outer_dp::gemm(a, b, c, m, n, k)
        },
        (Operand::F32(a), Operand::Bf16(b)) => unsafe {
            bf16_weights_gemm(a, b, c, (m, n, k), kernel, simd, amx)
        },
        (Operand::Bf16(a), Operand::Bf16(b)) if kernel == Kernel::OuterDp && !amx => unsafe {
            super::outer_dp::gemm(a, b, c, m, n, k)
        },
        (Operand::Bf16(a), Operand::Bf16(b)) => unsafe {
            bf16_weights_gemm(a, b, c, (m, n, k), kernel, simd, amx)
        },
        (Operand::Bf16(_), Operand::F32(_)) => return false,
    }
    true
}

/// A CPU op's two operands as kernel operands, or an error naming `op`.
pub(super) fn operands<'a>(
    op: &str,
    (s1, l1): (&'a CpuStorage, &Layout),
    (s2, l2): (&'a CpuStorage, &Layout),
) -> candle::Result<(Operand<'a>, Operand<'a>)> {
    match (Operand::of_cpu(s1, l1), Operand::of_cpu(s2, l2)) {
        (Some(a), Some(w)) => Ok((a, w)),
        _ => candle::bail!(
            "{op}: x ({:?}) and w ({:?}) must be contiguous f32 or bf16",
            s1.dtype(),
            s2.dtype()
        ),
    }
}

/// An op's f32 products `c` as its output, in the activations' (`s1`'s) dtype (bf16 rounded to
/// nearest even), or an error naming `op` if the kernels did not take the pair (`done` false).
pub(super) fn output(
    op: &str,
    s1: &CpuStorage,
    s2: &CpuStorage,
    c: Vec<f32>,
    done: bool,
) -> candle::Result<CpuStorage> {
    if !done {
        candle::bail!(
            "{op}: no kernel for {:?} x {:?} on this CPU",
            s1.dtype(),
            s2.dtype()
        );
    }
    Ok(match s1 {
        CpuStorage::BF16(_) => CpuStorage::BF16(c.into_iter().map(bf16::from_f32).collect()),
        _ => CpuStorage::F32(c),
    })
}

impl CustomOp2 for LinearNt {
    fn name(&self) -> &'static str {
        "occult-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle::Result<(CpuStorage, Shape)> {
        let (m, k) = l1.shape().dims2()?;
        let (n, k2) = l2.shape().dims2()?;
        if k != k2 {
            candle::bail!("occult linear: x [{m}, {k}] and w [{n}, {k2}] disagree on K");
        }
        let (a, w) = operands("occult linear", (s1, l1), (s2, l2))?;
        let mut c = vec![0f32; m * n];
        let done = rows(a, w, &mut c, (m, n, k), self.path, self.isa);
        Ok((
            output("occult linear", s1, s2, c, done)?,
            Shape::from((m, n)),
        ))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle::Result<(Option<Tensor>, Option<Tensor>)> {
        let lin = |a: &Tensor, b: &Tensor| {
            linear_on(a, b, self.path, self.isa)
                .map_err(|e| candle::Error::Msg(format!("occult linear backward: {e}")))
        };
        // dx [m, k] = dy [m, n] · w [n, k] = dy · (wᵀ)ᵀ
        let dx = lin(dy, &w.t()?.contiguous()?)?;
        // dw [n, k] = dyᵀ [n, m] · x [m, k] = dyᵀ · (xᵀ)ᵀ
        let dw = lin(&dy.t()?.contiguous()?, &x.t()?.contiguous()?)?.to_dtype(w.dtype())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// [`super::linear_with`] with the instruction sets `isa` (at most this CPU's): tests run every level
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
            .apply_op2(&w.contiguous()?, LinearNt { path, isa })?
    } else {
        portable(&x2, w)?
    };
    let mut out = lead.to_vec();
    out.push(n);
    Ok(y.reshape(out)?)
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
