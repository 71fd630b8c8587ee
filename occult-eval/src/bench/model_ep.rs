//! `occult bench model --devices D` (D > 1): a whole model data + expert parallel, every MoE
//! mode side by side in one run on the same prompts. Each of the D ranks prefills its own batch
//! of random prompts and decodes greedily from them; the single-device reference runs all the
//! prompts as one batch. Reported per mode: prefill tokens/s over all ranks, decode ms per step,
//! the prefill's exact traffic (rows, remote rows, remote bytes), E[C_T], the slowest rank's time
//! in each EP stage (summed over MoE layers), and with a link profile the projected prefill
//! time and decode step time of that machine.

use super::model_runs::{measure, plan, Measure};
use super::modes::{ep_dispatch, reference, summarise, Exchanges, ModeSummary, RankRun};
use crate::context::{Backend, ModelSpec};
use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor};
use occult_core::analysis::cost::links::{swiglu_flops, LinkProfile};
use occult_core::analysis::pruning::PruneLimit;
use occult_core::analysis::run_key::MoeMode;
use occult_core::ep::StepStats;
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::{Logits, Model};
use serde::Serialize;
use std::time::Instant;

/// The bench's settings.
#[derive(Clone, Debug, Serialize)]
pub struct EpModelBench {
    pub devices: usize,
    /// Sequences per rank.
    pub batch: usize,
    pub prompt_len: usize,
    pub decode_tokens: usize,
    pub repeats: usize,
    /// Devices per token in the pruned run (0: no pruned run).
    pub max_devices: usize,
    /// A node limit to run as one more pruned mode (`--max-nodes`).
    pub node_limit: Option<PruneLimit>,
    /// Devices per node when the ranks span nodes: the two-level exchange runs as one more
    /// mode (and with the node limit, one more).
    pub devices_per_node: Option<usize>,
    pub seed: u64,
}

/// How a prefill of `tokens` over `devices` ranks is laid out: each rank's share in sequences
/// of `seq_len` tokens (shorter when the share is), as (sequence length, sequences per rank).
pub fn prefill_shape(tokens: usize, devices: usize, seq_len: usize) -> (usize, usize) {
    let per_rank = (tokens / devices.max(1)).max(1);
    let len = seq_len.clamp(1, per_rank);
    (len, per_rank / len)
}

/// Rank `rank`'s batch of random prompts, `[batch, prompt_len]` row-major.
fn prompt(b: &EpModelBench, vocab: usize, rank: usize) -> Vec<u32> {
    (0..b.batch.max(1))
        .flat_map(|i| {
            let seed = b.seed + (rank * b.batch.max(1) + i) as u64;
            super::timing::random_prompt(b.prompt_len, vocab, seed)
        })
        .collect()
}

/// The greedy next token of each sequence from the last position's logits `[B, 1, V]`, as
/// the next input `[B, 1]`.
fn greedy_next(logits: &Tensor) -> Result<Tensor> {
    Ok(logits
        .squeeze(1)?
        .to_dtype(DType::F32)?
        .argmax(candle::D::Minus1)?
        .to_dtype(DType::U32)?
        .unsqueeze(1)?)
}

/// Prefill then greedy decode of `ids` `[B, T]`: (prefill seconds, seconds per decode step).
fn prefill_and_decode(m: &Model, ids: &[u32], batch: usize, steps: usize) -> Result<(f64, f64)> {
    let t = ids.len() / batch;
    let mut cache = m.new_cache();
    let clock = Instant::now();
    let x = Tensor::from_slice(ids, (batch, t), &Device::Cpu)?;
    let mut logits = m.forward(&x, Some(&mut cache), None, Logits::Last)?;
    // A GPU runs kernels after their launch returns: wait for them.
    logits.device().synchronize()?;
    let prefill_s = clock.elapsed().as_secs_f64();
    let clock = Instant::now();
    for _ in 0..steps {
        logits = m.forward(&greedy_next(&logits)?, Some(&mut cache), None, Logits::Last)?;
    }
    logits.device().synchronize()?;
    Ok((
        prefill_s,
        clock.elapsed().as_secs_f64() / steps.max(1) as f64,
    ))
}

/// This rank's runs of one mode: `repeats` times prefill and decode, keeping the best prefill.
fn rank_run(m: &Model, b: &EpModelBench, ck: &Checkpoint) -> Result<RankRun> {
    let (rank, _) = m.rank_and_size();
    let ids = prompt(b, ck.cfg.vocab_size, rank);
    let comm = m.comm().context("the EP modes have a communicator")?;
    let mut best = RankRun {
        rank,
        seconds: f64::INFINITY,
        ..RankRun::default()
    };
    for _ in 0..b.repeats.max(1) {
        comm.barrier()?;
        comm.reset_stats();
        m.take_ep_stats();
        let clock = Instant::now();
        let batch = b.batch.max(1);
        let x = Tensor::from_slice(&ids, (batch, b.prompt_len), &Device::Cpu)?;
        let mut cache = m.new_cache();
        let logits = m.forward(&x, Some(&mut cache), None, Logits::Last)?;
        logits.device().synchronize()?;
        let prefill_s = clock.elapsed().as_secs_f64();
        let stats = m.take_ep_stats();
        let comm_stats = comm.stats();
        let (exchanges, local_s) = (
            comm_stats.exchanges,
            (prefill_s - comm_stats.seconds).max(0.0),
        );
        let mut decode_s = 0.0;
        let (mut decode_exchanges, mut decode_stats) = (Vec::new(), StepStats::default());
        let mut last = logits;
        for _ in 0..b.decode_tokens {
            comm.reset_stats();
            let clock = Instant::now();
            last = m.forward(&greedy_next(&last)?, Some(&mut cache), None, Logits::Last)?;
            last.device().synchronize()?;
            decode_s += clock.elapsed().as_secs_f64();
            decode_stats = m.take_ep_stats();
            decode_exchanges = comm.stats().exchanges;
        }
        let decode_step_s = decode_s / b.decode_tokens.max(1) as f64;
        if prefill_s < best.seconds {
            let (h, i) = (ck.cfg.hidden_size, ck.cfg.moe.expert_intermediate);
            best = RankRun {
                rank,
                seconds: prefill_s,
                decode_step_s,
                flops: swiglu_flops(stats.pairs, h, i),
                stats,
                exchanges,
                decode_exchanges,
                decode_flops: swiglu_flops(decode_stats.pairs, h, i),
                decode_stats,
                local_s,
            };
        }
    }
    Ok(best)
}

/// Runs every EP mode on D ranks (threads, or this process's rank under mpirun) and, on rank 0,
/// the single-device reference; returns the results on rank 0 (`None` on other processes).
pub fn run(
    opts: &ModelSpec,
    ck: &Checkpoint,
    b: &EpModelBench,
    link: Option<&LinkProfile>,
) -> Result<Option<Vec<ModeSummary>>> {
    if b.devices < 2 {
        bail!("the expert-parallel model bench needs --devices 2 or more");
    }
    if b.prompt_len == 0 {
        bail!("--prompt-len must be at least 1");
    }
    if b.prompt_len + b.decode_tokens > ck.cfg.positions() {
        bail!(
            "--prompt-len {} plus --decode-tokens {} exceed the model's {} positions",
            b.prompt_len,
            b.decode_tokens,
            ck.cfg.positions()
        );
    }
    let mut results = Vec::new();
    let prune_devices = (b.max_devices > 0).then_some(b.max_devices);
    for key in plan(
        opts,
        b.devices,
        b.devices_per_node,
        prune_devices.into_iter().collect(),
        b.node_limit,
    ) {
        let how = Measure {
            key,
            settings: b,
            training: false,
            devices_per_node: b.devices_per_node,
        };
        if let Some(runs) = measure(opts, ck, &how, |m| rank_run(m, b, ck))? {
            let tokens = b.devices * b.batch.max(1) * b.prompt_len;
            let dispatch = ep_dispatch(&key);
            results.push(summarise(
                key,
                b.devices,
                tokens,
                &runs,
                link,
                Exchanges::model(dispatch),
            ));
        }
    }
    if results.is_empty() {
        return Ok(None);
    }
    // The single-device reference on the union of the ranks' prompts, one batch.
    let prompts = b.devices * b.batch.max(1);
    eprintln!("reference: 1 device, {prompts} prompts in one batch");
    let mut o = opts.clone();
    o.devices = 1;
    o.mode = Some(MoeMode::Reference);
    o.prune = None;
    o.backend = Backend::Local;
    let ids: Vec<u32> = (0..b.devices)
        .flat_map(|r| prompt(b, ck.cfg.vocab_size, r))
        .collect();
    let (prefill_s, step_s) = o
        .run(ck, |m| {
            let mut best = (f64::INFINITY, 0.0);
            for _ in 0..b.repeats.max(1) {
                let (p, s) = prefill_and_decode(m, &ids, prompts, b.decode_tokens)?;
                if p < best.0 {
                    best = (p, s);
                }
            }
            Ok(best)
        })?
        .context("the reference runs in this process")?;
    let tokens = prompts * b.prompt_len;
    results.insert(0, reference(tokens, prefill_s, Some(step_s), None));
    Ok(Some(results))
}
