//! Whole models data + expert parallel on local ranks (threads), on the committed transformers
//! fixtures of all five families: each rank runs its own sequences (uneven shares, one rank
//! with none) and every sequence's logits equal the one-device reference; and the gradients of
//! D ranks on the union of their batches equal one device's on the whole batch.

use candle::{DType, Device, Tensor, D};
use occult_core::ep::comm::local::run_local_with_timeout;
use occult_core::ep::comm::Communicator;
use occult_core::ep::dispatch::{DispatchMode, ExpertLocations};
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::{DenseParts, Logits, Model, MoeSetup};
use occult_tests::placements::random_maps;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

const ARCHS: [&str; 5] = ["olmoe", "qwen2_moe", "deepseek", "mixtral", "qwen3_moe"];

/// A peer that never arrives fails the test in seconds rather than hanging it.
const TIMEOUT: Duration = Duration::from_secs(20);

fn open(arch: &str, trainable: bool) -> Checkpoint {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/models")
        .join(arch);
    let mut ck = Checkpoint::open(dir.to_str().unwrap(), None, DType::F32).unwrap();
    ck.weights.set_trainable(trainable);
    ck
}

fn sequences(lengths: &[usize], vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    lengths
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(0..vocab as u32)).collect())
        .collect()
}

fn batch(seqs: &[&Vec<u32>]) -> Tensor {
    let t = seqs[0].len();
    let flat: Vec<u32> = seqs.iter().flat_map(|s| s.iter().copied()).collect();
    Tensor::from_slice(&flat, (seqs.len(), t), &Device::Cpu).unwrap()
}

fn setup(ck: &Checkpoint, d: usize, mode: DispatchMode, seed: u64) -> MoeSetup {
    MoeSetup {
        mode: Some(mode),
        maps: random_maps(&ck.cfg, d, seed),
        num_devices: d,
        prune: BTreeMap::new(),
    }
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

/// Which sequences rank `r` of `d` runs: uneven shares, and the last rank none (for d > 1).
fn share(n: usize, d: usize, r: usize) -> Vec<usize> {
    if d == 1 {
        return (0..n).collect();
    }
    (0..n).filter(|i| i % (d - 1) == r).collect()
}

#[test]
fn every_rank_runs_its_own_sequences_and_matches_one_device() {
    // Lengths differ, so ranks run different numbers of forwards of different sizes.
    let lengths = [7, 3, 9, 5, 4, 6];
    for (a, arch) in ARCHS.iter().enumerate() {
        let ck = open(arch, false);
        let seqs = sequences(&lengths, ck.cfg.vocab_size, a as u64);
        let reference = Model::load_reference(&ck.weights, &ck.cfg).unwrap();
        let want: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| {
                flat(
                    &reference
                        .forward(&batch(&[s]), None, None, Logits::All)
                        .unwrap(),
                )
            })
            .collect();
        let tol = 1e-4 * want.iter().map(|w| max_abs(w)).fold(1.0, f32::max);
        let dense = DenseParts::load(&ck.weights, &ck.cfg).unwrap();
        for (d, mode) in [
            (1, DispatchMode::Occult),
            (2, DispatchMode::Standard),
            (3, DispatchMode::Occult),
            (4, DispatchMode::Standard),
            (4, DispatchMode::Occult),
        ] {
            let setup = setup(&ck, d, mode, 10 + d as u64);
            let out = run_local_with_timeout(d, TIMEOUT, |comm: &Arc<dyn Communicator>| {
                let m = Model::assemble(dense.clone(), &ck.weights, &setup, Some(comm.clone()))?;
                let mut got = Vec::new();
                let mine = share(seqs.len(), d, comm.rank());
                for i in mine {
                    let logits = m.forward(&batch(&[&seqs[i]]), None, None, Logits::All)?;
                    got.push((i, flat(&logits)));
                }
                m.finish()?;
                Ok(got)
            });
            let mut seen = vec![false; seqs.len()];
            for (r, res) in out.into_iter().enumerate() {
                let got = res.unwrap_or_else(|e| panic!("{arch} D={d} {mode:?} rank {r}: {e}"));
                if d > 1 && r == d - 1 {
                    assert!(got.is_empty());
                }
                for (i, logits) in got {
                    let err = max_diff(&logits, &want[i]);
                    assert!(err <= tol, "{arch} D={d} {mode:?} sequence {i}: {err}");
                    seen[i] = true;
                }
            }
            assert!(
                seen.iter().all(|&s| s),
                "{arch} D={d}: a sequence was not run"
            );
        }
    }
}

/// Next-token loss summed over the sequences `seqs` (one batch of equal lengths), divided by
/// `global_tokens`.
fn loss(m: &Model, seqs: &[&Vec<u32>], global_tokens: usize) -> Tensor {
    let t = seqs[0].len();
    let inputs: Vec<Vec<u32>> = seqs.iter().map(|s| s[..t - 1].to_vec()).collect();
    let targets: Vec<u32> = seqs.iter().flat_map(|s| s[1..].iter().copied()).collect();
    let logits = m
        .forward(
            &batch(&inputs.iter().collect::<Vec<_>>()),
            None,
            None,
            Logits::All,
        )
        .unwrap();
    let v = logits.dims3().unwrap().2;
    let logp = candle_nn::ops::log_softmax(&logits.reshape(((), v)).unwrap(), D::Minus1).unwrap();
    let target = Tensor::from_slice(&targets, (targets.len(), 1), &Device::Cpu).unwrap();
    (logp
        .gather(&target, 1)
        .unwrap()
        .sum_all()
        .unwrap()
        .neg()
        .unwrap()
        / global_tokens as f64)
        .unwrap()
}

#[test]
fn gradients_of_d_ranks_on_the_union_batch_equal_one_device() {
    let n_seq = 4;
    let len = 9;
    for (a, arch) in ARCHS.iter().enumerate() {
        let ck = open(arch, true);
        let seqs = sequences(&vec![len; n_seq], ck.cfg.vocab_size, 100 + a as u64);
        let global = n_seq * (len - 1);
        // One device, the whole batch.
        let reference = Model::load_reference(&ck.weights, &ck.cfg).unwrap();
        let grads = loss(&reference, &seqs.iter().collect::<Vec<_>>(), global)
            .backward()
            .unwrap();
        let want: BTreeMap<String, Tensor> = reference
            .params()
            .into_iter()
            .map(|(name, t)| {
                // A tensor the loss does not reach (an expert no token chose) has gradient 0.
                let g = grads.get(&t).cloned().unwrap_or(t.zeros_like().unwrap());
                (name, g)
            })
            .collect();
        let dense = DenseParts::load(&ck.weights, &ck.cfg).unwrap();
        // D = 4: rank 0 takes two sequences, rank 2 none.
        for (d, mode, shares) in [
            (2, DispatchMode::Occult, vec![vec![0, 1], vec![2, 3]]),
            (2, DispatchMode::Standard, vec![vec![0, 1], vec![2, 3]]),
            (
                4,
                DispatchMode::Occult,
                vec![vec![0, 1], vec![2], vec![], vec![3]],
            ),
            (
                4,
                DispatchMode::Standard,
                vec![vec![0, 1], vec![2], vec![], vec![3]],
            ),
        ] {
            let setup = setup(&ck, d, mode, 20 + d as u64);
            let out = run_local_with_timeout(d, TIMEOUT, |comm: &Arc<dyn Communicator>| {
                let m = Model::assemble(dense.clone(), &ck.weights, &setup, Some(comm.clone()))?;
                let mine: Vec<&Vec<u32>> = shares[comm.rank()].iter().map(|&i| &seqs[i]).collect();
                let local_tokens = mine.len() * (len - 1);
                assert_eq!(m.global_count(local_tokens)?, global);
                let l = if mine.is_empty() {
                    m.forward_empty()?
                } else {
                    loss(&m, &mine, global)
                };
                let mut grads = l.backward()?;
                m.all_reduce_grads(&mut grads)?;
                let mut got = Vec::new();
                for (name, t) in m.params() {
                    let g = grads.get(&t).map(flat);
                    got.push((name, g));
                }
                Ok(got)
            });
            for (r, res) in out.into_iter().enumerate() {
                let got = res.unwrap_or_else(|e| panic!("{arch} D={d} {mode:?} rank {r}: {e}"));
                for (name, g) in got {
                    let full = &want[&name];
                    let expected = if name.contains(".experts.") {
                        // This rank's experts, in slot order.
                        let layer: usize = name.split('.').nth(2).unwrap().parse().unwrap();
                        let mine = &ExpertLocations::new(&setup.maps[&layer], d).experts_of[r];
                        let idx = Tensor::from_slice(mine, mine.len(), &Device::Cpu).unwrap();
                        flat(&full.index_select(&idx, 0).unwrap())
                    } else {
                        flat(full)
                    };
                    let g = g.unwrap_or_else(|| vec![0.0; expected.len()]);
                    let tol = 1e-4 * max_abs(&expected).max(1e-3);
                    let err = max_diff(&g, &expected);
                    assert!(
                        err <= tol,
                        "{arch} D={d} {mode:?} rank {r}: {name}: {err} (scale {})",
                        max_abs(&expected)
                    );
                }
            }
        }
    }
}
