//! Fine-tuning: the MoE blocks (routers, experts, shared experts; everything else frozen, as
//! in the paper; or every tensor) on instruction data (Alpaca) or plain text, on a model's
//! ranks, with exact or pruned routing. Writes the model in the source's layout, `log.jsonl`
//! (a line per step) and the state a resumed run continues from, in the output folder.

use crate::context::ModelSpec;
use anyhow::{bail, Context, Result};
use occult_core::models::loader::Checkpoint;
use occult_train::dataset::{build, read_records, Dataset};
use occult_train::heldout::heldout_loss;
use occult_train::log::{read_lines, read_log, LogLine, StepRecord};
use occult_train::run::{has_saved_state, holds_a_run, saved_step, train, Job, TrainConfig};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One fine-tuning run: its data, its output folder and its schedule.
#[derive(Clone, Debug)]
pub struct FineTune {
    /// Training data: a JSON/JSONL/Parquet file, a folder with a train split, or a dataset id
    /// in the Hugging Face cache.
    pub data: String,
    /// Output folder: the fine-tuned model, log.jsonl and the resumable state.
    pub out: PathBuf,
    /// Optimiser steps (the learning-rate schedule runs over them).
    pub steps: u64,
    /// Longest sequence in tokens; 512, or the model's positions if fewer, when `None`.
    pub seq_len: Option<usize>,
    /// Examples per step over all ranks.
    pub batch_size: usize,
    /// Micro-batches per step on each rank.
    pub grad_accum: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Linear warm-up steps; 3% of the steps when `None`.
    pub warmup: Option<u64>,
    /// The final learning rate as a fraction of the peak (cosine decay).
    pub min_lr_ratio: f64,
    pub weight_decay: f64,
    /// Clip gradients to this global norm.
    pub max_grad_norm: f64,
    /// Seed of the data order.
    pub seed: u64,
    /// Save the model and state every this many steps (and at the end).
    pub save_every: Option<u64>,
    /// Continue the run saved in `out`.
    pub resume: bool,
    /// Start afresh in an `out` that holds another run.
    pub overwrite: bool,
    /// Stop after this many steps (saving first); the schedule still runs over `steps`.
    pub stop_at: Option<u64>,
    /// Add the tokenizer's special tokens (BOS) when encoding.
    pub add_bos: bool,
    /// Add the model's load-balancing auxiliary loss.
    pub aux_loss: bool,
    /// Held-out data, scored at the end and every `eval_every` steps.
    pub eval_data: Option<String>,
    pub eval_every: Option<u64>,
    /// What trains.
    pub train: TrainWhat,
}

impl FineTune {
    /// `data` into `out`, every setting at `occult train`'s default.
    pub fn new(data: &str, out: &Path) -> Self {
        FineTune {
            data: data.to_string(),
            out: out.to_path_buf(),
            steps: 1000,
            seq_len: None,
            batch_size: 8,
            grad_accum: 1,
            lr: 2e-5,
            warmup: None,
            min_lr_ratio: 0.0,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            seed: 0,
            save_every: None,
            resume: false,
            overwrite: false,
            stop_at: None,
            add_bos: false,
            aux_loss: false,
            eval_data: None,
            eval_every: None,
            train: TrainWhat::Moe,
        }
    }
}

/// What fine-tuning trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainWhat {
    /// Routers, experts and shared experts; everything else frozen.
    Moe,
    /// Every tensor: embeddings, attention, norms, dense MLPs, the MoE blocks and the head.
    All,
}

/// `--seq-len`, or its default: 512, or the model's positions if fewer.
pub(crate) fn seq_len(ck: &Checkpoint, given: Option<usize>) -> usize {
    given.unwrap_or_else(|| ck.cfg.positions().min(512))
}

/// Training or held-out data as examples of at most `seq_len` tokens (checked against the
/// model's positions); says how many records were too long to keep.
pub(crate) fn load_examples(
    ck: &Checkpoint,
    data: &str,
    seq_len: usize,
    add_bos: bool,
) -> Result<Dataset> {
    if seq_len < 2 || seq_len > ck.cfg.positions() {
        bail!(
            "--seq-len {seq_len} must be between 2 and the model's {} positions",
            ck.cfg.positions()
        );
    }
    let set = build(&read_records(data)?, ck.tokenizer()?, seq_len, add_bos)
        .with_context(|| format!("reading {data}"))?;
    if set.skipped > 0 {
        eprintln!(
            "note: {data}: {} record(s) skipped: their prompt fills --seq-len {seq_len}",
            set.skipped
        );
    }
    Ok(set)
}

/// Runs `job` on `spec`'s ranks (rank 0 writes the log and the model). Returns the run's log,
/// every step from the first (those a resumed run kept, then its own), on rank 0; `None` on the
/// other processes of an `mpirun` job, except where the run has nothing left to do (then the
/// log as every process reads it).
pub fn fine_tune(spec: &ModelSpec, job: &FineTune) -> Result<Option<Vec<StepRecord>>> {
    let a = job;
    refuse_out_over_model(&a.out, &spec.model)?;
    let cfg = train_config(a)?;
    if a.out.exists() && !a.out.is_dir() {
        bail!("--out {} is not a folder", a.out.display());
    }
    let mut ck = spec.open_header()?;
    spec.check_memory(&ck, true)?;
    let data = load_examples(&ck, &a.data, seq_len(&ck, a.seq_len), a.add_bos)?;
    let held_out = match &a.eval_data {
        Some(d) => Some(load_examples(&ck, d, seq_len(&ck, a.seq_len), a.add_bos)?),
        None => None,
    };
    if a.eval_every == Some(0) {
        bail!("--eval-every must be at least 1");
    }
    let settings = run_settings(spec, a, &ck)?;
    let start = start_step(spec, a, &cfg, &ck.name, &settings)?;
    let log_path = a.out.join("log.jsonl");
    let until = a.stop_at.unwrap_or(cfg.steps).min(cfg.steps);
    if start >= until {
        eprintln!(
            "the run in {} is at step {start}: nothing to do",
            a.out.display()
        );
        return Ok(Some(read_log(&log_path)?));
    }
    let created = !a.out.exists();
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    // The log keeps the steps before the resumed one, as they were written.
    let kept: Vec<LogLine> = read_lines(&log_path)?
        .into_iter()
        .filter(|l| a.resume && l.record.as_ref().is_some_and(|r| r.step < start))
        .collect();
    match a.train {
        TrainWhat::Moe => ck.weights.set_trainable_only(ck.cfg.moe_prefixes()),
        TrainWhat::All => ck.weights.set_trainable(true),
    }
    let run = Job {
        ck: &ck,
        data: &data,
        data_name: &a.data,
        cfg: &cfg,
        out: &a.out,
        settings: &settings,
    };
    eprintln!(
        "{} examples ({:?}); training {} for steps {start}..{until} of {} on {} rank(s)",
        data.examples.len(),
        data.kind,
        match a.train {
            TrainWhat::Moe => "the MoE blocks",
            TrainWhat::All => "every tensor",
        },
        cfg.steps,
        spec.devices
    );
    let steps = Steps {
        run: &run,
        start,
        until,
        held_out: held_out.as_ref(),
        job: a,
        log_path: &log_path,
        kept: &kept,
    };
    let ran = spec.run_training(&ck, |m| steps.run_on(m));
    if ran.is_err() && created && !a.out.join("state").exists() {
        // A run that failed before saving anything leaves no folder behind (a saved state
        // stays, for --resume).
        let _ = std::fs::remove_dir_all(&a.out);
    }
    let log = ran?;
    eprintln!(
        "fine-tuned model, log.jsonl and state -> {}",
        a.out.display()
    );
    Ok(log)
}

/// The loop's settings from the job, checked.
fn train_config(a: &FineTune) -> Result<TrainConfig> {
    let cfg = TrainConfig {
        steps: a.steps,
        batch_size: a.batch_size,
        grad_accum: a.grad_accum,
        lr: a.lr,
        warmup: a.warmup.unwrap_or(a.steps * 3 / 100),
        min_lr_ratio: a.min_lr_ratio,
        weight_decay: a.weight_decay,
        max_grad_norm: Some(a.max_grad_norm),
        seed: a.seed,
        aux_loss: a.aux_loss,
        save_every: a.save_every,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// What else the run depends on, which a resumed run must bring the same: the placement (a
/// file's bytes, as runs have always recorded it; one given as a value, its JSON), the mode,
/// pruning, the calibration trace, the sequence length, BOS, dtype and what trains.
fn run_settings(spec: &ModelSpec, a: &FineTune, ck: &Checkpoint) -> Result<serde_json::Value> {
    let print = |bytes: Vec<u8>| {
        format!(
            "{:016x}",
            occult_core::models::data_parallel::fingerprint(bytes)
        )
    };
    let placement = match (&spec.placement_file, &spec.placement) {
        (Some(f), _) => Some(print(occult_core::input::read_bytes(f)?)),
        (None, Some(p)) => Some(print(serde_json::to_vec(p)?)),
        (None, None) => None,
    };
    // The calibration trace: its file's bytes; one held only in memory, its routing.
    let calibration = match (&spec.calibration, &spec.calibration_trace) {
        (Some(p), _) => Some(print(occult_core::input::read_bytes(p)?)),
        (None, Some(t)) => Some(print(trace_bytes(t))),
        (None, None) => None,
    };
    Ok(serde_json::json!({
        "placement": placement,
        "mode": spec.mode(),
        "max_devices": spec.max_devices(),
        "prune_limit": spec.prune.map(|l| l.label()),
        "prune_rule": spec.prune.map(|_| spec.prune_rule),
        "calibration": calibration,
        "seq_len": seq_len(ck, a.seq_len),
        "add_bos": a.add_bos,
        "dtype": spec.dtype,
        "train": a.train,
    }))
}

/// A trace's routing as bytes, for a fingerprint: each layer's index, ids and router logits.
fn trace_bytes(t: &occult_core::analysis::trace::Trace) -> Vec<u8> {
    let mut out = Vec::new();
    for l in &t.layers {
        out.extend((l.layer as u64).to_le_bytes());
        out.extend(l.topk_ids.iter().flat_map(|x| x.to_le_bytes()));
        for x in l.router_logits.iter().flatten() {
            out.extend(x.to_le_bytes());
        }
    }
    out
}

/// The step the run starts from: the saved one with `--resume`; else 0, refusing an `--out`
/// that holds another run unless `--overwrite`, whose state and log then go (the model is
/// replaced at the first save).
fn start_step(
    spec: &ModelSpec,
    a: &FineTune,
    cfg: &TrainConfig,
    model: &str,
    settings: &serde_json::Value,
) -> Result<u64> {
    if a.resume {
        return Ok(saved_step(
            &a.out,
            cfg,
            model,
            &a.data,
            spec.devices,
            settings,
        )?);
    }
    if holds_a_run(&a.out) && !a.overwrite && !has_saved_state(&a.out) {
        bail!(
            "{} holds a run that saved no state (it stopped before its first save): give \
             --overwrite to start afresh, or another --out",
            a.out.display()
        );
    }
    if holds_a_run(&a.out) && !a.overwrite {
        bail!(
            "{} holds another run: give --resume to continue it, --overwrite to start \
             afresh, or another --out",
            a.out.display()
        );
    }
    if a.overwrite {
        let state = a.out.join("state");
        if state.exists() {
            std::fs::remove_dir_all(&state)
                .with_context(|| format!("removing {}", state.display()))?;
        }
        let log = a.out.join("log.jsonl");
        if log.exists() {
            std::fs::remove_file(&log).with_context(|| format!("removing {}", log.display()))?;
        }
    }
    Ok(0)
}

/// The steps one run takes on every rank, and where rank 0 logs them.
struct Steps<'a> {
    run: &'a Job<'a>,
    start: u64,
    until: u64,
    held_out: Option<&'a Dataset>,
    job: &'a FineTune,
    log_path: &'a Path,
    /// The lines before `start` that the log keeps.
    kept: &'a [LogLine],
}

impl Steps<'_> {
    /// This rank's part of the run: the loop, with a progress bar and, on rank 0, a line of
    /// the log per step (the kept records first). Returns rank 0's whole log.
    fn run_on(&self, m: &occult_core::models::model::Model) -> Result<Vec<StepRecord>> {
        let a = self.job;
        let rank = m.rank_and_size().0;
        let bar = crate::progress::rank_bar(rank, self.until - self.start, "steps");
        let mut records: Vec<StepRecord> =
            self.kept.iter().filter_map(|l| l.record.clone()).collect();
        let mut log = if rank == 0 {
            // The kept lines replace the log whole, then the new steps are appended.
            occult_core::atomic::write_atomic(self.log_path, |w| {
                for l in self.kept {
                    writeln!(w, "{}", l.text)?;
                }
                Ok(())
            })?;
            Some(
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(self.log_path)
                    .with_context(|| format!("writing {}", self.log_path.display()))?,
            )
        } else {
            None
        };
        train(m, self.run, self.start, self.until, &mut |step, r| {
            let done = step + 1;
            let eval_loss = match self.held_out {
                Some(h) if done == self.until || a.eval_every.is_some_and(|n| done % n == 0) => {
                    Some(heldout_loss(m, &h.examples, a.batch_size)?.loss)
                }
                _ => None,
            };
            let record = StepRecord::of(step, r, eval_loss);
            if let Some(f) = log.as_mut() {
                writeln!(f, "{}", record.line())
                    .map_err(|e| occult_train::Error::Invalid(e.to_string()))?;
            }
            bar.set_message(format!(
                "loss {:.4}  {:.0} tok/s  E[C_T] {:.2}",
                r.loss, record.tokens_per_s, r.ect
            ));
            if let (Some(e), 0) = (eval_loss, rank) {
                bar.println(format!("step {done}: held-out loss {e:.4}"));
            }
            bar.inc(1);
            records.push(record);
            Ok(())
        })?;
        bar.finish_and_clear();
        Ok(records)
    }
}

/// Refuses an `--out` folder that is the input model's folder or lies inside it: the
/// fine-tuned model would overwrite (or be read back as) its own start.
fn refuse_out_over_model(out: &std::path::Path, model: &str) -> Result<()> {
    let Ok(model) = std::fs::canonicalize(model) else {
        return Ok(()); // a hub id, resolved in the cache
    };
    let out = occult_core::atomic::absolute_path(out);
    if out.starts_with(&model) {
        anyhow::bail!(
            "--out {} is the input model's folder or lies inside it; the fine-tuned model would \
             overwrite its start: write it elsewhere",
            out.display()
        );
    }
    Ok(())
}
