//! SwiGLU MLPs, the compute of every expert: one MLP on rows ([`swiglu`], and [`swiglu_wide`],
//! which keeps the result in the dtype expert sums are kept in), experts stored stacked
//! ([`SwigluStack`]: `[n, I, H]` gate and up, `[n, H, I]` down, with gpt-oss's biases and
//! clamped activation where the model has them: [`ExpertBiases`], [`Activation`]) and shared
//! experts ([`SharedExperts`]). Every op here is differentiable in candle; the grouped compute
//! of a stack over received rows is [`super::experts`]'s.

use crate::kernels::grouped_linear::grouped_linear;
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
    glu_wide(x, [gate, up, down], None, Activation::Silu)
}

/// The gated MLP of every expert, in [`sum_dtype`]: `down(act(gate(x) + bg, up(x) + bu)) + bd`
/// with `weights` `[gate, up, down]` and, if given, `biases` `[bg, bu, bd]` (`[I]`, `[I]`,
/// `[H]`). See [`swiglu_wide`] for the dtypes.
pub fn glu_wide(
    x: &Tensor,
    weights: [&Tensor; 3],
    biases: Option<[Tensor; 3]>,
    act: Activation,
) -> Result<Tensor> {
    let [gate, up, down] = weights;
    let wide = sum_dtype(x.dtype());
    let x = if wide != x.dtype() && gate.dtype() == DType::BF16 && x.device().is_cpu() {
        x.to_dtype(wide)?
    } else {
        x.clone()
    };
    let add = |y: Tensor, b: Option<&Tensor>| -> Result<Tensor> {
        Ok(match b {
            Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?)?,
            None => y,
        })
    };
    let [bg, bu, bd] = match &biases {
        Some([g, u, d]) => [Some(g), Some(u), Some(d)],
        None => [None; 3],
    };
    let g = add(linear(&x, gate)?, bg)?;
    let u = add(linear(&x, up)?, bu)?;
    let y = add(linear(&act.apply(&g, &u)?, down)?, bd)?;
    Ok(y.to_dtype(wide)?)
}

/// The gated activation between an expert's projections.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// `silu(g) * u`.
    Silu,
    /// gpt-oss's: `g' = min(g, limit)`, `u' = clamp(u, -limit, limit)`, then
    /// `g' * sigmoid(alpha * g') * (u' + 1)` (`swiglu_alpha` 1.702, `swiglu_limit` 7).
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl Activation {
    /// The activation of gate and up projections `g`, `u` (same shape), differentiable.
    pub fn apply(self, g: &Tensor, u: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Silu => Ok((g.silu()? * u)?),
            Activation::ClampedSwiglu { alpha, limit } => {
                let limit = limit as f64;
                let g = g.minimum(limit)?;
                let u = u.clamp(-limit, limit)?;
                let glu = (&g * sigmoid(&g.affine(alpha as f64, 0.0)?)?)?;
                Ok(((u + 1.0)? * glu)?)
            }
        }
    }

    /// [`Activation::apply`] on slices, in place into `g` (`u` is scratch), after adding the
    /// bias rows `(bg, bu)` to every row of `g` and `u` if given, on the vector kernels
    /// ([`crate::kernels::vmath`]: the same products within a few roundings).
    pub fn apply_in_place(self, g: &mut [f32], u: &mut [f32], bias: Option<(&[f32], &[f32])>) {
        match self {
            Activation::Silu => {
                if let Some((bg, bu)) = bias {
                    for (x, b) in [(&mut *g, bg), (&mut *u, bu)] {
                        for row in x.chunks_exact_mut(b.len().max(1)) {
                            row.iter_mut().zip(b).for_each(|(x, &b)| *x += b);
                        }
                    }
                }
                crate::kernels::vmath::silu_mul(g, u)
            }
            Activation::ClampedSwiglu { alpha, limit } => {
                crate::kernels::vmath::clamped_swiglu(g, u, alpha, limit, bias)
            }
        }
    }
}

/// The biases of stacked experts (gpt-oss): `[n, I]` on the gate and up projections, `[n, H]`
/// on the down projection.
#[derive(Clone, Debug)]
pub struct ExpertBiases {
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
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
    /// gpt-oss's projection biases.
    pub bias: Option<ExpertBiases>,
    pub act: Activation,
}

impl SwigluStack {
    /// Checks shapes: gate and up `[n, I, H]`, down `[n, H, I]`. SiLU, no biases; see
    /// [`SwigluStack::with_form`].
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
        Ok(SwigluStack {
            gate,
            up,
            down,
            bias: None,
            act: Activation::Silu,
        })
    }

    /// The stack with activation `act` and projection biases `bias` (shapes checked).
    pub fn with_form(mut self, act: Activation, bias: Option<ExpertBiases>) -> Result<Self> {
        let (n, i, h) = self.gate.dims3()?;
        if let Some(b) = &bias {
            for (name, t, want) in [
                ("gate", &b.gate, [n, i]),
                ("up", &b.up, [n, i]),
                ("down", &b.down, [n, h]),
            ] {
                if t.dims() != want {
                    bail!(
                        "expert {name} biases have shape {:?}, expected {want:?}",
                        t.dims()
                    );
                }
            }
        }
        self.act = act;
        self.bias = bias;
        Ok(self)
    }

    /// Expert `x`'s biases (gate, up, down), if the stack has them.
    pub fn biases_of(&self, x: usize) -> Result<Option<[Tensor; 3]>> {
        self.bias
            .as_ref()
            .map(|b| Ok([b.gate.get(x)?, b.up.get(x)?, b.down.get(x)?]))
            .transpose()
    }

    /// Every tensor of the stack, named: `gate`, `up`, `down` and, with biases, `gate_bias`,
    /// `up_bias`, `down_bias`.
    pub fn tensors(&self) -> Vec<(&'static str, &Tensor)> {
        let mut out = vec![("gate", &self.gate), ("up", &self.up), ("down", &self.down)];
        if let Some(b) = &self.bias {
            out.extend([
                ("gate_bias", &b.gate),
                ("up_bias", &b.up),
                ("down_bias", &b.down),
            ]);
        }
        out
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
        let bias = self
            .bias
            .as_ref()
            .map(|b| -> Result<ExpertBiases> {
                Ok(ExpertBiases {
                    gate: b.gate.index_select(&idx, 0)?,
                    up: b.up.index_select(&idx, 0)?,
                    down: b.down.index_select(&idx, 0)?,
                })
            })
            .transpose()?;
        SwigluStack::new(
            self.gate.index_select(&idx, 0)?,
            self.up.index_select(&idx, 0)?,
            self.down.index_select(&idx, 0)?,
        )?
        .with_form(self.act, bias)
    }

    /// Every expert on its own rows at once: `rows` `[P, H]` grouped by expert (`counts[s]`
    /// rows of expert s, in slot order), each row's expert output in [`sum_dtype`] of the rows'
    /// dtype, as [`SwigluStack::expert`] gives it, through [`grouped_linear`] on the stacked
    /// weights (CPU, at a level with kernels): training writes each weight's gradient once.
    pub fn stacked(&self, rows: &Tensor, counts: &[usize]) -> Result<Tensor> {
        let wide = sum_dtype(rows.dtype());
        let x = if wide != rows.dtype() && self.gate.dtype() == DType::BF16 {
            rows.to_dtype(wide)?
        } else {
            rows.clone()
        };
        // Each row's expert, for the biases.
        let slots: Vec<u32> = counts
            .iter()
            .enumerate()
            .flat_map(|(s, &m)| std::iter::repeat_n(s as u32, m))
            .collect();
        let slots = Tensor::from_vec(slots, rows.dim(0)?, rows.device())?;
        let add = |y: Tensor, b: Option<&Tensor>| -> Result<Tensor> {
            Ok(match b {
                Some(b) => (&y + b.index_select(&slots, 0)?.to_dtype(y.dtype())?)?,
                None => y,
            })
        };
        let b = self.bias.as_ref();
        let g = add(grouped_linear(&x, &self.gate, counts)?, b.map(|b| &b.gate))?;
        let u = add(grouped_linear(&x, &self.up, counts)?, b.map(|b| &b.up))?;
        let h = self.act.apply(&g, &u)?;
        let y = add(grouped_linear(&h, &self.down, counts)?, b.map(|b| &b.down))?;
        Ok(y.to_dtype(wide)?)
    }

    /// Expert `x` applied to rows `[n, H]`, in [`sum_dtype`] of the rows' dtype.
    pub fn expert(&self, x: usize, rows: &Tensor) -> Result<Tensor> {
        glu_wide(
            rows,
            [&self.gate.get(x)?, &self.up.get(x)?, &self.down.get(x)?],
            self.biases_of(x)?,
            self.act,
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
