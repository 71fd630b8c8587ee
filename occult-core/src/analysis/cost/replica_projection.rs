//! The projected layer time of one placement, with or without replicas, on a machine: the
//! cost model of `occult project` ([`super::projection`]) applied to a given placement and copy
//! rule. The trace's tokens are spread over the devices as `occult project` spreads them
//! ([`token_order`]), each token's copies are chosen by the rule for a token on its device
//! ([`ReplicaMap::choose`]), the one-row-per-device exchange is counted at two levels and timed
//! on the link profile, and the slowest device's expert compute is added
//! ([`layer_seconds`]).

use crate::analysis::collab::{max_over_mean, DeviceCounter};
use crate::analysis::cost::cluster::{occult_exchange, Cluster, LevelTraffic};
use crate::analysis::cost::links::LinkProfile;
use crate::analysis::cost::projection::{layer_seconds, token_order, LayerSizes};
use crate::analysis::drivers::whole_trace::check_placement_fits;
use crate::analysis::placement::replicas::CopyRule;
use crate::analysis::placement::Placement;
use crate::analysis::trace::Trace;
use crate::{bail, Result};
use serde::Serialize;

/// A placement's projected MoE layer on one machine (means over the trace's layers).
#[derive(Clone, Debug, Serialize)]
pub struct PlacementTime {
    pub profile: String,
    pub tokens_per_device: usize,
    pub ect: f64,
    /// The busiest device's (token, expert) pairs over the mean.
    pub max_load_ratio: f64,
    /// One exchange (dispatch or combine).
    pub exchange_s: f64,
    /// The slowest device's expert compute.
    pub compute_s: f64,
    /// Dispatch, compute and combine.
    pub layer_s: f64,
}

/// Projects `placement` (its devices, E and layers checked against `trace`) on `profile` with
/// `tokens_per_device` tokens per device, copies chosen by `rule`, tokens spread by `seed`.
pub fn project_placement(
    trace: &Trace,
    placement: &Placement,
    rule: CopyRule,
    profile: &LinkProfile,
    tokens_per_device: usize,
    sizes: &LayerSizes,
    seed: u64,
) -> Result<PlacementTime> {
    check_placement_fits(trace, placement)?;
    if tokens_per_device == 0 || trace.layers.iter().any(|l| l.tokens == 0) {
        bail!("a projection needs tokens: at least one per device and in every layer");
    }
    let k = trace.meta.top_k;
    let d = placement.num_devices;
    let cluster = Cluster::on(d, profile);
    let exchange = occult_exchange(profile, d);
    let order = token_order(trace, seed);
    // Each token's experts at their k positions, on the devices the rule picks.
    let positions: Vec<u32> = (0..k as u32).collect();
    let mut counter = DeviceCounter::new(d);
    let mut chosen = Vec::with_capacity(k);
    let mut traffic = Vec::with_capacity(trace.layers.len());
    let maps = placement.replica_maps(rule, None)?;
    for (l, order) in trace.layers.iter().zip(&order) {
        placement.covers(l.layer)?;
        let at = placement
            .layers
            .iter()
            .filter(|x| x.layer < l.layer)
            .count();
        let map = &maps[at];
        let mut t = LevelTraffic::new(cluster);
        for src in 0..d {
            for j in 0..tokens_per_device {
                let tok = order[(src * tokens_per_device + j) % order.len()];
                map.choose(l.ids(tok, k), src as u32, rule, &mut chosen);
                t.add_token(src, &positions, &chosen, exchange, &mut counter);
            }
        }
        traffic.push(t);
    }
    let (exchange_s, compute_s) = layer_seconds(&traffic, profile, tokens_per_device, sizes);
    let layers = traffic.len() as f64;
    let mean = |f: &dyn Fn(&LevelTraffic) -> f64| traffic.iter().map(f).sum::<f64>() / layers;
    Ok(PlacementTime {
        profile: profile.name.clone(),
        tokens_per_device,
        ect: mean(&|t| t.ect()),
        max_load_ratio: mean(&|t| max_over_mean(&t.pairs)),
        exchange_s,
        compute_s,
        layer_s: 2.0 * exchange_s + compute_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::cost::projection::{project_trace, ProjectSettings};
    use crate::analysis::placement::{contiguous, Method, SearchConfig};
    use crate::analysis::synth::{synth_trace, SynthConfig};

    /// On a partition, the projection of one placement equals `occult project`'s dedup row
    /// (contiguous experts, the same token spread): the same traffic, compute and layer time,
    /// from a separate path (the copy rule's choice instead of the map).
    #[test]
    fn a_partition_projects_as_occult_project_does() {
        let cfg = SynthConfig {
            num_experts: 16,
            top_k: 4,
            layers: 2,
            ..SynthConfig::olmoe_like(600, 5)
        };
        let trace = synth_trace(&cfg, &|| ()).unwrap();
        let s = ProjectSettings {
            devices: vec![4],
            tokens_per_device: vec![200],
            prune_devices: vec![],
            hidden: 64,
            intermediate: 32,
            shared_intermediate: 16,
            load_caps: vec![],
            restarts: 1,
            seed: 3,
        };
        let profile = LinkProfile::load("pcie4").unwrap();
        let report = project_trace(&trace, std::slice::from_ref(&profile), &s, &|_| ()).unwrap();
        let dedup = report.rows.iter().find(|r| r.mode == "dedup").unwrap();
        let (placed, _) = crate::analysis::place_trace(
            &trace,
            4,
            Method::Contiguous,
            &SearchConfig::default(),
            &|| (),
        )
        .unwrap();
        assert_eq!(placed.layers[0].device_of_expert, contiguous(16, 4));
        let sizes = LayerSizes {
            hidden: 64,
            intermediate: 32,
            shared_intermediate: 16,
        };
        for rule in [CopyRule::Cover, CopyRule::Sglang] {
            let got = project_placement(&trace, &placed, rule, &profile, 200, &sizes, 3).unwrap();
            assert_eq!(got.ect, dedup.ect);
            assert_eq!(got.exchange_s, dedup.exchange_s);
            assert_eq!(got.compute_s, dedup.compute_s);
            assert_eq!(got.layer_s, dedup.layer_s);
        }
    }
}
