//! Whole-trace drivers for placements with replicas: adding replicas to every layer of a
//! placement ([`replicate_trace`]: Occult's copies on its partition, or EPLB's slots), and the
//! statistics of a trace under a replicated placement and a copy rule ([`replica_trace_stats`]).
//! Each token starts on its rank of the trace's source split, as in the other drivers.

use crate::analysis::collab::token_weighted_mean;
use crate::analysis::drivers::whole_trace::{check_placement_fits, source_split};
use crate::analysis::placement::cooccurrence::cooccurrence_map;
use crate::analysis::placement::eplb::{eplb_map, EplbGroups};
use crate::analysis::placement::replica_search::{replicate, LayerRouting};
use crate::analysis::placement::replicas::{spread_duplicates, CopyRule, ReplicaMap, ReplicaStats};
use crate::analysis::placement::sglang_dispatch::SglangState;
use crate::analysis::placement::{
    feed_dense_rows, Method, Placement, PlacementMetrics, PLACEMENT_FORMAT_V2,
};
use crate::analysis::trace::{LayerTrace, Trace};
use crate::{bail, Error, Result};
use serde::Serialize;

/// Each token's source device under an even split of the layer's tokens.
fn sources(trace: &Trace, l: &LayerTrace, devices: usize, resplit: bool) -> Result<Vec<u32>> {
    let split = source_split(trace, l.tokens, devices, resplit)?;
    Ok((0..l.tokens).map(|t| split.rank_of(t) as u32).collect())
}

/// What [`replicate_trace`] adds to a partition: how many slots, by which method, under which
/// copy rule, within which load cap.
#[derive(Clone, Copy, Debug)]
pub struct ReplicaJob {
    /// `Method::Occult` (copies beside their partners), `Method::Eplb` (DeepSeek's, load only)
    /// or `Method::Cooccurrence` (TensorRT-LLM's).
    pub method: Method,
    pub replicas: usize,
    /// Occult's copies: keep the max/mean load within this, under `rule`.
    pub max_load_factor: Option<f64>,
    /// EPLB's policy (its groups and nodes).
    pub eplb: EplbGroups,
    /// The rule the placement will be served with: Occult's copies are chosen under it, and
    /// every layer's metrics are counted under it.
    pub rule: CopyRule,
}

/// `partition` (a placement without replicas) with `job.replicas` more slots per layer:
/// Occult's copies where they lower the sum of C_T most under the job's rule, within its load
/// cap (method occult); EPLB's own slots from the layer's expert loads under the policy the job
/// asks for (method eplb); or TensorRT-LLM's co-occurrence placement (method cooccurrence). The
/// slots EPLB and TensorRT-LLM would put twice on one device are spread
/// ([`spread_duplicates`]). Returns an `occult.placement.v2` placement whose metrics are those
/// of the job's rule, every layer recounted from its finished map.
pub fn replicate_trace(trace: &Trace, partition: &Placement, job: ReplicaJob) -> Result<Placement> {
    check_placement_fits(trace, partition)?;
    let (e, k, d) = (
        trace.meta.num_experts,
        trace.meta.top_k,
        partition.num_devices,
    );
    let replicas = job.replicas;
    if !(e + replicas).is_multiple_of(d) || (job.method == Method::Occult && !e.is_multiple_of(d)) {
        let valid: Vec<usize> = (1..=4 * d)
            .filter(|r| (e + r).is_multiple_of(d) && (job.method != Method::Occult || r % d == 0))
            .take(4)
            .collect();
        bail!(
            "{e} experts + {replicas} replicas do not fill {d} devices evenly{}: SGLang and \
             TensorRT-LLM need the same slots on every device; give --replicas {}",
            if job.method == Method::Occult {
                " (Occult's copies also need E and R each a multiple of the devices)"
            } else {
                ""
            },
            if valid.is_empty() {
                "so that E + R is a multiple of the devices".to_string()
            } else {
                format!("{valid:?}")
                    .trim_matches(['[', ']'])
                    .replace(", ", " or ")
            }
        );
    }
    let mut out = partition.clone();
    out.format = PLACEMENT_FORMAT_V2.into();
    out.layers.sort_by_key(|l| l.layer);
    let mut state = SglangState::start(d, None);
    let mut next = 0;
    for entry in out.layers.iter_mut() {
        let l = trace
            .layers
            .iter()
            .find(|l| l.layer == entry.layer)
            .ok_or_else(|| Error::invalid(format!("the trace has no layer {}", entry.layer)))?;
        let source = sources(trace, l, d, true)?;
        let at = |err: Error| Error::invalid(format!("layer {}: {err}", l.layer));
        feed_dense_rows(&mut state, next..l.layer, e + replicas, e);
        next = l.layer + 1;
        let mut map = match job.method {
            Method::Occult => {
                let routing = LayerRouting {
                    ids: &l.topk_ids,
                    k,
                    source: &source,
                    rule: job.rule,
                    sglang: &state,
                };
                replicate(
                    routing,
                    &entry.device_of_expert,
                    d,
                    replicas,
                    job.max_load_factor,
                )
                .map_err(at)?
                .map
            }
            Method::Eplb => {
                let m = eplb_map(&l.topk_ids, e, d, replicas, job.eplb.groups, job.eplb.nodes)
                    .map_err(at)?;
                let per_node = (job.eplb.nodes > 1).then(|| d / job.eplb.nodes);
                spread_duplicates(&m, per_node).map_err(at)?
            }
            Method::Cooccurrence => {
                let m = cooccurrence_map(&l.topk_ids, k, e, d, replicas).map_err(at)?;
                spread_duplicates(&m, None).map_err(at)?
            }
            other => bail!(
                "--replicas places copies with the occult, eplb or cooccurrence method, not {}",
                other.name()
            ),
        };
        map.set_sglang_state(&mut state);
        map.check_servable().map_err(at)?;
        let st = map.stats(&l.topk_ids, k, &source, job.rule, None)?;
        entry.device_of_expert.clear();
        entry.slots = Some(map.slot_expert.clone());
        entry.expert_load = map.expert_load().map(<[f64]>::to_vec);
        entry.metrics = Some(PlacementMetrics {
            ect: st.ect(),
            intra_ratio: None,
            max_load_ratio: st.max_load_ratio(),
        });
    }
    out.method = job.method.name().into();
    out.source.insert("replicas".into(), replicas.into());
    out.source
        .insert("copy_rule".into(), job.rule.name().into());
    if job.method == Method::Eplb && job.eplb != EplbGroups::GLOBAL {
        out.source
            .insert("eplb_groups".into(), job.eplb.groups.into());
        out.source
            .insert("eplb_nodes".into(), job.eplb.nodes.into());
    }
    Ok(out)
}

/// One layer's counts under a replicated placement.
#[derive(Clone, Debug, Serialize)]
pub struct ReplicaLayerStats {
    pub layer: usize,
    pub tokens: usize,
    pub ect: f64,
    /// E[C_N] (distinct nodes per token), given a node size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ecn: Option<f64>,
    pub max_load_ratio: f64,
    /// (token, expert) pairs each device computes (expected, under TensorRT-LLM's rule).
    pub pairs: Vec<f64>,
}

/// A trace's counts under a replicated placement and one copy rule.
#[derive(Clone, Debug, Serialize)]
pub struct ReplicaTraceStats {
    pub rule: CopyRule,
    pub slots_per_device: usize,
    pub mean_ect: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean_ecn: Option<f64>,
    pub mean_max_load_ratio: f64,
    pub layers: Vec<ReplicaLayerStats>,
}

/// E[C_T] and device loads of every layer of `trace` under `p` (with or without replicas),
/// copies chosen by `rule` (the cover rule's ties ordered by the loads the placement stores,
/// as the EP layer orders them); with `per_node` devices per node (device d in node d / G),
/// E[C_N] after the choice too.
pub fn replica_trace_stats(
    trace: &Trace,
    p: &Placement,
    rule: CopyRule,
    resplit: bool,
    per_node: Option<usize>,
) -> Result<ReplicaTraceStats> {
    if per_node.is_some_and(|g| g == 0 || g > p.num_devices) {
        bail!(
            "{} devices per node for {} devices: give between 1 and {}",
            per_node.unwrap_or(0),
            p.num_devices,
            p.num_devices
        );
    }
    check_placement_fits(trace, p)?;
    let k = trace.meta.top_k;
    let mut layers = Vec::with_capacity(trace.layers.len());
    let mut slots_per_device = 0;
    let maps = p.replica_maps(rule, per_node)?;
    for l in &trace.layers {
        p.covers(l.layer)?;
        let at = p.layers.iter().filter(|x| x.layer < l.layer).count();
        let map: &ReplicaMap = &maps[at];
        slots_per_device = slots_per_device.max(map.slots_per_device());
        let source = sources(trace, l, p.num_devices, resplit)?;
        let st: ReplicaStats = map.stats(&l.topk_ids, k, &source, rule, per_node)?;
        let ecn = per_node.map(|_| st.nodes_touched / l.tokens.max(1) as f64);
        layers.push(ReplicaLayerStats {
            layer: l.layer,
            tokens: l.tokens,
            ect: st.ect(),
            ecn,
            max_load_ratio: st.max_load_ratio(),
            pairs: st.pairs,
        });
    }
    Ok(ReplicaTraceStats {
        rule,
        slots_per_device,
        mean_ect: token_weighted_mean(layers.iter().map(|l| (l.ect, l.tokens))),
        mean_ecn: per_node
            .map(|_| token_weighted_mean(layers.iter().map(|l| (l.ecn.unwrap_or(0.0), l.tokens)))),
        mean_max_load_ratio: token_weighted_mean(
            layers.iter().map(|l| (l.max_load_ratio, l.tokens)),
        ),
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::cost::cluster::trace_node_stats;
    use crate::analysis::placement::SearchConfig;
    use crate::analysis::synth::{synth_trace, SynthConfig};

    /// On a partition, E[C_N] after the copy rule's choice is the node statistics' (a separate
    /// count); with copies added it is still between 1 and the nodes, and never above E[C_T].
    #[test]
    fn nodes_per_token_under_a_partition_agree_with_the_node_statistics() {
        let cfg = SynthConfig {
            num_experts: 16,
            top_k: 4,
            layers: 2,
            ..SynthConfig::olmoe_like(500, 9)
        };
        let trace = synth_trace(&cfg, &|| ()).unwrap();
        let cfg = SearchConfig::default();
        let (placed, _) =
            crate::analysis::place_trace(&trace, 4, Method::Occult, &cfg, &|| ()).unwrap();
        for g in [1, 2, 4] {
            let want = trace_node_stats(&trace, &placed, g, true).unwrap().mean_ecn;
            for rule in CopyRule::ALL {
                let got = replica_trace_stats(&trace, &placed, rule, true, Some(g)).unwrap();
                assert!(
                    (got.mean_ecn.unwrap() - want).abs() < 1e-12,
                    "G={g} {rule:?}"
                );
            }
        }
        let job = ReplicaJob {
            method: Method::Occult,
            replicas: 4,
            max_load_factor: None,
            eplb: EplbGroups::GLOBAL,
            rule: CopyRule::Cover,
        };
        let copies = replicate_trace(&trace, &placed, job).unwrap();
        let st = replica_trace_stats(&trace, &copies, CopyRule::Cover, true, Some(2)).unwrap();
        let ecn = st.mean_ecn.unwrap();
        assert!(
            (1.0..=2.0).contains(&ecn) && ecn <= st.mean_ect,
            "{ecn} {}",
            st.mean_ect
        );
        assert!(replica_trace_stats(&trace, &copies, CopyRule::Cover, true, Some(0)).is_err());
    }
}
