//! SwiGLU MLPs, the compute of every expert: one MLP on rows ([`swiglu`], and [`swiglu_wide`],
//! which keeps the result in the dtype expert sums are kept in), experts stored stacked
//! ([`SwigluStack`]: `[n, I, H]` gate and up, `[n, H, I]` down) and shared experts
//! ([`SharedExperts`]). Every op here is differentiable in candle; the grouped compute of a
//! stack over received rows is [`super::experts`]'s.

use crate::kernels::linear;
use crate::{bail, Result};
use candle::{DType, Tensor};

/// `down(silu(gate(x)) * up(x))` for rows `x` `[n, H]` and weights `gate`, `up` `[I, H]`,
/// `down` `[H, I]`, in `x`'s dtype.
pub fn swiglu(x: &Tensor, gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor> {
    Ok(swiglu_wide(x, gate, up, down)?.to_dtype(x.dtype())?)
}

/// The dtype sums of expert outputs are kept in for rows of `dtype`: f32 for bf16 (rounded
/// once, when the sum is done), else `dtype` itself.
pub fn sum_dtype(dtype: DType) -> DType {
    if dtype == DType::BF16 {
        DType::F32
    } else {
        dtype
    }
}

/// [`swiglu`] in [`sum_dtype`], for callers that weight and sum expert outputs before rounding.
///
/// With bf16 rows and weights on the CPU, the activations inside are f32 (the weights stay
/// bf16): the projections accumulate in f32 and their outputs, SiLU and the product are not
/// rounded to bf16, and neither is the result. This is at least as exact as rounding each
/// step, and measured faster on CPU (candle's bf16 element-wise ops convert every element
/// twice). On a GPU the projections run on bf16 tensor cores (f32 accumulation, one rounding
/// per product, as in transformers and Megatron-Core), and only the result is widened.
pub fn swiglu_wide(x: &Tensor, gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let wide = sum_dtype(x.dtype());
    let x = if wide != x.dtype() && gate.dtype() == DType::BF16 && x.device().is_cpu() {
        x.to_dtype(wide)?
    } else {
        x.clone()
    };
    let g = linear(&x, gate)?.silu()?;
    let u = linear(&x, up)?;
    let y = linear(&(g * u)?, down)?;
    Ok(y.to_dtype(wide)?)
}

/// `sigmoid(z)` from differentiable primitives.
pub fn sigmoid(z: &Tensor) -> Result<Tensor> {
    Ok((z.neg()?.exp()? + 1.0)?.recip()?)
}

/// SwiGLU experts stored stacked along the first dimension.
#[derive(Clone, Debug)]
pub struct SwigluStack {
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

impl SwigluStack {
    /// Checks shapes: gate and up `[n, I, H]`, down `[n, H, I]`.
    pub fn new(gate: Tensor, up: Tensor, down: Tensor) -> Result<Self> {
        let (n, i, h) = gate.dims3()?;
        if up.dims() != [n, i, h] {
            bail!(
                "expert up projections have shape {:?}, expected [{n}, {i}, {h}]",
                up.dims()
            );
        }
        if down.dims() != [n, h, i] {
            bail!(
                "expert down projections have shape {:?}, expected [{n}, {h}, {i}]",
                down.dims()
            );
        }
        Ok(SwigluStack { gate, up, down })
    }

    pub fn len(&self) -> usize {
        self.gate.dims()[0]
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn hidden(&self) -> usize {
        self.gate.dims()[2]
    }

    pub fn intermediate(&self) -> usize {
        self.gate.dims()[1]
    }

    /// The experts `ids`, in that order (how a rank takes its experts from the full set).
    pub fn select(&self, ids: &[u32]) -> Result<Self> {
        let idx = Tensor::from_slice(ids, ids.len(), self.gate.device())?;
        SwigluStack::new(
            self.gate.index_select(&idx, 0)?,
            self.up.index_select(&idx, 0)?,
            self.down.index_select(&idx, 0)?,
        )
    }

    /// Expert `x` applied to rows `[n, H]`, in [`sum_dtype`] of the rows' dtype.
    pub fn expert(&self, x: usize, rows: &Tensor) -> Result<Tensor> {
        swiglu_wide(
            rows,
            &self.gate.get(x)?,
            &self.up.get(x)?,
            &self.down.get(x)?,
        )
    }
}

/// Shared experts, computed on a rank's own tokens: one SwiGLU MLP (several shared experts are
/// fused into one wider MLP), optionally scaled by `sigmoid(x . gate)` (Qwen-MoE).
#[derive(Clone, Debug)]
pub struct SharedExperts {
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
    /// `[1, H]`, Qwen's `shared_expert_gate`.
    pub gate: Option<Tensor>,
}

impl SharedExperts {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = swiglu(x, &self.gate_proj, &self.up_proj, &self.down_proj)?;
        match &self.gate {
            Some(g) => Ok(y.broadcast_mul(&sigmoid(&linear(x, g)?)?)?),
            None => Ok(y),
        }
    }
}
