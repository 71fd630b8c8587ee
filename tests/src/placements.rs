//! Random expert placements for the model tests.

use occult_core::models::config::ModelConfig;
use rand::SeedableRng;
use std::collections::BTreeMap;

/// A seeded random balanced placement on `d` devices for every MoE layer of `cfg`.
pub fn random_maps(cfg: &ModelConfig, d: usize, seed: u64) -> BTreeMap<usize, Vec<u32>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..cfg.num_layers)
        .filter(|&l| cfg.moe_layers[l])
        .map(|l| {
            let map =
                occult_core::analysis::placement::random_balanced(cfg.moe.num_experts, d, &mut rng);
            (l, map)
        })
        .collect()
}
