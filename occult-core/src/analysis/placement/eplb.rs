//! DeepSeek's expert-parallelism load balancer (EPLB), the load-only baseline for placements
//! with replicas: from each expert's load it chooses which experts get redundant copies and
//! packs the E + R physical experts onto the devices, the same number on each, so that device
//! loads are as even as it can make them. It has no co-activation term.
//!
//! Two policies, as the published algorithm (github.com/deepseek-ai/EPLB, `eplb.py`) has them:
//! - **hierarchical** (the expert groups divide evenly over the nodes): pack whole expert groups
//!   onto nodes, replicate within each node, then pack each node's physical experts onto its
//!   devices;
//! - **global** (otherwise): the same with one group and one node.
//!
//! Loads are `f32` and every step computes as the published code does in float32 (its sums,
//! its divisions by copy counts); ties go to the lowest index, as its stable sort, `argmax` and
//! `min` do. A fixture made by running the published code (`tests/fixtures/eplb/`) holds this
//! port to it, output for output.

use crate::{bail, Result};
use serde::Serialize;

/// EPLB's answer for one layer: `E + R` physical experts, `P / D` on each device (physical
/// expert p on device `p / (P / D)`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replicated {
    /// `[P]`: the logical expert of each physical expert.
    pub phy2log: Vec<u32>,
    /// `[P]`: which copy of its expert each physical expert is (0 for the first).
    pub replica_rank: Vec<u32>,
    /// `[E]`: copies of each logical expert.
    pub copies: Vec<u32>,
}

/// The shape of an EPLB run: physical experts, expert groups, nodes and devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EplbShape {
    pub physical: usize,
    pub groups: usize,
    pub nodes: usize,
    pub devices: usize,
}

impl EplbShape {
    /// Whether the hierarchical policy applies (the groups divide evenly over the nodes), as
    /// the published entry point decides.
    pub fn hierarchical(&self) -> bool {
        self.groups.is_multiple_of(self.nodes.max(1))
    }
}

/// Packs items of `weights` into `packs` packs of `n / packs` items each, heaviest first, each
/// into the lightest pack that has room (the lowest-numbered on ties). Returns each item's pack
/// and its rank in the pack (the order it arrived in).
pub fn balanced_packing(weights: &[f32], packs: usize) -> Result<(Vec<usize>, Vec<usize>)> {
    let n = weights.len();
    if packs == 0 || !n.is_multiple_of(packs) {
        bail!("EPLB: {n} items do not pack evenly into {packs} packs");
    }
    let per_pack = n / packs;
    if per_pack == 1 {
        return Ok(((0..n).collect(), vec![0; n]));
    }
    let mut order: Vec<usize> = (0..n).collect();
    // Descending; equal weights keep their index order (a stable sort).
    order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]));
    let mut pack_weight = vec![0f32; packs];
    let mut pack_items = vec![0usize; packs];
    let (mut pack_of, mut rank) = (vec![0; n], vec![0; n]);
    for item in order {
        let pack = (0..packs)
            .filter(|&p| pack_items[p] < per_pack)
            .min_by(|&a, &b| pack_weight[a].total_cmp(&pack_weight[b]))
            .expect("a pack has room while items remain");
        pack_of[item] = pack;
        rank[item] = pack_items[pack];
        pack_weight[pack] += weights[item];
        pack_items[pack] += 1;
    }
    Ok((pack_of, rank))
}

/// Replicates `weights.len()` logical experts into `physical` physical ones, each new copy for
/// the expert whose load per copy is largest (the lowest index on ties). Returns each physical
/// expert's logical one and copy rank, and each logical expert's copy count.
pub fn replicate_experts(
    weights: &[f32],
    physical: usize,
) -> Result<(Vec<u32>, Vec<u32>, Vec<u32>)> {
    let logical = weights.len();
    if physical < logical {
        bail!("EPLB: {physical} physical experts for {logical} logical ones");
    }
    let mut phy2log: Vec<u32> = (0..logical as u32).collect();
    let mut rank = vec![0u32; logical];
    let mut copies = vec![1u32; logical];
    for _ in logical..physical {
        let mut best = 0;
        for e in 1..logical {
            if weights[e] / copies[e] as f32 > weights[best] / copies[best] as f32 {
                best = e;
            }
        }
        phy2log.push(best as u32);
        rank.push(copies[best]);
        copies[best] += 1;
    }
    Ok((phy2log, rank, copies))
}

/// Each expert's load in a layer's routing `ids`: the tokens that chose it.
pub fn expert_loads(ids: &[u32], num_experts: usize) -> Vec<f32> {
    let mut counts = vec![0u64; num_experts];
    for &e in ids {
        if let Some(c) = counts.get_mut(e as usize) {
            *c += 1;
        }
    }
    counts.into_iter().map(|c| c as f32).collect()
}

/// Which EPLB policy a placement asks for: the hierarchical one over `groups` expert groups and
/// `nodes` nodes where the groups divide over the nodes, else the global one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct EplbGroups {
    pub groups: usize,
    pub nodes: usize,
}

impl EplbGroups {
    /// The global policy (one group, one node).
    pub const GLOBAL: EplbGroups = EplbGroups {
        groups: 1,
        nodes: 1,
    };
}

/// EPLB's placement for a layer's routing `ids` on `devices` devices with `replicas` redundant
/// slots (`E + R` must fill the devices evenly), as a [`super::replicas::ReplicaMap`] whose
/// tie-breaking loads are the same counts. The global policy unless `groups` divide over
/// `nodes` (one group and one node: global).
pub fn eplb_map(
    ids: &[u32],
    num_experts: usize,
    devices: usize,
    replicas: usize,
    groups: usize,
    nodes: usize,
) -> Result<super::replicas::ReplicaMap> {
    let loads = expert_loads(ids, num_experts);
    eplb_map_of_loads(&loads, devices, replicas, groups, nodes)
}

/// [`eplb_map`] from each expert's load alone (what an engine's expert counts give).
pub fn eplb_map_of_loads(
    loads: &[f32],
    devices: usize,
    replicas: usize,
    groups: usize,
    nodes: usize,
) -> Result<super::replicas::ReplicaMap> {
    let num_experts = loads.len();
    let shape = EplbShape {
        physical: num_experts + replicas,
        groups,
        nodes,
        devices,
    };
    let r = rebalance(loads, shape)?;
    let loads: Vec<f64> = loads.iter().map(|&x| x as f64).collect();
    super::replicas::ReplicaMap::new(r.phy2log, num_experts, devices, Some(&loads))
}

/// The inverse of a permutation.
fn inverse(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}

/// EPLB for one layer's expert loads, by the policy `shape` calls for.
pub fn rebalance(weights: &[f32], shape: EplbShape) -> Result<Replicated> {
    if shape.hierarchical() {
        rebalance_hierarchical(weights, shape)
    } else {
        rebalance_hierarchical(
            weights,
            EplbShape {
                groups: 1,
                nodes: 1,
                ..shape
            },
        )
    }
}

/// The hierarchical policy: groups onto nodes, copies within nodes, physical experts onto each
/// node's devices.
pub fn rebalance_hierarchical(weights: &[f32], shape: EplbShape) -> Result<Replicated> {
    let EplbShape {
        physical,
        groups,
        nodes,
        devices,
    } = shape;
    let logical = weights.len();
    if groups == 0 || !logical.is_multiple_of(groups) {
        bail!("EPLB: {logical} experts do not split into {groups} groups");
    }
    if nodes == 0 || !groups.is_multiple_of(nodes) {
        bail!("EPLB: {groups} expert groups do not split over {nodes} nodes");
    }
    if devices == 0 || !devices.is_multiple_of(nodes) {
        bail!("EPLB: {devices} devices do not split over {nodes} nodes");
    }
    if !physical.is_multiple_of(devices) || physical < logical {
        bail!(
            "EPLB: {physical} physical experts do not fill {devices} devices evenly, or are \
             fewer than the {logical} experts"
        );
    }
    let group_size = logical / groups;
    let groups_per_node = groups / nodes;
    let per_device = physical / devices;
    let (log_per_node, phy_per_node) = (logical / nodes, physical / nodes);

    // Step 1: whole groups onto nodes; experts renumbered node by node ("mlog").
    let group_load: Vec<f32> = weights
        .chunks_exact(group_size)
        .map(|g| g.iter().sum())
        .collect();
    let (group_pack, group_rank) = balanced_packing(&group_load, nodes)?;
    let log2mlog: Vec<usize> = (0..logical)
        .map(|e| {
            let g = e / group_size;
            (group_pack[g] * groups_per_node + group_rank[g]) * group_size + e % group_size
        })
        .collect();
    let mlog2log = inverse(&log2mlog);

    let mut phy2log = vec![0u32; physical];
    let mut replica_rank = vec![0u32; physical];
    let mut mlog_copies = vec![0u32; logical];
    for node in 0..nodes {
        // Step 2: copies within the node.
        let mlog = node * log_per_node..(node + 1) * log_per_node;
        let load: Vec<f32> = mlog.clone().map(|m| weights[mlog2log[m]]).collect();
        let (phy2mlog, phy_rank, copies) = replicate_experts(&load, phy_per_node)?;
        mlog_copies[mlog].copy_from_slice(&copies);
        // Step 3: the node's physical experts onto its devices.
        let phy_load: Vec<f32> = phy2mlog
            .iter()
            .map(|&m| load[m as usize] / copies[m as usize] as f32)
            .collect();
        let (pack, rank) = balanced_packing(&phy_load, devices / nodes)?;
        let phy2pphy: Vec<usize> = (0..phy_per_node)
            .map(|p| pack[p] * per_device + rank[p])
            .collect();
        for (q, &p) in inverse(&phy2pphy).iter().enumerate() {
            let slot = node * phy_per_node + q;
            phy2log[slot] = mlog2log[node * log_per_node + phy2mlog[p] as usize] as u32;
            replica_rank[slot] = phy_rank[p];
        }
    }
    let copies = (0..logical).map(|e| mlog_copies[log2mlog[e]]).collect();
    Ok(Replicated {
        phy2log,
        replica_rank,
        copies,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The heaviest item first, each into the lightest pack with room.
    #[test]
    fn hand_checked_packing_and_replication() {
        let (pack, rank) = balanced_packing(&[5.0, 1.0, 4.0, 2.0], 2).unwrap();
        // 5 -> pack 0; 4 -> pack 1; 2 -> pack 1 (4 < 5); 1 -> pack 0.
        assert_eq!(pack, vec![0, 0, 1, 1]);
        assert_eq!(rank, vec![0, 1, 0, 1]);
        // Loads 6, 3, 1 into 5 physical experts: 6 gets a copy (3 each), then the tie between
        // expert 0's 3 per copy and expert 1's 3 goes to expert 0 (the lowest index).
        let (phy2log, rank, copies) = replicate_experts(&[6.0, 3.0, 1.0], 5).unwrap();
        assert_eq!(phy2log, vec![0, 1, 2, 0, 0]);
        assert_eq!(rank, vec![0, 0, 0, 1, 2]);
        assert_eq!(copies, vec![3, 1, 1]);
        assert!(balanced_packing(&[1.0; 3], 2).is_err());
        assert!(replicate_experts(&[1.0; 3], 2).is_err());
    }

    /// The published code's answers (`scripts/make_eplb_fixtures.py`), case for case and layer
    /// for layer: both policies, skewed loads, equal loads among them. The copies of each
    /// expert must be the same, and each device must hold the same per-copy loads. The
    /// physical order itself is compared only where no equal loads meet: the published code
    /// sorts with torch's unstable sort, which orders equal loads in no defined way (seen:
    /// indices 1, 23, 21, 18, 16 for five equal values), so there either order is EPLB's.
    #[test]
    fn matches_the_published_eplb() {
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../../../../tests/fixtures/eplb/cases.json"))
                .unwrap();
        let cases = doc["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 8);
        let n = |c: &serde_json::Value, k: &str| c[k].as_u64().unwrap() as usize;
        let rows = |v: &serde_json::Value| -> Vec<Vec<u64>> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    r.as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_u64().unwrap())
                        .collect()
                })
                .collect()
        };
        let mut policies = (0, 0);
        let (mut exact, mut layers) = (0, 0);
        for (i, c) in cases.iter().enumerate() {
            let shape = EplbShape {
                physical: n(c, "physical"),
                groups: n(c, "groups"),
                nodes: n(c, "nodes"),
                devices: n(c, "gpus"),
            };
            assert_eq!(shape.hierarchical(), c["hierarchical"].as_bool().unwrap());
            if shape.hierarchical() {
                policies.0 += 1;
            } else {
                policies.1 += 1;
            }
            let (phy2log, counts) = (rows(&c["phy2log"]), rows(&c["logcnt"]));
            for (l, load) in rows(&c["loads"]).iter().enumerate() {
                let w: Vec<f32> = load.iter().map(|&x| x as f32).collect();
                let got = rebalance(&w, shape).unwrap();
                let got_phy: Vec<u64> = got.phy2log.iter().map(|&x| x as u64).collect();
                let got_cnt: Vec<u64> = got.copies.iter().map(|&x| x as u64).collect();
                assert_eq!(got_cnt, counts[l], "case {i} layer {l}");
                // Each device's per-copy loads, in f32 bits, sorted.
                let per_device = |phy: &[u64]| -> Vec<Vec<u32>> {
                    phy.chunks(shape.physical / shape.devices)
                        .map(|slots| {
                            let mut v: Vec<u32> = slots
                                .iter()
                                .map(|&e| (w[e as usize] / counts[l][e as usize] as f32).to_bits())
                                .collect();
                            v.sort_unstable();
                            v
                        })
                        .collect()
                };
                assert_eq!(
                    per_device(&got_phy),
                    per_device(&phy2log[l]),
                    "case {i} layer {l} ({shape:?})"
                );
                exact += usize::from(got_phy == phy2log[l]);
                layers += 1;
            }
        }
        assert!(policies.0 > 0 && policies.1 > 0, "{policies:?}");
        // Copies of one expert carry equal loads, so most layers meet ties; 7 of the 24 match
        // slot for slot.
        assert!(exact >= 7, "{exact} of {layers} layers slot for slot");
    }

    /// Every expert keeps a copy, every device holds P / D, and the copy counts add up.
    #[test]
    fn every_expert_is_placed_and_devices_fill_evenly() {
        let loads: Vec<f32> = (0..16).map(|e| ((e * 7) % 11 + 1) as f32).collect();
        for shape in [
            EplbShape {
                physical: 20,
                groups: 4,
                nodes: 2,
                devices: 4,
            },
            EplbShape {
                physical: 24,
                groups: 4,
                nodes: 3,
                devices: 6,
            },
        ] {
            let r = rebalance(&loads, shape).unwrap();
            assert_eq!(r.phy2log.len(), shape.physical);
            assert_eq!(r.copies.iter().sum::<u32>() as usize, shape.physical);
            for e in 0..16u32 {
                let n = r.phy2log.iter().filter(|&&x| x == e).count() as u32;
                assert_eq!(n, r.copies[e as usize], "{shape:?} expert {e}");
            }
        }
        let bad = EplbShape {
            physical: 21,
            groups: 4,
            nodes: 2,
            devices: 4,
        };
        assert!(rebalance(&loads, bad).is_err());
    }
}
