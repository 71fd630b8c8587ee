//! Placement that keeps a model's expert groups whole. DeepSeek-V2/V3 (and Kimi-K2, GLM-4.5)
//! route group-limited: `n_group` groups of consecutive expert ids, and each token's experts
//! come from its best `topk_group` groups. A map that keeps every group whole bounds the devices
//! and nodes a token reaches by construction, and is the only kind a renumbered checkpoint can
//! carry for such a model (the renumbered ids must keep each group in one run). Two layouts:
//!
//! - **groups fill devices** (D a multiple of G): group g owns a block of D / G devices, and
//!   its experts are placed within the block by the search with experts kept in their block
//!   ([`super::search_within_groups`]). With blocks inside nodes, a token reaches at most
//!   `topk_group` blocks, so at most `topk_group` nodes.
//! - **devices hold groups** (G a multiple of D): every device holds G / D whole groups, so a
//!   token reaches at most `topk_group` devices.
//!
//! Which group takes which block or device is searched too (pairwise swaps of groups while
//! `w * sum C_N + sum C_T` over the trace falls, C_T counted by block where blocks are split
//! later); it matters only where the groups are not all alike: nodes, or several groups on a
//! device.

use super::config::{NodeLevel, SearchConfig};
use super::search::{search_within_groups, SearchOutcome};
use crate::analysis::collab::CoActivation;
use crate::{bail, Result};

/// How the groups sit on the devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupLayout {
    /// Each group owns `devices / groups` devices.
    GroupsFillDevices,
    /// Each device holds `groups / devices` groups.
    DevicesHoldGroups,
}

impl GroupLayout {
    pub fn name(self) -> &'static str {
        match self {
            GroupLayout::GroupsFillDevices => "each group fills whole devices",
            GroupLayout::DevicesHoldGroups => "each device holds whole groups",
        }
    }
}

/// A group-whole placement of one layer: the map, its layout, and the search's outcome where
/// experts were placed within blocks.
pub struct GroupPlacement {
    pub map: Vec<u32>,
    pub layout: GroupLayout,
    pub search: Option<SearchOutcome>,
}

/// The layout `groups` of `num_experts` experts take on `num_devices` devices, or why none does.
pub fn layout_of(num_experts: usize, num_devices: usize, groups: usize) -> Result<GroupLayout> {
    if groups == 0 || !num_experts.is_multiple_of(groups) {
        bail!("{groups} expert groups do not divide the {num_experts} experts evenly");
    }
    if num_devices == 0 || !num_experts.is_multiple_of(num_devices) {
        bail!("{num_devices} devices do not divide the {num_experts} experts evenly");
    }
    if num_devices.is_multiple_of(groups) {
        Ok(GroupLayout::GroupsFillDevices)
    } else if groups.is_multiple_of(num_devices) {
        Ok(GroupLayout::DevicesHoldGroups)
    } else {
        bail!(
            "{groups} expert groups on {num_devices} devices: neither divides the other, so no \
             placement keeps every group whole with as many experts on every device"
        )
    }
}

/// Places one layer's routing `ids` (`[tokens, k]`) with every one of `groups` expert groups
/// whole, on `num_devices` devices (in nodes where `cfg.nodes` says); the search within blocks
/// follows `cfg`. Calls `on_step` as the search within blocks goes.
pub fn place_groups_whole(
    ids: &[u32],
    k: usize,
    num_experts: usize,
    num_devices: usize,
    groups: usize,
    cfg: &SearchConfig,
    on_step: &(dyn Fn() + Sync),
) -> Result<GroupPlacement> {
    let layout = layout_of(num_experts, num_devices, groups)?;
    if let Some(level) = cfg.nodes {
        level.check(num_devices)?;
    }
    let size = num_experts / groups;
    // The units groups are assigned to: blocks of devices, or devices holding several groups.
    let (units, per_unit, unit_devices) = match layout {
        GroupLayout::GroupsFillDevices => (groups, 1, num_devices / groups),
        GroupLayout::DevicesHoldGroups => (num_devices, groups / num_devices, 1),
    };
    let touched = groups_per_token(ids, k, size, groups);
    let slot = assign_groups(&touched, units, per_unit, unit_devices, cfg.nodes);
    // Group g's experts dealt over its unit's devices in order, E / D to each.
    let per_device = num_experts / num_devices;
    let mut map = vec![0u32; num_experts];
    let mut filled = vec![0usize; num_devices];
    for (g, &u) in slot.iter().enumerate() {
        let first = u * unit_devices;
        for slot in &mut map[g * size..(g + 1) * size] {
            let dev = (first..first + unit_devices)
                .find(|&d| filled[d] < per_device)
                .expect("a unit holds its groups' experts");
            filled[dev] += 1;
            *slot = dev as u32;
        }
    }
    if unit_devices == 1 {
        return Ok(GroupPlacement {
            map,
            layout,
            search: None,
        });
    }
    let co = CoActivation::from_ids(ids, k, num_experts);
    let block_of_device: Vec<u32> = (0..num_devices)
        .map(|d| (d / unit_devices) as u32)
        .collect();
    let within = SearchConfig {
        nodes: None,
        ..cfg.clone()
    };
    let out = search_within_groups(
        ids,
        k,
        &co,
        num_devices,
        &block_of_device,
        ("groups in their blocks".into(), map),
        &within,
        on_step,
    )?;
    Ok(GroupPlacement {
        map: out.map.clone(),
        layout,
        search: Some(out),
    })
}

/// Each token's distinct groups, ascending.
fn groups_per_token(ids: &[u32], k: usize, size: usize, groups: usize) -> Vec<Vec<u32>> {
    ids.chunks_exact(k.max(1))
        .map(|row| {
            let mut g: Vec<u32> = row
                .iter()
                .map(|&x| (x as usize / size).min(groups - 1) as u32)
                .collect();
            g.sort_unstable();
            g.dedup();
            g
        })
        .collect()
}

/// The unit each group goes to (`per_unit` groups a unit, `unit_devices` devices a unit):
/// pairwise swaps of groups on different units, first improvement, while the two-level cost
/// over the tokens' groups falls.
fn assign_groups(
    touched: &[Vec<u32>],
    units: usize,
    per_unit: usize,
    unit_devices: usize,
    nodes: Option<NodeLevel>,
) -> Vec<usize> {
    let groups = units * per_unit;
    let mut slot: Vec<usize> = (0..groups).map(|g| g / per_unit).collect();
    // Units alike: every assignment costs the same.
    let node_of_unit = |u: usize| nodes.map(|l| u * unit_devices / l.devices_per_node);
    let spans_nodes = nodes.is_some_and(|l| units * unit_devices > l.devices_per_node);
    if per_unit == 1 && !spans_nodes {
        return slot;
    }
    let w = nodes.map_or(0.0, |l| l.inter_weight);
    let cost = |slot: &[usize]| -> f64 {
        let (mut units_seen, mut nodes_seen) = (Vec::new(), Vec::new());
        touched
            .iter()
            .map(|gs| {
                units_seen.clear();
                nodes_seen.clear();
                for &g in gs {
                    let u = slot[g as usize];
                    units_seen.push(u);
                    if let Some(n) = node_of_unit(u) {
                        nodes_seen.push(n);
                    }
                }
                units_seen.sort_unstable();
                units_seen.dedup();
                nodes_seen.sort_unstable();
                nodes_seen.dedup();
                w * nodes_seen.len() as f64 + units_seen.len() as f64
            })
            .sum()
    };
    let mut best = cost(&slot);
    for _ in 0..groups * groups {
        let mut improved = false;
        for a in 0..groups {
            for b in a + 1..groups {
                if slot[a] == slot[b] {
                    continue;
                }
                slot.swap(a, b);
                let c = cost(&slot);
                if c < best - 1e-9 {
                    best = c;
                    improved = true;
                } else {
                    slot.swap(a, b);
                }
            }
        }
        if !improved {
            break;
        }
    }
    slot
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::placement::maps::contiguous;
    use crate::analysis::placement::nodes::devices_and_nodes;
    use rand::{Rng, SeedableRng};

    /// Group-limited routing: each token picks `m` of `g` groups (groups j and j + g/2 always
    /// together), then `k` experts inside them, of one parity of offset (so neither pairing is
    /// what contiguous placement gives).
    fn routing(e: usize, g: usize, m: usize, k: usize, tokens: usize) -> Vec<u32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let size = e / g;
        let mut ids = Vec::with_capacity(tokens * k);
        for _ in 0..tokens {
            let first = rng.random_range(0..g / 2);
            let mut gs = vec![first, first + g / 2];
            while gs.len() < m {
                let x = rng.random_range(0..g);
                if !gs.contains(&x) {
                    gs.push(x);
                }
            }
            let mut row = Vec::with_capacity(k);
            while row.len() < k {
                let grp = gs[rng.random_range(0..m)];
                // Within a group, experts of one parity of offset together.
                let parity = rng.random_range(0..2);
                let x = (grp * size + 2 * rng.random_range(0..size / 2) + parity) as u32;
                if !row.contains(&x) {
                    row.push(x);
                }
            }
            ids.extend(row);
        }
        ids
    }

    fn check_whole(map: &[u32], e: usize, d: usize, g: usize) {
        let size = e / g;
        for grp in 0..g {
            let devs: std::collections::BTreeSet<u32> =
                map[grp * size..(grp + 1) * size].iter().copied().collect();
            if d >= g {
                // The group's devices hold nothing else.
                for &dev in &devs {
                    assert!(map
                        .iter()
                        .enumerate()
                        .filter(|(_, &x)| x == dev)
                        .all(|(x, _)| x / size == grp));
                }
            } else {
                assert_eq!(devs.len(), 1, "group {grp} split: {devs:?}");
            }
        }
        let mut per = vec![0; d];
        map.iter().for_each(|&x| per[x as usize] += 1);
        assert!(per.iter().all(|&c| c == e / d), "{per:?}");
    }

    /// DeepSeek-V3's shape scaled down (64 experts in 8 groups, top-6 from 4 groups) on 16
    /// devices in 4 nodes: groups whole, each token within 4 nodes by construction, and
    /// E[C_T] below contiguous (which keeps groups whole too, but not the groups' partners).
    #[test]
    fn groups_fill_devices_and_bound_the_nodes() {
        let (e, g, m, k, d) = (64, 8, 4, 6, 16);
        let ids = routing(e, g, m, k, 3000);
        let level = NodeLevel {
            devices_per_node: 4,
            inter_weight: 4.0,
        };
        let cfg = SearchConfig {
            nodes: Some(level),
            ..SearchConfig::default()
        };
        let out = place_groups_whole(&ids, k, e, d, g, &cfg, &|| ()).unwrap();
        assert_eq!(out.layout, GroupLayout::GroupsFillDevices);
        check_whole(&out.map, e, d, g);
        let (ct, cn) = devices_and_nodes(&ids, k, &out.map, d, 4);
        let (ct0, cn0) = devices_and_nodes(&ids, k, &contiguous(e, d), d, 4);
        let tokens = (ids.len() / k) as u64;
        assert!(ct < ct0, "E[C_T] {ct} vs contiguous {ct0}");
        // Group partners (j, j + 4) share a node, which contiguous does not give them.
        assert!(cn < cn0, "E[C_N] {cn} vs contiguous {cn0}");
        assert!(cn < 3 * tokens, "{cn} over {tokens} tokens");
        for row in ids.chunks_exact(k) {
            let mut nodes: Vec<u32> = row.iter().map(|&x| out.map[x as usize] / 4).collect();
            nodes.sort_unstable();
            nodes.dedup();
            assert!(nodes.len() <= m);
        }
    }

    /// Fewer devices than groups: each device takes whole groups, partners paired.
    #[test]
    fn devices_hold_groups_and_pair_partners() {
        let (e, g, m, k, d) = (64, 8, 3, 6, 4);
        let ids = routing(e, g, m, k, 2000);
        let out = place_groups_whole(&ids, k, e, d, g, &SearchConfig::default(), &|| ()).unwrap();
        assert_eq!(out.layout, GroupLayout::DevicesHoldGroups);
        check_whole(&out.map, e, d, g);
        let size = e / g;
        for j in 0..g / 2 {
            assert_eq!(out.map[j * size], out.map[(j + g / 2) * size], "pair {j}");
        }
        let (ct, _) = devices_and_nodes(&ids, k, &out.map, d, d);
        let (ct0, _) = devices_and_nodes(&ids, k, &contiguous(e, d), d, d);
        assert!(ct < ct0, "{ct} vs {ct0}");
    }

    #[test]
    fn layouts_that_cannot_keep_groups_whole_are_named() {
        assert!(layout_of(64, 6, 8).is_err());
        assert!(layout_of(64, 12, 8)
            .unwrap_err()
            .to_string()
            .contains("do not divide the 64 experts"));
        assert!(layout_of(64, 16, 6)
            .unwrap_err()
            .to_string()
            .contains("6 expert groups do not divide"));
        assert!(layout_of(96, 12, 8)
            .unwrap_err()
            .to_string()
            .contains("neither divides"));
    }
}
