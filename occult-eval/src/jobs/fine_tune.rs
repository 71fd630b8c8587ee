//! Fine-tuning: the MoE blocks (routers, experts, shared experts; everything else frozen, as
//! in the paper; or every tensor) on instruction data (Alpaca) or plain text, on a model's
//! ranks, with exact or pruned routing. Writes the model in the source's layout, `log.jsonl`
//! (a line per step) and the state a resumed run continues from, in the output folder.

use crate::context::ModelSpec;
use anyhow::{bail, Context, Result};
use occult_core::models::loader::Checkpoint;
use occult_train::dataset::{build, read_records, Dataset};
use occult_train::heldout::heldout_loss;
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

/// Runs `job` on `spec`'s ranks (rank 0 writes the log and the model).
pub fn fine_tune(spec: &ModelSpec, job: &FineTune) -> Result<()> {
    let a = job;
    refuse_out_over_model(&a.out, &spec.model)?;
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
    // What else the run depends on: a resumed run must bring the same.
    let print = |bytes: Vec<u8>| {
        format!(
            "{:016x}",
            occult_core::models::data_parallel::fingerprint(bytes)
        )
    };
    // A placement read from a file is the file's bytes (as runs have always recorded it); one
    // given as a value, its JSON.
    let placement = match (&spec.placement_file, &spec.placement) {
        (Some(f), _) => Some(print(occult_core::input::read_bytes(f)?)),
        (None, Some(p)) => Some(print(serde_json::to_vec(p)?)),
        (None, None) => None,
    };
    let calibration = match &spec.calibration {
        Some(p) => Some(print(occult_core::input::read_bytes(p)?)),
        None => None,
    };
    let settings = serde_json::json!({
        "placement": placement,
        "mode": spec.mode(),
        "max_devices": spec.max_devices(),
        "prune_limit": spec.prune.map(|l| l.label()),
        "prune_rule": spec.prune.map(|_| spec.prune_rule),
        "calibration": calibration,
        "seq_len": seq_len(&ck, a.seq_len),
        "add_bos": a.add_bos,
        "dtype": spec.dtype,
        "train": a.train,
    });
    let start = if a.resume {
        saved_step(&a.out, &cfg, &ck.name, &a.data, spec.devices, &settings)?
    } else {
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
            // Start afresh: the other run's state and log go (the model is replaced at the
            // first save).
            let state = a.out.join("state");
            if state.exists() {
                std::fs::remove_dir_all(&state)
                    .with_context(|| format!("removing {}", state.display()))?;
            }
            let log = a.out.join("log.jsonl");
            if log.exists() {
                std::fs::remove_file(&log)
                    .with_context(|| format!("removing {}", log.display()))?;
            }
        }
        0
    };
    let until = a.stop_at.unwrap_or(cfg.steps).min(cfg.steps);
    if start >= until {
        eprintln!(
            "the run in {} is at step {start}: nothing to do",
            a.out.display()
        );
        return Ok(());
    }
    let created = !a.out.exists();
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let log_path = a.out.join("log.jsonl");
    // The log keeps the steps before the resumed one.
    let kept: Vec<String> = std::fs::read_to_string(&log_path)
        .map(|t| {
            t.lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v["step"].as_u64())
                        .is_some_and(|s| s < start && a.resume)
                })
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
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
    let ran = spec.run_training(&ck, |m| {
        let rank = m.rank_and_size().0;
        let bar = crate::progress::rank_bar(rank, until - start, "steps");
        let mut log = if rank == 0 {
            // The kept lines replace the log whole, then the new steps are appended.
            occult_core::atomic::write_atomic(&log_path, |w| {
                for l in &kept {
                    writeln!(w, "{l}")?;
                }
                Ok(())
            })?;
            Some(
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(&log_path)
                    .with_context(|| format!("writing {}", log_path.display()))?,
            )
        } else {
            None
        };
        train(m, &run, start, until, &mut |step, r| {
            let seconds = r.seconds;
            let done = step + 1;
            let eval_loss = match &held_out {
                Some(h) if done == until || a.eval_every.is_some_and(|n| done % n == 0) => {
                    Some(heldout_loss(m, &h.examples, a.batch_size)?.loss)
                }
                _ => None,
            };
            if let Some(f) = log.as_mut() {
                let line = serde_json::json!({
                    "step": step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                    "tokens": r.tokens, "targets": r.targets,
                    "tokens_per_s": r.tokens as f64 / seconds.max(1e-9),
                    "ect": r.ect_by_layer, "mean_ect": r.ect,
                });
                let mut line = line;
                if let Some(aux) = r.aux_loss {
                    line["aux_loss"] = aux.into();
                }
                if let Some(e) = eval_loss {
                    line["eval_loss"] = e.into();
                }
                writeln!(f, "{line}").map_err(|e| occult_train::Error::Invalid(e.to_string()))?;
            }
            bar.set_message(format!(
                "loss {:.4}  {:.0} tok/s  E[C_T] {:.2}",
                r.loss,
                r.tokens as f64 / seconds.max(1e-9),
                r.ect
            ));
            if let (Some(e), 0) = (eval_loss, rank) {
                bar.println(format!("step {done}: held-out loss {e:.4}"));
            }
            bar.inc(1);
            Ok(())
        })?;
        bar.finish_and_clear();
        Ok(())
    });
    if ran.is_err() && created && !a.out.join("state").exists() {
        // A run that failed before saving anything leaves no folder behind (a saved state
        // stays, for --resume).
        let _ = std::fs::remove_dir_all(&a.out);
    }
    ran?;
    eprintln!(
        "fine-tuned model, log.jsonl and state -> {}",
        a.out.display()
    );
    Ok(())
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
