//! Dispatch traffic on a cluster of nodes, at two levels, and its projected time; E[C_N] and
//! the rows within and across nodes of one layer ([`node_stats`]) and of a trace
//! ([`trace_node_stats`]).
//!
//! A cluster is D devices in nodes of G (the link profile's `ranks_per_node`). A token starts
//! on its source device and its rows go where its experts are:
//! - [`DispatchMode::Standard`]: one row per chosen expert, each sent straight to its device,
//!   across the node boundary when the device is in another node;
//! - [`DispatchMode::Occult`] (deduplicated, as DeepEP's dispatch): one row per distinct device,
//!   each sent straight to its device;
//! - [`DispatchMode::TwoLevel`]: one row per distinct device inside the node, and one per
//!   remote node across: a token's rows to another node cross the boundary once, to the device
//!   with the source's local index there (its *proxy*), which forwards the row over the
//!   intra-node link to each other device of that node that needs it, as DeepEP does across
//!   RDMA. [`occult_exchange`] says which of the last two a machine runs Occult's rows in.
//!
//! A rank's time in an exchange is, per level, the larger of its send and receive time (bytes
//! over bandwidth, plus one latency per non-empty message); the two levels use different
//! hardware and run concurrently, as DeepEP overlaps RDMA with NVLink forwarding, so the rank
//! takes the larger of the two. The exchange lasts as long as its slowest rank. The combine is
//! the same traffic reversed and costs the same.

use crate::analysis::collab::{token_weighted_mean, DeviceCounter};
use crate::analysis::cost::links::{Link, LinkProfile};
use crate::analysis::drivers::whole_trace::per_layer;
use crate::analysis::placement::Placement;
use crate::analysis::run_key::DispatchMode;
use crate::analysis::trace::Trace;
use crate::{bail, Result};
use serde::Serialize;

/// D devices in nodes of `per_node` (the last node may hold fewer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cluster {
    pub devices: usize,
    pub per_node: usize,
}

impl Cluster {
    /// D devices of the machine `profile` describes.
    pub fn on(devices: usize, profile: &LinkProfile) -> Self {
        Cluster {
            devices,
            per_node: profile.ranks_per_node,
        }
    }

    pub fn node(&self, device: usize) -> usize {
        device / self.per_node
    }

    /// The device of `node` that receives `source`'s rows: the same local index, folded into
    /// a short last node.
    pub fn proxy(&self, source: usize, node: usize) -> usize {
        let first = node * self.per_node;
        let size = self.per_node.min(self.devices - first);
        first + (source % self.per_node) % size
    }
}

/// The exchange Occult's deduplicated rows take on `devices` devices of the machine `profile`
/// describes: the two-level one where they span nodes joined by a link slower than the one
/// inside a node, else the flat one.
pub fn occult_exchange(profile: &LinkProfile, devices: usize) -> DispatchMode {
    if devices > profile.ranks_per_node && profile.nodes_slower() {
        DispatchMode::TwoLevel
    } else {
        DispatchMode::Occult
    }
}

/// Rows over each link level of one dispatch, and the expert work it causes.
#[derive(Clone, Debug, PartialEq)]
pub struct LevelTraffic {
    pub cluster: Cluster,
    /// `intra[s * D + p]`: rows from device s to device p over the intra-node link.
    pub intra: Vec<u64>,
    /// `inter[s * D + p]`: rows from device s to device p across nodes.
    pub inter: Vec<u64>,
    /// (token, expert) pairs each device computes.
    pub pairs: Vec<u64>,
    pub tokens: u64,
    /// Sum over tokens of the distinct devices their experts are on (E[C_T] = this / tokens).
    pub devices_touched: u64,
    /// Sum over tokens of the distinct nodes their experts are on (E[C_N] = this / tokens).
    pub nodes_touched: u64,
}

impl LevelTraffic {
    pub fn new(cluster: Cluster) -> Self {
        let d = cluster.devices;
        LevelTraffic {
            cluster,
            intra: vec![0; d * d],
            inter: vec![0; d * d],
            pairs: vec![0; d],
            tokens: 0,
            devices_touched: 0,
            nodes_touched: 0,
        }
    }

    /// Adds one token on device `source` with experts `ids`; `counter` is scratch.
    pub fn add_token(
        &mut self,
        source: usize,
        ids: &[u32],
        device_of_expert: &[u32],
        dispatch: DispatchMode,
        counter: &mut DeviceCounter,
    ) {
        let c = self.cluster;
        let d_n = c.devices;
        let here = c.node(source);
        self.devices_touched += counter.load(ids, device_of_expert) as u64;
        self.tokens += 1;
        let mut remote_nodes: Vec<usize> = Vec::new();
        for &p in counter.devices() {
            let (p, n) = (p as usize, counter.count(p) as u64);
            self.pairs[p] += n;
            if p == source {
                continue;
            }
            match dispatch {
                DispatchMode::Standard if c.node(p) == here => self.intra[source * d_n + p] += n,
                DispatchMode::Standard => self.inter[source * d_n + p] += n,
                _ if c.node(p) == here => self.intra[source * d_n + p] += 1,
                DispatchMode::Occult => self.inter[source * d_n + p] += 1,
                DispatchMode::TwoLevel => {
                    let node = c.node(p);
                    let q = c.proxy(source, node);
                    if !remote_nodes.contains(&node) {
                        self.inter[source * d_n + q] += 1;
                    }
                    if p != q {
                        self.intra[q * d_n + p] += 1;
                    }
                }
            }
            if c.node(p) != here && !remote_nodes.contains(&c.node(p)) {
                remote_nodes.push(c.node(p));
            }
        }
        let own = counter
            .devices()
            .iter()
            .any(|&p| c.node(p as usize) == here);
        self.nodes_touched += remote_nodes.len() as u64 + u64::from(own);
    }

    /// Rows per token over each level: (intra, inter).
    pub fn rows_per_token(&self) -> (f64, f64) {
        let t = self.tokens.max(1) as f64;
        (
            self.intra.iter().sum::<u64>() as f64 / t,
            self.inter.iter().sum::<u64>() as f64 / t,
        )
    }

    pub fn ect(&self) -> f64 {
        self.devices_touched as f64 / self.tokens.max(1) as f64
    }

    /// E[C_N]: distinct nodes per token.
    pub fn ecn(&self) -> f64 {
        self.nodes_touched as f64 / self.tokens.max(1) as f64
    }

    /// Projected seconds of this exchange, rows of `row_bytes` bytes, on `profile`.
    pub fn exchange_seconds(&self, profile: &LinkProfile, row_bytes: f64) -> f64 {
        let d = self.cluster.devices;
        let level = |m: &[u64], link: &Link, r: usize| {
            let leg = |rows: u64| link.message_seconds(rows as f64 * row_bytes);
            let send: f64 = (0..d).filter(|&p| p != r).map(|p| leg(m[r * d + p])).sum();
            let recv: f64 = (0..d).filter(|&p| p != r).map(|p| leg(m[p * d + r])).sum();
            send.max(recv)
        };
        (0..d)
            .map(|r| {
                level(&self.intra, &profile.intra, r).max(level(&self.inter, &profile.inter, r))
            })
            .fold(0.0, f64::max)
    }

    /// The slowest device's expert pairs.
    pub fn max_pairs(&self) -> u64 {
        self.pairs.iter().copied().max().unwrap_or(0)
    }
}

/// Rows of one dispatch at each level, over a layer's tokens (each direction).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LevelRows {
    pub intra: u64,
    pub inter: u64,
}

impl LevelRows {
    fn of(t: &LevelTraffic) -> Self {
        LevelRows {
            intra: t.intra.iter().sum(),
            inter: t.inter.iter().sum(),
        }
    }
}

/// One layer's traffic at two levels: nodes touched per token and the rows each dispatch sends
/// within and across nodes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NodeStats {
    pub layer: usize,
    pub tokens: usize,
    pub devices_per_node: usize,
    pub nodes: usize,
    /// E[C_N]: distinct nodes of a token's experts.
    pub ecn: f64,
    /// `ecn_histogram[c]` = tokens with C_N = c, for c in 0..=min(k, nodes).
    pub ecn_histogram: Vec<u64>,
    /// One row per (token, expert), straight to the expert's device.
    pub standard: LevelRows,
    /// One row per (token, device), straight to the device (the flat exchange).
    pub dedup: LevelRows,
    /// One row per (token, remote node) across, to the proxy, forwarded inside the node (the
    /// two-level exchange).
    pub two_level: LevelRows,
    /// Rows each node receives across nodes under the two-level exchange.
    pub node_inter_rows: Vec<u64>,
    /// max / mean of `node_inter_rows` (1 when none).
    pub max_node_inter_ratio: f64,
}

/// Computes [`NodeStats`] for one layer: `ids` `[tokens, k]` under `device_of_expert` on
/// `num_devices` devices in nodes of `devices_per_node`, token t starting on `source(t)`.
pub fn node_stats(
    layer: usize,
    ids: &[u32],
    k: usize,
    device_of_expert: &[u32],
    num_devices: usize,
    devices_per_node: usize,
    source: impl Fn(usize) -> usize,
) -> NodeStats {
    let cluster = Cluster {
        devices: num_devices,
        per_node: devices_per_node,
    };
    let mut standard = LevelTraffic::new(cluster);
    let mut dedup = LevelTraffic::new(cluster);
    let mut two_level = LevelTraffic::new(cluster);
    let nodes = num_devices.div_ceil(devices_per_node);
    let mut hist = vec![0u64; k.min(nodes) + 1];
    let mut counter = DeviceCounter::new(num_devices);
    for (t, row) in ids.chunks_exact(k).enumerate() {
        let src = source(t);
        standard.add_token(
            src,
            row,
            device_of_expert,
            DispatchMode::Standard,
            &mut counter,
        );
        dedup.add_token(
            src,
            row,
            device_of_expert,
            DispatchMode::Occult,
            &mut counter,
        );
        let before = two_level.nodes_touched;
        two_level.add_token(
            src,
            row,
            device_of_expert,
            DispatchMode::TwoLevel,
            &mut counter,
        );
        hist[(two_level.nodes_touched - before) as usize] += 1;
    }
    let mut node_inter_rows = vec![0u64; nodes];
    for (i, &n) in two_level.inter.iter().enumerate() {
        node_inter_rows[(i % num_devices) / devices_per_node] += n;
    }
    NodeStats {
        layer,
        tokens: ids.len() / k.max(1),
        devices_per_node,
        nodes,
        ecn: two_level.ecn(),
        ecn_histogram: hist,
        standard: LevelRows::of(&standard),
        dedup: LevelRows::of(&dedup),
        two_level: LevelRows::of(&two_level),
        max_node_inter_ratio: crate::analysis::collab::max_over_mean(&node_inter_rows),
        node_inter_rows,
    }
}

/// Two-level statistics of every layer of a trace under a placement.
#[derive(Clone, Debug, Serialize)]
pub struct TraceNodeStats {
    pub devices_per_node: usize,
    pub nodes: usize,
    /// E[C_N] over all (layer, token) pairs.
    pub mean_ecn: f64,
    pub layers: Vec<NodeStats>,
}

/// Computes [`TraceNodeStats`] for nodes of `devices_per_node` (device d in node d / G); the
/// tokens' sources are split as [`trace_stats`](crate::analysis::trace_stats) splits them.
pub fn trace_node_stats(
    trace: &Trace,
    placement: &Placement,
    devices_per_node: usize,
    resplit: bool,
) -> Result<TraceNodeStats> {
    let d = placement.num_devices;
    if devices_per_node == 0 {
        bail!("a node holds at least one device");
    }
    let k = trace.meta.top_k;
    let layers = per_layer(trace, placement, resplit, |l, map, split| {
        node_stats(l.layer, &l.topk_ids, k, map, d, devices_per_node, |t| {
            split.rank_of(t)
        })
    })?;
    Ok(TraceNodeStats {
        devices_per_node,
        nodes: d.div_ceil(devices_per_node),
        mean_ecn: token_weighted_mean(layers.iter().map(|s| (s.ecn, s.tokens))),
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::analysis::cost::links::tests::test_profile as profile;

    #[test]
    fn proxies_fold_into_a_short_last_node() {
        let c = Cluster {
            devices: 5,
            per_node: 2,
        };
        assert_eq!(c.proxy(3, 0), 1);
        assert_eq!(c.proxy(0, 1), 2);
        assert_eq!(c.proxy(3, 2), 4);
        assert_eq!(c.proxy(1, 2), 4);
    }

    /// 4 devices in 2 nodes, one expert per device; a token on device 0 picks experts on
    /// devices 0, 1, 2, 3 and twice on 3.
    #[test]
    fn hand_counted_rows_and_time() {
        let c = Cluster::on(4, &profile());
        assert_eq!(occult_exchange(&profile(), 4), DispatchMode::TwoLevel);
        assert_eq!(occult_exchange(&profile(), 2), DispatchMode::Occult);
        let map = [0u32, 1, 2, 3];
        let ids = [0u32, 1, 2, 3, 3];
        let mut counter = DeviceCounter::new(4);
        let mut copies = LevelTraffic::new(c);
        copies.add_token(0, &ids, &map, DispatchMode::Standard, &mut counter);
        assert_eq!(copies.intra[1], 1);
        assert_eq!((copies.inter[2], copies.inter[3]), (1, 2));
        assert_eq!(copies.pairs, vec![1, 1, 1, 2]);
        assert_eq!(copies.rows_per_token(), (1.0, 3.0));
        let mut dedup = LevelTraffic::new(c);
        dedup.add_token(0, &ids, &map, DispatchMode::TwoLevel, &mut counter);
        // One row crosses to node 1's proxy (device 2), which forwards one to device 3.
        assert_eq!(dedup.intra[1], 1);
        assert_eq!(dedup.inter[2], 1);
        assert_eq!(dedup.inter[3], 0);
        assert_eq!(dedup.intra[2 * 4 + 3], 1);
        assert_eq!(dedup.rows_per_token(), (2.0, 1.0));
        assert_eq!(dedup.ect(), 4.0);
        let p = profile();
        // Copies: device 0 sends 3 rows of 100 B across (two messages) and 1 within.
        let inter0 = (100.0 / 1e8 + 1e-5) + (200.0 / 1e8 + 1e-5);
        assert!((copies.exchange_seconds(&p, 100.0) - inter0).abs() < 1e-15);
        // Dedup: one row across; device 2 receives it and forwards one within its node.
        let inter0 = 100.0 / 1e8 + 1e-5;
        assert!((dedup.exchange_seconds(&p, 100.0) - inter0).abs() < 1e-15);
        // Without forwarding, each remote device gets its own row across.
        let mut direct = LevelTraffic::new(c);
        direct.add_token(0, &ids, &map, DispatchMode::Occult, &mut counter);
        assert_eq!((direct.inter[2], direct.inter[3]), (1, 1));
        assert_eq!(direct.rows_per_token(), (1.0, 2.0));
    }

    /// Two tokens on 4 devices in 2 nodes (one expert per device), counted by hand.
    #[test]
    fn node_stats_by_hand() {
        let map = [0u32, 1, 2, 3];
        // Token 0 from device 0: experts on 0, 2, 3 (nodes 0 and 1). Token 1 from device 3:
        // experts 1, 1 (node 0 only).
        let ids = [0u32, 2, 3, 1, 1, 1];
        let s = node_stats(5, &ids, 3, &map, 4, 2, |t| [0, 3][t]);
        assert_eq!((s.nodes, s.tokens, s.layer), (2, 2, 5));
        assert_eq!(s.ecn, 1.5);
        assert_eq!(s.ecn_histogram, vec![0, 1, 1]);
        // Standard: token 0 sends 2 across; token 1 sends 3 copies across (to device 1).
        assert_eq!(s.standard, LevelRows { intra: 0, inter: 5 });
        // Flat dedup: token 0 one row to each of devices 2 and 3; token 1 one row to device 1.
        assert_eq!(s.dedup, LevelRows { intra: 0, inter: 3 });
        // Two-level: token 0 one row to node 1's proxy (device 2), forwarded to 3; token 1 one
        // row to node 0's proxy (device 1, local index 1), which needs it.
        assert_eq!(s.two_level, LevelRows { intra: 1, inter: 2 });
        assert_eq!(s.node_inter_rows, vec![1, 1]);
        assert_eq!(s.max_node_inter_ratio, 1.0);
    }

    /// On random routing: the histogram covers every token, and two-level inter rows are
    /// exactly the remote nodes each token touches.
    #[test]
    fn two_level_rows_are_remote_nodes_per_token() {
        use crate::analysis::synth::{synth_trace, SynthConfig};
        use std::collections::HashSet;
        let mut c = SynthConfig::olmoe_like(500, 8);
        c.layers = 1;
        let l = &synth_trace(&c, &|| ()).unwrap().layers[0];
        let map: Vec<u32> = (0..64).map(|x| (x * 11 % 64 / 4) as u32).collect();
        for g in [1, 2, 4, 8, 16] {
            let src = |t: usize| t * 7 % 16;
            let s = node_stats(0, &l.topk_ids, 8, &map, 16, g, src);
            assert_eq!(s.ecn_histogram.iter().sum::<u64>(), 500);
            let mut remote = 0;
            let mut nodes_total = 0;
            for (t, row) in l.topk_ids.chunks_exact(8).enumerate() {
                let nodes: HashSet<u32> = row.iter().map(|&x| map[x as usize] / g as u32).collect();
                nodes_total += nodes.len();
                remote += nodes.iter().filter(|&&n| n as usize != src(t) / g).count() as u64;
            }
            assert_eq!(s.two_level.inter, remote, "g {g}");
            assert_eq!(s.node_inter_rows.iter().sum::<u64>(), remote);
            assert!((s.ecn - nodes_total as f64 / 500.0).abs() < 1e-12);
            assert!(s.two_level.inter <= s.dedup.inter && s.dedup.inter <= s.standard.inter);
        }
    }

    /// Inside one node the counts are `collab`'s link-row matrices (k copies and one row per
    /// device), computed by its own code on the same tokens and sources.
    #[test]
    fn one_node_counts_agree_with_collab_link_rows() {
        use crate::analysis::collab::layer_stats;
        use crate::analysis::ranks::RankSplit;
        use crate::analysis::synth::{synth_trace, SynthConfig};
        let mut c = SynthConfig::olmoe_like(300, 5);
        c.layers = 1;
        let trace = synth_trace(&c, &|| ()).unwrap();
        let l = &trace.layers[0];
        let (k, d) = (trace.meta.top_k, 4);
        let map: Vec<u32> = (0..64).map(|x| (x * 7 % 64 / 16) as u32).collect();
        let split = RankSplit::new(l.tokens, d);
        let stats = layer_stats(0, &l.topk_ids, k, &map, d, split, 0);
        let cluster = Cluster {
            devices: d,
            per_node: 8,
        };
        let mut counter = DeviceCounter::new(d);
        for (dispatch, want) in [
            (DispatchMode::Standard, &stats.link_rows_standard),
            (DispatchMode::TwoLevel, &stats.link_rows_occult),
        ] {
            let mut t = LevelTraffic::new(cluster);
            for tok in 0..l.tokens {
                t.add_token(
                    split.rank_of(tok),
                    l.ids(tok, k),
                    &map,
                    dispatch,
                    &mut counter,
                );
            }
            for (s, row) in want.iter().enumerate() {
                for p in (0..d).filter(|&p| p != s) {
                    assert_eq!(t.intra[s * d + p], row[p], "{dispatch:?} {s}->{p}");
                }
            }
            assert!(t.inter.iter().all(|&x| x == 0));
            assert_eq!(t.devices_touched, stats.rows_occult);
        }
    }

    #[test]
    fn one_node_dedup_is_one_row_per_remote_device() {
        let c = Cluster {
            devices: 4,
            per_node: 8,
        };
        let map = [0u32, 0, 1, 1, 2, 2, 3, 3];
        let mut counter = DeviceCounter::new(4);
        let mut t = LevelTraffic::new(c);
        t.add_token(1, &[0, 1, 2, 4], &map, DispatchMode::TwoLevel, &mut counter);
        assert_eq!(t.rows_per_token(), (2.0, 0.0));
        assert_eq!(t.ect(), 3.0);
    }
}
