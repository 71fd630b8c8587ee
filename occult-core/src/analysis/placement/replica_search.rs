//! Occult's placement with replicas: from a partition (one slot per expert), R more slots, the
//! same number on every device. Where the partition is over the load cap, copies of the
//! over-cap devices' experts first bring it under (each the copy that lowers the pairs over the
//! cap most); then each slot left is filled greedily with the copy
//! that lowers the layer's exact sum of C_T the most under the cover rule ([`CopyRule::Cover`]),
//! among copies that keep the busiest device within the load cap when one is given. The sum never rises: where no
//! copy lowers it, the slots left hold second copies of their devices' own experts. Every candidate is scored by a
//! full recount of the layer under the rule, so the figure it reports is the one the analysis,
//! the dispatch and the export count.
//!
//! Candidates per step: for each device with a free slot, the experts not on it whose tokens
//! most often also use an expert on it (those a copy there can save a device for), the best
//! few of them.

use super::replicas::{CopyRule, ReplicaMap};
use crate::{bail, Result};

/// Candidates scored exactly per device and step.
const CANDIDATES_PER_DEVICE: usize = 8;

/// A copy in the balance phase: its key (pairs over the cap, max/mean load, E[C_T]), its
/// (E[C_T], max/mean load), and the device and expert.
type BalanceStep = ((u64, f64, f64), (f64, f64), usize, u32);

/// What [`replicate`] found.
#[derive(Clone, Debug)]
pub struct ReplicaOutcome {
    pub map: ReplicaMap,
    /// E[C_T] and max/mean load of the start (the partition) and of the result, under the
    /// cover rule.
    pub start: (f64, f64),
    pub result: (f64, f64),
}

/// Adds `replicas` copies to the partition `device_of_expert` (E and R each a multiple of the
/// devices) for the routing `ids` (`[tokens, k]`, token t starting on `source[t]`), keeping the
/// max/mean device load within `max_load_factor` where given. A start over the cap is first
/// balanced: copies of the over-cap devices' experts go where they lower the pairs over the cap
/// most (refused, with the figures, if R copies cannot bring it under); then no copy that breaks
/// the cap is taken. The experts' token counts order the cover rule's ties.
pub fn replicate(
    ids: &[u32],
    k: usize,
    source: &[u32],
    device_of_expert: &[u32],
    num_devices: usize,
    replicas: usize,
    max_load_factor: Option<f64>,
) -> Result<ReplicaOutcome> {
    let e_n = device_of_expert.len();
    if num_devices == 0 || !e_n.is_multiple_of(num_devices) || !replicas.is_multiple_of(num_devices)
    {
        bail!(
            "{e_n} experts and {replicas} replicas must each divide evenly over {num_devices} \
             devices"
        );
    }
    let loads: Vec<f64> = super::eplb::expert_loads(ids, e_n)
        .into_iter()
        .map(f64::from)
        .collect();
    let by_device = super::experts_by_device(device_of_expert, num_devices);
    let mut slots: Vec<Vec<u32>> = by_device;
    let build = |slots: &[Vec<u32>]| -> Result<ReplicaMap> {
        // Devices not yet full are padded with their own first expert's second slot: the map
        // needs equal devices, and a copy on a device that has it changes nothing.
        let width = slots.iter().map(Vec::len).max().unwrap_or(0);
        let padded: Vec<u32> = slots
            .iter()
            .flat_map(|s| {
                let mut s = s.clone();
                while s.len() < width {
                    s.push(s[0]);
                }
                s
            })
            .collect();
        ReplicaMap::new(padded, e_n, num_devices, Some(&loads))
    };
    let score = |m: &ReplicaMap| -> Result<(f64, f64)> {
        let st = m.stats(ids, k, source, CopyRule::Cover)?;
        Ok((st.ect(), st.max_load_ratio()))
    };
    let start_map = build(&slots)?;
    let start = score(&start_map)?;
    let per_device = (e_n + replicas) / num_devices;
    let over = |s: (f64, f64)| max_load_factor.is_some_and(|f| s.1 > f + 1e-12);
    let mut best = start;
    let mut left = replicas;
    // Balance first: while devices are over the cap, copy an expert of an over-cap device to
    // a device with a free slot, the copy that lowers the pairs over the cap most (then
    // max/mean load, then the sum of C_T).
    let excess = |m: &ReplicaMap| -> Result<(u64, (f64, f64))> {
        let st = m.stats(ids, k, source, CopyRule::Cover)?;
        let total: u64 = st.pairs.iter().sum();
        let limit = max_load_factor.unwrap_or(f64::INFINITY) * total as f64 / num_devices as f64;
        let over: f64 = st.pairs.iter().map(|&p| (p as f64 - limit).max(0.0)).sum();
        Ok((over.ceil() as u64, (st.ect(), st.max_load_ratio())))
    };
    let mut current = excess(&start_map)?.0;
    while over(best) && left > 0 {
        let pairs = build(&slots)?.stats(ids, k, source, CopyRule::Cover)?.pairs;
        let total: u64 = pairs.iter().sum();
        let limit = max_load_factor.unwrap_or(f64::INFINITY) * total as f64 / num_devices as f64;
        let mut step: Option<BalanceStep> = None;
        for b in (0..num_devices).filter(|&b| pairs[b] as f64 > limit) {
            let mut own: Vec<u32> = slots[b].clone();
            own.sort_unstable();
            own.dedup();
            for &e in &own {
                for d in (0..num_devices).filter(|&d| d != b && slots[d].len() < per_device) {
                    if slots[d].contains(&e) {
                        continue;
                    }
                    let mut trial = slots.clone();
                    trial[d].push(e);
                    let (x, s) = excess(&build(&trial)?)?;
                    let key = (x, s.1, s.0);
                    let better = x < current || (x == current && s.1 < best.1 - 1e-12);
                    if better && step.is_none_or(|(b, ..)| key < b) {
                        step = Some((key, s, d, e));
                    }
                }
            }
        }
        let Some(((x, _, _), s, d, e)) = step else {
            break;
        };
        slots[d].push(e);
        best = s;
        current = x;
        left -= 1;
    }
    if over(best) {
        bail!(
            "no copies bring the max/mean load to the cap {}: {:.3} after {} of {replicas} \
             copies (from {:.3}); give more --replicas or a higher --max-load-factor",
            max_load_factor.unwrap_or(0.0),
            best.1,
            replicas - left,
            start.1
        );
    }
    for _ in 0..left {
        let mut step: Option<((f64, f64), usize, u32)> = None;
        for d in 0..num_devices {
            if slots[d].len() >= per_device {
                continue;
            }
            for e in candidates(ids, k, &slots, d, e_n) {
                let mut trial = slots.clone();
                trial[d].push(e);
                let m = build(&trial)?;
                let s = score(&m)?;
                if over(s) {
                    continue;
                }
                // Only a copy that lowers the sum (the cover is greedy, so one can raise it).
                if s.0 < best.0 - 1e-12 && step.is_none_or(|(b, _, _)| s.0 < b.0) {
                    step = Some((s, d, e));
                }
            }
        }
        match step {
            Some((s, d, e)) => {
                slots[d].push(e);
                best = s;
            }
            None => break,
        }
    }
    // Slots no copy helps in hold second copies of their devices' own experts (no effect), so
    // every device has the same slots.
    for s in slots.iter_mut() {
        while s.len() < per_device {
            s.push(s[0]);
        }
    }
    let map = build(&slots)?;
    Ok(ReplicaOutcome {
        map,
        start,
        result: best,
    })
}

/// The experts a copy on device `d` could save the most for: not on `d`, ranked by the tokens
/// that use them together with an expert on `d`.
fn candidates(ids: &[u32], k: usize, slots: &[Vec<u32>], d: usize, e_n: usize) -> Vec<u32> {
    let mut on_d = vec![false; e_n];
    for &e in &slots[d] {
        on_d[e as usize] = true;
    }
    let mut gain = vec![0u64; e_n];
    for chosen in ids.chunks_exact(k) {
        if chosen.iter().any(|&e| on_d[e as usize]) {
            for &e in chosen.iter().filter(|&&e| !on_d[e as usize]) {
                gain[e as usize] += 1;
            }
        }
    }
    let mut order: Vec<u32> = (0..e_n as u32).filter(|&e| !on_d[e as usize]).collect();
    order.sort_by(|&a, &b| gain[b as usize].cmp(&gain[a as usize]).then(a.cmp(&b)));
    order.truncate(CANDIDATES_PER_DEVICE);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two devices; tokens pair expert 0 (device 0) with expert 2 (device 1): one copy of 2 on
    /// device 0 (or of 0 on device 1) brings every such token to one device.
    #[test]
    fn a_copy_beside_its_partner_brings_tokens_to_one_device() {
        let map = [0, 0, 1, 1];
        let ids: Vec<u32> = (0..10).flat_map(|_| [0u32, 2]).collect();
        let source = vec![0u32; 10];
        let out = replicate(&ids, 2, &source, &map, 2, 2, None).unwrap();
        assert_eq!(out.start.0, 2.0);
        assert_eq!(out.result.0, 1.0);
        assert_eq!(out.map.slots_per_device(), 3);
        // Recounted from the map itself.
        let st = out.map.stats(&ids, 2, &source, CopyRule::Cover).unwrap();
        assert_eq!(st.ect(), 1.0);
        assert!(replicate(&ids, 2, &source, &map, 2, 1, None).is_err());
    }

    /// Every token uses expert 0 (device 0), half of them from each device: the start's
    /// max/mean load is 2. A copy of 0 on device 1 serves the tokens that start there, which
    /// brings it to 1; a cap one copy cannot reach is refused with the figures.
    #[test]
    fn a_start_over_the_cap_is_balanced_by_copies_of_the_busiest_devices_experts() {
        let map = [0, 0, 1, 1];
        let ids = vec![0u32; 10];
        let source: Vec<u32> = (0..10).map(|t| t / 5).collect();
        let out = replicate(&ids, 1, &source, &map, 2, 2, Some(1.05)).unwrap();
        assert_eq!(out.start.1, 2.0);
        assert_eq!(out.result.1, 1.0);
        assert!(out.map.devices_of(0).contains(&1));
        let st = out.map.stats(&ids, 1, &source, CopyRule::Cover).unwrap();
        assert_eq!(st.pairs, vec![5, 5]);
        // All tokens from device 0: no copy moves load, so the cap is out of reach.
        let e = replicate(&ids, 1, &[0; 10], &map, 2, 2, Some(1.05)).unwrap_err();
        assert!(e.to_string().contains("no copies bring"), "{e}");
    }
}
