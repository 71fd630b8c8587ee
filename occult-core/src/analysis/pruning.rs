//! Collaboration pruning: limit each token to at most N devices, or to at most M nodes (and N
//! devices in each), as DeepSeek-V3 limits its tokens to 4 nodes.
//!
//! Both rules first fix the allowed devices.
//! - **Device limit N** (the paper's): a token already within N devices is left unchanged;
//!   otherwise walk its experts best first and collect their devices until N are seen.
//! - **Node limit M** (nodes of G devices, device d in node d / G), as DeepSeek-V3 routes: every
//!   token, within the limit or not, keeps its M best nodes, each node scored by the sum of its
//!   best two experts' selection scores as V3 scores its expert groups (ties: lower node), and
//!   takes its top-k inside them; with a limit of N devices per node, each device of a kept node
//!   is scored the same way and its best N kept. On a contiguous placement this is V3's
//!   group-limited routing with the nodes as its groups (held to transformers' DeepSeek-V3
//!   router by `tests/fixtures/routing/v3_node_limit.json`).
//!
//! Then:
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

/// How far a token's experts may spread once pruned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PruneLimit {
    /// At most this many devices.
    Devices(usize),
    /// At most `max_nodes` nodes of `devices_per_node` devices, and at most `devices_in_node`
    /// devices in each when given.
    Nodes {
        devices_per_node: usize,
        max_nodes: usize,
        devices_in_node: Option<usize>,
    },
}

impl PruneLimit {
    /// How the limit reads in tables and messages: `2 devices`, `1 node`, `2 nodes x 1 device`.
    pub fn label(&self) -> String {
        let n = |x: usize, what: &str| format!("{x} {what}{}", if x == 1 { "" } else { "s" });
        match *self {
            PruneLimit::Devices(d) => n(d, "device"),
            PruneLimit::Nodes {
                max_nodes,
                devices_in_node: None,
                ..
            } => n(max_nodes, "node"),
            PruneLimit::Nodes {
                max_nodes,
                devices_in_node: Some(d),
                ..
            } => format!("{} x {}", n(max_nodes, "node"), n(d, "device")),
        }
    }
}

/// Experts whose scores a node or device is ranked by (the sum of its best this many).
const GROUP_SCORE_TOP: usize = 2;

/// A configured pruner for one layer.
#[derive(Clone, Debug)]
pub struct Pruner<'a> {
    rule: PruneRule,
    router: &'a RouterRule,
    device_of_expert: &'a [u32],
    num_devices: usize,
    limit: PruneLimit,
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
        let limit = PruneLimit::Devices(max_devices);
        Self::with_limit(
            rule,
            router,
            device_of_expert,
            num_devices,
            limit,
            similarity,
        )
    }

    /// Checks that pruning to `limit` can always leave k experts.
    pub fn with_limit(
        rule: PruneRule,
        router: &'a RouterRule,
        device_of_expert: &'a [u32],
        num_devices: usize,
        limit: PruneLimit,
        similarity: Option<&'a SimilarityTable>,
    ) -> Result<Self> {
        router.validate()?;
        validate_map(device_of_expert, router.num_experts, num_devices)?;
        let caps = capacities(router.num_experts, num_devices);
        // Sums of the smallest `n` of `v`.
        let smallest = |mut v: Vec<usize>, n: usize| -> usize {
            v.sort_unstable();
            v.iter().take(n).sum()
        };
        // Limits above what exists allow everything; clamp so that no size depends on them.
        let (limit, room) = match limit {
            PruneLimit::Devices(0) => bail!("--max-devices must be at least 1"),
            PruneLimit::Devices(n) => {
                let n = n.min(num_devices);
                (PruneLimit::Devices(n), smallest(caps, n))
            }
            PruneLimit::Nodes {
                devices_per_node: g,
                max_nodes,
                devices_in_node,
            } => {
                if g == 0 || !num_devices.is_multiple_of(g) {
                    bail!("--devices-per-node {g} must divide the {num_devices} devices");
                }
                if max_nodes == 0 || devices_in_node == Some(0) {
                    bail!("--max-nodes and --max-devices-per-node must be at least 1");
                }
                let m = max_nodes.min(num_devices / g);
                let n = devices_in_node.map(|n| n.min(g));
                let rooms: Vec<usize> = caps
                    .chunks(g)
                    .map(|node| smallest(node.to_vec(), n.unwrap_or(g)))
                    .collect();
                let limit = PruneLimit::Nodes {
                    devices_per_node: g,
                    max_nodes: m,
                    devices_in_node: n,
                };
                (limit, smallest(rooms, m))
            }
        };
        if room < router.top_k {
            let smallest = match limit {
                PruneLimit::Devices(n) => format!("the smallest {n} device(s) hold"),
                PruneLimit::Nodes {
                    max_nodes,
                    devices_in_node: None,
                    ..
                } => format!("the smallest {max_nodes} node(s) hold"),
                PruneLimit::Nodes {
                    max_nodes,
                    devices_in_node: Some(n),
                    ..
                } => format!("the smallest {n} device(s) of the smallest {max_nodes} node(s) hold"),
            };
            bail!(
                "pruning to {} cannot keep top_k = {} experts: {smallest} only {room}",
                limit.label(),
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
            num_devices,
            limit,
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
        let ids = match self.allowed(choice, ranked) {
            None => ranked.to_vec(),
            Some(ok) => match self.rule {
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
            },
        };
        let weights = self.router.gate_weights(scores, &ids);
        Selection { ids, weights }
    }

    /// The experts a token over the limit may keep (`None`: it is within the limit).
    fn allowed(&self, choice: &[f32], ranked: &[u32]) -> Option<Vec<bool>> {
        let dev = |x: u32| self.device_of_expert[x as usize] as usize;
        let mut devices: Vec<usize> = Vec::with_capacity(ranked.len());
        for &x in ranked {
            if !devices.contains(&dev(x)) {
                devices.push(dev(x));
            }
        }
        let keep: Vec<bool> = match self.limit {
            PruneLimit::Devices(n) => {
                if devices.len() <= n {
                    return None;
                }
                let mut keep = vec![false; self.num_devices];
                devices.iter().take(n).for_each(|&d| keep[d] = true);
                keep
            }
            PruneLimit::Nodes {
                devices_per_node: g,
                max_nodes,
                devices_in_node,
            } => {
                let nodes = self.num_devices / g;
                let mut per_node = vec![0usize; nodes];
                devices.iter().for_each(|&d| per_node[d / g] += 1);
                let spanned = per_node.iter().filter(|&&c| c > 0).count();
                let crowded = devices_in_node.is_some_and(|n| per_node.iter().any(|&c| c > n));
                // Spread over one node only, a token keeps its experts: its best node and
                // devices are its own.
                if spanned <= 1 && !crowded {
                    return None;
                }
                // Each device's best two selection scores, summed per device and per node.
                let mut best = vec![[f32::NEG_INFINITY; GROUP_SCORE_TOP]; self.num_devices];
                for (x, &c) in choice.iter().enumerate() {
                    let b = &mut best[dev(x as u32)];
                    if c > b[GROUP_SCORE_TOP - 1] {
                        b[GROUP_SCORE_TOP - 1] = c;
                        b.sort_unstable_by(|p, q| q.total_cmp(p));
                    }
                }
                let top = |v: &mut Vec<f32>| -> f32 {
                    v.sort_unstable_by(|p, q| q.total_cmp(p));
                    v.iter()
                        .take(GROUP_SCORE_TOP)
                        .filter(|c| c.is_finite())
                        .sum()
                };
                let device_score: Vec<f32> = best.iter().map(|b| top(&mut b.to_vec())).collect();
                let node_score: Vec<f32> = (0..nodes)
                    .map(|n| top(&mut best[n * g..(n + 1) * g].concat()))
                    .collect();
                let ranked_by = |score: &[f32], ids: std::ops::Range<usize>| -> Vec<usize> {
                    let mut v: Vec<usize> = ids.collect();
                    v.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
                    v
                };
                let mut keep = vec![false; self.num_devices];
                for n in ranked_by(&node_score, 0..nodes).into_iter().take(max_nodes) {
                    let in_node = ranked_by(&device_score, n * g..(n + 1) * g);
                    for d in in_node.into_iter().take(devices_in_node.unwrap_or(g)) {
                        keep[d] = true;
                    }
                }
                keep
            }
        };
        Some(
            self.device_of_expert
                .iter()
                .map(|&d| keep[d as usize])
                .collect(),
        )
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

    /// 8 experts on 4 devices in 2 nodes of 2: node 0 = devices 0, 1 (experts 0..4), node 1 =
    /// devices 2, 3 (experts 4..8).
    #[test]
    fn node_limit_keeps_the_best_scoring_nodes() {
        let rule = RouterRule::softmax_topk(8, 3, false);
        let nodes = |m, n| PruneLimit::Nodes {
            devices_per_node: 2,
            max_nodes: m,
            devices_in_node: n,
        };
        // Ranking 2, 4, 0, 3, 6, 1, 5, 7: the top-3 {2, 4, 0} spans both nodes. Node scores
        // (two best probabilities): node 0 p2 + p0 (logits 6, 3), node 1 p4 + p6 (5, 1.5).
        let p =
            Pruner::with_limit(PruneRule::Router, &rule, &MAP, 4, nodes(1, None), None).unwrap();
        let out = p.prune_logits(&logits(), &[2, 4, 0]);
        assert_eq!(out.ids, vec![2, 0, 3]);
        // Node 1 wins when its experts score higher.
        let mut l = logits();
        l[6] = 5.9;
        let out = p.prune_logits(&l, &[2, 6, 4]);
        assert_eq!(out.ids, vec![6, 4, 5]);
        // One device per node: node 0's best device is device 1 (experts 2, 3: logits 6, 2.5).
        let p = Pruner::with_limit(PruneRule::Router, &rule, &MAP, 4, nodes(1, Some(1)), None);
        let err = p.unwrap_err().to_string();
        assert!(
            err.contains("cannot keep top_k = 3") && err.contains("1 node x 1 device"),
            "{err}"
        );
        let rule2 = RouterRule::softmax_topk(8, 2, false);
        let p = Pruner::with_limit(PruneRule::Router, &rule2, &MAP, 4, nodes(1, Some(1)), None)
            .unwrap();
        assert_eq!(p.prune_logits(&logits(), &[2, 4]).ids, vec![2, 3]);
        // Within the limit: unchanged (two nodes allowed; one node holding the whole top-k).
        let p =
            Pruner::with_limit(PruneRule::Router, &rule, &MAP, 4, nodes(2, None), None).unwrap();
        assert_eq!(p.prune_logits(&logits(), &[2, 4, 0]).ids, vec![2, 4, 0]);
        let p =
            Pruner::with_limit(PruneRule::Router, &rule, &MAP, 4, nodes(1, None), None).unwrap();
        assert_eq!(p.prune_logits(&logits(), &[2, 0, 3]).ids, vec![2, 0, 3]);
        // Bad levels are named.
        for (bad, what) in [
            (nodes(0, None), "at least 1"),
            (nodes(1, Some(0)), "at least 1"),
        ] {
            let e = Pruner::with_limit(PruneRule::Router, &rule, &MAP, 4, bad, None).unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
        }
        let three = PruneLimit::Nodes {
            devices_per_node: 3,
            max_nodes: 1,
            devices_in_node: None,
        };
        let e = Pruner::with_limit(PruneRule::Router, &rule, &MAP, 4, three, None).unwrap_err();
        assert!(e.to_string().contains("must divide"), "{e}");
        assert_eq!(nodes(2, Some(1)).label(), "2 nodes x 1 device");
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

    /// `--max-nodes M` on a contiguous placement whose nodes are DeepSeek-V3's expert groups
    /// routes as transformers' `DeepseekV3TopkRouter` with `topk_group = M`: the same experts
    /// for every token (within M nodes already or not) and the same weights.
    #[test]
    fn the_node_limit_routes_as_deepseek_v3() {
        use crate::analysis::routing::Scoring;
        let v = crate::test_util::fixture_json("routing/v3_node_limit.json");
        let num = |x: &serde_json::Value| x.as_u64().unwrap() as usize;
        let mut rewritten = 0;
        for case in v["cases"].as_array().unwrap() {
            let (e, k, groups, kept) = (
                num(&case["experts"]),
                num(&case["top_k"]),
                num(&case["groups"]),
                num(&case["groups_kept"]),
            );
            let rule = RouterRule {
                num_experts: e,
                top_k: k,
                scoring: Scoring::Sigmoid,
                renormalize: true,
                scaling_factor: case["scaling"].as_f64().unwrap() as f32,
                group_limit: None,
                selection_bias: Some(serde_json::from_value(case["bias"].clone()).unwrap()),
            };
            // Two devices per node, the nodes in expert order: node n holds group n.
            let devices = groups * 2;
            let map = crate::analysis::placement::contiguous(e, devices);
            let limit = PruneLimit::Nodes {
                devices_per_node: 2,
                max_nodes: kept,
                devices_in_node: None,
            };
            let p =
                Pruner::with_limit(PruneRule::Router, &rule, &map, devices, limit, None).unwrap();
            let logits: Vec<Vec<f32>> = serde_json::from_value(case["logits"].clone()).unwrap();
            let ids: Vec<Vec<u32>> = serde_json::from_value(case["ids"].clone()).unwrap();
            let weights: Vec<Vec<f32>> = serde_json::from_value(case["weights"].clone()).unwrap();
            for (t, l) in logits.iter().enumerate() {
                let ranked = rule.route(l).ids;
                let out = p.prune_logits(l, &ranked);
                let mut got: Vec<(u32, f32)> = out.ids.iter().copied().zip(out.weights).collect();
                got.sort_by_key(|x| x.0);
                let got_ids: Vec<u32> = got.iter().map(|x| x.0).collect();
                assert_eq!(got_ids, ids[t], "E={e} M={kept} token {t}");
                for (g, w) in got.iter().zip(&weights[t]) {
                    assert!((g.1 - w).abs() < 1e-5, "token {t}: {} vs {w}", g.1);
                }
                let mut before = ranked.clone();
                before.sort_unstable();
                rewritten += usize::from(before != ids[t]);
            }
        }
        // The limit binds on many tokens (else the fixture would not test it).
        assert!(rewritten > 20, "{rewritten}");
    }
}
