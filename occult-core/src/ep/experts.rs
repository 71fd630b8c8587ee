//! Expert MLPs: experts stored stacked (`[n, I, H]` gate and up, `[n, H, I]` down) with their
//! grouped compute over received rows, the dense SwiGLU MLP of shared experts, and the weights
//! of one MoE layer. Every op here is differentiable in candle.

use crate::ep::dispatch::ComputePlan;
use crate::ep::experts_fast::{grouped_sum, Group};
use crate::ep::pre_reduce::{self, pre_reduce};
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
    /// CPU this runs on [`grouped_sum`] (the same sums, but for SiLU's `exp` in the last bits);
    /// elsewhere as [`Grouping::Auto`] picks.
    pub fn grouped(
        &self,
        rows: &Tensor,
        weights: Option<&Tensor>,
        plan: &ComputePlan,
    ) -> Result<Tensor> {
        self.grouped_with(rows, weights, plan, Grouping::Auto)
    }

    /// [`SwigluStack::grouped`] with the experts run as `grouping` says (the CPU's inference
    /// path only with [`Grouping::Auto`]).
    pub fn grouped_with(
        &self,
        rows: &Tensor,
        weights: Option<&Tensor>,
        plan: &ComputePlan,
        grouping: Grouping,
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
        if grouping == Grouping::Auto {
            if let Some(sum) = grouped_sum(self, &xs_all, weights.as_ref(), &groups, rows.dtype())?
            {
                return Ok(sum);
            }
        }
        let inputs = GroupedInputs {
            xs_all: &xs_all,
            weights: weights.as_ref(),
            plan,
            busy: &busy,
            num_rows,
        };
        let sum = self.grouped_on_graph(&inputs, grouping)?;
        Ok(sum.to_dtype(rows.dtype())?)
    }

    /// The grouped compute in candle ops: differentiable, on any device. The plan's index maps
    /// go to the rows' device once per layer; the experts run as `grouping` picks, one per busy expert
    /// (in parallel over experts on the CPU, in order on a GPU, whose stream runs kernels one
    /// after another anyway) or padded and batched. Then the pre-reduction: every pair's
    /// output, gate-weighted, summed into its row in [`sum_dtype`] ([`pre_reduce()`] for f32
    /// sums, one kernel on a GPU; candle ops for f16). No host round trip per expert. Returns
    /// `[num_rows, H]` in the sum dtype.
    fn grouped_on_graph(&self, g: &GroupedInputs<'_>, grouping: Grouping) -> Result<Tensor> {
        let dev = g.xs_all.device();
        let wide = sum_dtype(g.xs_all.dtype());
        if g.busy.is_empty() {
            // Rows without a pair (none are sent so): zeros, kept on the rows' graph so that
            // the backward still runs this rank's reverse exchanges.
            return Ok(g.xs_all.affine(0.0, 0.0)?.to_dtype(wide)?);
        }
        let plan = g.plan;
        // Pairs are grouped by slot, so the experts' outputs, in slot order, line up with
        // `pair_row` and `pair_weight` as they are.
        let pads = grouping.pads(plan, dev, g.xs_all.dtype() == self.gate.dtype());
        let y = if pads {
            self.padded(g)?
        } else {
            let pair_row = Tensor::from_slice(&plan.pair_row, plan.pairs(), dev)?;
            let expert = |&slot: &usize| {
                let range = plan.range(slot);
                let rows = pair_row.narrow(0, range.start, range.len())?;
                self.expert(slot, &g.xs_all.index_select(&rows, 0)?)
            };
            let outputs = if dev.is_cpu() {
                par_map(g.busy, expert)?
            } else {
                g.busy.iter().map(expert).collect::<Result<Vec<_>>>()?
            };
            Tensor::cat(&outputs, 0)?
        };
        let gate = g.weights.map(|w| (w, plan.pair_weight.as_slice()));
        if y.dtype() == DType::F32 {
            return pre_reduce(&y, gate, &plan.pair_row, g.num_rows);
        }
        pre_reduce::reference(&y, gate, &plan.pair_row, g.num_rows)
    }

    /// Every local expert's SwiGLU as three batched products: each expert's rows padded with
    /// zero rows to the busiest expert's count, `[n, cap, H]` against the stacked weights
    /// (cuBLAS's strided batched GEMM on a GPU: three launches for all experts instead of
    /// three per expert). Returns the `[pairs, H]` outputs in pair order, in [`sum_dtype`].
    fn padded(&self, g: &GroupedInputs<'_>) -> Result<Tensor> {
        let (plan, dev) = (g.plan, g.xs_all.device());
        let (n, hidden) = (self.len(), self.hidden());
        if plan.num_local != n {
            bail!("a plan for {} experts, {n} experts here", plan.num_local);
        }
        let cap = (0..n).map(|s| plan.range(s).len()).max().unwrap_or(0);
        // The row of every padded position (an appended zero row for padding), and the padded
        // position of every pair.
        let mut row_at = vec![g.num_rows as u32; n * cap];
        let mut pair_at = Vec::with_capacity(plan.pairs());
        for slot in 0..n {
            for (j, p) in plan.range(slot).enumerate() {
                row_at[slot * cap + j] = plan.pair_row[p];
                pair_at.push((slot * cap + j) as u32);
            }
        }
        // The products run in the weights' dtype (on a GPU the rows are in it already).
        let xs = g.xs_all.to_dtype(self.gate.dtype())?;
        let zero = Tensor::zeros((1, hidden), xs.dtype(), dev)?;
        let xs = Tensor::cat(&[&xs, &zero], 0)?
            .index_select(&Tensor::from_vec(row_at, n * cap, dev)?, 0)?
            .reshape((n, cap, hidden))?;
        let gate = xs.matmul(&self.gate.transpose(1, 2)?)?.silu()?;
        let up = xs.matmul(&self.up.transpose(1, 2)?)?;
        let y = (gate * up)?.matmul(&self.down.transpose(1, 2)?)?;
        let pair_at = Tensor::from_vec(pair_at, plan.pairs(), dev)?;
        let y = y.reshape((n * cap, hidden))?.index_select(&pair_at, 0)?;
        Ok(y.to_dtype(sum_dtype(g.xs_all.dtype()))?)
    }
}

/// What the grouped compute on candle's graph works on.
struct GroupedInputs<'a> {
    /// `[num_rows, H]`, the received rows' hidden part.
    xs_all: &'a Tensor,
    /// Flat gate weights, indexed by `plan.pair_weight`.
    weights: Option<&'a Tensor>,
    plan: &'a ComputePlan,
    /// The slots with pairs.
    busy: &'a [usize],
    num_rows: usize,
}

/// How the grouped compute on the graph runs the experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grouping {
    /// Padded on a GPU where there are several local experts, the rows are in the weights'
    /// dtype, and the padding at most doubles the rows ([`PADDED_MAX_ROWS_PER_PAIR`]); else
    /// one expert at a time.
    Auto,
    /// One SwiGLU per busy expert on its own rows.
    PerExpert,
    /// Every local expert padded to the busiest one's rows and run as three batched products.
    Padded,
}

/// [`Grouping::Auto`] pads only where the padded rows (local experts times the busiest
/// expert's count) are at most this many times the pairs: the padding's wasted products then
/// cost at most as much as the real ones, and save three product launches, the activations'
/// and a gather per expert.
pub const PADDED_MAX_ROWS_PER_PAIR: usize = 2;

impl Grouping {
    /// Whether to pad, for `plan` on `device` (`same_dtype`: the rows are in the weights'
    /// dtype; [`Grouping::Padded`] casts them otherwise).
    fn pads(self, plan: &ComputePlan, device: &candle::Device, same_dtype: bool) -> bool {
        match self {
            Grouping::PerExpert => false,
            Grouping::Padded => true,
            Grouping::Auto => {
                let cap = (0..plan.num_local)
                    .map(|s| plan.range(s).len())
                    .max()
                    .unwrap_or(0);
                !device.is_cpu()
                    && same_dtype
                    && plan.num_local > 1
                    && plan.num_local * cap <= PADDED_MAX_ROWS_PER_PAIR * plan.pairs()
            }
        }
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
