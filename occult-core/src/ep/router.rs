//! The router stage: logits on the graph, top-k ids chosen on the host (by the model's
//! [`RouterRule`], then rewritten by a [`Pruner`] if collaboration pruning is on), gate weights
//! gathered back from the scores on the graph so that the router gets gradients.

use super::experts::sigmoid;
use crate::analysis::pruning::{PruneRule, Pruner};
use crate::analysis::routing::{RouterRule, Scoring};
use crate::analysis::similarity::SimilarityTable;
use crate::Result;
use candle::{DType, Tensor, D};

/// Collaboration pruning applied inside the layer.
#[derive(Clone, Debug)]
pub struct PruneSpec {
    pub rule: PruneRule,
    pub max_devices: usize,
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
        Pruner::new(
            self.rule,
            rule,
            device_of_expert,
            num_devices,
            self.max_devices,
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
    let logits = x.matmul(&router.t()?)?;
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
    let scores = match rule.scoring {
        Scoring::Softmax => candle_nn::ops::softmax(&logits, D::Minus1)?,
        Scoring::Sigmoid => sigmoid(&logits)?,
    };
    let idx = Tensor::from_slice(&ids, (tokens, k), x.device())?;
    let mut weights = scores.gather(&idx, 1)?;
    if rule.renormalize {
        weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
    }
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
