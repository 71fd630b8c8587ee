//! SGLang's static dispatch table, as SGLang builds it from an expert-location file (written
//! from sglang 0.5.23, `srt/eplb/expert_location.py`: `_compute_logical_to_all_physical_map`,
//! `compute_logical_to_rank_dispatch_physical_map`, `_find_nearest_expert`, `_fair_choices`;
//! held to that code by `tests/fixtures/sglang/dispatch.json`, which it wrote).
//!
//! With an all-to-all backend (DeepEP, what expert parallelism with a token exchange runs), each
//! rank r builds its own table: for every hidden layer in order and every logical expert in
//! order, its candidates are the expert's physical slots, narrowed to the nearest one when r has
//! one (a slot on r's GPU, else, over several nodes, a slot on r's node when that narrows the
//! list). Then every rank takes its nearest candidate; the ranks with none are dealt the
//! candidates by `_fair_choices` (each candidate `k / n` times, the remainder a
//! `random.sample`, the whole shuffled) from one `random.Random(42)` per rank, shared by all
//! layers. So a layer's table depends on the layers before it ([`SglangState`] carries the
//! per-rank generators), and rank r keeps only its own row.

use crate::pyrandom::PyRandom;

/// The seed SGLang gives `compute_logical_to_rank_dispatch_physical_map`.
const SEED: u128 = 42;

/// The per-rank generators after the layers fed so far, and the cluster's shape.
#[derive(Clone, Debug)]
pub struct SglangState {
    ep_size: usize,
    /// GPUs per node, when the EP group spans several nodes (`ep_size / nnodes`).
    gpus_per_node: Option<usize>,
    rngs: Vec<PyRandom>,
}

impl SglangState {
    /// Before the first hidden layer, on `ep_size` ranks; `gpus_per_node` where they span
    /// several nodes (SGLang's `ep_size // nnodes`; `None` or `ep_size`: one node).
    pub fn start(ep_size: usize, gpus_per_node: Option<usize>) -> Self {
        SglangState {
            ep_size,
            gpus_per_node: gpus_per_node.filter(|&g| g > 0 && g < ep_size),
            rngs: vec![PyRandom::new(SEED); ep_size],
        }
    }

    /// The next hidden layer's table from its row (`row[p]`: the logical expert in physical
    /// slot p, the slots dealt evenly over the ranks): `table[rank * E + e]`, the physical slot
    /// rank `rank` sends expert e's tokens to. Advances the generators past the layer.
    pub fn next_layer(&mut self, row: &[u32], num_logical: usize) -> Vec<u32> {
        let d = self.ep_size;
        let per_gpu = row.len() / d;
        let mut copies: Vec<Vec<u32>> = vec![Vec::new(); num_logical];
        for (p, &e) in row.iter().enumerate() {
            copies[e as usize].push(p as u32);
        }
        let gpu_of = |p: u32| p as usize / per_gpu;
        let node = self.gpus_per_node;
        // `_find_nearest_expert`: the one candidate, else the first on the rank's GPU, else the
        // first on its node where that narrows the list.
        let nearest = |cands: &[u32], rank: usize| -> Option<u32> {
            if let [only] = cands {
                return Some(*only);
            }
            if let Some(&p) = cands.iter().find(|&&p| gpu_of(p) == rank) {
                return Some(p);
            }
            let g = node?;
            let same: Vec<u32> = cands
                .iter()
                .copied()
                .filter(|&p| gpu_of(p) / g == rank / g)
                .collect();
            (!same.is_empty() && same.len() < cands.len()).then(|| same[0])
        };
        let mut table = vec![0u32; d * num_logical];
        for (e, all) in copies.iter().enumerate() {
            if all.is_empty() {
                continue;
            }
            // Each rank's nearest copy in the full list; the ranks without one.
            let near: Vec<Option<u32>> = (0..d).map(|rank| nearest(all, rank)).collect();
            let remaining: Vec<usize> = (0..d).filter(|&rank| near[rank].is_none()).collect();
            for (r, rng) in self.rngs.iter_mut().enumerate() {
                // Rank r's view is narrowed to its nearest copy where it has one: then every
                // rank's nearest is that copy and nothing is drawn. Otherwise the full list is
                // dealt to the ranks without a nearest copy, r among them.
                table[r * num_logical + e] = match near[r] {
                    Some(p) => p,
                    None => {
                        let dealt = fair_choices(all, remaining.len(), rng);
                        let at = remaining.iter().position(|&x| x == r).expect("r remains");
                        dealt[at]
                    }
                };
            }
        }
        table
    }
}

/// `_fair_choices(arr, k, r)`: each of `arr` `k / n` times, then `r.sample(arr, k % n)`, the
/// whole shuffled.
fn fair_choices(arr: &[u32], k: usize, rng: &mut PyRandom) -> Vec<u32> {
    let n = arr.len();
    let mut ans: Vec<u32> = Vec::with_capacity(k);
    for _ in 0..k / n {
        ans.extend_from_slice(arr);
    }
    ans.extend(rng.sample(n, k % n).into_iter().map(|i| arr[i]));
    rng.shuffle(&mut ans);
    ans
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-checked: one rank without a copy of a two-copy expert draws from the generator;
    /// ranks with a local copy take it; a one-copy expert goes everywhere to its copy.
    #[test]
    fn local_copies_are_kept_and_the_rest_are_dealt_fairly() {
        // 3 ranks of 2 slots: expert 0 on ranks 0 and 1, experts 1..4 once.
        let row = [0, 1, 0, 2, 3, 4];
        let mut st = SglangState::start(3, None);
        let t = st.next_layer(&row, 5);
        let e = 5;
        assert_eq!(t[0], 0); // rank 0: its own slot 0
        assert_eq!(t[e], 2); // rank 1: its own slot 2
        assert!([0, 2].contains(&t[2 * e]), "{}", t[2 * e]);
        for r in 0..3 {
            assert_eq!(t[r * e + 3], 4);
        }
        // The draw for rank 2 is one sample of one of two copies, shuffled: as Python's.
        let mut rng = PyRandom::new(42);
        let want = fair_choices(&[0, 2], 1, &mut rng);
        assert_eq!(t[2 * e], want[0]);
    }

    /// Every rank's table, layer after layer, as SGLang's own code built it
    /// (`scripts/make_sglang_dispatch_fixtures.py`): one and several nodes, dense layers'
    /// rows first, an expert twice on one GPU, no replicas.
    #[test]
    fn matches_sglangs_own_tables() {
        let v = crate::test_util::fixture_json("sglang/dispatch.json");
        let cases = v["cases"].as_array().unwrap();
        assert!(cases.len() >= 8);
        let num = |x: &serde_json::Value| x.as_u64().unwrap() as usize;
        for (c, case) in cases.iter().enumerate() {
            let (e, d, nodes) = (
                num(&case["num_logical"]),
                num(&case["ep_size"]),
                num(&case["nnodes"]),
            );
            let rows: Vec<Vec<u32>> = serde_json::from_value(case["rows"].clone()).unwrap();
            // tables[rank][layer][expert]
            let want: Vec<Vec<Vec<u32>>> = serde_json::from_value(case["tables"].clone()).unwrap();
            let mut st = SglangState::start(d, (nodes > 1).then(|| d / nodes));
            for (l, row) in rows.iter().enumerate() {
                let got = st.next_layer(row, e);
                for (r, table) in want.iter().enumerate() {
                    assert_eq!(
                        &got[r * e..(r + 1) * e],
                        &table[l][..],
                        "case {c}, layer {l}, rank {r}"
                    );
                }
            }
        }
    }
}
