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

/// [`random_maps`], but for a group-limited model (`n_group` > 1) keeping its expert groups
/// whole, as an export must: the groups in a random order, each group's experts shuffled, laid
/// out in contiguous blocks of `E / d` (each device then holds whole groups, or each group fills
/// whole devices, when one divides the other).
pub fn random_group_whole_maps(
    cfg: &ModelConfig,
    d: usize,
    seed: u64,
) -> BTreeMap<usize, Vec<u32>> {
    use rand::seq::SliceRandom;
    let Some(g) = cfg.moe.router.group_limit else {
        return random_maps(cfg, d, seed);
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let e = cfg.moe.num_experts;
    let per_group = e / g.num_groups;
    (0..cfg.num_layers)
        .filter(|&l| cfg.moe_layers[l])
        .map(|l| {
            let mut groups: Vec<usize> = (0..g.num_groups).collect();
            groups.shuffle(&mut rng);
            let order: Vec<u32> = groups
                .iter()
                .flat_map(|&gi| {
                    let mut ids: Vec<u32> =
                        ((gi * per_group) as u32..((gi + 1) * per_group) as u32).collect();
                    ids.shuffle(&mut rng);
                    ids
                })
                .collect();
            let mut map = vec![0u32; e];
            for (slot, &x) in order.iter().enumerate() {
                map[x as usize] = (slot * d / e) as u32;
            }
            (l, map)
        })
        .collect()
}
