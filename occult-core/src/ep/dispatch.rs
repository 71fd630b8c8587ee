//! Dispatch plans: pure index maps from one rank's routing decision and a placement to the rows
//! it sends, what each row carries, and how returned rows go back into token order.
//!
//! - **standard** mode: one row per (token, expert) pair; each row carries one expert slot and
//!   comes back unweighted: the source applies the gate weight after combine (as Megatron's
//!   token dispatcher does), so no weights travel.
//! - **occult** mode: one row per (token, device) pair; each row carries the token's experts on
//!   that device (up to `slots_per_row`) and the token's k gate weights, and the device sums the
//!   gate-weighted expert outputs before sending one row back (the pre-reduction).
//!
//! - **two-level** mode: the first leg ([`NodePlan`]) sends one row per (token, node) to the
//!   node's proxy ([`crate::analysis::cost::cluster::Cluster::proxy`]), carrying the token's expert
//!   ids there; the proxy forwards each row inside its node ([`SendPlan::forwarded`]) as an
//!   occult-mode row, one per device that needs it.
//!
//! Rows are grouped by destination rank (ascending) and, inside a group, in token order, so
//! a send buffer is one `index_select` of the token rows and one contiguous block per peer.
//! The row counts are those of [`crate::analysis::collab`] (the plan is built with its
//! [`DeviceCounter`]), which tests hold together.

use crate::analysis::collab::DeviceCounter;
use crate::analysis::cost::cluster::Cluster;
use crate::analysis::placement::experts_by_device;
use crate::analysis::placement::replicas::{CopyRule, ReplicaMap};
use crate::analysis::run_key::DispatchMode;
use crate::{bail, Result};

/// Marks an unused slot in `row_slots`.
pub const NO_SLOT: u32 = u32::MAX;

/// Where each expert lives: its rank and its slot among the rank's local experts (ascending
/// expert id), derived from a placement map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLocations {
    pub num_ranks: usize,
    /// `rank_of[e]`, `slot_of[e]` for each global expert e.
    pub rank_of: Vec<u32>,
    pub slot_of: Vec<u32>,
    /// `experts_of[r][slot]` = global expert id.
    pub experts_of: Vec<Vec<u32>>,
}

impl ExpertLocations {
    /// From a validated expert -> device map.
    pub fn new(device_of_expert: &[u32], num_ranks: usize) -> Self {
        let experts_of = experts_by_device(device_of_expert, num_ranks);
        let mut slot_of = vec![0u32; device_of_expert.len()];
        for list in &experts_of {
            for (s, &e) in list.iter().enumerate() {
                slot_of[e as usize] = s as u32;
            }
        }
        ExpertLocations {
            num_ranks,
            rank_of: device_of_expert.to_vec(),
            slot_of,
            experts_of,
        }
    }

    /// From a placement with replicas: `experts_of[r]` lists rank r's slots (an expert may
    /// appear on several ranks, or twice on one); `rank_of` and `slot_of` name each expert's
    /// first copy (the plans under replicas choose copies with [`SendPlan::replicated`]).
    pub fn replicated(map: &ReplicaMap) -> Self {
        let experts_of: Vec<Vec<u32>> = (0..map.num_devices)
            .map(|d| map.device_slots(d).to_vec())
            .collect();
        let (mut rank_of, mut slot_of) = (vec![0u32; map.num_experts], vec![0u32; map.num_experts]);
        for e in 0..map.num_experts as u32 {
            let d = map.devices_of(e)[0];
            rank_of[e as usize] = d;
            slot_of[e as usize] = map.local_slot(d, e).expect("a device of the expert");
        }
        ExpertLocations {
            num_ranks: map.num_devices,
            rank_of,
            slot_of,
            experts_of,
        }
    }

    /// The most experts any rank holds.
    pub fn max_local(&self) -> usize {
        self.experts_of.iter().map(Vec::len).max().unwrap_or(0)
    }
}

/// A row before layout: its token and the (slot, k position) of each expert it carries.
type PlannedRow = (u32, Vec<(u32, u32)>);

/// The rows one rank sends in one dispatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendPlan {
    pub mode: DispatchMode,
    pub top_k: usize,
    /// Width of the per-row slot lists: 1 in standard mode, `min(k, max local experts)` in
    /// occult mode.
    pub slots_per_row: usize,
    /// Local token index of each row, in send order.
    pub row_token: Vec<u32>,
    /// Rows for each destination rank; rows of rank r follow those of rank r - 1.
    pub send_counts: Vec<usize>,
    /// `[rows, slots_per_row]`: the destination's local expert slot of each carried expert,
    /// or [`NO_SLOT`].
    pub row_slots: Vec<u32>,
    /// `[rows, slots_per_row]`: the position of each carried expert in the token's top-k
    /// (where its gate weight is), or [`NO_SLOT`].
    pub row_kpos: Vec<u32>,
}

impl SendPlan {
    /// Plans the dispatch of `tokens = ids.len() / k` tokens (standard or occult mode; a
    /// two-level dispatch starts with a [`NodePlan`]).
    pub fn new(ids: &[u32], k: usize, loc: &ExpertLocations, mode: DispatchMode) -> Result<Self> {
        check_routing(ids, k, loc.rank_of.len())?;
        let slots_per_row = match mode {
            DispatchMode::Standard => 1,
            DispatchMode::Occult => k.min(loc.max_local()),
            DispatchMode::TwoLevel => bail!("a two-level dispatch starts with a NodePlan"),
        };
        // Rows gathered per destination rank, then concatenated.
        let mut per_rank: Vec<Vec<PlannedRow>> = vec![Vec::new(); loc.num_ranks];
        let mut counter = DeviceCounter::new(loc.num_ranks);
        for (token, chosen) in ids.chunks_exact(k).enumerate() {
            let token = token as u32;
            // (slot on the destination, kpos) of each expert of the token.
            let carried = |kpos: usize, expert: u32| (loc.slot_of[expert as usize], kpos as u32);
            if mode == DispatchMode::Standard {
                for (kpos, &expert) in chosen.iter().enumerate() {
                    let rank = loc.rank_of[expert as usize] as usize;
                    per_rank[rank].push((token, vec![carried(kpos, expert)]));
                }
                continue;
            }
            counter.load(chosen, &loc.rank_of);
            for &rank in counter.devices() {
                let on_rank: Vec<(u32, u32)> = chosen
                    .iter()
                    .enumerate()
                    .filter(|(_, &expert)| loc.rank_of[expert as usize] == rank)
                    .map(|(kpos, &expert)| carried(kpos, expert))
                    .collect();
                per_rank[rank as usize].push((token, on_rank));
            }
        }
        Ok(Self::lay_out(mode, k, slots_per_row, per_rank))
    }

    /// The rows under a placement with replicas: each of a token's experts is served on the
    /// device the copy `rule` picks for a token on rank `me` (the rule the analysis counts
    /// with, [`ReplicaMap::choose`]), carrying the local slot of that copy there. Occult mode:
    /// one row per (token, device), with the k positions; standard mode: one row per (token,
    /// expert).
    pub fn replicated(
        ids: &[u32],
        k: usize,
        map: &ReplicaMap,
        rule: CopyRule,
        me: u32,
        mode: DispatchMode,
    ) -> Result<Self> {
        check_routing(ids, k, map.num_experts)?;
        if me as usize >= map.num_devices {
            bail!("rank {me} of {} devices", map.num_devices);
        }
        let slots_per_row = match mode {
            DispatchMode::Standard => 1,
            DispatchMode::Occult => k.min(map.slots_per_device()),
            DispatchMode::TwoLevel => bail!(
                "two-level dispatch does not run placements with replicas yet: use --mode \
                 occult or standard"
            ),
        };
        let mut per_rank: Vec<Vec<PlannedRow>> = vec![Vec::new(); map.num_devices];
        let mut devices = Vec::with_capacity(k);
        for (token, chosen) in ids.chunks_exact(k).enumerate() {
            map.choose(chosen, me, rule, &mut devices);
            // (device, slot there, k position) of each expert.
            let mut order: Vec<(u32, u32, u32)> = chosen
                .iter()
                .zip(&devices)
                .enumerate()
                .map(|(kpos, (&e, &d))| {
                    let slot = map
                        .local_slot(d, e)
                        .expect("the rule picks a device with a copy");
                    (d, slot, kpos as u32)
                })
                .collect();
            if mode == DispatchMode::Standard {
                for (d, slot, kpos) in order {
                    per_rank[d as usize].push((token as u32, vec![(slot, kpos)]));
                }
                continue;
            }
            order.sort_by_key(|&(d, _, kpos)| (d, kpos));
            for group in order.chunk_by(|a, b| a.0 == b.0) {
                let carried = group.iter().map(|&(_, slot, kpos)| (slot, kpos)).collect();
                per_rank[group[0].0 as usize].push((token as u32, carried));
            }
        }
        Ok(Self::lay_out(mode, k, slots_per_row, per_rank))
    }

    /// The proxy's leg of a two-level dispatch: each row received across nodes (`row_ids`,
    /// `[rows, k]`: the token's experts in this node at their k positions, [`NO_SLOT`]
    /// elsewhere, as [`NodePlan`] sent them) forwarded as an occult-mode row to each device of
    /// `node` that holds some of them. `row_token` then names the received row.
    pub fn forwarded(
        row_ids: &[u32],
        k: usize,
        loc: &ExpertLocations,
        cluster: &Cluster,
        node: usize,
    ) -> Result<Self> {
        if k == 0 || !row_ids.len().is_multiple_of(k) {
            bail!(
                "{} received expert ids are not whole rows of top-{k} routing",
                row_ids.len()
            );
        }
        let num_experts = loc.rank_of.len();
        let slots_per_row = k.min(loc.max_local());
        let mut per_rank: Vec<Vec<PlannedRow>> = vec![Vec::new(); loc.num_ranks];
        for (row, ids) in row_ids.chunks_exact(k).enumerate() {
            let mut here: Vec<(u32, u32, u32)> = Vec::with_capacity(k);
            for (kpos, &expert) in ids.iter().enumerate() {
                if expert == NO_SLOT {
                    continue;
                }
                if expert as usize >= num_experts {
                    bail!("received row {row}: expert id {expert} is out of range for {num_experts} experts");
                }
                let rank = loc.rank_of[expert as usize];
                if cluster.node(rank as usize) != node {
                    bail!("received row {row}: expert {expert} is on device {rank}, not in node {node}");
                }
                if here.iter().any(|&(_, e, _)| e == expert) {
                    bail!("received row {row}: expert {expert} is carried twice");
                }
                here.push((rank, expert, kpos as u32));
            }
            if here.is_empty() {
                bail!("received row {row} carries no expert of node {node}");
            }
            // Devices ascending; experts in k order within each.
            here.sort_by_key(|&(rank, _, kpos)| (rank, kpos));
            for group in here.chunk_by(|a, b| a.0 == b.0) {
                let carried = group
                    .iter()
                    .map(|&(_, e, kpos)| (loc.slot_of[e as usize], kpos))
                    .collect();
                per_rank[group[0].0 as usize].push((row as u32, carried));
            }
        }
        Ok(Self::lay_out(
            DispatchMode::Occult,
            k,
            slots_per_row,
            per_rank,
        ))
    }

    /// The plan of rows gathered per destination rank, concatenated in rank order.
    fn lay_out(
        mode: DispatchMode,
        k: usize,
        slots_per_row: usize,
        per_rank: Vec<Vec<PlannedRow>>,
    ) -> Self {
        let rows: usize = per_rank.iter().map(Vec::len).sum();
        let mut plan = SendPlan {
            mode,
            top_k: k,
            slots_per_row,
            row_token: Vec::with_capacity(rows),
            send_counts: per_rank.iter().map(Vec::len).collect(),
            row_slots: vec![NO_SLOT; rows * slots_per_row],
            row_kpos: vec![NO_SLOT; rows * slots_per_row],
        };
        for (row, (token, carried)) in per_rank.into_iter().flatten().enumerate() {
            plan.row_token.push(token);
            for (j, (slot, kpos)) in carried.into_iter().enumerate() {
                plan.row_slots[row * slots_per_row + j] = slot;
                plan.row_kpos[row * slots_per_row + j] = kpos;
            }
        }
        plan
    }

    pub fn rows(&self) -> usize {
        self.row_token.len()
    }

    /// Rows sent to other ranks (those that cross a link) when this rank is `me`.
    pub fn remote_rows(&self, me: usize) -> usize {
        self.rows() - self.send_counts[me]
    }

    /// The metadata each row carries to its destination, `[rows, width]`: the local expert
    /// slots, then (occult mode) the k positions of their gate weights.
    pub fn metadata(&self) -> (Vec<u32>, usize) {
        let width = self.slots_per_row;
        match self.mode {
            DispatchMode::Standard => (self.row_slots.clone(), width),
            DispatchMode::Occult | DispatchMode::TwoLevel => {
                let mut meta = Vec::with_capacity(self.rows() * 2 * width);
                for (slots, kpos) in self
                    .row_slots
                    .chunks_exact(width)
                    .zip(self.row_kpos.chunks_exact(width))
                {
                    meta.extend_from_slice(slots);
                    meta.extend_from_slice(kpos);
                }
                (meta, 2 * width)
            }
        }
    }

    /// Flat indices into the `[tokens, k]` gate weights for each (row, slot), with `None` for
    /// empty slots.
    pub fn weight_index(&self) -> Vec<Option<u32>> {
        let k = self.top_k as u32;
        self.row_token
            .iter()
            .zip(self.row_kpos.chunks_exact(self.slots_per_row))
            .flat_map(|(&token, kpos)| {
                kpos.iter()
                    .map(move |&p| (p != NO_SLOT).then(|| token * k + p))
            })
            .collect()
    }
}

/// Checks one rank's routing: whole rows of k ids, each in range, none twice in a row.
fn check_routing(ids: &[u32], k: usize, num_experts: usize) -> Result<()> {
    if k == 0 || !ids.len().is_multiple_of(k) {
        bail!(
            "routing of {} ids is not a whole number of top-{k} rows",
            ids.len()
        );
    }
    if num_experts == 0 {
        bail!("no experts to dispatch to");
    }
    // The last token that chose each expert, to catch an expert chosen twice.
    let mut last_token = vec![u32::MAX; num_experts];
    for (token, chosen) in ids.chunks_exact(k).enumerate() {
        let token = token as u32;
        for &expert in chosen {
            if expert as usize >= num_experts {
                bail!(
                    "token {token}: expert id {expert} is out of range for {num_experts} experts"
                );
            }
            if last_token[expert as usize] == token {
                bail!("token {token}: expert {expert} is chosen twice");
            }
            last_token[expert as usize] = token;
        }
    }
    Ok(())
}

/// The first leg of a two-level dispatch from rank `me`: one row per (token, node its experts
/// are in), nodes ascending, to the node's proxy (the device with `me`'s local index there; the
/// row to `me`'s own node goes to `me` itself and crosses no link). Each row carries the
/// token's expert ids in that node at their k positions ([`NO_SLOT`] elsewhere); its hidden
/// state and k gate weights travel as the tensor row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePlan {
    pub top_k: usize,
    /// Local token index of each row, in send order (grouped by destination rank).
    pub row_token: Vec<u32>,
    /// Rows for each destination rank.
    pub send_counts: Vec<usize>,
    /// `[rows, top_k]`: the expert ids each row carries.
    pub row_ids: Vec<u32>,
}

impl NodePlan {
    pub fn new(
        ids: &[u32],
        k: usize,
        loc: &ExpertLocations,
        cluster: &Cluster,
        me: usize,
    ) -> Result<Self> {
        check_routing(ids, k, loc.rank_of.len())?;
        if cluster.devices != loc.num_ranks || me >= loc.num_ranks {
            bail!(
                "a cluster of {} devices for {} ranks (this is rank {me})",
                cluster.devices,
                loc.num_ranks
            );
        }
        let mut per_rank: Vec<Vec<(u32, Vec<u32>)>> = vec![Vec::new(); loc.num_ranks];
        let mut nodes: Vec<usize> = Vec::with_capacity(k);
        for (token, chosen) in ids.chunks_exact(k).enumerate() {
            nodes.clear();
            nodes.extend(
                chosen
                    .iter()
                    .map(|&e| cluster.node(loc.rank_of[e as usize] as usize)),
            );
            nodes.sort_unstable();
            nodes.dedup();
            for &node in &nodes {
                let carried = chosen
                    .iter()
                    .map(|&e| {
                        let here = cluster.node(loc.rank_of[e as usize] as usize) == node;
                        if here {
                            e
                        } else {
                            NO_SLOT
                        }
                    })
                    .collect();
                per_rank[cluster.proxy(me, node)].push((token as u32, carried));
            }
        }
        let send_counts = per_rank.iter().map(Vec::len).collect();
        let mut row_token = Vec::new();
        let mut row_ids = Vec::new();
        for (token, carried) in per_rank.into_iter().flatten() {
            row_token.push(token);
            row_ids.extend(carried);
        }
        Ok(NodePlan {
            top_k: k,
            row_token,
            send_counts,
            row_ids,
        })
    }

    pub fn rows(&self) -> usize {
        self.row_token.len()
    }
}

/// The expert work of the received rows, grouped by local expert: for expert slot `s`, pairs
/// `offsets[s]..offsets[s + 1]` name the received row (`pair_row`) and, when rows carry gate
/// weights, the flat index `row * k + kpos` of the pair's weight in the received `[rows, k]`
/// weight block (`pair_weight`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComputePlan {
    pub num_local: usize,
    pub offsets: Vec<usize>,
    pub pair_row: Vec<u32>,
    pub pair_weight: Vec<u32>,
}

impl ComputePlan {
    /// Groups received rows by local expert. `meta` is what [`SendPlan::metadata`] sent:
    /// `[rows, slots_per_row]` slots, followed in each row (when `top_k` is given: occult mode)
    /// by the slots' k positions, whose weights are then read from a `[rows, top_k]` block.
    pub fn new(
        meta: &[u32],
        slots_per_row: usize,
        top_k: Option<usize>,
        num_local: usize,
    ) -> Result<Self> {
        let width = if top_k.is_some() {
            2 * slots_per_row
        } else {
            slots_per_row
        };
        if width == 0 || !meta.len().is_multiple_of(width) {
            bail!(
                "received metadata of {} values is not whole rows of {width}",
                meta.len()
            );
        }
        let rows = meta.len() / width;
        // Entry j of row r's metadata.
        let entry = |row: usize, j: usize| meta[row * width + j];
        // Pairs per slot, shifted by one, then summed into each slot's first pair.
        let mut counts = vec![0usize; num_local + 1];
        for row in 0..rows {
            for j in 0..slots_per_row {
                let slot = entry(row, j);
                if slot == NO_SLOT {
                    continue;
                }
                if slot as usize >= num_local {
                    bail!("received expert slot {slot}, but this rank holds {num_local} experts");
                }
                counts[slot as usize + 1] += 1;
            }
        }
        for slot in 0..num_local {
            counts[slot + 1] += counts[slot];
        }
        let offsets = counts.clone();
        let pairs = counts[num_local];
        let mut next = counts;
        let mut pair_row = vec![0u32; pairs];
        let mut pair_weight = vec![0u32; pairs];
        for row in 0..rows {
            for j in 0..slots_per_row {
                let slot = entry(row, j);
                if slot == NO_SLOT {
                    continue;
                }
                let at = next[slot as usize];
                next[slot as usize] += 1;
                pair_row[at] = row as u32;
                if let Some(k) = top_k {
                    let kpos = entry(row, slots_per_row + j);
                    if kpos as usize >= k {
                        bail!("received k position {kpos} for top-{k} routing");
                    }
                    pair_weight[at] = u32::try_from(row * k + kpos as usize).map_err(|_| {
                        crate::Error::invalid(format!(
                            "{rows} received rows x top-{k} overflow u32"
                        ))
                    })?;
                }
            }
        }
        Ok(ComputePlan {
            num_local,
            offsets,
            pair_row,
            pair_weight,
        })
    }

    pub fn pairs(&self) -> usize {
        self.pair_row.len()
    }

    /// Pairs of the local expert in `slot`.
    pub fn range(&self, slot: usize) -> std::ops::Range<usize> {
        self.offsets[slot]..self.offsets[slot + 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_checked_plans() {
        // 4 experts on 2 ranks: {0, 1} -> rank 0, {2, 3} -> rank 1. k = 2.
        let loc = ExpertLocations::new(&[0, 0, 1, 1], 2);
        assert_eq!(loc.slot_of, vec![0, 1, 0, 1]);
        let ids = [1, 0, /**/ 3, 0, /**/ 2, 3];
        let occ = SendPlan::new(&ids, 2, &loc, DispatchMode::Occult).unwrap();
        // Rank 0 gets token 0 (slots 1, 0) and token 1 (slot 0); rank 1 gets token 1 (slot 1)
        // and token 2 (slots 0, 1).
        assert_eq!(occ.send_counts, vec![2, 2]);
        assert_eq!(occ.row_token, vec![0, 1, 1, 2]);
        assert_eq!(occ.slots_per_row, 2);
        assert_eq!(occ.row_slots, vec![1, 0, 0, NO_SLOT, 1, NO_SLOT, 0, 1]);
        assert_eq!(occ.row_kpos, vec![0, 1, 1, NO_SLOT, 0, NO_SLOT, 0, 1]);
        assert_eq!(
            occ.weight_index(),
            vec![
                Some(0),
                Some(1),
                Some(3),
                None,
                Some(2),
                None,
                Some(4),
                Some(5)
            ]
        );
        let std = SendPlan::new(&ids, 2, &loc, DispatchMode::Standard).unwrap();
        assert_eq!(std.send_counts, vec![3, 3]);
        assert_eq!(std.row_token, vec![0, 0, 1, 1, 2, 2]);
        assert_eq!(std.row_slots, vec![1, 0, 0, 1, 0, 1]);

        // Rank 0 receives rank 0's first two rows: token 0 (slots 1, 0 at k positions 0, 1) and
        // token 1 (slot 0 at k position 1).
        let (meta, width) = occ.metadata();
        assert_eq!(width, 4);
        assert_eq!(&meta[..8], &[1, 0, 0, 1, 0, NO_SLOT, 1, NO_SLOT]);
        let cp = ComputePlan::new(&meta[..8], 2, Some(2), 2).unwrap();
        // Expert slot 0: row 0 (weight 0 * 2 + 1), row 1 (1 * 2 + 1); slot 1: row 0 (0).
        assert_eq!(cp.offsets, vec![0, 2, 3]);
        assert_eq!(cp.pair_row, vec![0, 1, 0]);
        assert_eq!(cp.pair_weight, vec![1, 3, 0]);
        // Standard rows carry one slot and no weights.
        let (meta, width) = std.metadata();
        assert_eq!(width, 1);
        let cp = ComputePlan::new(&meta[..3], 1, None, 2).unwrap();
        assert_eq!(cp.offsets, vec![0, 2, 3]);
        assert_eq!(cp.pair_row, vec![1, 2, 0]);
    }

    /// Two nodes of 2 ranks, one expert per rank (expert e on rank e), k = 2, from rank 1.
    #[test]
    fn hand_checked_two_level_plans() {
        let loc = ExpertLocations::new(&[0, 1, 2, 3], 4);
        let cluster = Cluster {
            devices: 4,
            per_node: 2,
        };
        // Token 0 on experts 3 and 2 (node 1 only); token 1 on 0 and 3 (both nodes).
        let ids = [3, 2, /**/ 0, 3];
        let p = NodePlan::new(&ids, 2, &loc, &cluster, 1).unwrap();
        // Node 0's rows go to rank 1 itself; node 1's to its proxy, rank 3 (local index 1).
        assert_eq!(p.send_counts, vec![0, 1, 0, 2]);
        assert_eq!(p.row_token, vec![1, 0, 1]);
        assert_eq!(p.row_ids, vec![0, NO_SLOT, /**/ 3, 2, /**/ NO_SLOT, 3]);
        // Rank 3 forwards what it received (node 1): token 0 to ranks 2 and 3, token 1 to 3.
        let f = SendPlan::forwarded(&p.row_ids[2..], 2, &loc, &cluster, 1).unwrap();
        assert_eq!(f.send_counts, vec![0, 0, 1, 2]);
        assert_eq!(f.row_token, vec![0, 0, 1]);
        // One expert per rank: one slot per row, each with its gate weight's k position.
        assert_eq!(f.slots_per_row, 1);
        assert_eq!(f.row_slots, vec![0, 0, 0]);
        assert_eq!(f.row_kpos, vec![1, 0, 1]);
        // Received ids of another node, twice, out of range, or none are refused.
        for bad in [[0, NO_SLOT], [3, 3], [9, NO_SLOT], [NO_SLOT, NO_SLOT]] {
            assert!(
                SendPlan::forwarded(&bad, 2, &loc, &cluster, 1).is_err(),
                "{bad:?}"
            );
        }
        // The flat plan refuses two-level mode (it starts with a NodePlan).
        assert!(SendPlan::new(&ids, 2, &loc, DispatchMode::TwoLevel).is_err());
    }

    /// Under replicas, on random maps and tokens under both rules: the rows to each rank are
    /// the tokens whose chosen devices include it (counted from the rule's choice, token by
    /// token), each carried slot on its destination holds the expert at its k position, and
    /// the rows are the analysis's sum of C_T.
    #[test]
    fn replicated_plans_send_each_expert_to_its_chosen_copy() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for _ in 0..100 {
            let (e, d) = (16usize, [2usize, 4][rng.random_range(0..2)]);
            let per = e / d + 2;
            let map = crate::test_util::random_replica_map(&mut rng, e, d, per);
            let k = rng.random_range(1..=4);
            let tokens = rng.random_range(0..20);
            let ids: Vec<u32> = (0..tokens)
                .flat_map(|_| {
                    let mut all: Vec<u32> = (0..e as u32).collect();
                    for i in 0..k {
                        let j = rng.random_range(i..e);
                        all.swap(i, j);
                    }
                    all.truncate(k);
                    all
                })
                .collect();
            let me = rng.random_range(0..d as u32);
            for rule in [CopyRule::Cover, CopyRule::Sglang] {
                // Per destination: rows (token, device) and pairs (token, expert) of the rule's
                // choice, counted token by token.
                let (mut want_rows, mut want_pairs) = (vec![0usize; d], vec![0usize; d]);
                let mut chosen = Vec::new();
                for t in ids.chunks_exact(k) {
                    map.choose(t, me, rule, &mut chosen);
                    chosen.iter().for_each(|&x| want_pairs[x as usize] += 1);
                    let mut devs = chosen.clone();
                    devs.sort_unstable();
                    devs.dedup();
                    devs.iter().for_each(|&x| want_rows[x as usize] += 1);
                }
                for (mode, want) in [
                    (DispatchMode::Occult, &want_rows),
                    (DispatchMode::Standard, &want_pairs),
                ] {
                    let plan = SendPlan::replicated(&ids, k, &map, rule, me, mode).unwrap();
                    assert_eq!(&plan.send_counts, want, "{rule:?} {mode:?}");
                    // Every (token, k position) is carried once, to a slot holding its expert.
                    let mut carried = vec![0usize; ids.len()];
                    let mut row = 0;
                    for (dest, &n) in plan.send_counts.iter().enumerate() {
                        for _ in 0..n {
                            let w = plan.slots_per_row;
                            for j in 0..w {
                                let (slot, kpos) =
                                    (plan.row_slots[row * w + j], plan.row_kpos[row * w + j]);
                                if slot == NO_SLOT {
                                    continue;
                                }
                                let token = plan.row_token[row] as usize;
                                let expert = ids[token * k + kpos as usize];
                                assert_eq!(map.slot_expert[dest * per + slot as usize], expert);
                                carried[token * k + kpos as usize] += 1;
                            }
                            row += 1;
                        }
                    }
                    assert!(carried.iter().all(|&c| c == 1), "{rule:?} {mode:?}");
                }
                let sources = vec![me; tokens];
                let st = map.stats(&ids, k, &sources, rule, None).unwrap();
                assert_eq!(want_rows.iter().sum::<usize>() as f64, st.devices_touched);
            }
            assert!(SendPlan::replicated(
                &ids,
                k,
                &map,
                CopyRule::Cover,
                me,
                DispatchMode::TwoLevel
            )
            .is_err());
        }
    }

    #[test]
    fn bad_routing_is_rejected() {
        let loc = ExpertLocations::new(&[0, 0, 1, 1], 2);
        assert!(SendPlan::new(&[0, 0], 2, &loc, DispatchMode::Occult).is_err());
        assert!(SendPlan::new(&[0, 7], 2, &loc, DispatchMode::Standard).is_err());
        assert!(SendPlan::new(&[0, 1, 2], 2, &loc, DispatchMode::Standard).is_err());
        assert!(ComputePlan::new(&[5], 1, None, 2).is_err());
        assert!(ComputePlan::new(&[0, 9], 1, Some(2), 2).is_err());
        assert!(ComputePlan::new(&[0, 1, 0], 1, Some(2), 2).is_err());
    }

    #[test]
    fn zero_tokens_plan_nothing() {
        let loc = ExpertLocations::new(&[0, 1], 2);
        let p = SendPlan::new(&[], 1, &loc, DispatchMode::Occult).unwrap();
        assert_eq!(p.send_counts, vec![0, 0]);
        assert_eq!(p.rows(), 0);
    }
}
