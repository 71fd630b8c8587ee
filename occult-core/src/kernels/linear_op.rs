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
        let isa = super::isa();
        let mut c = vec![0f32; m * n];
        let bf16_weights = matches!(s2, CpuStorage::BF16(_));
        let kernel = match self.path {
            Path::Kernel(k) => k,
            _ => Kernel::pick(m, bf16_weights && isa.amx),
        };
        let amx = kernel == Kernel::Amx && bf16_weights && isa.amx;
        let out = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) if isa.avx512f => {
                let a = contiguous::<f32>(s1, l1, "x")?;
                let b = contiguous::<f32>(s2, l2, "w")?;
                // SAFETY: AVX-512 F was detected.
                unsafe { gemm_nt(a, b, &mut c, m, n, k, kernel) };
                CpuStorage::F32(c)
            }
            (CpuStorage::F32(_), CpuStorage::BF16(_)) if isa.mixed() => {
                let a = contiguous::<f32>(s1, l1, "x")?;
                let b = contiguous::<bf16>(s2, l2, "w")?;
                // SAFETY: AVX-512 F and BW were detected, and AMX where `amx` says so.
                unsafe { bf16_weights_gemm(a, b, &mut c, m, n, k, kernel, amx) };
                CpuStorage::F32(c)
            }
            (CpuStorage::BF16(_), CpuStorage::BF16(_)) if isa.avx512bf16 => {
                let a = contiguous::<bf16>(s1, l1, "x")?;
                let b = contiguous::<bf16>(s2, l2, "w")?;
                // SAFETY: AVX-512 F and BF16 were detected, and AMX where `amx` says so.
                unsafe { bf16_weights_gemm(a, b, &mut c, m, n, k, kernel, amx) };
                CpuStorage::BF16(c.into_iter().map(bf16::from_f32).collect())
            }
            _ => candle::bail!(
                "occult linear: no kernel for {:?} x {:?} on this CPU",
                s1.dtype(),
                s2.dtype()
            ),
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
