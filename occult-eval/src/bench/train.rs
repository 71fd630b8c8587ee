//! `occult bench train`: a fine-tuning step of the MoE blocks on D ranks in every mode side by
//! side, on the same model, data and steps: standard dispatch, Occult dispatch, and Occult
//! pruned to 2 and to 1 devices. Each rank trains on its own share of a seeded random batch;
//! after warm-up steps, each mode's fastest measured step is reported with its exact traffic
//! (forward and backward exchanges, gradient reduction), E[C_T], the EP stages' times, and
//! with a link profile its projection (the exchanges as measured, in f32).

use super::model_runs::{measure, plan, Measure};
use super::modes::{summarise, Exchanges, ModeSummary, RankRun};
use crate::context::ModelSpec;
use anyhow::{bail, Context, Result};
use occult_core::analysis::cost::links::{swiglu_flops, LinkProfile};
use occult_core::analysis::PruneLimit;
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::Model;
use occult_train::examples::Example;
use occult_train::optim::{AdamW, AdamWConfig};
use occult_train::step::{train_step, StepSettings};
use serde::Serialize;
use std::time::Instant;

/// The bench's settings.
#[derive(Clone, Debug, Serialize)]
pub struct TrainBench {
    pub devices: usize,
    /// Sequences per rank and step, and their length.
    pub batch_per_rank: usize,
    pub seq_len: usize,
    pub warmup: usize,
    pub steps: usize,
    pub seed: u64,
}

/// This rank's sequences: random tokens, every position but the first a target.
fn examples(b: &TrainBench, vocab: usize, rank: usize) -> Vec<Example> {
    (0..b.batch_per_rank)
        .map(|i| {
            let seed = b.seed + (rank * b.batch_per_rank + i) as u64;
            let ids = super::timing::random_prompt(b.seq_len, vocab, seed);
            Example {
                target: (0..ids.len()).map(|j| j > 0).collect(),
                ids,
            }
        })
        .collect()
}

/// This rank's warm-up and measured steps; keeps the fastest measured one.
fn rank_run(m: &Model, b: &TrainBench, ck: &Checkpoint) -> Result<RankRun> {
    let (rank, _) = m.rank_and_size();
    let comm = m.comm().context("the EP modes have a communicator")?;
    let mine = examples(b, ck.cfg.vocab_size, rank);
    let share: Vec<&Example> = mine.iter().collect();
    let mut opt = AdamW::new(&m.trainable_params(), AdamWConfig::default())?;
    let mut best = RankRun {
        rank,
        seconds: f64::INFINITY,
        ..RankRun::default()
    };
    for step in 0..b.warmup + b.steps {
        comm.barrier()?;
        comm.reset_stats();
        let clock = Instant::now();
        let report = train_step(
            m,
            &mut opt,
            &share,
            &StepSettings {
                max_norm: Some(1.0),
                ..StepSettings::new(1e-5)
            },
        )?;
        let seconds = clock.elapsed().as_secs_f64();
        let stats = report.ep;
        if step >= b.warmup && seconds < best.seconds {
            let (h, i) = (ck.cfg.hidden_size, ck.cfg.moe.expert_intermediate);
            best = RankRun {
                rank,
                seconds,
                decode_step_s: 0.0,
                // Forward, and a backward of about twice its FLOPs.
                flops: 3.0 * swiglu_flops(stats.pairs, h, i),
                stats,
                local_s: (seconds - comm.stats().seconds).max(0.0),
                exchanges: comm.stats().exchanges,
                ..RankRun::default()
            };
        }
    }
    Ok(best)
}

/// Runs every mode on D ranks; returns the results on rank 0 (`None` on other processes).
pub fn run(
    opts: &ModelSpec,
    ck: &mut Checkpoint,
    b: &TrainBench,
    link: Option<&LinkProfile>,
) -> Result<Option<Vec<ModeSummary>>> {
    if b.devices < 2 {
        bail!("the training bench compares expert-parallel modes: give --devices 2 or more");
    }
    if b.steps == 0 || b.batch_per_rank == 0 || b.seq_len < 2 {
        bail!("--steps and --batch-size must be at least 1, and --seq-len at least 2");
    }
    if b.seq_len > ck.cfg.positions() {
        bail!(
            "--seq-len {} exceeds the model's {} positions",
            b.seq_len,
            ck.cfg.positions()
        );
    }
    ck.weights.set_trainable_only(ck.cfg.moe_prefixes());
    // Across nodes, the two-level exchange runs too; a node limit asked for (`--max-nodes`)
    // runs in each exchange.
    let nodes = super::modes::node_size(opts.devices_per_node, link, b.devices);
    let node_limit = opts.prune.filter(|l| matches!(l, PruneLimit::Nodes { .. }));
    let mut results = Vec::new();
    let ck = &*ck;
    for key in plan(opts, b.devices, nodes, vec![2, 1], node_limit) {
        let how = Measure {
            key,
            settings: b,
            training: true,
            devices_per_node: nodes,
        };
        if let Some(runs) = measure(opts, ck, &how, |m| rank_run(m, b, ck))? {
            let tokens = b.devices * b.batch_per_rank * b.seq_len;
            results.push(summarise(
                key,
                b.devices,
                tokens,
                &runs,
                link,
                Exchanges::Measured,
            ));
        }
    }
    Ok((!results.is_empty()).then_some(results))
}

/// `occult bench train`: runs every mode on `spec`'s ranks, prints the table on rank 0 and
/// writes it as JSON to `json`, projected onto `link` when given.
pub fn bench(
    spec: &ModelSpec,
    bench: &TrainBench,
    link: Option<&LinkProfile>,
    json: Option<&std::path::Path>,
) -> Result<()> {
    let mut ck = spec.open()?;
    let Some(results) = run(spec, &mut ck, bench, link)? else {
        return Ok(());
    };
    super::modes::print(&results, link.is_some(), "training step");
    println!(
        "({} ranks, {} sequences of {} tokens each per step; training the MoE blocks; stage \
         times are the slowest rank's forward stages, summed over MoE layers)",
        bench.devices, bench.batch_per_rank, bench.seq_len
    );
    if let Some(p) = json {
        super::report::write_modes(
            p,
            "train",
            Some(&ck.name),
            spec.backend,
            bench,
            link,
            &results,
        )?;
    }
    Ok(())
}
