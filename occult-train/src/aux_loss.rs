//! The load-balancing auxiliary loss on the routers, in the family's own form
//! ([`AuxForm`]), over the real tokens of the global batch: padding never counts, and D ranks
//! give the loss one device gives on their union (the expert counts and token totals are summed
//! over ranks before the loss is formed; each rank's share is its tokens' part of the sum).
//!
//! With `c_i` the routed slots that went to expert `i`, `S_i` the summed router probabilities
//! (softmax over all experts) of expert `i`, `N` the tokens and `k` the top-k:
//! - [`AuxForm::AllLayers`] (transformers): `coef * E * sum_i (c_i / N) (S_i / N)`, with the
//!   tokens of all MoE layers pooled (`N` counts each token once per layer);
//! - [`AuxForm::PerLayer`] (DeepSeek, `seq_aux` false): per layer,
//!   `coef * E / k * sum_i (c_i / N) (S_i / N)`, summed over layers;
//! - [`AuxForm::PerSequence`] (DeepSeek, `seq_aux` true): the same per layer and per sequence,
//!   averaged over the global batch's sequences.
//!
//! The counts come from the experts each token was actually sent to (after pruning, when the
//! run prunes): the load the experts receive.

use crate::{Error, Result};
use candle::Tensor;
use occult_core::models::config::{AuxForm, AuxLoss};
use occult_core::models::model::{Model, RouterTap};
use std::ops::Range;

/// This rank's share of the auxiliary loss (a scalar on the routers' graph; `None` when this
/// rank has no tokens or the batch has none). `taps` are the routing of one forward, one per
/// MoE layer in layer order; `seqs` are the rows of each sequence's real tokens among the
/// forward's `rows` flattened positions. Collective: every rank calls it once per forward,
/// with or without tokens.
pub fn aux_loss_share(
    m: &Model,
    aux: AuxLoss,
    taps: &[RouterTap],
    seqs: &[Range<usize>],
    rows: usize,
) -> Result<Option<Tensor>> {
    let moe_layers = m.cfg.moe_layers.iter().filter(|&&x| x).count();
    let (e, k) = (m.cfg.moe.num_experts, m.cfg.moe.top_k);
    if !taps.is_empty() {
        check_taps(m, taps, rows)?;
    }
    let local_tokens: usize = seqs.iter().map(|s| s.len()).sum();
    // counts[g][l][i]: slots of group g in layer l routed to expert i.
    let groups: Vec<&[Range<usize>]> = match aux.form {
        AuxForm::PerSequence => seqs.iter().map(std::slice::from_ref).collect(),
        AuxForm::AllLayers | AuxForm::PerLayer => vec![seqs],
    };
    let mut counts = vec![vec![vec![0u64; e]; moe_layers]; groups.len()];
    for (g, ranges) in groups.iter().enumerate() {
        for (l, tap) in taps.iter().enumerate() {
            for r in ranges.iter().flat_map(|r| r.clone()) {
                for &id in &tap.ids[r * k..(r + 1) * k] {
                    counts[g][l][id as usize] += 1;
                }
            }
        }
    }
    // weights[g][l][i]: what S_i of group g in layer l is multiplied by.
    let weights: Vec<Vec<Vec<f64>>> = match aux.form {
        AuxForm::AllLayers | AuxForm::PerLayer => {
            let mut flat: Vec<u64> = counts[0].iter().flatten().copied().collect();
            flat.push(local_tokens as u64);
            m.sum_counts_over_ranks(&mut flat)?;
            let n = *flat.last().expect("the token count") as f64;
            if n == 0.0 {
                return Ok(None);
            }
            let per_layer: Vec<&[u64]> = flat[..moe_layers * e].chunks(e.max(1)).collect();
            let w: Vec<Vec<f64>> = if aux.form == AuxForm::AllLayers {
                let pooled_n = n * moe_layers as f64;
                let scale = aux.coef * e as f64 / (pooled_n * pooled_n);
                let pooled: Vec<f64> = (0..e)
                    .map(|i| per_layer.iter().map(|c| c[i]).sum::<u64>() as f64 * scale)
                    .collect();
                vec![pooled; moe_layers]
            } else {
                let scale = aux.coef * e as f64 / (k as f64 * n * n);
                per_layer
                    .iter()
                    .map(|c| c.iter().map(|&x| x as f64 * scale).collect())
                    .collect()
            };
            vec![w]
        }
        AuxForm::PerSequence => {
            let sequences = m.global_count(seqs.len())? as f64;
            groups
                .iter()
                .zip(&counts)
                .map(|(ranges, c)| {
                    let t = ranges[0].len().max(1) as f64;
                    let scale = aux.coef * e as f64 / (k as f64 * t * t * sequences);
                    c.iter()
                        .map(|layer| layer.iter().map(|&x| x as f64 * scale).collect())
                        .collect()
                })
                .collect()
        }
    };
    if taps.is_empty() || local_tokens == 0 {
        return Ok(None);
    }
    // select[g, r] = 1 where row r is a real token of group g.
    let mut select = vec![0f32; groups.len() * rows];
    for (g, ranges) in groups.iter().enumerate() {
        for r in ranges.iter().flat_map(|r| r.clone()) {
            select[g * rows + r] = 1.0;
        }
    }
    // On the router logits' device (a GPU's, with --cuda).
    let dev = taps[0].logits.device();
    let select = Tensor::from_vec(select, (groups.len(), rows), dev)?;
    let mut total: Option<Tensor> = None;
    for (l, tap) in taps.iter().enumerate() {
        let probs = candle_nn::ops::softmax(&tap.logits, candle::D::Minus1)?;
        let summed = select.matmul(&probs)?; // [G, E]: S_i per group
        let w: Vec<f32> = weights
            .iter()
            .flat_map(|g| g[l].iter().map(|&x| x as f32))
            .collect();
        let w = Tensor::from_vec(w, (groups.len(), e), dev)?;
        let part = (summed * w)?.sum_all()?;
        total = Some(match total {
            None => part,
            Some(t) => (t + part)?,
        });
    }
    Ok(total)
}

/// The taps must be one forward's: one per MoE layer, in order, each with `rows` tokens.
fn check_taps(m: &Model, taps: &[RouterTap], rows: usize) -> Result<()> {
    let layers: Vec<usize> = (0..m.cfg.num_layers)
        .filter(|&l| m.cfg.moe_layers[l])
        .collect();
    let got: Vec<usize> = taps.iter().map(|t| t.layer).collect();
    if got != layers {
        return Err(Error::Invalid(format!(
            "the routing taps cover layers {got:?}, the model's MoE layers are {layers:?}"
        )));
    }
    let k = m.cfg.moe.top_k;
    for t in taps {
        let (n, e) = t.logits.dims2()?;
        if n != rows || e != m.cfg.moe.num_experts || t.ids.len() != rows * k {
            return Err(Error::Invalid(format!(
                "layer {}: routing of {n} tokens over {e} experts with {} ids, expected {rows} \
                 tokens",
                t.layer,
                t.ids.len()
            )));
        }
    }
    Ok(())
}
