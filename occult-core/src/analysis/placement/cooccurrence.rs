//! TensorRT-LLM's co-occurrence placement, ported from its published code
//! (`examples/wide_ep/ep_load_balancer/`: `generate_eplb_config_cooccurrence.py` and
//! `utils.py`'s `do_placement_with_cooccurrence`, on top of `doReplication` in
//! `cpp/tensorrt_llm/runtime/moeLoadBalancer/moeLoadBalancer.cpp`) and held to it by
//! `tests/fixtures/trtllm/cooccurrence.json`, which that code wrote.
//!
//! - **Replication** ([`replica_counts`]): every expert one slot, then each extra slot to the
//!   expert whose per-slot load is largest (a max-heap on (load / copies, expert id): ties to
//!   the higher id).
//! - **Placement** ([`cooccurrence_slots`]), with `alpha` (0.8 in its script): each rank in
//!   turn is seeded with the heaviest slot still unplaced, then keeps taking the expert that
//!   co-occurs most with what it already holds (summed co-occurrence rows, its own experts
//!   masked at -1e9), while it stays within `alpha` of its slots and of the mean rank load;
//!   then the slots left go, heaviest first, to the least loaded rank with room (ties: the lower
//!   rank).
//!
//! Sorts are torch's CPU sort, descending, its ties where libstdc++'s `std::sort` leaves them
//! ([`super::torch_sort`]); sums of co-occurrence rows in f32.

use crate::analysis::collab::CoActivation;
use crate::{bail, Result};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// The `alpha` of TensorRT-LLM's script.
pub const ALPHA: f64 = 0.8;

/// `doReplication`: each expert's slot count for `total_slots` slots from its load.
pub fn replica_counts(loads: &[f32], total_slots: usize) -> Vec<usize> {
    let e = loads.len();
    if total_slots == e {
        return vec![1; e];
    }
    let sum: f64 = loads.iter().map(|&x| f64::from(x)).sum();
    if sum == 0.0 {
        return (0..e)
            .map(|i| total_slots / e + usize::from(i < total_slots % e))
            .collect();
    }
    let mut counts = vec![1usize; e];
    // (slot size, expert id), the largest first; f64 ordered by its bits (all sizes >= 0).
    let mut heap: BinaryHeap<(u64, usize)> =
        (0..e).map(|i| (f64::from(loads[i]).to_bits(), i)).collect();
    for _ in e..total_slots {
        let (_, i) = heap.pop().expect("one entry per expert");
        counts[i] += 1;
        heap.push(((f64::from(loads[i]) / counts[i] as f64).to_bits(), i));
    }
    counts
}

use super::torch_sort::argsort_desc as sorted_desc;

/// `do_placement_with_cooccurrence`: each rank's experts, in the order placed, from the
/// experts' loads, slot counts and co-occurrence (`cooc[a * E + b]`, the diagonal ignored).
pub fn cooccurrence_slots(
    loads: &[f32],
    counts: &[usize],
    cooc: &[f32],
    ep_size: usize,
    alpha: f64,
) -> Result<Vec<Vec<u32>>> {
    let e = loads.len();
    let num_slots: usize = counts.iter().sum();
    let per_rank = num_slots / ep_size;
    let slot_load: Vec<f32> = loads
        .iter()
        .zip(counts)
        .map(|(&l, &c)| l / c as f32)
        .collect();
    let sorted = sorted_desc(&slot_load);
    let total: f32 = loads.iter().sum();
    let average = f64::from(total) / ep_size as f64;
    let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); ep_size];
    let mut rank_load = vec![0f64; ep_size];
    let mut assigned = vec![0usize; e];
    let select = |order: &[usize], assigned: &[usize]| -> Result<usize> {
        match order.iter().find(|&&x| assigned[x] < counts[x]) {
            Some(&x) => Ok(x),
            None => bail!("no expert replica is left to place"),
        }
    };
    // Step 1: seed each rank, then grow it by co-occurrence.
    for r in 0..ep_size {
        let mut order = sorted.clone();
        loop {
            let x = select(&order, &assigned)?;
            if (ranks[r].len() + 1) as f64 > per_rank as f64 * alpha {
                break;
            }
            if rank_load[r] + f64::from(slot_load[x]) > average * alpha {
                break;
            }
            ranks[r].push(x as u32);
            rank_load[r] += f64::from(slot_load[x]);
            assigned[x] += 1;
            // The rank's co-occurrence rows summed, its own experts masked.
            let mut sum = vec![0f32; e];
            for &y in &ranks[r] {
                let y = y as usize;
                for (b, s) in sum.iter_mut().enumerate() {
                    *s += if b == y { -1e9 } else { cooc[y * e + b] };
                }
            }
            order = sorted_desc(&sum);
        }
    }
    // Step 2: the rest, heaviest first, to the least loaded rank with room.
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> = (0..ep_size)
        .filter(|&r| ranks[r].len() < per_rank)
        .map(|r| Reverse((rank_load[r].to_bits(), r)))
        .collect();
    for &x in &sorted {
        while assigned[x] < counts[x] {
            let Some(Reverse((_, r))) = heap.pop() else {
                bail!("no rank has room for a copy of expert {x}");
            };
            ranks[r].push(x as u32);
            rank_load[r] += f64::from(slot_load[x]);
            assigned[x] += 1;
            if ranks[r].len() < per_rank {
                heap.push(Reverse((rank_load[r].to_bits(), r)));
            }
        }
    }
    Ok(ranks)
}

/// TensorRT-LLM's co-occurrence placement of one layer's routing (`ids`, `[tokens, k]`) with
/// `replicas` redundant slots on `devices` devices, loads and co-occurrence counted from the
/// routing, as a replica map (its slots as TensorRT-LLM lays them out, two copies on one device
/// included).
pub fn cooccurrence_map(
    ids: &[u32],
    k: usize,
    num_experts: usize,
    devices: usize,
    replicas: usize,
) -> Result<super::replicas::ReplicaMap> {
    let slots = num_experts + replicas;
    if devices == 0 || !slots.is_multiple_of(devices) {
        bail!(
            "TensorRT-LLM's placement needs E + R slots ({num_experts} + {replicas}) that divide \
             evenly over {devices} devices"
        );
    }
    let loads = super::eplb::expert_loads(ids, num_experts);
    let co = CoActivation::from_ids(ids, k, num_experts);
    let cooc: Vec<f32> = co.counts.iter().map(|&c| c as f32).collect();
    let counts = replica_counts(&loads, slots);
    let ranks = cooccurrence_slots(&loads, &counts, &cooc, devices, ALPHA)?;
    let f64_loads: Vec<f64> = loads.iter().map(|&x| f64::from(x)).collect();
    super::replicas::ReplicaMap::new(ranks.concat(), num_experts, devices, Some(&f64_loads))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-checked replication: the heaviest per-slot load takes each extra slot; equal sizes
    /// go to the higher id (the C++ max-heap on (size, id)); no load: spread evenly.
    #[test]
    fn extra_slots_go_to_the_heaviest_per_slot_load() {
        assert_eq!(replica_counts(&[8.0, 3.0, 1.0], 5), vec![3, 1, 1]);
        assert_eq!(replica_counts(&[8.0, 3.0, 1.0], 6), vec![3, 2, 1]);
        assert_eq!(replica_counts(&[4.0, 4.0], 3), vec![1, 2]);
        assert_eq!(replica_counts(&[0.0, 0.0, 0.0], 5), vec![2, 2, 1]);
        assert_eq!(replica_counts(&[5.0, 1.0], 2), vec![1, 1]);
    }

    /// Two ranks of three slots, six experts of equal load: 0 and 1 often together, 2 and 3
    /// too. Each rank is seeded by the first free expert (the stable sort) and grows by its
    /// partner up to alpha (0.8) of its slots; the rest go to the least loaded rank, the lower
    /// on ties. With alpha 1 the first step places everything and then finds nothing left:
    /// TensorRT-LLM's code raises there too.
    #[test]
    fn partners_land_together() {
        let loads = [5.0; 6];
        let mut cooc = vec![0f32; 36];
        for (a, b, n) in [(0, 1, 9.0), (2, 3, 7.0), (0, 2, 1.0)] {
            cooc[a * 6 + b] = n;
            cooc[b * 6 + a] = n;
        }
        let ranks = cooccurrence_slots(&loads, &[1; 6], &cooc, 2, ALPHA).unwrap();
        assert_eq!(ranks, vec![vec![0, 1, 4], vec![2, 3, 5]]);
        // Four experts, two ranks of two, alpha 1: all four placed in the first step.
        let zero = vec![0f32; 16];
        assert!(cooccurrence_slots(&loads[..4], &[1; 4], &zero, 2, 1.0).is_err());
    }

    /// TensorRT-LLM's own code on seeded routings (`scripts/make_trtllm_fixtures.py`: its C++
    /// `doReplication` compiled as it is, its Python placement imported): the same replica
    /// counts and the same experts on every rank, in order.
    #[test]
    fn matches_tensorrt_llms_own_placement() {
        let v = crate::test_util::fixture_json("trtllm/cooccurrence.json");
        let cases = v["cases"].as_array().unwrap();
        assert!(cases.len() >= 7);
        let num = |x: &serde_json::Value| x.as_u64().unwrap() as usize;
        for (c, case) in cases.iter().enumerate() {
            let (e, k, d, r) = (
                num(&case["experts"]),
                num(&case["k"]),
                num(&case["ep_size"]),
                num(&case["replicas"]),
            );
            let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            let counts: Vec<usize> =
                serde_json::from_value(case["replica_counts"].clone()).unwrap();
            let ranks: Vec<Vec<u32>> = serde_json::from_value(case["ranks"].clone()).unwrap();
            let loads = crate::analysis::placement::eplb::expert_loads(&ids, e);
            assert_eq!(replica_counts(&loads, e + r), counts, "case {c}");
            let map = cooccurrence_map(&ids, k, e, d, r).unwrap();
            assert_eq!(map.slot_expert, ranks.concat(), "case {c}");
        }
    }
}
