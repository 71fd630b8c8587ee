//! Whole-trace drivers for placements with replicas: adding replicas to every layer of a
//! placement ([`replicate_trace`]: Occult's copies on its partition, or EPLB's slots), and the
//! statistics of a trace under a replicated placement and a copy rule ([`replica_trace_stats`]).
//! Each token starts on its rank of the trace's source split, as in the other drivers.

use crate::analysis::collab::token_weighted_mean;
use crate::analysis::drivers::whole_trace::{check_placement_fits, source_split};
use crate::analysis::placement::eplb::{eplb_map, EplbGroups};
use crate::analysis::placement::replica_search::replicate;
use crate::analysis::placement::replicas::{CopyRule, ReplicaMap, ReplicaStats};
use crate::analysis::placement::{Method, Placement, PlacementMetrics, PLACEMENT_FORMAT_V2};
use crate::analysis::trace::{LayerTrace, Trace};
use crate::{bail, Error, Result};
use serde::Serialize;

/// Each token's source device under an even split of the layer's tokens.
fn sources(trace: &Trace, l: &LayerTrace, devices: usize, resplit: bool) -> Result<Vec<u32>> {
    let split = source_split(trace, l.tokens, devices, resplit)?;
    Ok((0..l.tokens).map(|t| split.rank_of(t) as u32).collect())
}

/// `partition` (a placement without replicas, made by `method`) with `replicas` more slots per
/// layer: Occult's copies where they lower the sum of C_T most under the cover rule, within
/// `max_load_factor` (method occult), or EPLB's own slots from the layer's expert loads under
/// the policy `eplb` asks for (method eplb). Returns an `occult.placement.v2` placement whose
/// metrics are those of the cover rule.
pub fn replicate_trace(
    trace: &Trace,
    partition: &Placement,
    method: Method,
    replicas: usize,
    max_load_factor: Option<f64>,
    eplb: EplbGroups,
) -> Result<Placement> {
    check_placement_fits(trace, partition)?;
    let (e, k, d) = (
        trace.meta.num_experts,
        trace.meta.top_k,
        partition.num_devices,
    );
    let mut out = partition.clone();
    out.format = PLACEMENT_FORMAT_V2.into();
    for (entry, l) in out.layers.iter_mut().zip(&trace.layers) {
        let source = sources(trace, l, d, true)?;
        let at = |err: Error| Error::invalid(format!("layer {}: {err}", l.layer));
        let map = match method {
            Method::Occult => {
                replicate(
                    &l.topk_ids,
                    k,
                    &source,
                    &entry.device_of_expert,
                    d,
                    replicas,
                    max_load_factor,
                )
                .map_err(at)?
                .map
            }
            Method::Eplb => {
                eplb_map(&l.topk_ids, e, d, replicas, eplb.groups, eplb.nodes).map_err(at)?
            }
            other => bail!(
                "--replicas places copies with the occult or the eplb method, not {}",
                other.name()
            ),
        };
        let st = map.stats(&l.topk_ids, k, &source, CopyRule::Cover, None)?;
        entry.device_of_expert.clear();
        entry.slots = Some(map.slot_expert.clone());
        entry.expert_load = map.expert_load().map(<[f64]>::to_vec);
        entry.metrics = Some(PlacementMetrics {
            ect: st.ect(),
            intra_ratio: None,
            max_load_ratio: st.max_load_ratio(),
        });
    }
    out.source.insert("replicas".into(), replicas.into());
    if method == Method::Eplb && eplb != EplbGroups::GLOBAL {
        out.source.insert("eplb_groups".into(), eplb.groups.into());
        out.source.insert("eplb_nodes".into(), eplb.nodes.into());
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
    /// (token, expert) pairs each device computes.
    pub pairs: Vec<u64>,
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
    for l in &trace.layers {
        let map: ReplicaMap = p.replica_map(l.layer)?;
        slots_per_device = slots_per_device.max(map.slots_per_device());
        let source = sources(trace, l, p.num_devices, resplit)?;
        let st: ReplicaStats = map.stats(&l.topk_ids, k, &source, rule, per_node)?;
        let ecn = per_node.map(|_| st.nodes_touched as f64 / l.tokens.max(1) as f64);
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
            for rule in [CopyRule::Cover, CopyRule::Sglang] {
                let got = replica_trace_stats(&trace, &placed, rule, true, Some(g)).unwrap();
                assert!(
                    (got.mean_ecn.unwrap() - want).abs() < 1e-12,
                    "G={g} {rule:?}"
                );
            }
        }
        let copies =
            replicate_trace(&trace, &placed, Method::Occult, 4, None, EplbGroups::GLOBAL).unwrap();
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
