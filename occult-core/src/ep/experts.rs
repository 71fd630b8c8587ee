//! The grouped compute of stacked experts over received rows, on candle's graph (any device,
//! differentiable), with the CPU's inference path ([`super::experts_infer`]) taken where it
//! applies; and the weights of one MoE layer ([`MoeWeights`]). The experts themselves, and shared
//! experts, are [`super::swiglu`]'s.

use crate::ep::dispatch::ComputePlan;
use crate::ep::experts_infer::{grouped_sum, Group};
use crate::ep::pre_reduce::{self, pre_reduce};
use crate::ep::swiglu::sum_dtype;
use crate::{bail, Result};
use candle::{DType, Tensor};

pub use crate::ep::swiglu::{SharedExperts, SwigluStack};

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

/// The weights of one MoE layer: every expert (the reference), or one rank's experts in slot
/// order (the EP layer).
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// `[E, H]`, replicated on every rank.
    pub router: Tensor,
    /// `[E]`, added to the router's logits (gpt-oss).
    pub router_bias: Option<Tensor>,
    pub experts: SwigluStack,
    pub shared: Option<SharedExperts>,
}

impl SwigluStack {
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
        } else if grouping.stacks(dev, g.xs_all.dtype(), self.gate.dtype()) {
            if plan.num_local != self.len() {
                bail!(
                    "a plan for {} experts, {} experts here",
                    plan.num_local,
                    self.len()
                );
            }
            let pair_row = Tensor::from_slice(&plan.pair_row, plan.pairs(), dev)?;
            let counts: Vec<usize> = (0..plan.num_local).map(|s| plan.range(s).len()).collect();
            self.stacked(&g.xs_all.index_select(&pair_row, 0)?, &counts)?
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
        // Biases `[n, X]` are added to every padded row of their expert.
        let add = |y: Tensor, b: Option<&Tensor>| -> Result<Tensor> {
            Ok(match b {
                Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?.unsqueeze(1)?)?,
                None => y,
            })
        };
        let b = self.bias.as_ref();
        let gate = add(xs.matmul(&self.gate.transpose(1, 2)?)?, b.map(|b| &b.gate))?;
        let up = add(xs.matmul(&self.up.transpose(1, 2)?)?, b.map(|b| &b.up))?;
        let y = add(
            self.act
                .apply(&gate, &up)?
                .matmul(&self.down.transpose(1, 2)?)?,
            b.map(|b| &b.down),
        )?;
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
    /// dtype, and the padding at most doubles the rows ([`PADDED_MAX_ROWS_PER_PAIR`]); stacked
    /// on the CPU where the kernels take the rows and weights; else one expert at a time.
    Auto,
    /// One SwiGLU per busy expert on its own rows.
    PerExpert,
    /// Every local expert padded to the busiest one's rows and run as three batched products.
    Padded,
    /// Every local expert on its own rows through three grouped products over the stacked
    /// weights ([`SwigluStack::stacked`]; CPU, at a level with kernels, else per expert):
    /// [`Grouping::Auto`]'s pick on the CPU, where it trains without a gradient the size of
    /// the stack per expert.
    Stacked,
}

impl Grouping {
    /// Whether to run the grouped products over the stack: on the CPU, at a level with
    /// kernels, for rows and weights of a pair the kernels take.
    fn stacks(self, device: &candle::Device, rows: DType, weights: DType) -> bool {
        let pair = matches!(
            (rows, weights),
            (DType::F32, DType::F32) | (DType::F32, DType::BF16) | (DType::BF16, DType::BF16)
        );
        matches!(self, Grouping::Auto | Grouping::Stacked)
            && device.is_cpu()
            && pair
            && crate::kernels::process_level() != crate::kernels::Level::Portable
    }
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
            Grouping::PerExpert | Grouping::Stacked => false,
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
