//! `x · wᵀ` as a candle `CustomOp2` over [`super::gemm_nt`], with its backward
//! (`dx = dy · w`, `dw = dyᵀ · x`), itself computed through [`super::linear`].

use super::amx;
use super::gemm_nt::{gemm_nt, Dot, Kernel};
use super::Path;
use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use half::bf16;

/// The op; [`super::linear`] applies it only to contiguous f32 or bf16 operands of one dtype,
/// or f32 activations with bf16 weights, on a CPU with the matching AVX-512 instructions.
/// `path` is [`Path::Kernel`] to force one kernel (tests and benchmarks), else the kernel is
/// picked by rows; the backward runs on the same path.
pub(super) struct LinearNt {
    pub path: Path,
}

/// A storage's contiguous f32 or bf16 elements (`None` for other dtypes).
fn operand<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle::Result<Option<Operand<'a>>> {
    Ok(match s {
        CpuStorage::F32(_) => Some(Operand::F32(contiguous::<f32>(s, l, what)?)),
        CpuStorage::BF16(_) => Some(Operand::Bf16(contiguous::<bf16>(s, l, what)?)),
        _ => None,
    })
}

fn contiguous<'a, T: candle::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> candle::Result<&'a [T]> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle::Error::Msg(format!("occult linear: {what} is not contiguous")))?;
    Ok(&s.as_slice::<T>()?[start..end])
}

/// `c = a · bᵀ` with bf16 weights: on AMX if `amx`, else by `kernel`.
///
/// # Safety
/// As [`gemm_nt`] for the pair, and [`amx::gemm`] when `amx`.
#[allow(clippy::too_many_arguments)]
unsafe fn bf16_weights_gemm<A: Dot<bf16> + amx::AmxRow>(
    a: &[A],
    b: &[bf16],
    c: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    kernel: Kernel,
    amx: bool,
) {
    if amx {
        amx::gemm(a, b, c, m, n, k)
    } else {
        gemm_nt(a, b, c, m, n, k, kernel)
    }
}

/// An operand of a [`super::linear_rows`] product, as stored: activations `[m, k]` or weights `[n, k]`.
#[derive(Clone, Copy, Debug)]
pub enum Operand<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

/// The kernel for `m` rows on `path`, and whether it is the AMX kernel (bf16 weights on a CPU
/// with AMX).
fn kernel_for(path: Path, m: usize, bf16_weights: bool) -> (Kernel, bool) {
    let amx_here = bf16_weights && super::isa().amx;
    let kernel = match path {
        Path::Kernel(k) => k,
        _ => Kernel::pick(m, amx_here),
    };
    (kernel, kernel == Kernel::Amx && amx_here)
}

/// `c[m, n] = a[m, k] · wᵀ` in f32, on the kernel `path` picks for the operands (the kernel
/// [`super::linear`] runs for the same operands, so the same bits before its rounding of a bf16
/// result). Returns false, with `c` untouched, where this CPU has no kernel for the pair (bf16
/// activations take bf16 weights).
///
/// # Panics
/// If the slices' lengths do not match `m`, `n` and `k`.
pub(crate) fn rows(
    a: Operand<'_>,
    w: Operand<'_>,
    c: &mut [f32],
    (m, n, k): (usize, usize, usize),
    path: Path,
) -> bool {
    let isa = super::isa();
    let (kernel, amx) = kernel_for(path, m, matches!(w, Operand::Bf16(_)));
    match (a, w) {
        (Operand::F32(a), Operand::F32(b)) if isa.avx512f => {
            // SAFETY: AVX-512 F was detected; `gemm_nt` checks the lengths.
            unsafe { gemm_nt(a, b, c, m, n, k, kernel) };
        }
        (Operand::F32(a), Operand::Bf16(b)) if isa.mixed() => {
            check_lengths(a.len(), b.len(), c.len(), (m, n, k));
            // SAFETY: AVX-512 F and BW were detected, and AMX where `amx` says so.
            unsafe { bf16_weights_gemm(a, b, c, m, n, k, kernel, amx) };
        }
        (Operand::Bf16(a), Operand::Bf16(b)) if isa.avx512bf16 => {
            check_lengths(a.len(), b.len(), c.len(), (m, n, k));
            // SAFETY: AVX-512 F and BF16 were detected, and AMX where `amx` says so.
            unsafe { bf16_weights_gemm(a, b, c, m, n, k, kernel, amx) };
        }
        _ => return false,
    }
    true
}

fn check_lengths(a: usize, b: usize, c: usize, (m, n, k): (usize, usize, usize)) {
    assert!(
        a == m * k && b == n * k && c == m * n,
        "occult linear: operand lengths {a}, {b}, {c} do not match m={m} n={n} k={k}"
    );
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
        let mut c = vec![0f32; m * n];
        let done = match (operand(s1, l1, "x")?, operand(s2, l2, "w")?) {
            (Some(a), Some(w)) => rows(a, w, &mut c, (m, n, k), self.path),
            _ => false,
        };
        if !done {
            candle::bail!(
                "occult linear: no kernel for {:?} x {:?} on this CPU",
                s1.dtype(),
                s2.dtype()
            );
        }
        let out = match s1 {
            CpuStorage::BF16(_) => CpuStorage::BF16(c.into_iter().map(bf16::from_f32).collect()),
            _ => CpuStorage::F32(c),
        };
        Ok((out, Shape::from((m, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle::Result<(Option<Tensor>, Option<Tensor>)> {
        let lin = |a: &Tensor, b: &Tensor| {
            super::linear_with(a, b, self.path)
                .map_err(|e| candle::Error::Msg(format!("occult linear backward: {e}")))
        };
        // dx [m, k] = dy [m, n] · w [n, k] = dy · (wᵀ)ᵀ
        let dx = lin(dy, &w.t()?.contiguous()?)?;
        // dw [n, k] = dyᵀ [n, m] · x [m, k] = dyᵀ · (xᵀ)ᵀ
        let dw = lin(&dy.t()?.contiguous()?, &x.t()?.contiguous()?)?.to_dtype(w.dtype())?;
        Ok((Some(dx), Some(dw)))
    }
}
