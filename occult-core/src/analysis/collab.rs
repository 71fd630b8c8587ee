//! Collaboration statistics of one layer's routing: the E x E co-activation counts, expert
//! loads, and, for an expert -> device map, C_T per token (the number of distinct devices that
//! hold the token's experts, counting the source device), E[C_T] and its histogram, the
//! intra-collaboration ratio, and the rows each dispatch mode sends.
//!
//! Row counting rules (one row travels out in dispatch and one comes back in combine, so each
//! count holds for both directions):
//! - standard dispatch: one row per (token, expert) pair, k per token;
//! - Occult dispatch: one row per (token, device) pair, C_T per token;
//! - a *remote* row is one whose destination device differs from the token's source rank
//!   (see [`crate::analysis::ranks::RankSplit`]); rows to the source device never cross a link.
//!
//! These functions are the project's one definition of C_T and of row counts: dispatch plans
//! are checked against them.

use crate::analysis::ranks::RankSplit;
use serde::Serialize;

/// Co-activation counts and expert loads of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct CoActivation {
    pub num_experts: usize,
    /// Row-major E x E; entry (a, b) counts tokens that chose both a and b. Diagonal is 0.
    pub counts: Vec<u64>,
    /// Tokens that chose each expert.
    pub loads: Vec<u64>,
}

impl CoActivation {
    /// Counts co-activations over `ids` (`[tokens, k]`, row-major).
    pub fn from_ids(ids: &[u32], k: usize, num_experts: usize) -> Self {
        let e = num_experts;
        let mut counts = vec![0u64; e * e];
        let mut loads = vec![0u64; e];
        for row in ids.chunks_exact(k) {
            for (i, &a) in row.iter().enumerate() {
                loads[a as usize] += 1;
                for &b in &row[i + 1..] {
                    counts[a as usize * e + b as usize] += 1;
                    counts[b as usize * e + a as usize] += 1;
                }
            }
        }
        CoActivation {
            num_experts: e,
            counts,
            loads,
        }
    }

    pub fn get(&self, a: usize, b: usize) -> u64 {
        self.counts[a * self.num_experts + b]
    }
}

/// Per-token device counts: reusable scratch for computing C_T without allocation.
pub struct DeviceCounter {
    counts: Vec<u32>,
    touched: Vec<u32>,
}

impl DeviceCounter {
    pub fn new(num_devices: usize) -> Self {
        DeviceCounter {
            counts: vec![0; num_devices],
            touched: Vec::with_capacity(num_devices),
        }
    }

    /// Loads one token's experts; returns C_T. Devices are then listed in order of first use.
    pub fn load(&mut self, ids: &[u32], device_of_expert: &[u32]) -> usize {
        for &d in &self.touched {
            self.counts[d as usize] = 0;
        }
        self.touched.clear();
        for &x in ids {
            let d = device_of_expert[x as usize];
            if self.counts[d as usize] == 0 {
                self.touched.push(d);
            }
            self.counts[d as usize] += 1;
        }
        self.touched.len()
    }

    /// Distinct devices of the loaded token, in order of first use.
    pub fn devices(&self) -> &[u32] {
        &self.touched
    }

    /// How many of the loaded token's experts sit on device `d`.
    pub fn count(&self, d: u32) -> u32 {
        self.counts[d as usize]
    }
}

/// C_T of one token: distinct devices holding its experts.
pub fn token_devices(ids: &[u32], device_of_expert: &[u32], num_devices: usize) -> usize {
    DeviceCounter::new(num_devices).load(ids, device_of_expert)
}

/// Sum of C_T over all tokens of a layer.
pub fn total_devices(ids: &[u32], k: usize, device_of_expert: &[u32], num_devices: usize) -> u64 {
    let mut c = DeviceCounter::new(num_devices);
    ids.chunks_exact(k)
        .map(|row| c.load(row, device_of_expert) as u64)
        .sum()
}

/// Everything `occult collab` reports for one layer under one placement.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerStats {
    pub layer: usize,
    pub tokens: usize,
    /// E[C_T].
    pub ect: f64,
    /// `ect_histogram[c]` = tokens with C_T = c, for c in 0..=min(k, D).
    pub ect_histogram: Vec<u64>,
    /// Share of co-activated expert pairs (within one token) that sit on one device;
    /// `None` when k = 1 (no pairs).
    pub intra_ratio: Option<f64>,
    pub rows_standard: u64,
    pub rows_occult: u64,
    pub remote_rows_standard: u64,
    pub remote_rows_occult: u64,
    /// Bytes of the remote rows, each direction (dispatch and, again, combine).
    pub remote_bytes_standard: u64,
    pub remote_bytes_occult: u64,
    /// `link_rows_*[s][d]`: rows from source rank s to device d (diagonal = local rows).
    pub link_rows_standard: Vec<Vec<u64>>,
    pub link_rows_occult: Vec<Vec<u64>>,
    /// Tokens that chose each expert.
    pub expert_load: Vec<u64>,
    /// (token, expert) pairs each device computes: its expert-compute load.
    pub device_load: Vec<u64>,
    /// Distinct tokens each device receives (its Occult rows).
    pub device_tokens: Vec<u64>,
    /// max / mean of `device_load`.
    pub max_load_ratio: f64,
    /// max / mean of `device_tokens`.
    pub max_token_ratio: f64,
}

/// Computes the statistics of one layer.
///
/// `ids` is `[tokens, k]`; `device_of_expert` has length E with values below `num_devices`;
/// `split` says which source rank each token starts on (its `ranks` must equal `num_devices`);
/// `row_bytes` is the size of one hidden-state row (hidden size x bytes per element).
pub fn layer_stats(
    layer: usize,
    ids: &[u32],
    k: usize,
    device_of_expert: &[u32],
    num_devices: usize,
    split: RankSplit,
    row_bytes: u64,
) -> LayerStats {
    let d_n = num_devices;
    let e = device_of_expert.len();
    let tokens = ids.len() / k;
    debug_assert_eq!(split.tokens, tokens);
    debug_assert_eq!(split.ranks, d_n);
    let mut hist = vec![0u64; k.min(d_n) + 1];
    let mut link_std = vec![vec![0u64; d_n]; d_n];
    let mut link_occ = vec![vec![0u64; d_n]; d_n];
    let mut expert_load = vec![0u64; e];
    let mut intra_pairs = 0u64;
    let mut counter = DeviceCounter::new(d_n);
    for (t, row) in ids.chunks_exact(k).enumerate() {
        let c = counter.load(row, device_of_expert);
        hist[c] += 1;
        let src = split.rank_of(t);
        for &d in counter.devices() {
            let n = counter.count(d) as u64;
            link_std[src][d as usize] += n;
            link_occ[src][d as usize] += 1;
            intra_pairs += n * (n - 1) / 2;
        }
        for &x in row {
            expert_load[x as usize] += 1;
        }
    }
    let sum_rows = |m: &Vec<Vec<u64>>| m.iter().flatten().sum::<u64>();
    let remote = |m: &Vec<Vec<u64>>| sum_rows(m) - (0..d_n).map(|i| m[i][i]).sum::<u64>();
    let rows_standard = sum_rows(&link_std);
    let rows_occult = sum_rows(&link_occ);
    let remote_rows_standard = remote(&link_std);
    let remote_rows_occult = remote(&link_occ);
    let mut device_load = vec![0u64; d_n];
    for (x, &d) in device_of_expert.iter().enumerate() {
        device_load[d as usize] += expert_load[x];
    }
    let device_tokens: Vec<u64> = (0..d_n)
        .map(|d| link_occ.iter().map(|r| r[d]).sum())
        .collect();
    let total_pairs = tokens as u64 * (k as u64 * (k as u64 - 1) / 2);
    LayerStats {
        layer,
        tokens,
        ect: if tokens == 0 {
            0.0
        } else {
            rows_occult as f64 / tokens as f64
        },
        ect_histogram: hist,
        intra_ratio: (total_pairs > 0).then(|| intra_pairs as f64 / total_pairs as f64),
        rows_standard,
        rows_occult,
        remote_rows_standard,
        remote_rows_occult,
        remote_bytes_standard: remote_rows_standard * row_bytes,
        remote_bytes_occult: remote_rows_occult * row_bytes,
        link_rows_standard: link_std,
        link_rows_occult: link_occ,
        max_load_ratio: max_over_mean(&device_load),
        max_token_ratio: max_over_mean(&device_tokens),
        expert_load,
        device_load,
        device_tokens,
    }
}

/// Mean of per-layer values weighted by their token counts (E[C_T] over every (layer, token)
/// pair, so that a layer with few tokens does not weigh as much as a full one); 0 without tokens.
pub fn token_weighted_mean(values: impl IntoIterator<Item = (f64, usize)>) -> f64 {
    let (sum, tokens) = values
        .into_iter()
        .fold((0.0, 0usize), |(s, n), (v, t)| (s + v * t as f64, n + t));
    if tokens == 0 {
        0.0
    } else {
        sum / tokens as f64
    }
}

/// max / mean of a list of counts (1 when all are zero).
pub fn max_over_mean(v: &[u64]) -> f64 {
    let sum: u64 = v.iter().sum();
    if sum == 0 {
        return 1.0;
    }
    let max = *v.iter().max().expect("non-empty") as f64;
    max * v.len() as f64 / sum as f64
}

/// Expected C_T of uniform-random top-k routing with equal-sized devices:
/// `D * (1 - C(E - E/D, k) / C(E, k))`. Used as the "no locality" reference.
pub fn uniform_ect(num_experts: usize, top_k: usize, num_devices: usize) -> f64 {
    let per = num_experts as f64 / num_devices as f64;
    // C(E - per, k) / C(E, k) = prod_{i<k} (E - per - i) / (E - i)
    let mut p = 1.0;
    for i in 0..top_k {
        let num = num_experts as f64 - per - i as f64;
        if num <= 0.0 {
            p = 0.0;
            break;
        }
        p *= num / (num_experts as f64 - i as f64);
    }
    num_devices as f64 * (1.0 - p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_checked_example() {
        // 4 experts on 2 devices: {0,1} -> 0, {2,3} -> 1. k = 2, 4 tokens, 2 source ranks.
        let map = [0, 0, 1, 1];
        let ids = [0, 1, /**/ 0, 2, /**/ 3, 2, /**/ 1, 3];
        let s = layer_stats(5, &ids, 2, &map, 2, RankSplit::new(4, 2), 10);
        assert_eq!(s.ect_histogram, vec![0, 2, 2]);
        assert_eq!(s.ect, 1.5);
        assert_eq!(s.rows_standard, 8);
        assert_eq!(s.rows_occult, 6);
        // Tokens 0,1 start on rank 0; tokens 2,3 on rank 1.
        // Standard remote: t0: 0, t1: 1 (expert 2), t2: 0, t3: 1 (expert 1) -> 2.
        assert_eq!(s.remote_rows_standard, 2);
        // Occult remote: t0: 0, t1: 1, t2: 0, t3: 1 -> 2.
        assert_eq!(s.remote_rows_occult, 2);
        assert_eq!(s.remote_bytes_occult, 20);
        assert_eq!(s.intra_ratio, Some(0.5));
        assert_eq!(s.expert_load, vec![2, 2, 2, 2]);
        assert_eq!(s.device_load, vec![4, 4]);
        assert_eq!(s.device_tokens, vec![3, 3]);
        assert_eq!(s.link_rows_occult, vec![vec![2, 1], vec![1, 2]]);
        assert_eq!(s.max_load_ratio, 1.0);
    }

    #[test]
    fn coactivation_is_symmetric_with_loads() {
        let ids = [0, 1, 2, /**/ 1, 2, 3];
        let c = CoActivation::from_ids(&ids, 3, 4);
        assert_eq!(c.get(1, 2), 2);
        assert_eq!(c.get(2, 1), 2);
        assert_eq!(c.get(0, 3), 0);
        assert_eq!(c.get(0, 0), 0);
        assert_eq!(c.loads, vec![1, 2, 2, 1]);
    }

    #[test]
    fn uniform_ect_matches_the_papers_reference() {
        // OLMoE on 4 devices: 64 experts, top-8, 16 per device -> about 3.66.
        let v = uniform_ect(64, 8, 4);
        assert!((v - 3.66).abs() < 0.01, "{v}");
        assert_eq!(uniform_ect(8, 8, 4), 4.0);
    }
}
