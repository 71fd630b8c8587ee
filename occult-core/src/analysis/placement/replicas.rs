//! Placements with replicas: E + R physical expert slots, the same number on every device, an
//! expert in one or more of them ([`ReplicaMap`]); and the rules that say which copy a token's
//! row goes to, defined once here for analysis, dispatch and export:
//!
//! - [`CopyRule::Cover`] (Occult's): cover the token's experts with as few devices as the
//!   greedy cover finds. Experts with one copy fix their devices first; then each remaining
//!   expert takes a copy on a device already chosen (the source's first, then the least
//!   loaded, then the lowest); if none is, the device that holds copies of the most remaining
//!   experts joins (ties: the source, then the least loaded, then the lowest).
//! - [`CopyRule::Sglang`] (SGLang's static dispatch, exactly as SGLang builds its table:
//!   [`super::sglang_dispatch`]): the copy on the source's GPU when there is one; otherwise a
//!   fixed copy per (source, expert), dealt by SGLang's seeded fair choice. It looks at one
//!   expert at a time, not at the token's others.
//! - [`CopyRule::Trtllm`] (TensorRT-LLM's): each copy of an expert equally likely, counted in
//!   expectation as its `report_send_ranks_per_token.py` counts (a token reaches device r with
//!   probability 1 - prod(1 - p) over r's slots), loads as the expected pairs. Where one copy
//!   must be picked (dispatch, projections), a hash of the token's experts, its source and the
//!   expert's position picks it, uniformly.
//!
//! "Least loaded" is the device's share of the placement's expected load (each copy carrying
//! its expert's load over the devices holding it), so the rule is a function of the placement
//! alone. Two copies of an expert on one device serve as one (SGLang under DeepEP never loads
//! the second); placements Occult writes never hold them ([`ReplicaMap::check_servable`]).

use super::sglang_dispatch::SglangState;
use crate::{bail, Result};
use serde::{Deserialize, Serialize};

/// Which copy of a replicated expert a token uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum CopyRule {
    /// Fewest devices for the token's experts (greedy cover).
    Cover,
    /// SGLang's static dispatch: the local copy, else a fixed copy per (source, expert).
    Sglang,
    /// TensorRT-LLM's: every copy equally likely, counted in expectation.
    Trtllm,
}

impl CopyRule {
    pub fn name(self) -> &'static str {
        match self {
            CopyRule::Cover => "cover",
            CopyRule::Sglang => "sglang",
            CopyRule::Trtllm => "trtllm",
        }
    }

    /// Every rule, in the order tables show them.
    pub const ALL: [CopyRule; 3] = [CopyRule::Cover, CopyRule::Sglang, CopyRule::Trtllm];
}

/// E + R physical slots on D devices, `slots_per_device` each: slot p is on device
/// `p / slots_per_device` and holds expert `slot_expert[p]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaMap {
    pub num_experts: usize,
    pub num_devices: usize,
    pub slot_expert: Vec<u32>,
    /// `devices_of[e]`: the devices holding a copy of e, ascending.
    devices_of: Vec<Vec<u32>>,
    /// The expert loads the map was built with (ties of the cover rule), if any.
    expert_load: Option<Vec<f64>>,
    /// Each device's expected load (each device holding an expert carries its load over the
    /// devices holding it).
    device_load: Vec<f64>,
    /// `sglang_copy[source * E + e]`: the device SGLang's static rule sends e to from `source`
    /// (built on first use as a first layer's table, unless set from a state).
    sglang_copy: std::sync::OnceLock<Vec<u32>>,
}

impl ReplicaMap {
    /// Checks and indexes a slot map; `expert_load` (per expert, e.g. token counts) orders the
    /// rule's ties between devices (all equal when `None`).
    pub fn new(
        slot_expert: Vec<u32>,
        num_experts: usize,
        num_devices: usize,
        expert_load: Option<&[f64]>,
    ) -> Result<Self> {
        if num_devices == 0
            || slot_expert.is_empty()
            || !slot_expert.len().is_multiple_of(num_devices)
        {
            bail!(
                "{} slots do not fill {num_devices} devices evenly",
                slot_expert.len()
            );
        }
        if slot_expert.len() < num_experts {
            bail!("{} slots for {num_experts} experts", slot_expert.len());
        }
        let per_device = slot_expert.len() / num_devices;
        let mut devices_of = vec![Vec::new(); num_experts];
        for (p, &e) in slot_expert.iter().enumerate() {
            let device = (p / per_device) as u32;
            let Some(list) = devices_of.get_mut(e as usize) else {
                bail!("slot {p} holds expert {e}, but there are {num_experts} experts");
            };
            // Two copies on one device (EPLB can pack them so) serve as one device.
            if !list.contains(&device) {
                list.push(device);
            }
        }
        if let Some(e) = devices_of.iter().position(Vec::is_empty) {
            bail!("expert {e} has no slot");
        }
        if let Some(l) = expert_load {
            if l.len() != num_experts || l.iter().any(|x| !x.is_finite() || *x < 0.0) {
                bail!(
                    "expert loads: {} values for {num_experts} experts, each finite and >= 0",
                    l.len()
                );
            }
        }
        // Each device holding e carries e's load over the devices holding it (copies per
        // device, not per slot).
        let mut device_load = vec![0.0; num_devices];
        for (e, devices) in devices_of.iter().enumerate() {
            for &d in devices {
                device_load[d as usize] += expert_load.map_or(1.0, |l| l[e]) / devices.len() as f64;
            }
        }
        let map = ReplicaMap {
            num_experts,
            num_devices,
            slot_expert,
            devices_of,
            expert_load: expert_load.map(<[f64]>::to_vec),
            device_load,
            sglang_copy: std::sync::OnceLock::new(),
        };
        Ok(map)
    }

    /// Rebuilds SGLang's table for this layer as SGLang builds it after the layers `state` has
    /// seen (a new map's table is that of a first layer on one node), and advances `state`.
    pub fn set_sglang_state(&mut self, state: &mut SglangState) {
        self.sglang_copy = std::sync::OnceLock::from(self.sglang_table(state));
    }

    /// SGLang's table for this layer after the layers `state` has seen, as devices.
    fn sglang_table(&self, state: &mut SglangState) -> Vec<u32> {
        let per = self.slots_per_device() as u32;
        state
            .next_layer(&self.slot_expert, self.num_experts)
            .into_iter()
            .map(|slot| slot / per)
            .collect()
    }

    /// Refuses what an engine would misload: two copies of one expert on one device (SGLang
    /// under DeepEP loads one and still routes to the other).
    pub fn check_servable(&self) -> Result<()> {
        for d in 0..self.num_devices {
            let slots = self.device_slots(d);
            for (i, &e) in slots.iter().enumerate() {
                if slots[..i].contains(&e) {
                    bail!(
                        "device {d} holds expert {e} twice (slots {:?}): SGLang with an \
                         all-to-all backend (DeepEP) loads one copy and still routes tokens \
                         to the other",
                        slots
                            .iter()
                            .enumerate()
                            .filter(|&(_, &x)| x == e)
                            .map(|(s, _)| d * slots.len() + s)
                            .collect::<Vec<_>>()
                    );
                }
            }
        }
        Ok(())
    }

    /// A partition (one slot per expert, as an `occult.placement.v1` map) as a replica map.
    pub fn from_partition(device_of_expert: &[u32], num_devices: usize) -> Result<Self> {
        let by_device = super::maps::experts_by_device(device_of_expert, num_devices);
        let per_device = by_device.iter().map(Vec::len).max().unwrap_or(0);
        if by_device.iter().any(|l| l.len() != per_device) {
            bail!("a partition with unequal devices has no equal slots per device");
        }
        let slots = by_device.into_iter().flatten().collect();
        Self::new(slots, device_of_expert.len(), num_devices, None)
    }

    /// The expert loads that order the cover rule's ties (`None`: all equal).
    pub fn expert_load(&self) -> Option<&[f64]> {
        self.expert_load.as_deref()
    }

    /// The experts with more than one copy, ascending.
    pub fn replicated_experts(&self) -> Vec<u32> {
        let mut copies = vec![0usize; self.num_experts];
        self.slot_expert
            .iter()
            .for_each(|&e| copies[e as usize] += 1);
        (0..self.num_experts as u32)
            .filter(|&e| copies[e as usize] > 1)
            .collect()
    }

    /// The expert in each of `device`'s slots, in slot order.
    pub fn device_slots(&self, device: usize) -> &[u32] {
        let per = self.slots_per_device();
        &self.slot_expert[device * per..(device + 1) * per]
    }

    pub fn slots_per_device(&self) -> usize {
        self.slot_expert.len() / self.num_devices
    }

    /// The local slot (among the device's own, 0-based) of the first copy of `expert` on
    /// `device`, if it has one.
    pub fn local_slot(&self, device: u32, expert: u32) -> Option<u32> {
        let per = self.slots_per_device();
        let start = device as usize * per;
        self.slot_expert
            .get(start..start + per)?
            .iter()
            .position(|&e| e == expert)
            .map(|s| s as u32)
    }

    /// The devices holding a copy of `expert`, ascending.
    pub fn devices_of(&self, expert: u32) -> &[u32] {
        &self.devices_of[expert as usize]
    }

    /// The device each of a token's experts (`ids`) is served on, under `rule`, for a token on
    /// device `source`; written into `out` (one per id).
    pub fn choose(&self, ids: &[u32], source: u32, rule: CopyRule, out: &mut Vec<u32>) {
        out.clear();
        match rule {
            CopyRule::Sglang => {
                let table = self.sglang_copy.get_or_init(|| {
                    self.sglang_table(&mut SglangState::start(self.num_devices, None))
                });
                out.extend(
                    ids.iter()
                        .map(|&e| table[source as usize * self.num_experts + e as usize]),
                )
            }
            CopyRule::Cover => self.cover(ids, source, out),
            CopyRule::Trtllm => out.extend(ids.iter().enumerate().map(|(j, &e)| {
                let devices = self.devices_of(e);
                let h = ids
                    .iter()
                    .fold(u64::from(source) ^ (j as u64) << 32, |h, &x| {
                        splitmix(h ^ u64::from(x))
                    });
                devices[(h % devices.len() as u64) as usize]
            })),
        }
    }

    /// TensorRT-LLM's count of one token: the expected distinct devices (device r reached with
    /// probability 1 - prod over the token's experts on r of (1 - 1/copies)) and the expected
    /// pairs each device computes, added to `pairs`; `miss[r]` is left at r's miss chance.
    fn expected(&self, ids: &[u32], pairs: &mut [f64], miss: &mut [f64]) -> f64 {
        miss.iter_mut().for_each(|x| *x = 1.0);
        for &e in ids {
            let devices = self.devices_of(e);
            let p = 1.0 / devices.len() as f64;
            for &d in devices {
                miss[d as usize] *= 1.0 - p;
                pairs[d as usize] += p;
            }
        }
        miss.iter().map(|&m| 1.0 - m).sum()
    }

    /// TensorRT-LLM's count of one token's nodes of `g` devices: node n is missed by expert e
    /// with probability 1 - (e's copies in n) / (e's copies), independently across experts (one
    /// copy is drawn per expert, so the devices of one node are not missed independently).
    fn expected_nodes(&self, ids: &[u32], g: usize, miss: &mut [f64]) -> f64 {
        miss.iter_mut().for_each(|x| *x = 1.0);
        for &e in ids {
            let devices = self.devices_of(e);
            let p = 1.0 / devices.len() as f64;
            // Devices ascending, so each node's copies are adjacent.
            for chunk in devices.chunk_by(|a, b| *a as usize / g == *b as usize / g) {
                miss[chunk[0] as usize / g] *= 1.0 - p * chunk.len() as f64;
            }
        }
        miss.iter().map(|&m| 1.0 - m).sum()
    }

    /// Orders candidate devices: the source first, then the least loaded, then the lowest.
    fn better(&self, source: u32, a: u32, b: u32) -> bool {
        if (a == source) != (b == source) {
            return a == source;
        }
        let (la, lb) = (self.device_load[a as usize], self.device_load[b as usize]);
        la < lb || (la == lb && a < b)
    }

    fn cover(&self, ids: &[u32], source: u32, out: &mut Vec<u32>) {
        const NONE: u32 = u32::MAX;
        out.resize(ids.len(), NONE);
        let mut chosen: Vec<u32> = Vec::with_capacity(ids.len());
        for (j, &e) in ids.iter().enumerate() {
            if let [only] = self.devices_of(e) {
                out[j] = *only;
                if !chosen.contains(only) {
                    chosen.push(*only);
                }
            }
        }
        loop {
            // Experts with a copy on a chosen device take the best such copy.
            for (j, &e) in ids.iter().enumerate() {
                if out[j] != NONE {
                    continue;
                }
                let best = self
                    .devices_of(e)
                    .iter()
                    .copied()
                    .filter(|d| chosen.contains(d))
                    .reduce(|a, b| if self.better(source, b, a) { b } else { a });
                if let Some(d) = best {
                    out[j] = d;
                }
            }
            if out.iter().all(|&d| d != NONE) {
                return;
            }
            // Otherwise the device with copies of the most remaining experts joins.
            let mut best: Option<(usize, u32)> = None;
            for (j, &e) in ids.iter().enumerate() {
                if out[j] != NONE {
                    continue;
                }
                for &d in self.devices_of(e) {
                    let covers = ids
                        .iter()
                        .zip(out.iter())
                        .filter(|&(&x, &o)| o == NONE && self.devices_of(x).contains(&d))
                        .count();
                    let wins = match best {
                        None => true,
                        Some((c, b)) => covers > c || (covers == c && self.better(source, d, b)),
                    };
                    if wins {
                        best = Some((covers, d));
                    }
                }
            }
            let (_, d) = best.expect("an unserved expert has a copy");
            chosen.push(d);
        }
    }

    /// E[C_T] and the devices' (row, expert) pairs over the tokens of `ids` (`[tokens, k]`),
    /// token t on device `source[t]`, under `rule`; with `per_node` devices per node (device d
    /// in node d / per_node), the sum of C_N too.
    pub fn stats(
        &self,
        ids: &[u32],
        k: usize,
        source: &[u32],
        rule: CopyRule,
        per_node: Option<usize>,
    ) -> Result<ReplicaStats> {
        if per_node == Some(0) {
            bail!("a node holds at least one device");
        }
        if k == 0 || !ids.len().is_multiple_of(k) || ids.len() / k != source.len() {
            bail!(
                "{} ids are not {} tokens of top-{k}",
                ids.len(),
                source.len()
            );
        }
        let mut pairs = vec![0f64; self.num_devices];
        let (mut touched, mut nodes) = (0f64, 0f64);
        let mut devices = Vec::with_capacity(k);
        let mut miss = vec![0f64; self.num_devices];
        let mut node_miss = vec![0f64; per_node.map_or(0, |g| self.num_devices.div_ceil(g))];
        for (chosen, &s) in ids.chunks_exact(k).zip(source) {
            if let Some(&e) = chosen.iter().find(|&&e| e as usize >= self.num_experts) {
                bail!(
                    "expert id {e} is out of range for {} experts",
                    self.num_experts
                );
            }
            if s as usize >= self.num_devices {
                bail!("source device {s} of {} devices", self.num_devices);
            }
            if rule == CopyRule::Trtllm {
                touched += self.expected(chosen, &mut pairs, &mut miss);
                if let Some(g) = per_node {
                    nodes += self.expected_nodes(chosen, g, &mut node_miss);
                }
                continue;
            }
            self.choose(chosen, s, rule, &mut devices);
            for &d in &devices {
                pairs[d as usize] += 1.0;
            }
            devices.sort_unstable();
            devices.dedup();
            touched += devices.len() as f64;
            if let Some(g) = per_node {
                // Sorted devices give sorted nodes.
                devices.iter_mut().for_each(|d| *d /= g as u32);
                devices.dedup();
                nodes += devices.len() as f64;
            }
        }
        Ok(ReplicaStats {
            tokens: source.len() as u64,
            devices_touched: touched,
            nodes_touched: nodes,
            pairs,
        })
    }
}

/// `map` with every second copy of an expert on one device swapped with a slot of another
/// device, so that no device holds an expert twice (what EPLB and TensorRT-LLM's placement can
/// make, and SGLang under DeepEP misloads). Each swap takes, among the slots of devices without
/// the expert whose own expert is not on the first device, the one that leaves the busiest
/// device's expected load lowest (ties: the lower slot), within the device's node of
/// `per_node` devices where given (EPLB's hierarchical policy keeps each group in one node).
/// Refused where no such slot exists.
pub fn spread_duplicates(map: &ReplicaMap, per_node: Option<usize>) -> Result<ReplicaMap> {
    let per = map.slots_per_device();
    let mut slots = map.slot_expert.clone();
    let e_n = map.num_experts;
    let load = |e: u32| map.expert_load.as_ref().map_or(1.0, |l| l[e as usize]);
    let holds = |slots: &[u32], d: usize, e: u32| slots[d * per..(d + 1) * per].contains(&e);
    loop {
        let dup = (0..slots.len()).find(|&p| {
            let d = p / per;
            slots[d * per..p].contains(&slots[p])
        });
        let Some(p) = dup else {
            break;
        };
        let (d, e) = (p / per, slots[p]);
        let mut best: Option<(f64, usize)> = None;
        let node = |dev: usize| per_node.map_or(0, |g| dev / g.max(1));
        for q in (0..slots.len()).filter(|&q| q / per != d && node(q / per) == node(d)) {
            let (d2, f) = (q / per, slots[q]);
            if holds(&slots, d2, e) || holds(&slots, d, f) {
                continue;
            }
            let mut trial = slots.clone();
            trial.swap(p, q);
            let copies = |e: u32| trial.iter().filter(|&&x| x == e).count() as f64;
            let busiest = (0..map.num_devices)
                .map(|dev| {
                    trial[dev * per..(dev + 1) * per]
                        .iter()
                        .map(|&x| load(x) / copies(x))
                        .sum::<f64>()
                })
                .fold(0.0, f64::max);
            if best.is_none_or(|(b, _)| busiest < b - 1e-12) {
                best = Some((busiest, q));
            }
        }
        let Some((_, q)) = best else {
            bail!("device {d} holds expert {e} twice, and no slot of another device can take it");
        };
        slots.swap(p, q);
    }
    ReplicaMap::new(slots, e_n, map.num_devices, map.expert_load())
}

/// SplitMix64's finaliser: the hash [`CopyRule::Trtllm`] picks a copy with.
fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Counts of one layer under a replica map and a copy rule.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplicaStats {
    pub tokens: u64,
    /// Sum of C_T (distinct devices per token, after the copy choice; expected, under
    /// TensorRT-LLM's rule).
    pub devices_touched: f64,
    /// Sum of C_N (distinct nodes per token) when a node size was given, else 0.
    pub nodes_touched: f64,
    /// (token, expert) pairs each device computes (expected, under TensorRT-LLM's rule).
    pub pairs: Vec<f64>,
}

impl ReplicaStats {
    pub fn ect(&self) -> f64 {
        self.devices_touched / self.tokens.max(1) as f64
    }

    /// The busiest device's pairs over the mean (1 without pairs).
    pub fn max_load_ratio(&self) -> f64 {
        max_over_mean_f64(&self.pairs)
    }
}

/// The largest value over the mean (1 when they sum to 0).
pub fn max_over_mean_f64(v: &[f64]) -> f64 {
    let sum: f64 = v.iter().sum();
    if sum <= 0.0 {
        return 1.0;
    }
    v.iter().copied().fold(0.0, f64::max) * v.len() as f64 / sum
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 4 experts on 2 devices of 3 slots: device 0 holds experts 0, 1, 2 and device 1 experts
    /// 0, 3, 1 (0 and 1 on both; 0 the hottest).
    fn map() -> ReplicaMap {
        ReplicaMap::new(vec![0, 1, 2, 0, 3, 1], 4, 2, Some(&[4.0, 1.0, 1.0, 1.0])).unwrap()
    }

    #[test]
    fn replicated_experts_and_loads_read_back() {
        let m = map();
        assert_eq!(m.replicated_experts(), vec![0, 1]);
        assert_eq!(m.expert_load(), Some(&[4.0, 1.0, 1.0, 1.0][..]));
        let once = ReplicaMap::new(vec![0, 1, 2, 3], 4, 2, None).unwrap();
        assert!(once.replicated_experts().is_empty());
        assert_eq!(once.expert_load(), None);
        // Two copies on one device count as two.
        let twice = ReplicaMap::new(vec![0, 0, 1, 2, 3, 3], 4, 2, None).unwrap();
        assert_eq!(twice.replicated_experts(), vec![0, 3]);
    }

    /// Five devices of two slots: expert 2 on devices 1, 2 and 3, expert 3 on 1 and 4.
    fn five(loads: Option<&[f64]>) -> ReplicaMap {
        ReplicaMap::new(vec![0, 1, 2, 3, 2, 4, 2, 5, 6, 3], 7, 5, loads).unwrap()
    }

    /// SGLang keeps the source's own copy and deals the others by its seeded draw (held to
    /// SGLang's code in sglang_dispatch's fixture test); the cover rule takes the source's
    /// copy, else the least loaded device, else the lowest.
    #[test]
    fn copies_are_dealt_and_ordered_by_their_rules() {
        let mut out = Vec::new();
        let m = five(None);
        for source in 0..5 {
            m.choose(&[2], source, CopyRule::Sglang, &mut out);
            if [1, 2, 3].contains(&source) {
                assert_eq!(out, vec![source], "the local copy");
            } else {
                assert!([1, 2, 3].contains(&out[0]), "{out:?}");
            }
        }
        // Device loads (each expert's load over its copies): 1/3 + 1/2 on device 1, 1 + 1/2 on
        // device 4.
        for (loads, from_0, from_2) in [
            (None, 1, 1),
            (Some([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]), 4, 4),
            // 3/3 + 1/2 on both: the lower.
            (Some([1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0]), 1, 1),
        ] {
            let m = five(loads.as_ref().map(|l| &l[..]));
            for (source, want) in [(0, from_0), (2, from_2), (4, 4), (1, 1)] {
                m.choose(&[3], source, CopyRule::Cover, &mut out);
                assert_eq!(out, vec![want], "{loads:?} from {source}");
            }
        }
        // Stats refuse ids that are not whole tokens of top-k from the given sources.
        assert!(m.stats(&[0, 1], 0, &[0, 0], CopyRule::Cover, None).is_err());
        assert!(m.stats(&[0, 1, 2], 2, &[0], CopyRule::Cover, None).is_err());
        assert!(m
            .stats(&[0, 1, 2, 3], 2, &[0], CopyRule::Cover, None)
            .is_err());
        assert!(m
            .stats(&[0, 1, 2, 3], 2, &[0, 1], CopyRule::Cover, None)
            .is_ok());
    }

    /// TensorRT-LLM's rule, hand-checked: expert 0 on devices 0 and 1 (one node of 2), expert
    /// 3 on device 1 alone. A token of expert 0 reaches each device with probability 1/2, so
    /// 1 device in expectation and its one node surely; a token of 0 and 3 reaches device 1
    /// surely and device 0 half the time.
    #[test]
    fn tensorrt_llms_rule_counts_in_expectation() {
        let m = map();
        let st = m
            .stats(&[0, 0, /**/ 0, 3], 2, &[0, 0], CopyRule::Trtllm, Some(2))
            .unwrap();
        // A token's ids are distinct in real routing; here the first repeats 0 to stay top-2:
        // device 0 missed with (1/2)^2, device 1 likewise: 2 * 3/4.
        assert_eq!(st.devices_touched, 1.5 + 1.5);
        assert_eq!(st.nodes_touched, 2.0);
        assert_eq!(st.pairs, vec![1.5, 2.5]);
        let one = m.stats(&[0], 1, &[1], CopyRule::Trtllm, Some(2)).unwrap();
        assert_eq!((one.devices_touched, one.nodes_touched), (1.0, 1.0));
        let apart = m.stats(&[0], 1, &[1], CopyRule::Trtllm, Some(1)).unwrap();
        assert_eq!(apart.nodes_touched, 1.0);
    }

    #[test]
    fn hand_checked_copy_rules() {
        let m = map();
        assert_eq!(m.devices_of(0), &[0, 1]);
        assert_eq!(m.devices_of(1), &[0, 1]);
        let mut out = Vec::new();
        // Experts 0 and 3 from device 0: 3 is only on device 1, so 0 joins it there (1 device).
        m.choose(&[0, 3], 0, CopyRule::Cover, &mut out);
        assert_eq!(out, vec![1, 1]);
        // SGLang takes 0's local copy on device 0: 2 devices.
        m.choose(&[0, 3], 0, CopyRule::Sglang, &mut out);
        assert_eq!(out, vec![0, 1]);
        // Experts 0 and 1 (both on both devices): the source's device.
        m.choose(&[0, 1], 1, CopyRule::Cover, &mut out);
        assert_eq!(out, vec![1, 1]);
        let st = m
            .stats(&[0, 3, /**/ 0, 1], 2, &[0, 1], CopyRule::Cover, None)
            .unwrap();
        assert_eq!(st.devices_touched, 2.0);
        assert_eq!(st.pairs, vec![0.0, 4.0]);
        let st = m
            .stats(&[0, 3, /**/ 0, 1], 2, &[0, 1], CopyRule::Sglang, None)
            .unwrap();
        assert_eq!(st.devices_touched, 3.0);
        assert_eq!(st.pairs, vec![1.0, 3.0]);
    }

    /// On random maps and tokens: every expert is served on a device holding a copy, and the
    /// cover's devices are within greedy set cover's bound of the fewest possible (found by
    /// brute force over sets of devices): opt <= cover <= H(k) * opt, so exactly one where one
    /// device holds all of the token's experts.
    #[test]
    fn the_cover_rule_serves_every_expert_on_a_copy_and_never_spreads_more() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(32);
        for _ in 0..200 {
            let (e, d) = (16, [2, 4, 8][rng.random_range(0..3)]);
            let per_device = e / d + rng.random_range(1..3);
            let m = crate::test_util::random_replica_map(&mut rng, e, d, per_device);
            let k = rng.random_range(1..=6);
            let mut ids: Vec<u32> = (0..e as u32).collect();
            for i in 0..k {
                let j = rng.random_range(i..e);
                ids.swap(i, j);
            }
            let ids = &ids[..k];
            let source = rng.random_range(0..d as u32);
            let distinct = |v: &[u32]| {
                let mut v = v.to_vec();
                v.sort_unstable();
                v.dedup();
                v.len()
            };
            let (mut cover, mut sglang) = (Vec::new(), Vec::new());
            m.choose(ids, source, CopyRule::Cover, &mut cover);
            m.choose(ids, source, CopyRule::Sglang, &mut sglang);
            for out in [&cover, &sglang] {
                for (&x, &dev) in ids.iter().zip(out.iter()) {
                    assert!(m.devices_of(x).contains(&dev), "{x} on {dev}");
                }
            }
            // The fewest devices that hold a copy of every expert of the token.
            let opt = (1u32..1 << d)
                .filter(|set| {
                    ids.iter()
                        .all(|&x| m.devices_of(x).iter().any(|&dev| set >> dev & 1 == 1))
                })
                .map(u32::count_ones)
                .min()
                .unwrap() as usize;
            let harmonic: f64 = (1..=k).map(|i| 1.0 / i as f64).sum();
            let got = distinct(&cover);
            assert!(
                opt <= got && got as f64 <= harmonic * opt as f64 + 1e-9,
                "{ids:?}: {got} vs {opt}"
            );
            if opt == 1 {
                assert_eq!(got, 1, "{ids:?}");
            }
        }
    }

    #[test]
    fn bad_maps_are_refused() {
        assert!(ReplicaMap::new(vec![0, 1, 2], 3, 2, None).is_err()); // uneven
                                                                      // Two copies on one device count as that device once.
        let twice = ReplicaMap::new(vec![0, 0, 1, 2], 3, 2, None).unwrap();
        assert_eq!(twice.devices_of(0), &[0]);
        assert!(ReplicaMap::new(vec![0, 1, 0, 1], 3, 2, None).is_err()); // expert 2 missing
        assert!(ReplicaMap::new(vec![0, 1, 2, 9], 3, 2, None).is_err()); // out of range
        assert!(ReplicaMap::new(vec![0, 1, 2, 0], 3, 2, Some(&[1.0])).is_err());
        let p = ReplicaMap::from_partition(&[0, 1, 0, 1], 2).unwrap();
        assert_eq!(p.slot_expert, vec![0, 2, 1, 3]);
    }
}
