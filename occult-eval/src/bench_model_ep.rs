//! `occult bench model --devices D` (D > 1): a whole model data + expert parallel, every MoE
//! mode side by side in one run on the same prompts. Each of the D ranks prefills its own batch
//! of random prompts and decodes greedily from them; the single-device reference runs all the
//! prompts as one batch. Reported per mode: prefill tokens/s over all ranks, decode ms per step,
//! the prefill's exact traffic (rows, remote rows, remote bytes), E[C_T], the slowest rank's time
//! in each EP stage (summed over MoE layers), and with a link profile the projected prefill
//! time and decode step time of that machine.

use crate::commands::model_opts::{ModeArg, ModelOpts, PruneRuleArg};
use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor};
use occult_core::analysis::links::{project_step, swiglu_flops, LinkProfile, Projection, RankStep};
use occult_core::ep::comm::Exchange;
use occult_core::ep::StepStats;
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::{Logits, Model};
use serde::{Deserialize, Serialize};
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
    pub seed: u64,
}

/// One rank's measurements of one mode.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RankRun {
    pub rank: usize,
    /// The measured step: the best prefill of the repeats (bench model), or a training step
    /// (bench train).
    pub seconds: f64,
    /// The mean decode step time of that repeat's decode (0 when none).
    pub decode_step_s: f64,
    /// The prefill's EP statistics, summed over MoE layers.
    pub stats: StepStats,
    /// The prefill's all-to-alls, in order (lockstep announcement, then per MoE layer: slot
    /// metadata, rows out, rows back).
    pub exchanges: Vec<Exchange>,
    /// Expert FLOPs of the prefill on this rank.
    pub flops: f64,
    /// The last decode step's EP statistics, all-to-alls and expert FLOPs (empty without
    /// decode).
    pub decode_stats: StepStats,
    pub decode_exchanges: Vec<Exchange>,
    pub decode_flops: f64,
}

/// One mode's results over all ranks.
#[derive(Clone, Debug, Serialize)]
pub struct ModeResult {
    pub mode: String,
    pub devices: usize,
    /// Prompt tokens over all ranks.
    pub tokens: usize,
    pub rows_sent: usize,
    pub remote_rows_sent: usize,
    /// Bytes sent to other ranks during the prefill.
    pub bytes_sent: u64,
    pub ect: f64,
    /// The slowest rank's prefill.
    pub seconds: f64,
    pub tokens_per_s: f64,
    /// The slowest rank's decode step (one token for each of its sequences).
    pub decode_ms_per_token: f64,
    /// With a link profile: the projected decode step.
    pub decode_projected_s: Option<f64>,
    /// The decode step's traffic and E[C_T] (the last step's).
    pub decode_rows_sent: usize,
    pub decode_bytes_sent: u64,
    pub decode_ect: f64,
    /// Each EP stage's slowest rank during the prefill (summed over MoE layers).
    pub route_s: f64,
    pub plan_s: f64,
    pub dispatch_s: f64,
    pub compute_s: f64,
    pub combine_s: f64,
    /// With a link profile: the projected prefill time and its parts.
    pub projected_seconds: Option<f64>,
    pub projected: Option<Projection>,
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
            crate::bench_model::random_prompt(b.prompt_len, vocab, seed)
        })
        .collect()
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
        let next = logits
            .squeeze(1)?
            .to_dtype(DType::F32)?
            .argmax(candle::D::Minus1)?
            .to_dtype(DType::U32)?;
        logits = m.forward(&next.unsqueeze(1)?, Some(&mut cache), None, Logits::Last)?;
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
        let exchanges = comm.stats().exchanges;
        let mut decode_s = 0.0;
        let (mut decode_exchanges, mut decode_stats) = (Vec::new(), StepStats::default());
        let mut last = logits;
        for _ in 0..b.decode_tokens {
            comm.reset_stats();
            let clock = Instant::now();
            let next = last
                .squeeze(1)?
                .to_dtype(DType::F32)?
                .argmax(candle::D::Minus1)?
                .to_dtype(DType::U32)?;
            last = m.forward(&next.unsqueeze(1)?, Some(&mut cache), None, Logits::Last)?;
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
            };
        }
    }
    Ok(best)
}

/// The modes to run: (label, mode, pruning to this many devices).
fn modes(b: &EpModelBench) -> Vec<(String, ModeArg, Option<usize>)> {
    let mut out = vec![
        ("standard".to_string(), ModeArg::Standard, None),
        ("occult".to_string(), ModeArg::Occult, None),
    ];
    if b.max_devices > 0 && b.max_devices < b.devices {
        out.push((
            format!("occult, pruned to {}", b.max_devices),
            ModeArg::Occult,
            Some(b.max_devices),
        ));
    }
    out
}

/// Runs every EP mode on D ranks (threads, or this process's rank under mpirun) and, on rank 0,
/// the single-device reference; returns the results on rank 0 (`None` on other processes).
pub fn run(
    opts: &ModelOpts,
    ck: &Checkpoint,
    b: &EpModelBench,
    link: Option<&LinkProfile>,
) -> Result<Option<Vec<ModeResult>>> {
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
    for (label, mode, prune) in modes(b) {
        let o = mode_opts(opts, mode, prune);
        let work = occult_core::models::data_parallel::fingerprint(
            serde_json::to_vec(b).unwrap_or_default(),
        );
        let runs = o.run(ck, |m| measure(m, work, &label, || rank_run(m, b, ck)))?;
        if let Some(runs) = runs {
            let tokens = b.devices * b.batch.max(1) * b.prompt_len;
            results.push(combine(&label, b.devices, tokens, &runs, link, true));
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
    o.mode = Some(ModeArg::Reference);
    o.max_devices = None;
    o.backend = crate::commands::Backend::Local;
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
    results.insert(
        0,
        ModeResult {
            mode: "reference (1 device)".into(),
            devices: 1,
            tokens,
            rows_sent: 0,
            remote_rows_sent: 0,
            bytes_sent: 0,
            ect: 1.0,
            seconds: prefill_s,
            tokens_per_s: tokens as f64 / prefill_s.max(1e-12),
            decode_ms_per_token: step_s * 1e3,
            decode_projected_s: None,
            decode_rows_sent: 0,
            decode_bytes_sent: 0,
            decode_ect: 1.0,
            route_s: 0.0,
            plan_s: 0.0,
            dispatch_s: 0.0,
            compute_s: prefill_s,
            combine_s: 0.0,
            projected_seconds: None,
            projected: None,
        },
    );
    Ok(Some(results))
}

/// The options of one mode: its dispatch and pruning (by the router rule when the similarity
/// rule has no calibration).
pub(crate) fn mode_opts(opts: &ModelOpts, mode: ModeArg, prune: Option<usize>) -> ModelOpts {
    let mut o = opts.clone();
    o.mode = Some(mode);
    o.max_devices = prune;
    if prune.is_some() && o.prune_rule == PruneRuleArg::Similarity && o.calibration.is_none() {
        o.prune_rule = PruneRuleArg::Router;
    }
    o
}

/// A rank's part of one mode: the ranks check they run the same bench (`work`), rank 0 names
/// the mode, each measures, and rank 0 gathers every rank's run.
pub(crate) fn measure(
    m: &Model,
    work: u64,
    label: &str,
    rank_run: impl FnOnce() -> Result<RankRun>,
) -> Result<Vec<RankRun>> {
    m.check_same_work("bench settings", work)?;
    let (rank, size) = m.rank_and_size();
    if rank == 0 {
        eprintln!("{label}: {size} ranks");
    }
    let mine = rank_run()?;
    Ok(m.finish_and_gather(vec![mine])?)
}

/// One mode's result from every rank's run of `tokens` tokens in all. `forward_only`: the
/// exchanges are one forward's (the lockstep announcement, then per MoE layer slot metadata,
/// rows out, rows back), and the rows are projected in the profile's activation size;
/// otherwise every exchange is projected as measured (f32).
pub(crate) fn combine(
    label: &str,
    devices: usize,
    tokens: usize,
    runs: &[RankRun],
    link: Option<&LinkProfile>,
    forward_only: bool,
) -> ModeResult {
    let max = |f: fn(&RankRun) -> f64| runs.iter().map(f).fold(0.0, f64::max);
    let seconds = max(|r| r.seconds);
    let bytes_sent = runs
        .iter()
        .map(|r| Exchange::remote_bytes(&r.exchanges, r.rank))
        .sum();
    let project = |p: &LinkProfile, part: fn(&RankRun) -> (&[Exchange], f64)| {
        let steps: Vec<RankStep> = runs
            .iter()
            .map(|r| {
                let (exchanges, flops) = part(r);
                RankStep { flops, exchanges }
            })
            .collect();
        let n = steps.iter().map(|r| r.exchanges.len()).min().unwrap_or(0);
        let activations: Vec<usize> = if forward_only {
            (1..n).filter(|j| (j - 1) % 3 != 0).collect()
        } else {
            Vec::new()
        };
        project_step(p, &steps, &activations)
    };
    let projected = link.map(|p| project(p, |r| (&r.exchanges, r.flops)));
    let decoded = runs.iter().all(|r| !r.decode_exchanges.is_empty());
    let decode_projected_s = link
        .filter(|_| forward_only && decoded)
        .map(|p| project(p, |r| (&r.decode_exchanges, r.decode_flops)).total_s);
    ModeResult {
        mode: label.to_string(),
        devices,
        tokens,
        rows_sent: runs.iter().map(|r| r.stats.rows_sent).sum(),
        remote_rows_sent: runs.iter().map(|r| r.stats.remote_rows_sent).sum(),
        bytes_sent,
        ect: ect(runs.iter().map(|r| &r.stats)),
        seconds,
        tokens_per_s: tokens as f64 / seconds.max(1e-12),
        decode_ms_per_token: max(|r| r.decode_step_s) * 1e3,
        decode_projected_s,
        decode_rows_sent: runs.iter().map(|r| r.decode_stats.rows_sent).sum(),
        decode_bytes_sent: runs
            .iter()
            .map(|r| Exchange::remote_bytes(&r.decode_exchanges, r.rank))
            .sum(),
        decode_ect: ect(runs.iter().map(|r| &r.decode_stats)),
        route_s: max(|r| r.stats.route_s),
        plan_s: max(|r| r.stats.plan_s),
        dispatch_s: max(|r| r.stats.dispatch_s),
        compute_s: max(|r| r.stats.compute_s),
        combine_s: max(|r| r.stats.combine_s),
        projected_seconds: projected.as_ref().map(|p| p.total_s),
        projected,
    }
}

/// E[C_T] of ranks' statistics: token-layer pairs on both sides, so the mean over MoE layers.
fn ect<'a>(stats: impl Iterator<Item = &'a StepStats> + Clone) -> f64 {
    let touched: usize = stats.clone().map(|s| s.devices_touched).sum();
    touched as f64 / stats.map(|s| s.tokens).sum::<usize>().max(1) as f64
}

/// Prints the results as a table, then each mode's ratios to standard dispatch, measured beside
/// projected; `what` names the timed step ("prefill", "training step").
pub fn print_results(results: &[ModeResult], projected: bool, what: &str) {
    let ms = |s: f64| format!("{:.1}", s * 1e3);
    let (rate, time) = (format!("{what} tok/s"), format!("{what} ms"));
    let mut header = vec![
        "mode",
        "E[C_T]",
        "rows",
        "remote rows",
        "remote MB",
        rate.as_str(),
        time.as_str(),
        "decode ms/step",
        "route",
        "plan",
        "dispatch",
        "compute",
        "combine",
    ];
    let decode_projected = results.iter().any(|r| r.decode_projected_s.is_some());
    if projected {
        header.push("projected ms");
    }
    if decode_projected {
        header.push("decode projected ms");
    }
    let mut table = crate::table::Table::new(&header);
    for r in results {
        let mut row = vec![
            r.mode.clone(),
            format!("{:.3}", r.ect),
            r.rows_sent.to_string(),
            r.remote_rows_sent.to_string(),
            format!("{:.2}", r.bytes_sent as f64 / 1e6),
            format!("{:.1}", r.tokens_per_s),
            ms(r.seconds),
            format!("{:.2}", r.decode_ms_per_token),
            ms(r.route_s),
            ms(r.plan_s),
            ms(r.dispatch_s),
            ms(r.compute_s),
            ms(r.combine_s),
        ];
        if projected {
            row.push(
                r.projected_seconds
                    .map_or("-".into(), |s| format!("{:.3}", s * 1e3)),
            );
        }
        if decode_projected {
            row.push(
                r.decode_projected_s
                    .map_or("-".into(), |s| format!("{:.3}", s * 1e3)),
            );
        }
        table.row(row);
    }
    println!("{}", table.render());
    // Each mode against standard dispatch, measured in this run beside the projection.
    if let Some(s) = results.iter().find(|r| r.mode == "standard") {
        for o in results
            .iter()
            .filter(|r| r.devices > 1 && r.mode != "standard")
        {
            println!(
                "{} / standard: rows {:.3}, remote bytes {:.3}, {what} time {:.3} (speed-up \
                 {:.2}x){}",
                o.mode,
                o.rows_sent as f64 / s.rows_sent.max(1) as f64,
                o.bytes_sent as f64 / s.bytes_sent.max(1) as f64,
                o.seconds / s.seconds.max(1e-12),
                s.seconds / o.seconds.max(1e-12),
                match (o.projected_seconds, s.projected_seconds) {
                    (Some(x), Some(y)) => format!(", projected time {:.3}", x / y.max(1e-12)),
                    _ => String::new(),
                }
            );
        }
    }
}
