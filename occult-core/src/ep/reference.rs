//! The plain single-device MoE forward: for each expert, its tokens, its MLP, the gate weights,
//! summed back into token order; plus shared experts. It shares nothing with the EP layer but
//! the router and the expert MLPs, and is the oracle every EP mode, backend and placement is
//! checked against (itself held to a plain-loop MoE in the tests). At inference on CPU the
//! experts' sums run on [`super::experts_infer`]: the tensor path's sums, but for SiLU's `exp`
//! in the last bits.

use super::experts::{par_map, MoeWeights};
use super::experts_infer::{grouped_sum, Group};
use super::router::{route_biased, PruneSpec, Routed};
use super::swiglu::sum_dtype;
use crate::analysis::routing::RouterRule;
use crate::Result;
use candle::Tensor;

/// The reference forward of tokens `x` `[T, H]`. `prune` (with the placement `[E]` and the
/// device count it refers to) rewrites routing as the EP layer would.
pub fn reference_forward(
    w: &MoeWeights,
    rule: &RouterRule,
    x: &Tensor,
    prune: Option<(&PruneSpec, &[u32], usize)>,
) -> Result<Tensor> {
    Ok(reference_forward_routed(w, rule, x, prune)?.0)
}

/// [`reference_forward`], also returning the routing it used.
pub fn reference_forward_routed(
    w: &MoeWeights,
    rule: &RouterRule,
    x: &Tensor,
    prune: Option<(&PruneSpec, &[u32], usize)>,
) -> Result<(Tensor, Routed)> {
    let pruner = prune
        .map(|(spec, map, devices)| spec.pruner(rule, map, devices))
        .transpose()?;
    let routed = route_biased(x, &w.router, w.router_bias.as_ref(), rule, pruner.as_ref())?;
    let (tokens, hidden) = x.dims2()?;
    let k = rule.top_k;
    // Rows, gate weights and the sum in the sum dtype (f32 for bf16), rounded once, as the EP
    // layer does.
    let wide = sum_dtype(x.dtype());
    let xw = x.to_dtype(wide)?;
    let flat_weights = routed.weights.flatten_all()?.to_dtype(wide)?;
    // Each expert's tokens and the flat (token, kpos) index of their gate weights, in token
    // order.
    let mut token_of = vec![Vec::new(); w.experts.len()];
    let mut weight_at = vec![Vec::new(); w.experts.len()];
    for (i, &id) in routed.ids.iter().enumerate() {
        token_of[id as usize].push((i / k) as u32);
        weight_at[id as usize].push(i as u32);
    }
    let busy: Vec<usize> = (0..w.experts.len())
        .filter(|&e| !token_of[e].is_empty())
        .collect();
    let groups: Vec<Group> = busy
        .iter()
        .map(|&e| Group {
            slot: e,
            rows: &token_of[e],
            weight_at: Some(&weight_at[e]),
        })
        .collect();
    let fast = grouped_sum(&w.experts, &xw, Some(&flat_weights), &groups, x.dtype())?;
    let mut out = match fast {
        Some(out) => out,
        None => {
            let one = |&expert: &usize| -> Result<(Tensor, Tensor)> {
                let n = token_of[expert].len();
                let tok = Tensor::from_slice(&token_of[expert], n, x.device())?;
                let at = Tensor::from_slice(&weight_at[expert], n, x.device())?;
                let y = w.experts.expert(expert, &xw.index_select(&tok, 0)?)?;
                let gate = flat_weights.index_select(&at, 0)?.unsqueeze(1)?;
                Ok((y.broadcast_mul(&gate)?, tok))
            };
            let (outputs, dest): (Vec<Tensor>, Vec<Tensor>) =
                par_map(&busy, one)?.into_iter().unzip();
            // One scatter of every expert's weighted rows back to their tokens.
            let zeros = Tensor::zeros((tokens, hidden), wide, x.device())?;
            if outputs.is_empty() {
                zeros
            } else {
                zeros.index_add(&Tensor::cat(&dest, 0)?, &Tensor::cat(&outputs, 0)?, 0)?
            }
            .to_dtype(x.dtype())?
        }
    };
    if let Some(s) = &w.shared {
        out = (out + s.forward(x)?)?;
    }
    Ok((out, routed))
}
