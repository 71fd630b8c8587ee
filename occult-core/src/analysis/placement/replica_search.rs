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

/// A candidate map's figures under the cover rule on the layer's routing.
#[derive(Clone, Debug)]
struct Scored {
    ect: f64,
    /// Max/mean device load.
    ratio: f64,
    /// Pairs over the load cap, summed over devices (0 without a cap).
    excess: u64,
    /// Each device's (token, expert) pairs.
    pairs: Vec<u64>,
}

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
    // The most pairs a device may hold under the cap, and the pairs over it, summed.
    let limit = |pairs: &[u64]| {
        let total: u64 = pairs.iter().sum();
        max_load_factor.unwrap_or(f64::INFINITY) * total as f64 / num_devices as f64
    };
    let excess = |pairs: &[u64]| -> u64 {
        let at = limit(pairs);
        let over: f64 = pairs.iter().map(|&p| (p as f64 - at).max(0.0)).sum();
        over.ceil() as u64
    };
    let score = |slots: &[Vec<u32>]| -> Result<Scored> {
        let st = build(slots)?.stats(ids, k, source, CopyRule::Cover, None)?;
        Ok(Scored {
            ect: st.ect(),
            ratio: st.max_load_ratio(),
            excess: excess(&st.pairs),
            pairs: st.pairs,
        })
    };
    let over = |s: &Scored| max_load_factor.is_some_and(|f| s.ratio > f + 1e-12);
    let per_device = (e_n + replicas) / num_devices;
    let start = score(&slots)?;
    let mut best = start.clone();
    let mut left = replicas;
    // Balance first: while devices are over the cap, copy an expert of an over-cap device to
    // a device with a free slot, the copy that lowers the pairs over the cap most (then
    // max/mean load, then the sum of C_T).
    let key = |s: &Scored| (s.excess, s.ratio, s.ect);
    while over(&best) && left > 0 {
        let at = limit(&best.pairs);
        let mut step: Option<(Scored, usize, u32)> = None;
        for b in (0..num_devices).filter(|&b| best.pairs[b] as f64 > at) {
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
                    let s = score(&trial)?;
                    let better = s.excess < best.excess
                        || (s.excess == best.excess && s.ratio < best.ratio - 1e-12);
                    if better && step.as_ref().is_none_or(|(t, ..)| key(&s) < key(t)) {
                        step = Some((s, d, e));
                    }
                }
            }
        }
        let Some((s, d, e)) = step else {
            break;
        };
        slots[d].push(e);
        best = s;
        left -= 1;
    }
    if over(&best) {
        bail!(
            "no copies bring the max/mean load to the cap {}: {:.3} after {} of {replicas} \
             copies (from {:.3}); give more --replicas or a higher --max-load-factor",
            max_load_factor.unwrap_or(0.0),
            best.ratio,
            replicas - left,
            start.ratio
        );
    }
    for _ in 0..left {
        let mut step: Option<(Scored, usize, u32)> = None;
        for d in 0..num_devices {
            if slots[d].len() >= per_device {
                continue;
            }
            for e in candidates(ids, k, &slots, d, e_n) {
                let mut trial = slots.clone();
                trial[d].push(e);
                let s = score(&trial)?;
                // Only a copy that lowers the sum (the cover is greedy, so one can raise it).
                if over(&s) || s.ect >= best.ect - 1e-12 {
                    continue;
                }
                if step.as_ref().is_none_or(|(t, ..)| s.ect < t.ect) {
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
        start: (start.ect, start.ratio),
        result: (best.ect, best.ratio),
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
        let st = out
            .map
            .stats(&ids, 2, &source, CopyRule::Cover, None)
            .unwrap();
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
        let st = out
            .map
            .stats(&ids, 1, &source, CopyRule::Cover, None)
            .unwrap();
        assert_eq!(st.pairs, vec![5, 5]);
        // All tokens from device 0: no copy moves load, so the cap is out of reach.
        let e = replicate(&ids, 1, &[0; 10], &map, 2, 2, Some(1.05)).unwrap_err();
        assert!(e.to_string().contains("no copies bring"), "{e}");
    }
}
