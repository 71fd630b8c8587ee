//! Node-aware placement: for a cluster of nodes of G devices, where a row across nodes costs
//! several rows inside one, place experts so that a token touches few *nodes* first, and few
//! devices within them second.
//!
//! The cost a placement is judged by is `w * sum C_N + sum C_T` over the trace's tokens (C_N:
//! distinct nodes of a token's experts, C_T: distinct devices; `w`: the cost of an inter-node
//! row in intra-node rows, such as the ratio of the two links' bandwidths). Under two-level
//! dispatch a token's row crosses to each remote node once and is forwarded inside it, so C_N
//! counts its inter-node rows (plus its own node) and C_T its device rows.
//!
//! Three candidates are built and the cheapest wins (ties in this order):
//! 1. **hierarchical**: the search ([`super::search`]) places experts on the N nodes as if each
//!    were one device (fewest nodes per token), then again on the devices of each node with
//!    experts kept in their node ([`super::search_within_groups`]);
//! 2. **flat**: the flat search on D devices, whose device d is in node d / G;
//! 3. **contiguous**, when it meets the load limit.
//!
//! So the result is never costlier, on the trace it was given, than Occult's flat placement or
//! the contiguous one. A load limit applies to nodes in the first step and to devices in every
//! candidate.

use super::config::{NodeLevel, SearchConfig};
use super::maps::{capacities, check_sizes, contiguous};
use super::search::SearchOutcome;
use super::search::{progress_steps, search_with_progress, search_within_groups};
use crate::analysis::collab::{CoActivation, DeviceCounter};
use crate::{bail, Result};

/// The inter-node row weight used when no link profile gives one: InfiniBand NDR against
/// NVLink is about 4 (`configs/links/ib-ndr.toml`: 150 / 40 GB/s).
pub const DEFAULT_INTER_WEIGHT: f64 = 4.0;

/// Looser device load limits tried, each this factor above the last, when the one asked for
/// cannot be met within the nodes; then none.
const LOOSER_LIMITS: usize = 8;
const LOOSER_STEP: f64 = 1.1;

/// Sums over the tokens of `ids` (`[tokens, k]`) of C_T and C_N under `map`.
pub fn devices_and_nodes(
    ids: &[u32],
    k: usize,
    map: &[u32],
    num_devices: usize,
    devices_per_node: usize,
) -> (u64, u64) {
    let nodes = num_devices.div_ceil(devices_per_node.max(1));
    let node_map: Vec<u32> = map
        .iter()
        .map(|&d| d / devices_per_node.max(1) as u32)
        .collect();
    let (mut dc, mut nc) = (DeviceCounter::new(num_devices), DeviceCounter::new(nodes));
    ids.chunks_exact(k).fold((0, 0), |(c_t, c_n), row| {
        (
            c_t + dc.load(row, map) as u64,
            c_n + nc.load(row, &node_map) as u64,
        )
    })
}

/// The two-level cost `w * sum C_N + sum C_T` of `map`.
pub fn two_level_cost(
    ids: &[u32],
    k: usize,
    map: &[u32],
    num_devices: usize,
    level: &NodeLevel,
) -> f64 {
    let (c_t, c_n) = devices_and_nodes(ids, k, map, num_devices, level.devices_per_node);
    level.inter_weight * c_n as f64 + c_t as f64
}

/// Progress steps [`node_search`] reports: the node step, the device step and the flat search.
pub fn node_progress_steps(cfg: &SearchConfig) -> usize {
    3 * progress_steps(cfg)
}

/// What [`node_search`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeOutcome {
    /// The winner (its `start` names the candidate: `hierarchical, ...`, `flat, ...`,
    /// `contiguous`).
    pub search: SearchOutcome,
    /// Sum of C_N under the winner's map.
    pub total_nodes: u64,
    /// The winner's two-level cost, and the flat search's (`None` when it found no map within
    /// the load limit).
    pub cost: f64,
    pub flat_cost: Option<f64>,
}

/// Places one layer's experts for a cluster of nodes (see the module's doc). Calls `on_step`
/// [`node_progress_steps`] times.
pub fn node_search(
    ids: &[u32],
    k: usize,
    co: &CoActivation,
    num_devices: usize,
    level: NodeLevel,
    cfg: &SearchConfig,
    on_step: &(dyn Fn() + Sync),
) -> Result<NodeOutcome> {
    let e = co.num_experts;
    check_sizes(e, num_devices)?;
    level.check(num_devices)?;
    let g = level.devices_per_node;
    let nodes = num_devices / g;
    let flat_cfg = SearchConfig {
        nodes: None,
        ..cfg.clone()
    };
    let steps = progress_steps(&flat_cfg);
    let cost = |map: &[u32]| two_level_cost(ids, k, map, num_devices, &level);
    // Each device's (token, expert) pairs over the mean, and whether the cap holds.
    let load_ratio = |map: &[u32]| {
        let mut load = vec![0u64; num_devices];
        for (x, &p) in map.iter().enumerate() {
            load[p as usize] += co.loads[x];
        }
        crate::analysis::collab::max_over_mean(&load)
    };
    let within_cap = |map: &[u32]| {
        cfg.max_load_factor
            .is_none_or(|f| load_ratio(map) <= f + 1e-12)
    };
    let mut candidates: Vec<(f64, SearchOutcome)> = Vec::new();
    // 1. Hierarchical: nodes first, then devices within each node.
    let mut hier_error = None;
    if nodes > 1 && g > 1 {
        match search_with_progress(ids, k, co, nodes, &flat_cfg, on_step) {
            Ok(by_node) => {
                let first = within_nodes_contiguous(&by_node.map, nodes, g);
                let groups = level.node_of_device(num_devices);
                let start = ("contiguous in nodes".to_string(), first);
                // The device loads are held to the limit where it can be met. With few experts
                // per device it often cannot (one hot expert is over it): then to the tightest
                // of a few looser limits that can, so that compute stays as even as it may.
                let within = |cfg: &SearchConfig, on_step: &(dyn Fn() + Sync)| {
                    search_within_groups(
                        ids,
                        k,
                        co,
                        num_devices,
                        &groups,
                        start.clone(),
                        cfg,
                        on_step,
                    )
                };
                let mut found = within(&flat_cfg, &|| ());
                let mut factor = flat_cfg.max_load_factor;
                for _ in 0..LOOSER_LIMITS {
                    if found.is_ok() || factor.is_none() {
                        break;
                    }
                    factor = factor.map(|f| f * LOOSER_STEP);
                    let looser = SearchConfig {
                        max_load_factor: factor,
                        ..flat_cfg.clone()
                    };
                    found = within(&looser, &|| ());
                }
                if found.is_err() && factor.is_some() {
                    let uncapped = SearchConfig {
                        max_load_factor: None,
                        ..flat_cfg.clone()
                    };
                    found = within(&uncapped, &|| ());
                }
                (0..steps).for_each(|_| on_step());
                match found {
                    // The cap binds every candidate: one found under a loosened cap only
                    // competes where it meets the asked one.
                    Ok(out) if !within_cap(&out.map) => {
                        hier_error = Some(crate::Error::invalid(format!(
                            "the hierarchical placement's max/mean load is {:.3}, over the cap \
                             {}",
                            load_ratio(&out.map),
                            cfg.max_load_factor.unwrap_or(0.0)
                        )));
                    }
                    Ok(mut out) => {
                        out.start = format!("hierarchical, {}", out.start);
                        candidates.push((cost(&out.map), out));
                    }
                    Err(err) => hier_error = Some(err),
                }
            }
            Err(err) => {
                (0..steps).for_each(|_| on_step());
                hier_error = Some(err);
            }
        }
    } else {
        (0..2 * steps).for_each(|_| on_step());
    }
    // 2. The flat search.
    let flat = search_with_progress(ids, k, co, num_devices, &flat_cfg, on_step);
    let flat_cost = flat.as_ref().ok().map(|out| cost(&out.map));
    let greedy_total_devices = match &flat {
        Ok(out) => Some(out.greedy_total_devices),
        Err(_) => None,
    };
    match flat {
        Ok(mut out) => {
            out.start = format!("flat, {}", out.start);
            candidates.push((cost(&out.map), out));
        }
        Err(err) => {
            if candidates.is_empty() {
                return Err(hier_error.unwrap_or(err));
            }
        }
    }
    // 3. Contiguous, within the load limit.
    let map = contiguous(e, num_devices);
    if within_cap(&map) {
        let total = devices_and_nodes(ids, k, &map, num_devices, g).0;
        let out = SearchOutcome {
            total_devices: total,
            greedy_total_devices: greedy_total_devices.unwrap_or(total),
            start: "contiguous".into(),
            swaps: 0,
            feasible_starts: 1,
            map,
        };
        candidates.push((cost(&out.map), out));
    }
    let Some((best_cost, best)) = candidates
        .into_iter()
        .reduce(|a, b| if b.0 < a.0 { b } else { a })
    else {
        bail!("no node-aware placement within the load limit was found");
    };
    // Recounted: the winner meets the cap (every candidate was held to it).
    if !within_cap(&best.map) {
        bail!(
            "the node-aware placement's max/mean load is {:.3}, over the cap {}",
            load_ratio(&best.map),
            cfg.max_load_factor.unwrap_or(0.0)
        );
    }
    let total_nodes = devices_and_nodes(ids, k, &best.map, num_devices, g).1;
    Ok(NodeOutcome {
        search: best,
        total_nodes,
        cost: best_cost,
        flat_cost,
    })
}

/// A device map from a node map: each node's experts (ascending) dealt in order over its G
/// devices, as many to each as the flat balanced sizes allow.
fn within_nodes_contiguous(node_of_expert: &[u32], nodes: usize, g: usize) -> Vec<u32> {
    let mut map = vec![0u32; node_of_expert.len()];
    for n in 0..nodes {
        let members: Vec<usize> = (0..node_of_expert.len())
            .filter(|&x| node_of_expert[x] as usize == n)
            .collect();
        let mut it = members.into_iter();
        for (j, c) in capacities(it.len(), g).into_iter().enumerate() {
            for x in it.by_ref().take(c) {
                map[x] = (n * g + j) as u32;
            }
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::placement::{random_balanced_within, validate_map};
    use crate::analysis::synth::{synth_trace, SynthConfig};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use std::collections::HashSet;

    fn level(g: usize, w: f64) -> NodeLevel {
        NodeLevel {
            devices_per_node: g,
            inter_weight: w,
        }
    }

    /// C_T and C_N by sets, token by token.
    fn by_sets(ids: &[u32], k: usize, map: &[u32], g: usize) -> (u64, u64) {
        ids.chunks_exact(k).fold((0, 0), |(t, n), row| {
            let devs: HashSet<u32> = row.iter().map(|&x| map[x as usize]).collect();
            let nodes: HashSet<u32> = devs.iter().map(|&d| d / g as u32).collect();
            (t + devs.len() as u64, n + nodes.len() as u64)
        })
    }

    #[test]
    fn devices_and_nodes_are_counted_by_sets() {
        let mut c = SynthConfig::olmoe_like(300, 3);
        c.layers = 1;
        let l = &synth_trace(&c, &|| ()).unwrap().layers[0];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for (d, g) in [(8, 2), (8, 4), (16, 4), (4, 4), (64, 8)] {
            let map = crate::analysis::placement::random_balanced(64, d, &mut rng);
            assert_eq!(
                devices_and_nodes(&l.topk_ids, 8, &map, d, g),
                by_sets(&l.topk_ids, 8, &map, g),
                "d {d} g {g}"
            );
        }
    }

    /// Four clusters of 16 experts, every token inside one: on 4 nodes of 2 devices the
    /// hierarchical search puts each cluster in one node (every token on one node), which the
    /// flat search, minimising devices alone, need not.
    #[test]
    fn clusters_that_fit_a_node_end_on_one_node() {
        let (e, k, d, g) = (64, 4, 8, 2);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut ids = Vec::new();
        // Cluster members scattered over the ids, so that contiguous is no help.
        let member = |c: usize, j: usize| ((j * 4 + c) * 5 % e) as u32;
        for _ in 0..2000 {
            let c = rand::Rng::random_range(&mut rng, 0..4);
            let mut picks: Vec<usize> = (0..16).collect();
            rand::seq::SliceRandom::shuffle(&mut picks[..], &mut rng);
            ids.extend(picks[..k].iter().map(|&j| member(c, j)));
        }
        let co = CoActivation::from_ids(&ids, k, e);
        let out = node_search(
            &ids,
            k,
            &co,
            d,
            level(g, 4.0),
            &SearchConfig::default(),
            &|| (),
        )
        .unwrap();
        validate_map(&out.search.map, e, d).unwrap();
        assert_eq!(out.total_nodes, 2000, "{}", out.search.start);
        assert!(out.search.start.starts_with("hierarchical"));
        let (c_t, c_n) = by_sets(&ids, k, &out.search.map, g);
        assert_eq!((out.search.total_devices, out.total_nodes), (c_t, c_n));
        assert_eq!(out.cost, 4.0 * c_n as f64 + c_t as f64);
    }

    /// On clustered and uniform routing, with and without a load limit, the result is valid,
    /// its counts are exact, and it costs no more than the flat search or contiguous.
    #[test]
    fn never_costlier_than_the_flat_search_or_contiguous() {
        for (seed, uniform) in [(1, false), (2, true)] {
            let mut c = SynthConfig::olmoe_like(600, seed);
            c.layers = 1;
            if uniform {
                c = c.uniform();
            }
            let l = &synth_trace(&c, &|| ()).unwrap().layers[0];
            let ids = &l.topk_ids;
            let co = CoActivation::from_ids(ids, 8, 64);
            for (d, g, cap) in [
                (8, 2, None),
                (16, 4, Some(1.1)),
                (32, 8, None),
                (4, 4, None),
            ] {
                let lv = level(g, 3.75);
                let cfg = SearchConfig {
                    max_load_factor: cap,
                    ..Default::default()
                };
                let out = node_search(ids, 8, &co, d, lv, &cfg, &|| ()).unwrap();
                validate_map(&out.search.map, 64, d).unwrap();
                let (c_t, c_n) = by_sets(ids, 8, &out.search.map, g);
                assert_eq!((out.search.total_devices, out.total_nodes), (c_t, c_n));
                // The cap binds the winner, recounted from its map.
                if let Some(f) = cap {
                    let mut load = vec![0u64; d];
                    for (x, &p) in out.search.map.iter().enumerate() {
                        load[p as usize] += co.loads[x];
                    }
                    let ratio = crate::analysis::collab::max_over_mean(&load);
                    assert!(ratio <= f + 1e-12, "d {d} g {g}: {ratio} over {f}");
                }
                let flat = crate::analysis::placement::search(ids, 8, &co, d, &cfg);
                if let Ok(flat) = flat {
                    let fc = two_level_cost(ids, 8, &flat.map, d, &lv);
                    assert!(out.cost <= fc, "d {d} g {g}: {} > flat {fc}", out.cost);
                    assert_eq!(out.flat_cost, Some(fc));
                }
                let cc = two_level_cost(ids, 8, &contiguous(64, d), d, &lv);
                if cap.is_none() {
                    assert!(
                        out.cost <= cc,
                        "d {d} g {g}: {} > contiguous {cc}",
                        out.cost
                    );
                }
                if let Some(f) = cap {
                    // Node loads are within the limit (the first step's).
                    let mut node_load = vec![0u64; d / g];
                    if out.search.start.starts_with("hierarchical") {
                        for (x, &p) in out.search.map.iter().enumerate() {
                            node_load[p as usize / g] += co.loads[x];
                        }
                        let mean = node_load.iter().sum::<u64>() as f64 / (d / g) as f64;
                        assert!(node_load.iter().all(|&n| n as f64 <= f * mean + 1e-9));
                    }
                }
            }
        }
    }

    #[test]
    fn progress_steps_are_exact_and_bad_levels_are_refused() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let mut c = SynthConfig::olmoe_like(200, 5);
        c.layers = 1;
        let l = &synth_trace(&c, &|| ()).unwrap().layers[0];
        let co = CoActivation::from_ids(&l.topk_ids, 8, 64);
        let cfg = SearchConfig::default();
        for (d, g, cap) in [(8, 2, None), (8, 8, None), (16, 4, Some(1.0))] {
            let n = AtomicUsize::new(0);
            let cfg = SearchConfig {
                max_load_factor: cap,
                ..cfg.clone()
            };
            let _ = node_search(&l.topk_ids, 8, &co, d, level(g, 2.0), &cfg, &|| {
                n.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(
                n.load(Ordering::Relaxed),
                node_progress_steps(&cfg),
                "d {d} g {g}"
            );
        }
        let run = |d, lv| node_search(&l.topk_ids, 8, &co, d, lv, &cfg, &|| ()).unwrap_err();
        assert!(run(8, level(3, 2.0)).to_string().contains("must divide"));
        assert!(run(8, level(0, 2.0)).to_string().contains("must divide"));
        for w in [0.5, f64::NAN, f64::INFINITY] {
            assert!(run(8, level(2, w)).to_string().contains("weight"), "{w}");
        }
    }

    /// Deals within groups keep every expert in its group and every device's count; the grouped
    /// search moves no expert across groups.
    #[test]
    fn grouped_starts_and_search_keep_experts_in_their_group() {
        let mut c = SynthConfig::olmoe_like(400, 9);
        c.layers = 1;
        let l = &synth_trace(&c, &|| ()).unwrap().layers[0];
        let co = CoActivation::from_ids(&l.topk_ids, 8, 64);
        let (d, g) = (16, 4);
        let groups = level(g, 2.0).node_of_device(d);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let start = crate::analysis::placement::random_balanced(64, d, &mut rng);
        let count = |m: &[u32]| {
            let mut n = vec![0; d];
            m.iter().for_each(|&p| n[p as usize] += 1);
            n
        };
        let dealt = random_balanced_within(&start, d, &groups, &mut rng);
        assert_ne!(dealt, start);
        assert_eq!(count(&dealt), count(&start));
        for x in 0..64 {
            assert_eq!(groups[dealt[x] as usize], groups[start[x] as usize]);
        }
        let out = crate::analysis::placement::search_within_groups(
            &l.topk_ids,
            8,
            &co,
            d,
            &groups,
            ("start".into(), start.clone()),
            &SearchConfig::default(),
            &|| (),
        )
        .unwrap();
        for x in 0..64 {
            assert_eq!(
                groups[out.map[x] as usize], groups[start[x] as usize],
                "{x}"
            );
        }
        assert!(out.total_devices <= devices_and_nodes(&l.topk_ids, 8, &start, d, g).0);
    }

    #[test]
    fn node_maps_deal_each_nodes_experts_over_its_devices() {
        let node_of = [1u32, 0, 1, 1, 0, 0, 1, 0, 1];
        // 9 experts on 2 nodes of 2 devices: node 0 holds 4, node 1 holds 5.
        assert_eq!(
            within_nodes_contiguous(&node_of, 2, 2),
            vec![2, 0, 2, 2, 0, 1, 3, 1, 3]
        );
    }
}
