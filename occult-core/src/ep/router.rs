//! The router stage: logits on the graph, top-k ids chosen on the host (by the model's
//! [`RouterRule`], then rewritten by a [`Pruner`] if collaboration pruning is on), gate weights
//! gathered back from the scores on the graph so that the router gets gradients.

use super::swiglu::sigmoid;
use crate::analysis::pruning::{PruneLimit, PruneRule, Pruner};
use crate::analysis::routing::{RouterRule, Scoring};
use crate::analysis::similarity::SimilarityTable;
use crate::Result;
use candle::{DType, Tensor, D};

/// Collaboration pruning applied inside the layer.
#[derive(Clone, Debug)]
pub struct PruneSpec {
    pub rule: PruneRule,
    /// How far a token may spread: devices, or nodes (and devices in each).
    pub limit: PruneLimit,
    /// Needed by the similarity rule.
    pub similarity: Option<SimilarityTable>,
}

impl PruneSpec {
    /// The pruner for a router rule and a placement on `num_devices` devices.
    pub fn pruner<'a>(
        &'a self,
        rule: &'a RouterRule,
        device_of_expert: &'a [u32],
        num_devices: usize,
    ) -> Result<Pruner<'a>> {
        Pruner::with_limit(
            self.rule,
            rule,
            device_of_expert,
            num_devices,
            self.limit,
            self.similarity.as_ref(),
        )
    }
}

/// A routing decision: host ids `[T, k]`, gate weights on the graph `[T, k]`, and the router
/// logits `[T, E]`, as the host saw them (f32, row-major) and on the graph (f32; what an
/// auxiliary loss on the router differentiates).
#[derive(Clone, Debug)]
pub struct Routed {
    pub ids: Vec<u32>,
    pub weights: Tensor,
    pub logits: Vec<f32>,
    pub router_logits: Tensor,
}

/// Routes tokens `x` `[T, H]` with router weights `[E, H]`; `pruner` rewrites the selection.
pub fn route(
    x: &Tensor,
    router: &Tensor,
    rule: &RouterRule,
    pruner: Option<&Pruner>,
) -> Result<Routed> {
    route_biased(x, router, None, rule, pruner)
}

/// [`route`] with the router's logit bias `[E]` (gpt-oss's `mlp.router.bias`), added to the
/// logits: it moves both the choice and the weights, unlike a selection bias.
pub fn route_biased(
    x: &Tensor,
    router: &Tensor,
    bias: Option<&Tensor>,
    rule: &RouterRule,
    pruner: Option<&Pruner>,
) -> Result<Routed> {
    let logits = crate::kernels::linear(x, router)?;
    let logits = match bias {
        Some(b) => logits.broadcast_add(&b.to_dtype(logits.dtype())?)?,
        None => logits,
    };
    let tokens = logits.dims2()?.0;
    let k = rule.top_k;
    if tokens == 0 {
        // candle cannot reduce over zero rows; there is nothing to route. The (empty) weights
        // are taken from the logits so that they stay on the router's graph: every rank must
        // keep the same exchanges in its backward, tokens or not.
        return Ok(Routed {
            ids: Vec::new(),
            weights: logits.narrow(1, 0, k)?,
            logits: Vec::new(),
            router_logits: logits.to_dtype(DType::F32)?,
        });
    }
    // Routing decisions are taken in f32 whatever the model's dtype; so are the gate weights.
    let logits = logits.to_dtype(DType::F32)?;
    let host = logits.flatten_all()?.to_vec1::<f32>()?;
    let mut ids = Vec::with_capacity(tokens * k);
    for row in host.chunks(rule.num_experts) {
        let chosen = rule.route(row);
        match pruner {
            Some(p) => ids.extend(p.prune_logits(row, &chosen.ids).ids),
            None => ids.extend(chosen.ids),
        }
    }
    let idx = Tensor::from_slice(&ids, (tokens, k), x.device())?;
    let mut weights = match (rule.scoring, rule.renormalize) {
        // The softmax over every expert renormalised over the chosen ones is the softmax of
        // the chosen logits (gpt-oss's own form), whose gradient is exactly zero for the
        // experts not chosen (the other form's is rounding noise, which AdamW turns into steps).
        (Scoring::Softmax, true) => candle_nn::ops::softmax(&logits.gather(&idx, 1)?, D::Minus1)?,
        (Scoring::Softmax, false) => {
            candle_nn::ops::softmax(&logits, D::Minus1)?.gather(&idx, 1)?
        }
        (Scoring::Sigmoid, renormalize) => {
            let w = sigmoid(&logits)?.gather(&idx, 1)?;
            if renormalize {
                w.broadcast_div(&w.sum_keepdim(1)?)?
            } else {
                w
            }
        }
    };
    if rule.scaling_factor != 1.0 {
        weights = weights.affine(rule.scaling_factor as f64, 0.0)?;
    }
    Ok(Routed {
        ids,
        weights: weights.to_dtype(x.dtype())?,
        logits: host,
        router_logits: logits,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::{Device, Var};

    /// The sigmoid-scored router (DeepSeek-V3 style: selection bias, renormalised, scaled) on
    /// the graph, against its definition in plain loops: ids, gate weights, and a router
    /// gradient by central differences.
    #[test]
    fn sigmoid_scoring_on_the_graph_matches_its_definition() {
        let (t, h, e, k) = (5usize, 6usize, 8usize, 3usize);
        let xs: Vec<f32> = (0..t * h)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 9.0)
            .collect();
        let rs: Vec<f32> = (0..e * h)
            .map(|i| ((i * 53 % 23) as f32 - 11.0) / 13.0)
            .collect();
        let bias: Vec<f32> = (0..e).map(|j| (j as f32 - 3.5) / 20.0).collect();
        let mut rule = RouterRule::softmax_topk(e, k, true);
        rule.scoring = Scoring::Sigmoid;
        rule.scaling_factor = 2.5;
        rule.selection_bias = Some(bias.clone());
        let x = Tensor::from_slice(&xs, (t, h), &Device::Cpu).unwrap();
        let router = Var::from_slice(&rs, (e, h), &Device::Cpu).unwrap();
        let routed = route(&x, router.as_tensor(), &rule, None).unwrap();
        let got: Vec<Vec<f32>> = routed.weights.to_vec2().unwrap();
        // The definition: scores sigmoid(x . r_e); choose the k largest score + bias; gate
        // weights the chosen scores over their sum, times the scaling factor.
        let plain = |rs: &[f32]| -> (Vec<u32>, Vec<f32>) {
            let (mut ids, mut w) = (Vec::new(), Vec::new());
            for tok in 0..t {
                let s: Vec<f32> = (0..e)
                    .map(|j| {
                        let l: f32 = (0..h).map(|c| xs[tok * h + c] * rs[j * h + c]).sum();
                        1.0 / (1.0 + (-l).exp())
                    })
                    .collect();
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&a, &b| (s[b] + bias[b]).total_cmp(&(s[a] + bias[a])));
                let chosen = &order[..k];
                let sum: f32 = chosen.iter().map(|&j| s[j]).sum();
                ids.extend(chosen.iter().map(|&j| j as u32));
                w.extend(chosen.iter().map(|&j| 2.5 * s[j] / sum));
            }
            (ids, w)
        };
        let (want_ids, want_w) = plain(&rs);
        assert_eq!(routed.ids, want_ids);
        for (g, w) in got.iter().flatten().zip(&want_w) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
        // d(sum of weights x c)/d router[j][c'] against central differences, ids held fixed
        // (the step is small enough not to change them).
        let coef: Vec<f32> = (0..t * k).map(|i| (i % 5) as f32 - 2.0).collect();
        let c = Tensor::from_slice(&coef, (t, k), &Device::Cpu).unwrap();
        let grads = (routed.weights * c)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g: Vec<f32> = grads
            .get(router.as_tensor())
            .expect("the router gets a gradient")
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let loss = |rs: &[f32]| -> f32 {
            let (ids, w) = plain(rs);
            assert_eq!(ids, want_ids, "the step changed the choice");
            w.iter().zip(&coef).map(|(a, b)| a * b).sum()
        };
        for at in [0usize, 7, 20, 33, 47] {
            let eps = 1e-2f32;
            let (mut up, mut down) = (rs.clone(), rs.clone());
            up[at] += eps;
            down[at] -= eps;
            let fd = (loss(&up) - loss(&down)) / (2.0 * eps);
            assert!(
                (g[at] - fd).abs() < 2e-3 * (1.0 + fd.abs()),
                "router[{at}]: {} vs {fd}",
                g[at]
            );
        }
    }
}
