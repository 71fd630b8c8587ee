//! Whole-model data + expert parallel checks, run by one rank of any communicator (threads in
//! `tests/tests/data_parallel.rs`, processes under mpirun in the `mpi-model` binary). Each rank
//! computes the one-device reference itself from the same checkpoint, runs its own share, and
//! returns what differs.

use crate::placements::random_maps;
use candle::{DType, Device, Tensor, D};
use occult_core::analysis::run_key::DispatchMode;
use occult_core::ep::comm::Communicator;
use occult_core::ep::dispatch::ExpertLocations;
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::{DenseParts, Logits, Model, MoeSetup};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

/// The committed transformers fixtures (`tests/fixtures/models`).
pub const ARCHS: [&str; 10] = [
    "olmoe",
    "qwen2_moe",
    "deepseek",
    "mixtral",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v2",
    "gpt_oss",
    "gpt_oss_mxfp4",
];

/// The folder of committed fixture `arch`.
pub fn fixture_dir(arch: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/models")
        .join(arch)
}

/// Opens a committed fixture in f32, its weights trainable if asked.
pub fn open(arch: &str, trainable: bool) -> Checkpoint {
    let dir = fixture_dir(arch);
    let mut ck = Checkpoint::open(dir.to_str().expect("a UTF-8 path"), None, DType::F32)
        .expect("the committed fixture opens");
    ck.weights.set_trainable(trainable);
    ck
}

/// Seeded random token sequences of the given lengths.
pub fn sequences(lengths: &[usize], vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    lengths
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(0..vocab as u32)).collect())
        .collect()
}

fn batch(seqs: &[&Vec<u32>]) -> candle::Result<Tensor> {
    let t = seqs[0].len();
    let flat: Vec<u32> = seqs.iter().flat_map(|s| s.iter().copied()).collect();
    Tensor::from_slice(&flat, (seqs.len(), t), &Device::Cpu)
}

/// The EP setup of a D-rank run: a seeded random placement per MoE layer; the two-level mode
/// in nodes of 2 devices.
pub fn setup(ck: &Checkpoint, d: usize, mode: DispatchMode, seed: u64) -> MoeSetup {
    MoeSetup {
        mode: Some(mode),
        maps: random_maps(&ck.cfg, d, seed),
        num_devices: d,
        prune: BTreeMap::new(),
        devices_per_node: (mode == DispatchMode::TwoLevel && d.is_multiple_of(2)).then_some(2),
        replicas: BTreeMap::new(),
    }
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .expect("a tensor to the host")
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

/// Which of `n` sequences rank `r` of `d` runs: uneven shares, and none on the last rank (for
/// d > 1).
pub fn share(n: usize, d: usize, r: usize) -> Vec<usize> {
    if d == 1 {
        return (0..n).collect();
    }
    (0..n).filter(|i| i % (d - 1) == r).collect()
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Runs this rank's share of sequences of different lengths (one forward each, so ranks run
/// different numbers of forwards), then [`Model::finish`], and checks every sequence's logits
/// against the one-device reference (1e-4 of the logits' scale). Returns how many it checked.
pub fn check_logits(
    ck: &Checkpoint,
    comm: &Arc<dyn Communicator>,
    mode: DispatchMode,
    seed: u64,
) -> Result<usize, String> {
    let d = comm.size();
    let seqs = sequences(&[7, 3, 9, 5, 4, 6], ck.cfg.vocab_size, seed);
    let reference = Model::load_reference(&ck.weights, &ck.cfg).map_err(err)?;
    let dense = DenseParts::load(&ck.weights, &ck.cfg).map_err(err)?;
    let setup = setup(ck, d, mode, seed);
    let m = Model::assemble(dense, &ck.weights, &setup, Some(comm.clone())).map_err(err)?;
    let mine = share(seqs.len(), d, comm.rank());
    let mut got = Vec::new();
    for &i in &mine {
        let logits = m
            .forward(&batch(&[&seqs[i]]).map_err(err)?, None, None, Logits::All)
            .map_err(err)?;
        got.push((i, flat(&logits)));
    }
    m.finish().map_err(err)?;
    for (i, logits) in got {
        let want = reference
            .forward(&batch(&[&seqs[i]]).map_err(err)?, None, None, Logits::All)
            .map_err(err)?;
        let want = flat(&want);
        let e = max_diff(&logits, &want);
        if e > 1e-4 * max_abs(&want).max(1.0) {
            return Err(format!("sequence {i}: logits differ by {e}"));
        }
    }
    Ok(mine.len())
}

/// Next-token loss summed over `seqs` (one batch of equal lengths), divided by `global`.
fn loss(m: &Model, seqs: &[&Vec<u32>], global: usize) -> candle::Result<Tensor> {
    let t = seqs[0].len();
    let inputs: Vec<Vec<u32>> = seqs.iter().map(|s| s[..t - 1].to_vec()).collect();
    let targets: Vec<u32> = seqs.iter().flat_map(|s| s[1..].iter().copied()).collect();
    let logits = m
        .forward(
            &batch(&inputs.iter().collect::<Vec<_>>())?,
            None,
            None,
            Logits::All,
        )
        .map_err(|e| candle::Error::Msg(e.to_string()))?;
    let v = logits.dims3()?.2;
    let logp = candle_nn::ops::log_softmax(&logits.reshape(((), v))?, D::Minus1)?;
    let target = Tensor::from_slice(&targets, (targets.len(), 1), &Device::Cpu)?;
    logp.gather(&target, 1)?.sum_all()?.neg()? / global as f64
}

/// Where a rank stops on purpose in [`check_gradients`] (to test that its peers fail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Die {
    BeforeForward,
    BeforeBackward,
}

/// The one-device reference's gradients for the union batch of `n_seq` sequences of `len`
/// tokens (seeded), with the loss normalised by the whole batch's tokens.
pub fn reference_step(
    ck: &Checkpoint,
    n_seq: usize,
    seed: u64,
) -> Result<(Model, candle::backprop::GradStore), String> {
    let len = 9;
    let seqs = sequences(&vec![len; n_seq], ck.cfg.vocab_size, seed);
    let reference = Model::load_reference(&ck.weights, &ck.cfg).map_err(err)?;
    let grads = loss(
        &reference,
        &seqs.iter().collect::<Vec<_>>(),
        n_seq * (len - 1),
    )
    .and_then(|l| l.backward())
    .map_err(err)?;
    Ok((reference, grads))
}

/// This rank's part of one training step on the union batch (`shares[r]`: rank r's
/// sequences; empty shares take part through [`Model::forward_empty`]): its loss divided by the
/// global token count, backward, and the replicated gradients all-reduced. `die` makes this
/// rank exit there, with status 7.
pub fn rank_step(
    ck: &Checkpoint,
    comm: &Arc<dyn Communicator>,
    setup: &MoeSetup,
    seed: u64,
    shares: &[Vec<usize>],
    die: Option<Die>,
) -> Result<(Model, candle::backprop::GradStore), String> {
    let rank = comm.rank();
    let n_seq = shares.iter().map(Vec::len).sum::<usize>();
    let len = 9;
    let seqs = sequences(&vec![len; n_seq], ck.cfg.vocab_size, seed);
    let global = n_seq * (len - 1);
    let dense = DenseParts::load(&ck.weights, &ck.cfg).map_err(err)?;
    let m = Model::assemble(dense, &ck.weights, setup, Some(comm.clone())).map_err(err)?;
    if die == Some(Die::BeforeForward) {
        eprintln!("rank {rank}: exiting on purpose before the forward");
        std::process::exit(7);
    }
    let mine: Vec<&Vec<u32>> = shares[rank].iter().map(|&i| &seqs[i]).collect();
    let counted = m.global_count(mine.len() * (len - 1)).map_err(err)?;
    if counted != global {
        return Err(format!("global token count {counted}, expected {global}"));
    }
    let l = if mine.is_empty() {
        m.forward_empty().map_err(err)?
    } else {
        loss(&m, &mine, global).map_err(err)?
    };
    if die == Some(Die::BeforeBackward) {
        eprintln!("rank {rank}: exiting on purpose before the backward");
        std::process::exit(7);
    }
    let mut grads = l.backward().map_err(err)?;
    m.all_reduce_grads(&mut grads).map_err(err)?;
    Ok((m, grads))
}

/// One training step on the union of the ranks' batches ([`rank_step`]): every trainable
/// tensor's gradient must equal one device's on the whole batch (a rank's experts: those rows
/// of the full expert gradients).
pub fn check_gradients(
    ck: &Checkpoint,
    comm: &Arc<dyn Communicator>,
    mode: DispatchMode,
    seed: u64,
    shares: &[Vec<usize>],
    die: Option<Die>,
) -> Result<(), String> {
    let (d, rank) = (comm.size(), comm.rank());
    let n_seq = shares.iter().map(Vec::len).sum::<usize>();
    let (reference, grads) = reference_step(ck, n_seq, seed)?;
    let want: BTreeMap<String, Tensor> = reference
        .params()
        .into_iter()
        .map(|(name, t)| {
            // A tensor the loss does not reach (an expert no token chose) has gradient 0.
            let g = grads
                .get(&t)
                .cloned()
                .unwrap_or(t.zeros_like().expect("zeros"));
            (name, g)
        })
        .collect();
    let setup = setup(ck, d, mode, seed);
    let (m, grads) = rank_step(ck, comm, &setup, seed, shares, die)?;
    for (name, t) in m.params() {
        let full = &want[&name];
        let expected = if name.contains(".experts.") {
            // This rank's experts, in slot order.
            let layer: usize = name
                .split('.')
                .nth(2)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("no layer in {name}"))?;
            let mine = &ExpertLocations::new(&setup.maps[&layer], d).experts_of[rank];
            let idx = Tensor::from_slice(mine, mine.len(), &Device::Cpu).map_err(err)?;
            flat(&full.index_select(&idx, 0).map_err(err)?)
        } else {
            flat(full)
        };
        let got = grads
            .get(&t)
            .map(flat)
            .unwrap_or_else(|| vec![0.0; expected.len()]);
        let e = max_diff(&got, &expected);
        if e > 1e-4 * max_abs(&expected).max(1e-3) {
            return Err(format!(
                "{name}: gradient differs by {e} (scale {})",
                max_abs(&expected)
            ));
        }
    }
    Ok(())
}

/// The shares of the gradient check on `d` ranks: uneven, with an empty rank from d = 3.
pub fn gradient_shares(d: usize) -> Vec<Vec<usize>> {
    match d {
        1 => vec![vec![0, 1, 2, 3]],
        2 => vec![vec![0, 1], vec![2, 3]],
        3 => vec![vec![0, 1, 2], vec![], vec![3]],
        _ => {
            let mut s = vec![vec![0, 1], vec![2], vec![], vec![3]];
            s.resize(d, Vec::new());
            s
        }
    }
}
