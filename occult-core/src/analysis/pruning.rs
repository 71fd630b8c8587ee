//! Collaboration pruning: limit each token to at most N devices.
//!
//! Both rules first fix the allowed devices: walk the token's experts best first and collect
//! their devices until N are seen. A token already on at most N devices is left unchanged.
//! - **Router-score rule**: re-pick the top-k among all experts on the allowed devices, by the
//!   full router (selection) scores.
//! - **Similarity rule**: keep the chosen experts on allowed devices; replace each other one,
//!   best first, by the most similar expert (cosine of router-logit columns, see
//!   [`crate::analysis::similarity`]) that is on an allowed device and not yet selected.
//!
//! The rewritten selection is ordered by selection score, best first (ties: lower id). Gate
//! weights follow the model's rule: each selected expert keeps its own router score,
//! renormalised over the selection where the model renormalises, times the scaling factor.
//! Under group-limited routing the device limit takes the place of the group limit when a token
//! is rewritten.

use crate::analysis::placement::{capacities, validate_map};
use crate::analysis::routing::{sort_by_score, top_k_ids, RouterRule, Selection};
use crate::analysis::similarity::SimilarityTable;
use crate::{bail, Result};
use serde::{Deserialize, Serialize};

/// Which pruning rule to apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum PruneRule {
    /// Re-pick the top-k on the allowed devices (the paper's rule A).
    Router,
    /// Replace outside experts by the most similar allowed ones (the paper's rule B).
    Similarity,
}

impl PruneRule {
    pub fn name(self) -> &'static str {
        match self {
            PruneRule::Router => "router",
            PruneRule::Similarity => "similarity",
        }
    }
}

/// A configured pruner for one layer.
#[derive(Clone, Debug)]
pub struct Pruner<'a> {
    rule: PruneRule,
    router: &'a RouterRule,
    device_of_expert: &'a [u32],
    max_devices: usize,
    similarity: Option<&'a SimilarityTable>,
}

impl<'a> Pruner<'a> {
    /// Checks that pruning to `max_devices` devices can always leave k experts.
    pub fn new(
        rule: PruneRule,
        router: &'a RouterRule,
        device_of_expert: &'a [u32],
        num_devices: usize,
        max_devices: usize,
        similarity: Option<&'a SimilarityTable>,
    ) -> Result<Self> {
        router.validate()?;
        validate_map(device_of_expert, router.num_experts, num_devices)?;
        if max_devices == 0 {
            bail!("--max-devices must be at least 1");
        }
        // More devices than exist allow everything; clamp so that no size depends on it.
        let max_devices = max_devices.min(num_devices);
        let mut caps = capacities(router.num_experts, num_devices);
        caps.sort_unstable();
        let room: usize = caps.iter().take(max_devices).sum();
        if room < router.top_k {
            bail!(
                "pruning to {max_devices} device(s) cannot keep top_k = {} experts: the smallest \
                 {max_devices} device(s) hold only {room}",
                router.top_k
            );
        }
        match (rule, similarity) {
            (PruneRule::Similarity, None) => {
                bail!("the similarity rule needs a similarity table (router logits)")
            }
            (PruneRule::Similarity, Some(s)) if s.num_experts != router.num_experts => bail!(
                "similarity table is for {} experts, the router has {}",
                s.num_experts,
                router.num_experts
            ),
            _ => {}
        }
        Ok(Pruner {
            rule,
            router,
            device_of_expert,
            max_devices,
            similarity,
        })
    }

    /// Prunes one token given its router logits and its standard selection (best first).
    pub fn prune_logits(&self, logits: &[f32], ranked: &[u32]) -> Selection {
        let scores = self.router.scores(logits);
        let choice = self.router.selection_scores(&scores);
        self.prune_scores(&scores, &choice, ranked)
    }

    /// Prunes one token given its gate scores, its selection scores and its selection.
    pub fn prune_scores(&self, scores: &[f32], choice: &[f32], ranked: &[u32]) -> Selection {
        let mut allowed_dev: Vec<u32> = Vec::with_capacity(ranked.len());
        let mut spans = 0;
        for &x in ranked {
            let d = self.device_of_expert[x as usize];
            if !allowed_dev.contains(&d) {
                spans += 1;
                if allowed_dev.len() < self.max_devices {
                    allowed_dev.push(d);
                }
            }
        }
        let ids = if spans <= self.max_devices {
            ranked.to_vec()
        } else {
            let ok: Vec<bool> = self
                .device_of_expert
                .iter()
                .map(|d| allowed_dev.contains(d))
                .collect();
            match self.rule {
                PruneRule::Router => top_k_ids(choice, ranked.len(), Some(&ok)),
                PruneRule::Similarity => {
                    let sim = self.similarity.expect("checked in new");
                    let mut chosen: Vec<u32> =
                        ranked.iter().copied().filter(|&x| ok[x as usize]).collect();
                    for &x in ranked.iter().filter(|&&x| !ok[x as usize]) {
                        let sub = (0..ok.len() as u32)
                            .filter(|&y| ok[y as usize] && !chosen.contains(&y))
                            .max_by(|&a, &b| {
                                sim.get(x as usize, a as usize)
                                    .total_cmp(&sim.get(x as usize, b as usize))
                                    .then(b.cmp(&a))
                            })
                            .expect("allowed devices hold at least k experts");
                        chosen.push(sub);
                    }
                    sort_by_score(&mut chosen, choice);
                    chosen
                }
            }
        };
        let weights = self.router.gate_weights(scores, &ids);
        Selection { ids, weights }
    }
}

/// Distinct devices of a selection (C_T).
pub fn devices_of(ids: &[u32], device_of_expert: &[u32]) -> usize {
    let mut seen: Vec<u32> = Vec::with_capacity(ids.len());
    for &x in ids {
        let d = device_of_expert[x as usize];
        if !seen.contains(&d) {
            seen.push(d);
        }
    }
    seen.len()
}

/// (token, expert) choices of `after` that are not in `before`.
pub fn changed_choices(before: &[u32], after: &[u32]) -> usize {
    after.iter().filter(|x| !before.contains(x)).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    // 8 experts on 4 devices: {0,1} {2,3} {4,5} {6,7}.
    const MAP: [u32; 8] = [0, 0, 1, 1, 2, 2, 3, 3];

    fn logits() -> Vec<f32> {
        // Ranking: 2 (dev 1), 4 (dev 2), 0 (dev 0), 3 (dev 1), 6, 1, 5, 7.
        vec![3.0, 1.0, 6.0, 2.5, 5.0, 0.5, 1.5, 0.0]
    }

    #[test]
    fn router_rule_repicks_on_first_devices() {
        let rule = RouterRule::softmax_topk(8, 3, false);
        let sel = rule.route(&logits());
        assert_eq!(sel.ids, vec![2, 4, 0]);
        let p = Pruner::new(PruneRule::Router, &rule, &MAP, 4, 2, None).unwrap();
        let out = p.prune_logits(&logits(), &sel.ids);
        // Allowed devices 1 and 2: experts 2,3,4,5; top-3: 2, 4, 3.
        assert_eq!(out.ids, vec![2, 4, 3]);
        let probs = crate::analysis::routing::softmax(&logits());
        assert_eq!(out.weights, vec![probs[2], probs[4], probs[3]]);
        assert_eq!(devices_of(&out.ids, &MAP), 2);
        assert_eq!(changed_choices(&sel.ids, &out.ids), 1);
    }

    #[test]
    fn similarity_rule_substitutes_most_similar_allowed_expert() {
        let rule = RouterRule::softmax_topk(8, 3, true);
        // Expert 0 is most similar to 5, then 3.
        let mut cos = vec![0.0f32; 64];
        for i in 0..8 {
            cos[i * 8 + i] = 1.0;
        }
        cos[5] = 0.9;
        cos[5 * 8] = 0.9;
        cos[3] = 0.8;
        cos[3 * 8] = 0.8;
        let sim = SimilarityTable {
            num_experts: 8,
            cos,
        };
        let p = Pruner::new(PruneRule::Similarity, &rule, &MAP, 4, 2, Some(&sim)).unwrap();
        let out = p.prune_logits(&logits(), &[2, 4, 0]);
        // 0 is replaced by 5; order by score: 2, 4, 5. Renormalised over the new set.
        assert_eq!(out.ids, vec![2, 4, 5]);
        assert!((out.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn identity_when_within_limit_and_errors_when_impossible() {
        let rule = RouterRule::softmax_topk(8, 3, false);
        let p = Pruner::new(PruneRule::Router, &rule, &MAP, 4, 3, None).unwrap();
        assert_eq!(p.prune_logits(&logits(), &[2, 4, 0]).ids, vec![2, 4, 0]);
        // One device holds 2 experts < k = 3.
        let err = Pruner::new(PruneRule::Router, &rule, &MAP, 4, 1, None).unwrap_err();
        assert!(err.to_string().contains("cannot keep"), "{err}");
        assert!(Pruner::new(PruneRule::Router, &rule, &MAP, 4, 0, None).is_err());
        assert!(Pruner::new(PruneRule::Similarity, &rule, &MAP, 4, 2, None).is_err());
    }
}
