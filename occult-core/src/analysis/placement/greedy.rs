//! The paper's Algorithm 1 (collaboration-aware greedy placement), on one layer's
//! co-activation counts:
//! 1. device 0 is seeded with the most co-activated pair of experts;
//! 2. each next device is seeded with the unplaced expert whose average co-activation with all
//!    placed experts is smallest (farthest-point seeding);
//! 3. then, device by device, each device is filled with the unplaced expert whose average
//!    co-activation with the device's members is largest, until it holds its share.
//!
//! Ties go to the lower expert id. Device sizes follow [`capacities`].

use super::maps::capacities;
use crate::analysis::collab::CoActivation;

/// Greedy placement of `co.num_experts` experts on `num_devices` devices
/// (sizes must have been checked with [`super::maps::check_sizes`]).
pub fn greedy(co: &CoActivation, num_devices: usize) -> Vec<u32> {
    let e = co.num_experts;
    let caps = capacities(e, num_devices);
    let mut device = vec![u32::MAX; e];
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); num_devices];
    let put = |x: usize, d: usize, device: &mut Vec<u32>, members: &mut Vec<Vec<usize>>| {
        device[x] = d as u32;
        members[d].push(x);
    };

    // 1. The most co-activated pair seeds device 0.
    let (mut best, mut pair) = (0u64, (0usize, 1usize.min(e - 1)));
    for a in 0..e {
        for b in a + 1..e {
            if co.get(a, b) > best {
                best = co.get(a, b);
                pair = (a, b);
            }
        }
    }
    put(pair.0, 0, &mut device, &mut members);
    if caps[0] >= 2 && pair.1 != pair.0 {
        put(pair.1, 0, &mut device, &mut members);
    }

    // 2. Farthest-point seeds for the other devices. The average over placed experts has the
    // same denominator for every candidate, so the sum decides.
    let mut sum_with_placed: Vec<u64> = (0..e)
        .map(|x| members[0].iter().map(|&m| co.get(x, m)).sum())
        .collect();
    for d in 1..num_devices {
        let seed = (0..e)
            .filter(|&x| device[x] == u32::MAX)
            .min_by_key(|&x| (sum_with_placed[x], x))
            .expect("devices <= experts leaves an unplaced expert");
        put(seed, d, &mut device, &mut members);
        for (x, s) in sum_with_placed.iter_mut().enumerate() {
            *s += co.get(x, seed);
        }
    }

    // 3. Fill devices in order with the most co-activated unplaced expert.
    for d in 0..num_devices {
        let mut sum_with_dev: Vec<u64> = (0..e)
            .map(|x| members[d].iter().map(|&m| co.get(x, m)).sum())
            .collect();
        while members[d].len() < caps[d] {
            let x = (0..e)
                .filter(|&x| device[x] == u32::MAX)
                .max_by_key(|&x| (sum_with_dev[x], std::cmp::Reverse(x)))
                .expect("capacities sum to the expert count");
            put(x, d, &mut device, &mut members);
            for (y, s) in sum_with_dev.iter_mut().enumerate() {
                *s += co.get(y, x);
            }
        }
    }
    device
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::placement::validate_map;

    #[test]
    fn recovers_planted_pairs() {
        // Experts {0,5}, {1,4}, {2,7}, {3,6} always fire together (k = 2).
        let mut ids = Vec::new();
        for _ in 0..10 {
            ids.extend_from_slice(&[0, 5, 1, 4, 2, 7, 3, 6]);
        }
        let co = CoActivation::from_ids(&ids, 2, 8);
        let map = greedy(&co, 4);
        validate_map(&map, 8, 4).unwrap();
        assert_eq!(map[0], map[5]);
        assert_eq!(map[1], map[4]);
        assert_eq!(map[2], map[7]);
        assert_eq!(map[3], map[6]);
    }

    #[test]
    fn handles_one_expert_per_device_and_one_device() {
        let ids = [0u32, 1, 2, 3];
        let co = CoActivation::from_ids(&ids, 2, 4);
        validate_map(&greedy(&co, 4), 4, 4).unwrap();
        assert_eq!(greedy(&co, 1), vec![0, 0, 0, 0]);
        validate_map(&greedy(&co, 3), 4, 3).unwrap();
    }
}
