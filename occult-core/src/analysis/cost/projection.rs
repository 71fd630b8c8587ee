//! Cluster projections (`occult project`): the layer and training-step time of standard and
//! Occult dispatch, with and without pruning, for D devices on a machine described by a link
//! profile, from a real routing trace and modelled expert compute.
//!
//! For each device count D: the experts are placed contiguously (standard and dedup-only) and
//! by Occult's search on the trace, once for the lowest E[C_T] and once under each load cap
//! (device load within a factor of the mean); on each machine Occult's rows use the candidate
//! that projects fastest, since grouping co-activated experts can pile popular ones onto one
//! device and the slowest device sets the compute time. Pruned routings are the trace pruned
//! by the router-score rule under that placement. Each device gets `tokens_per_device` tokens drawn from the
//! trace (a seeded shuffle, so every device sees different tokens while they last). Per MoE
//! layer the traffic is counted at two levels ([`super::cluster`]) and timed on the profile; the
//! expert compute is the slowest device's SwiGLU FLOPs (plus every token's shared expert, the
//! same in every mode) over the profile's `device_flops`. A forward layer is dispatch, compute
//! and combine; a training step's layer adds the backward: two more exchanges and twice the
//! compute. Times are the mean over MoE layers. Attention, metadata exchanges and overlap of
//! communication with compute are left out: these are projections, to be checked against a
//! measured run (`occult bench`, `scripts/shaped_links.sh`).

use crate::analysis::collab::DeviceCounter;
use crate::analysis::cost::cluster::{occult_exchange, Cluster, LevelTraffic};
use crate::analysis::cost::links::{swiglu_flops, LinkProfile};
use crate::analysis::drivers::whole_trace::{place_trace, prune_trace};
use crate::analysis::placement::{Method, NodeLevel, Placement, SearchConfig};
use crate::analysis::pruning::PruneRule;
use crate::analysis::routing::RouterRule;
use crate::analysis::run_key::DispatchMode;
use crate::analysis::trace::Trace;
use crate::{bail, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// What to project.
#[derive(Clone, Debug, Serialize)]
pub struct ProjectSettings {
    pub devices: Vec<usize>,
    pub tokens_per_device: Vec<usize>,
    /// Also project Occult pruned to each of these device counts (below D).
    pub prune_devices: Vec<usize>,
    pub hidden: usize,
    /// Intermediate size of one routed expert.
    pub intermediate: usize,
    /// Intermediate size of the shared expert(s) every token runs locally (0: none).
    pub shared_intermediate: usize,
    /// Besides Occult's lowest-E[C_T] placement, search placements whose device loads stay
    /// within each of these factors of the mean; each machine and size keeps the one that
    /// projects fastest (a placement that groups popular experts can trade E[C_T] for load).
    pub load_caps: Vec<f64>,
    pub restarts: usize,
    pub seed: u64,
}

/// One mode at one size on one machine.
#[derive(Clone, Debug, Serialize)]
pub struct ModeProjection {
    pub profile: String,
    pub devices: usize,
    pub nodes: usize,
    pub tokens_per_device: usize,
    /// `standard`, `dedup` (Occult's dispatch on the contiguous placement), `occult`, `occult,
    /// pruned to N devices (router)` (the run key's label) and `occult, node-aware`.
    pub mode: String,
    pub placement: String,
    /// The load cap Occult's placement was searched under (`None`: uncapped).
    pub load_cap: Option<f64>,
    /// The exchange the mode's rows take: `standard` (one row per token and expert), `occult`
    /// (one per token and device) or `two-level` (Occult's rows on a machine whose link
    /// between nodes is the slower: one per token and remote node across).
    pub dispatch: DispatchMode,
    pub ect: f64,
    /// E[C_N]: distinct nodes per token.
    pub ecn: f64,
    /// Rows per token and MoE layer, each direction, within nodes and across them.
    pub intra_rows_per_token: f64,
    pub inter_rows_per_token: f64,
    /// Means over MoE layers.
    pub exchange_s: f64,
    pub compute_s: f64,
    /// Dispatch + compute + combine.
    pub layer_s: f64,
    /// Forward and backward: 4 exchanges and 3x compute.
    pub train_s: f64,
    /// Standard's time over this mode's (same D, tokens and machine).
    pub layer_speedup: f64,
    pub train_speedup: f64,
}

/// A device count that could not be projected, and why.
#[derive(Clone, Debug, Serialize)]
pub struct Skipped {
    pub devices: usize,
    /// `all`, or the mode left out.
    pub mode: String,
    pub reason: String,
}

/// Everything `occult project` found.
#[derive(Clone, Debug, Serialize)]
pub struct ProjectReport {
    pub settings: ProjectSettings,
    pub num_experts: usize,
    pub top_k: usize,
    pub layers: usize,
    pub rows: Vec<ModeProjection>,
    pub skipped: Vec<Skipped>,
}

/// A routing under test: its label, placement (and the load cap it was searched under),
/// dispatch and (pruned) trace.
struct Variant<'a> {
    mode: String,
    placement: &'a Placement,
    dispatch: DispatchMode,
    trace: &'a Trace,
    cap: Option<f64>,
}

/// Occult's placement under one load cap, and the trace pruned under it to each N.
struct Candidate {
    cap: Option<f64>,
    placement: Placement,
    pruned: Vec<(usize, Trace)>,
}

/// Per-layer traffic of one variant with `t` tokens per device.
fn layer_traffic(
    v: &Variant,
    cluster: Cluster,
    t: usize,
    order: &[Vec<usize>],
) -> Result<Vec<LevelTraffic>> {
    let k = v.trace.meta.top_k;
    let mut counter = DeviceCounter::new(cluster.devices);
    v.trace
        .layers
        .iter()
        .zip(order)
        .map(|(l, order)| {
            let map = v.placement.layer(l.layer)?;
            let mut traffic = LevelTraffic::new(cluster);
            for src in 0..cluster.devices {
                for j in 0..t {
                    let tok = order[(src * t + j) % order.len()];
                    traffic.add_token(src, l.ids(tok, k), map, v.dispatch, &mut counter);
                }
            }
            Ok(traffic)
        })
        .collect()
}

/// Projects `trace` onto each profile; `on_step` is called once per device count.
pub fn project_trace(
    trace: &Trace,
    profiles: &[LinkProfile],
    s: &ProjectSettings,
    on_step: &(dyn Fn(usize) + Sync),
) -> Result<ProjectReport> {
    let (e, k) = (trace.meta.num_experts, trace.meta.top_k);
    if trace.layers.iter().any(|l| l.tokens == 0) || trace.layers.is_empty() {
        bail!("the trace has no tokens to project from");
    }
    if s.hidden == 0 || s.intermediate == 0 {
        bail!("the hidden and expert intermediate sizes must be positive");
    }
    if s.devices.contains(&0) {
        bail!("device counts must be at least 1");
    }
    if s.tokens_per_device.contains(&0) {
        bail!("tokens per device must be at least 1");
    }
    let order = token_order(trace, s.seed);
    if s.load_caps.iter().any(|&c| c.is_nan() || c < 1.0) {
        bail!("load caps are factors of the mean load, at least 1");
    }
    let cfg = SearchConfig {
        restarts: s.restarts,
        seed: s.seed,
        ..Default::default()
    };
    let router = RouterRule::softmax_topk(e, k, false);
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for &d in &s.devices {
        on_step(d);
        if d < 2 || d > e {
            skipped.push(Skipped {
                devices: d,
                mode: "all".into(),
                reason: format!(
                    "{e} experts cannot be spread over {d} devices (2 to {e}); project a trace \
                     of a model with more experts"
                ),
            });
            continue;
        }
        let (contiguous, _) = place_trace(trace, d, Method::Contiguous, &cfg, &|| ())?;
        let mut candidates = Vec::new();
        for cap in std::iter::once(None).chain(s.load_caps.iter().map(|&c| Some(c))) {
            let cfg = SearchConfig {
                max_load_factor: cap,
                ..cfg.clone()
            };
            // A cap the search cannot meet leaves that candidate out; the uncapped search
            // must succeed.
            let placement = match place_trace(trace, d, Method::Occult, &cfg, &|| ()) {
                Ok((p, _)) => p,
                Err(_) if cap.is_some() => continue,
                Err(e) => return Err(e),
            };
            let mut pruned = Vec::new();
            for &n in s.prune_devices.iter().filter(|&&n| n >= 1 && n < d) {
                let why = if trace.layers.iter().any(|l| l.router_logits.is_none()) {
                    "pruning needs router logits, and the trace has none (record it with \
                     `occult profile`)"
                        .to_string()
                } else {
                    match prune_trace(
                        trace,
                        &placement,
                        &router,
                        PruneRule::Router,
                        n,
                        None,
                        &|| (),
                    ) {
                        Ok((t, _)) => {
                            pruned.push((n, t));
                            continue;
                        }
                        Err(err) => err.to_string(),
                    }
                };
                if cap.is_none() {
                    skipped.push(Skipped {
                        devices: d,
                        mode: pruned_label(n),
                        reason: why,
                    });
                }
            }
            candidates.push(Candidate {
                cap,
                placement,
                pruned,
            });
        }
        // Node-aware placements, per node size and row weight of the profiles that forward
        // across nodes, under each load cap.
        let mut node_aware: Vec<(NodeLevel, Vec<Candidate>)> = Vec::new();
        for p in profiles {
            let Some(level) = node_level(d, p) else {
                continue;
            };
            if node_aware.iter().any(|(l, _)| *l == level) {
                continue;
            }
            let mut found = Vec::new();
            for cap in std::iter::once(None).chain(s.load_caps.iter().map(|&c| Some(c))) {
                let cfg = SearchConfig {
                    max_load_factor: cap,
                    nodes: Some(level),
                    ..cfg.clone()
                };
                match place_trace(trace, d, Method::Occult, &cfg, &|| ()) {
                    Ok((placement, _)) => found.push(Candidate {
                        cap,
                        placement,
                        pruned: Vec::new(),
                    }),
                    Err(_) if cap.is_some() => continue,
                    Err(e) => return Err(e),
                }
            }
            node_aware.push((level, found));
        }
        for &t in &s.tokens_per_device {
            for p in profiles {
                let cluster = Cluster::on(d, p);
                let exchange = occult_exchange(p, d);
                let first = rows.len();
                let fixed = [("standard", DispatchMode::Standard), ("dedup", exchange)];
                for (mode, dispatch) in fixed {
                    let v = Variant {
                        mode: mode.into(),
                        placement: &contiguous,
                        dispatch,
                        trace,
                        cap: None,
                    };
                    rows.push(project_variant(&v, cluster, t, &order, p, s)?);
                }
                // Occult's placement under the load cap that projects fastest here.
                let mut best: Option<(ModeProjection, &Candidate)> = None;
                for c in &candidates {
                    let v = Variant {
                        mode: "occult".into(),
                        placement: &c.placement,
                        dispatch: exchange,
                        trace,
                        cap: c.cap,
                    };
                    let m = project_variant(&v, cluster, t, &order, p, s)?;
                    if best.as_ref().is_none_or(|b| m.layer_s < b.0.layer_s) {
                        best = Some((m, c));
                    }
                }
                if let Some((m, c)) = best {
                    rows.push(m);
                    for (n, pruned) in &c.pruned {
                        let v = Variant {
                            mode: pruned_label(*n),
                            placement: &c.placement,
                            dispatch: exchange,
                            trace: pruned,
                            cap: c.cap,
                        };
                        rows.push(project_variant(&v, cluster, t, &order, p, s)?);
                    }
                }
                // On several nodes: the placement for the cluster that projects fastest here,
                // among the node-aware ones under each load cap, Occult's flat ones and the
                // contiguous one (so it is never slower than either); `placement` says which.
                let level = node_level(d, p);
                if let Some((_, found)) = node_aware.iter().find(|(l, _)| Some(*l) == level) {
                    let pool = found
                        .iter()
                        .map(|c| ("node-aware", c))
                        .chain(candidates.iter().map(|c| ("flat", c)));
                    let contiguous = Candidate {
                        cap: None,
                        placement: contiguous.clone(),
                        pruned: Vec::new(),
                    };
                    let mut best: Option<ModeProjection> = None;
                    for (kind, c) in pool.chain(std::iter::once(("contiguous", &contiguous))) {
                        let v = Variant {
                            mode: "occult, node-aware".into(),
                            placement: &c.placement,
                            dispatch: exchange,
                            trace,
                            cap: c.cap,
                        };
                        let mut m = project_variant(&v, cluster, t, &order, p, s)?;
                        m.placement = kind.into();
                        if best.as_ref().is_none_or(|b| m.layer_s < b.layer_s) {
                            best = Some(m);
                        }
                    }
                    rows.extend(best);
                }
                let (base_layer, base_train) = (rows[first].layer_s, rows[first].train_s);
                for r in &mut rows[first..] {
                    r.layer_speedup = base_layer / r.layer_s.max(1e-30);
                    r.train_speedup = base_train / r.train_s.max(1e-30);
                }
            }
        }
    }
    Ok(ProjectReport {
        settings: s.clone(),
        num_experts: e,
        top_k: k,
        layers: trace.layers.len(),
        rows,
        skipped,
    })
}

/// The label of Occult's rows pruned to `n` devices by the router-score rule: the run key's.
fn pruned_label(n: usize) -> String {
    use crate::analysis::pruning::PruneLimit;
    use crate::analysis::run_key::{MoeMode, RunKey};
    RunKey::pruned(MoeMode::Occult, PruneLimit::Devices(n), PruneRule::Router).to_string()
}

/// Each layer's tokens in a seeded shuffle: device s of a projection takes the tokens
/// `order[(s * t + j) % tokens]`, so every device sees different tokens while they last.
pub fn token_order(trace: &Trace, seed: u64) -> Vec<Vec<usize>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    trace
        .layers
        .iter()
        .map(|l| {
            let mut o: Vec<usize> = (0..l.tokens).collect();
            o.shuffle(&mut rng);
            o
        })
        .collect()
}

/// The sizes of one MoE layer a projection models.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct LayerSizes {
    pub hidden: usize,
    /// Intermediate size of one routed expert.
    pub intermediate: usize,
    /// Of the shared expert(s) every token runs locally (0: none).
    pub shared_intermediate: usize,
}

/// Mean seconds per MoE layer of one exchange of `traffic` (one layer each, `t` tokens per
/// device) on `p`, and of the slowest device's expert compute (its pairs' SwiGLU FLOPs plus
/// every token's shared expert, over the profile's `device_flops`).
pub fn layer_seconds(
    traffic: &[LevelTraffic],
    p: &LinkProfile,
    t: usize,
    sizes: &LayerSizes,
) -> (f64, f64) {
    let layers = traffic.len().max(1) as f64;
    let row_bytes = sizes.hidden as f64 * p.activation_bytes;
    let shared = swiglu_flops(t, sizes.hidden, sizes.shared_intermediate);
    let exchange: f64 = traffic
        .iter()
        .map(|l| l.exchange_seconds(p, row_bytes))
        .sum();
    let compute: f64 = traffic
        .iter()
        .map(|l| {
            let routed = swiglu_flops(l.max_pairs() as usize, sizes.hidden, sizes.intermediate);
            (routed + shared) / p.device_flops
        })
        .sum();
    (exchange / layers, compute / layers)
}

/// The node level a node-aware placement is searched for on `p` with D devices: its node size
/// and the intra- over inter-node bandwidth as the row weight; `None` on one node, when the
/// node size does not divide D, or when the profile does not forward across nodes.
fn node_level(d: usize, p: &LinkProfile) -> Option<NodeLevel> {
    let g = p.ranks_per_node;
    (p.nodes_slower() && g >= 1 && d > g && d.is_multiple_of(g)).then(|| NodeLevel {
        devices_per_node: g,
        inter_weight: p.intra.bandwidth / p.inter.bandwidth,
    })
}

fn project_variant(
    v: &Variant,
    cluster: Cluster,
    t: usize,
    order: &[Vec<usize>],
    p: &LinkProfile,
    s: &ProjectSettings,
) -> Result<ModeProjection> {
    let traffic = layer_traffic(v, cluster, t, order)?;
    let layers = traffic.len() as f64;
    let mean = |f: &dyn Fn(&LevelTraffic) -> f64| traffic.iter().map(f).sum::<f64>() / layers;
    let sizes = LayerSizes {
        hidden: s.hidden,
        intermediate: s.intermediate,
        shared_intermediate: s.shared_intermediate,
    };
    let (exchange_s, compute_s) = layer_seconds(&traffic, p, t, &sizes);
    let intra = mean(&|l| l.rows_per_token().0);
    let inter = mean(&|l| l.rows_per_token().1);
    Ok(ModeProjection {
        profile: p.name.clone(),
        devices: cluster.devices,
        nodes: cluster.devices.div_ceil(cluster.per_node),
        tokens_per_device: t,
        mode: v.mode.clone(),
        placement: v.placement.method.clone(),
        load_cap: v.cap,
        dispatch: v.dispatch,
        ect: mean(&|l| l.ect()),
        ecn: mean(&|l| l.ecn()),
        intra_rows_per_token: intra,
        inter_rows_per_token: inter,
        exchange_s,
        compute_s,
        layer_s: 2.0 * exchange_s + compute_s,
        train_s: 4.0 * exchange_s + 3.0 * compute_s,
        layer_speedup: 1.0,
        train_speedup: 1.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::synth::{synth_trace, SynthConfig};

    fn settings() -> ProjectSettings {
        ProjectSettings {
            devices: vec![4, 16, 128],
            tokens_per_device: vec![256],
            prune_devices: vec![2],
            hidden: 2048,
            intermediate: 1024,
            shared_intermediate: 0,
            load_caps: vec![1.1],
            restarts: 1,
            seed: 0,
        }
    }

    #[test]
    fn clustered_routing_projects_faster_under_occult() {
        let mut c = SynthConfig::olmoe_like(2000, 7);
        c.layers = 2;
        let trace = synth_trace(&c, &|| ()).unwrap();
        let profiles = [
            LinkProfile::load("pcie4").unwrap(),
            LinkProfile::load("ib-ndr").unwrap(),
        ];
        let r = project_trace(&trace, &profiles, &settings(), &|_| ()).unwrap();
        // 128 devices for 64 experts is skipped with a reason; 4 and 16 give 4 modes x 2
        // machines each.
        assert_eq!(r.skipped.len(), 1);
        assert!(r.skipped[0].reason.contains("64 experts"));
        // ib-ndr forwards across its nodes of 8: at 16 devices a fifth row, node-aware.
        assert_eq!(r.rows.len(), 2 * 2 * 4 + 1);
        let mut groups: Vec<Vec<&ModeProjection>> = Vec::new();
        for row in &r.rows {
            match groups.last_mut() {
                Some(g) if row.dispatch != DispatchMode::Standard => g.push(row),
                _ => groups.push(vec![row]),
            }
        }
        for chunk in groups {
            let (std, dedup, occ, pruned) = (chunk[0], chunk[1], chunk[2], chunk[3]);
            if let Some(nodes) = chunk.get(4) {
                assert_eq!((nodes.profile.as_str(), nodes.devices), ("ib-ndr", 16));
                assert_eq!(nodes.mode, "occult, node-aware");
                assert!(nodes.layer_s <= occ.layer_s && nodes.layer_s <= dedup.layer_s);
                assert!(nodes.ecn <= dedup.ecn, "{} > {}", nodes.ecn, dedup.ecn);
            }
            assert_eq!(std.mode, "standard");
            // Occult's rows take the two-level exchange where nodes are joined by slower links.
            let exchange = match std.profile.as_str() {
                "ib-ndr" if std.devices > 8 => DispatchMode::TwoLevel,
                _ => DispatchMode::Occult,
            };
            assert!(
                chunk[1..].iter().all(|m| m.dispatch == exchange),
                "{}",
                std.profile
            );
            // Same placement: dedup sends fewer rows at the same E[C_T] and compute.
            assert!((std.ect - dedup.ect).abs() < 1e-12);
            assert!(
                dedup.intra_rows_per_token + dedup.inter_rows_per_token
                    < std.intra_rows_per_token + std.inter_rows_per_token
            );
            assert!((std.compute_s - dedup.compute_s).abs() < 1e-15);
            // Placement and pruning lower E[C_T] and time further.
            assert!(occ.ect < dedup.ect && pruned.ect <= 2.0 + 1e-12);
            assert!(occ.layer_speedup > dedup.layer_speedup && dedup.layer_speedup > 1.0);
            assert!(pruned.layer_speedup > occ.layer_speedup);
            assert!(std.layer_speedup == 1.0 && std.train_s > std.layer_s);
        }
        // ib-ndr has 8 devices per node: at 16 devices rows cross nodes, once per remote
        // node under dedup.
        let ib16: Vec<_> = r
            .rows
            .iter()
            .filter(|m| m.profile == "ib-ndr" && m.devices == 16)
            .collect();
        assert_eq!(ib16[0].nodes, 2);
        assert!(ib16[1].inter_rows_per_token <= 1.0 && ib16[0].inter_rows_per_token > 1.0);
    }

    /// Load-capped candidates only ever make Occult's projected layer faster, and the row says
    /// which cap won.
    #[test]
    fn the_fastest_load_cap_is_kept() {
        let mut c = SynthConfig::olmoe_like(2000, 3);
        c.layers = 2;
        c.skew = 1.5;
        let trace = synth_trace(&c, &|| ()).unwrap();
        let p = [LinkProfile::load("pcie4").unwrap()];
        let mut s = settings();
        s.devices = vec![4, 8];
        s.prune_devices = vec![];
        s.load_caps = vec![];
        let plain = project_trace(&trace, &p, &s, &|_| ()).unwrap();
        s.load_caps = vec![1.05, 1.2];
        let capped = project_trace(&trace, &p, &s, &|_| ()).unwrap();
        let occult = |r: &ProjectReport| -> Vec<ModeProjection> {
            r.rows
                .iter()
                .filter(|m| m.mode == "occult")
                .cloned()
                .collect()
        };
        let (a, b) = (occult(&plain), occult(&capped));
        assert_eq!(a.len(), 2);
        for (a, b) in a.iter().zip(&b) {
            assert!(a.load_cap.is_none());
            assert!(b.layer_s <= a.layer_s + 1e-15);
            if b.load_cap.is_some() {
                assert!(b.layer_s < a.layer_s && b.ect >= a.ect - 1e-12);
            }
        }
        // With skewed expert popularity, some cap wins somewhere.
        assert!(b.iter().any(|m| m.load_cap.is_some()), "{b:?}");
        s.load_caps = vec![0.9];
        assert!(project_trace(&trace, &p, &s, &|_| ()).is_err());
    }

    #[test]
    fn bad_settings_are_refused() {
        let mut c = SynthConfig::olmoe_like(100, 1);
        c.layers = 1;
        let trace = synth_trace(&c, &|| ()).unwrap();
        let p = [LinkProfile::load("pcie4").unwrap()];
        let mut s = settings();
        s.hidden = 0;
        assert!(project_trace(&trace, &p, &s, &|_| ()).is_err());
        let mut s = settings();
        s.tokens_per_device = vec![0];
        assert!(project_trace(&trace, &p, &s, &|_| ()).is_err());
        let mut s = settings();
        s.devices = vec![4, 0];
        assert!(project_trace(&trace, &p, &s, &|_| ()).is_err());
    }
}
