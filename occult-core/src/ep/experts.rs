//! Expert MLPs: experts stored stacked (`[n, I, H]` gate and up, `[n, H, I]` down) with their
//! grouped compute over received rows, the dense SwiGLU MLP of shared experts, and the weights
//! of one MoE layer. Every op here is differentiable in candle.

use crate::ep::dispatch::ComputePlan;
use crate::ep::experts_fast::{grouped_sum, Group};
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

/// `f` of every item (an expert and its rows, or an attention head), in parallel across
/// rayon's threads, in order. Experts are independent, so the work splits at the grain where
/// each thread runs whole GEMMs: measured on OLMoE's shapes at 512 tokens, 1.05-1.15x the
/// prefill of splitting each GEMM across the threads, and the results are the same bits (each
/// product is computed by one thread either way, in the same order).
pub fn par_map<I: Sync, T: Send>(
    items: &[I],
    f: impl Fn(&I) -> Result<T> + Sync + Send,
) -> Result<Vec<T>> {
    use rayon::prelude::*;
    items.par_iter().map(f).collect()
}

/// `sigmoid(z)` from differentiable primitives.
pub fn sigmoid(z: &Tensor) -> Result<Tensor> {
    Ok((z.neg()?.exp()? + 1.0)?.recip()?)
}

/// The weights of one MoE layer: every expert (the reference), or one rank's experts in slot
/// order (the EP layer).
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// `[E, H]`, replicated on every rank.
    pub router: Tensor,
    pub experts: SwigluStack,
    pub shared: Option<SharedExperts>,
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

    /// Grouped compute of received rows: for every (row, expert) pair of `plan`, the expert's
    /// output on the row's first `H` columns (rows may carry more, such as gate weights), times
    /// the pair's gate weight from `weights` (flat, indexed by `plan.pair_weight`) if given,
    /// summed per row. Experts with no pairs cost nothing. Returns `[rows, H]`. At inference on
    /// CPU this runs on [`grouped_sum`] (the same sums, but for SiLU's `exp` in the last bits).
    pub fn grouped(
        &self,
        rows: &Tensor,
        weights: Option<&Tensor>,
        plan: &ComputePlan,
    ) -> Result<Tensor> {
        let num_rows = rows.dims2()?.0;
        let hidden = self.hidden();
        let dev = rows.device();
        if num_rows == 0 {
            // Nothing received. The (empty) result must stay on the graph through both the
            // received rows and the expert weights, as it would with rows: this rank's backward
            // must run the reverse exchanges that its peers wait in, whether the input or only
            // the experts are trained. (candle drops empty operands from binary ops, so join
            // them with `cat`.)
            let no_rows = self.gate.get(0)?.narrow(0, 0, 0)?;
            return Ok(Tensor::cat(&[&rows.narrow(1, 0, hidden)?, &no_rows], 0)?);
        }
        // Gate weights and sums in the sum dtype (f32 for bf16 rows), rounded once at the end;
        // on the CPU the rows too (see `swiglu_wide`).
        let wide = sum_dtype(rows.dtype());
        let xs_all = rows.narrow(1, 0, hidden)?;
        let xs_all = if dev.is_cpu() {
            xs_all.to_dtype(wide)?.contiguous()?
        } else {
            xs_all.contiguous()?
        };
        let weights = weights
            .map(|w| w.to_dtype(wide)?.contiguous())
            .transpose()?;
        let busy: Vec<usize> = (0..plan.num_local)
            .filter(|&slot| !plan.range(slot).is_empty())
            .collect();
        let groups: Vec<Group> = busy
            .iter()
            .map(|&slot| {
                let range = plan.range(slot);
                Group {
                    slot,
                    rows: &plan.pair_row[range.clone()],
                    weight_at: weights.as_ref().map(|_| &plan.pair_weight[range]),
                }
            })
            .collect();
        if let Some(sum) = grouped_sum(self, &xs_all, weights.as_ref(), &groups, rows.dtype())? {
            return Ok(sum);
        }
        let sum = self.grouped_on_graph(&xs_all, weights.as_ref(), plan, &busy, num_rows)?;
        Ok(sum.to_dtype(rows.dtype())?)
    }

    /// The grouped compute in candle ops: differentiable, on any device. The plan's index maps
    /// go to the rows' device once; each busy expert gathers its rows through its part of
    /// them and runs its SwiGLU (in parallel over experts on the CPU, in order on a GPU, whose
    /// stream runs kernels one after another anyway). Then one gate weighting of every pair
    /// and one scatter-add of every pair into its row, in [`sum_dtype`]. No host round trip
    /// per expert. Returns `[num_rows, H]` in the sum dtype.
    fn grouped_on_graph(
        &self,
        xs_all: &Tensor,
        weights: Option<&Tensor>,
        plan: &ComputePlan,
        busy: &[usize],
        num_rows: usize,
    ) -> Result<Tensor> {
        let dev = xs_all.device();
        let wide = sum_dtype(xs_all.dtype());
        let zeros = Tensor::zeros((num_rows, self.hidden()), wide, dev)?;
        if busy.is_empty() {
            return Ok(zeros);
        }
        let pairs = plan.pairs();
        // Pairs are grouped by slot, so the experts' outputs, concatenated in slot order, line
        // up with `pair_row` and `pair_weight` as they are.
        let pair_row = Tensor::from_slice(&plan.pair_row, pairs, dev)?;
        let expert = |&slot: &usize| {
            let range = plan.range(slot);
            let rows = pair_row.narrow(0, range.start, range.len())?;
            self.expert(slot, &xs_all.index_select(&rows, 0)?)
        };
        let outputs = if dev.is_cpu() {
            par_map(busy, expert)?
        } else {
            busy.iter().map(expert).collect::<Result<Vec<_>>>()?
        };
        let mut y = Tensor::cat(&outputs, 0)?;
        if let Some(w) = weights {
            let at = Tensor::from_slice(&plan.pair_weight, pairs, dev)?;
            y = y.broadcast_mul(&w.index_select(&at, 0)?.unsqueeze(1)?)?;
        }
        Ok(zeros.index_add(&pair_row, &y, 0)?)
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
