//! Which examples each optimiser step trains on. The order is a seeded shuffle per epoch that
//! does not depend on the number of ranks; a step takes the next `batch` examples of it (the
//! global batch), and each rank takes a contiguous, near-even share of those. So D ranks
//! together train on exactly the examples one device would, step by step.

use crate::examples::Example;
use crate::{Error, Result};
use occult_core::analysis::ranks::RankSplit;
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// The order of `n` examples in `epoch`: a shuffle seeded by `seed` and the epoch.
pub fn epoch_order(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mix = seed ^ epoch.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(mix));
    order
}

/// The examples of optimiser step `step` (0-based): `batch` examples of the epoch orders,
/// epochs following one another. Every example appears once per epoch; a batch may span two
/// epochs.
pub fn global_batch(n: usize, batch: usize, seed: u64, step: u64) -> Result<Vec<usize>> {
    if n == 0 {
        return Err(Error::Invalid("there are no training examples".into()));
    }
    if batch == 0 {
        return Err(Error::Invalid("the batch size must be at least 1".into()));
    }
    let first = step as u128 * batch as u128;
    let mut out = Vec::with_capacity(batch);
    let mut epoch = (first / n as u128) as u64;
    let mut at = (first % n as u128) as usize;
    let mut order = epoch_order(n, seed, epoch);
    while out.len() < batch {
        if at == n {
            epoch += 1;
            at = 0;
            order = epoch_order(n, seed, epoch);
        }
        out.push(order[at]);
        at += 1;
    }
    Ok(out)
}

/// Rank `rank`'s share of a global batch on `size` ranks (contiguous; the first ranks take one
/// more when it does not divide).
pub fn rank_share(global: &[usize], rank: usize, size: usize) -> &[usize] {
    &global[RankSplit::new(global.len(), size).range(rank)]
}

/// Examples padded on the right to the longest: ids `[B, T]` (padding with token 0) and the
/// loss mask `[B, T]` (1 where the loss counts), with `T`.
pub fn pad(examples: &[&Example]) -> (Vec<u32>, Vec<f32>, usize) {
    let t = examples.iter().map(|e| e.ids.len()).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(examples.len() * t);
    let mut mask = Vec::with_capacity(examples.len() * t);
    for e in examples {
        ids.extend(&e.ids);
        ids.extend(std::iter::repeat_n(0, t - e.ids.len()));
        mask.extend(e.target.iter().map(|&b| b as u8 as f32));
        mask.extend(std::iter::repeat_n(0.0, t - e.ids.len()));
    }
    (ids, mask, t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_cover_every_example_once_and_ranks_split_the_global_batch() {
        let n = 10;
        let mut seen = vec![0; n];
        for step in 0..5 {
            for i in global_batch(n, 4, 7, step).unwrap() {
                seen[i] += 1;
            }
        }
        // 20 examples over two epochs: each example twice.
        assert_eq!(seen, vec![2; n]);
        // The order depends on the seed and the epoch, not on anything else.
        assert_eq!(epoch_order(n, 7, 0), epoch_order(n, 7, 0));
        assert_ne!(epoch_order(n, 7, 0), epoch_order(n, 7, 1));
        assert_ne!(epoch_order(n, 7, 0), epoch_order(n, 8, 0));
        // Rank shares of any size join back into the global batch.
        let g = global_batch(n, 7, 3, 2).unwrap();
        for d in 1..=5 {
            let joined: Vec<usize> = (0..d).flat_map(|r| rank_share(&g, r, d).to_vec()).collect();
            assert_eq!(joined, g, "D={d}");
        }
        assert!(global_batch(0, 4, 0, 0).is_err() && global_batch(3, 0, 0, 0).is_err());
    }

    #[test]
    fn padding_masks_the_padded_positions() {
        let a = Example {
            ids: vec![5, 6, 7],
            target: vec![false, true, true],
        };
        let b = Example {
            ids: vec![8],
            target: vec![true],
        };
        let (ids, mask, t) = pad(&[&a, &b]);
        assert_eq!(t, 3);
        assert_eq!(ids, vec![5, 6, 7, 8, 0, 0]);
        assert_eq!(mask, vec![0.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
    }
}
