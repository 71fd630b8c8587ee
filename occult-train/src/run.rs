//! The fine-tuning loop on one rank of D: each step takes this rank's share of the global
//! batch ([`crate::batches`]), runs [`crate::step::train_step`] with the scheduled learning
//! rate, and reports; every `save_every` steps and at the end it saves the model in the
//! source's layout ([`crate::save`]) and the state a resumed run continues from, so that an
//! interrupted run loses at most the steps since the last save and, resumed, ends
//! bit-identical to one never interrupted.
//!
//! The state lives in `OUT/state/`: per save a folder `step-N/` with, per rank,
//! `rank{R}.safetensors` (every trainable tensor's value and both AdamW moments in the
//! optimiser's precision, f32 masters for bf16 tensors, in the order of [`Model::params`], and
//! the step), and `state.json`, which names the
//! last complete save's folder with the settings that must not change. `state.json` is
//! replaced (atomically) only after every rank has written its file, and older folders are
//! removed after it; a save interrupted at any point leaves the previous one in force.

use crate::batches::{global_batch, rank_share};
use crate::dataset::Dataset;
use crate::examples::Example;
use crate::optim::{AdamW, AdamWConfig, AdamWState};
use crate::save::{bytes_as, save_model, write_safetensors};
use crate::schedule::Schedule;
use crate::step::{train_step, StepReport, StepSettings};
use crate::{Error, Result};
use candle::Tensor;
use occult_core::atomic::write_json_atomic;
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::Model;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The loop's settings.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TrainConfig {
    pub steps: u64,
    /// Examples per optimiser step over all ranks.
    pub batch_size: usize,
    /// Micro-batches per step on each rank (gradient accumulation).
    pub grad_accum: usize,
    pub lr: f64,
    pub warmup: u64,
    /// The final learning rate as a fraction of `lr`.
    pub min_lr_ratio: f64,
    pub weight_decay: f64,
    /// Clip gradients to this global norm.
    pub max_grad_norm: Option<f64>,
    pub seed: u64,
    /// Add the model's load-balancing loss ([`crate::aux_loss`]) with its own coefficient.
    pub aux_loss: bool,
    /// Save every this many steps (and always at the end). Not part of what a resumed run
    /// must share.
    #[serde(skip)]
    pub save_every: Option<u64>,
}

impl TrainConfig {
    /// Checks the settings.
    pub fn validate(&self) -> Result<Schedule> {
        if self.batch_size == 0 {
            return Err(Error::Invalid("--batch-size must be at least 1".into()));
        }
        if self.grad_accum == 0 {
            return Err(Error::Invalid("--grad-accum must be at least 1".into()));
        }
        if self.save_every == Some(0) {
            return Err(Error::Invalid("--save-every must be at least 1".into()));
        }
        if let Some(n) = self.max_grad_norm {
            if !(n.is_finite() && n > 0.0) {
                return Err(Error::Invalid(format!(
                    "--max-grad-norm must be a positive number, got {n}"
                )));
            }
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(Error::Invalid(format!(
                "--weight-decay must be a number >= 0, got {}",
                self.weight_decay
            )));
        }
        Schedule::new(self.lr, self.warmup, self.steps, self.min_lr_ratio)
    }

    /// What a resumed run must share with the saved one, as text.
    fn fingerprint(&self, model: &str, data: &str, devices: usize, settings: &Value) -> String {
        json!({"config": self, "model": model, "data": data, "devices": devices,
            "settings": settings})
        .to_string()
    }
}

fn state_dir(out: &Path) -> PathBuf {
    out.join("state")
}

/// The saved step of a run in `out`, if it holds one made with the same settings; an error if
/// it holds a different run.
/// `settings` holds what else the run depends on (placement, mode, pruning, sequence length,
/// dtype...).
pub fn saved_step(
    out: &Path,
    cfg: &TrainConfig,
    model: &str,
    data: &str,
    d: usize,
    settings: &Value,
) -> Result<u64> {
    let path = state_dir(out).join("state.json");
    let (run, step) = read_state_record(&path)?;
    if run != cfg.fingerprint(model, data, d, settings) {
        return Err(Error::Invalid(format!(
            "{}: the saved run used other settings ({run}); resume with the same flags, or give \
             another --out",
            path.display(),
        )));
    }
    Ok(step)
}

/// The run fingerprint and step that a run's `state.json` records.
pub fn read_state_record(path: &Path) -> Result<(String, u64)> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Invalid(format!("{}: nothing to resume from: {e}", path.display())))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| Error::Invalid(format!("{}: not valid JSON: {e}", path.display())))?;
    let run = v["run"]
        .as_str()
        .ok_or_else(|| Error::Invalid(format!("{}: no run settings", path.display())))?;
    let step = v["step"]
        .as_u64()
        .ok_or_else(|| Error::Invalid(format!("{}: no step", path.display())))?;
    Ok((run.to_string(), step))
}

/// Whether `out` holds a saved state to resume from.
pub fn has_saved_state(out: &Path) -> bool {
    state_dir(out).join("state.json").is_file()
}

/// Whether `out` holds anything of a run.
pub fn holds_a_run(out: &Path) -> bool {
    state_dir(out).exists() || out.join("log.jsonl").exists()
}

fn save_state(m: &Model, opt: &AdamW, out: &Path, run: &str) -> Result<()> {
    let (rank, _) = m.rank_and_size();
    let state = opt.state()?;
    let folder = format!("step-{}", state.step);
    let dir = state_dir(out).join(&folder);
    std::fs::create_dir_all(&dir).map_err(|e| Error::Invalid(format!("{}: {e}", dir.display())))?;
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (i, (value, (mm, vv))) in state.values.iter().zip(&state.moments).enumerate() {
        tensors.push((format!("{i}.param"), value.clone()));
        tensors.push((format!("{i}.m"), mm.clone()));
        tensors.push((format!("{i}.v"), vv.clone()));
    }
    let entries = tensors
        .iter()
        .map(|(n, t)| {
            let dtype = match t.dtype() {
                candle::DType::BF16 => safetensors::Dtype::BF16,
                candle::DType::F16 => safetensors::Dtype::F16,
                _ => safetensors::Dtype::F32,
            };
            Ok((n.clone(), t.dims().to_vec(), dtype, bytes_as(t, dtype)?))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta: HashMap<String, String> = [("step".to_string(), state.step.to_string())].into();
    write_safetensors(
        &dir.join(format!("rank{rank}.safetensors")),
        &entries,
        Some(meta),
    )?;
    occult_core::fault::pause_point("checkpoint", rank);
    // Every rank has written its part before rank 0 makes the save the one in force.
    if let Some(c) = m.comm().filter(|c| c.size() > 1) {
        c.barrier()?;
    }
    if rank == 0 {
        write_json_atomic(
            &state_dir(out).join("state.json"),
            &json!({"step": state.step, "folder": folder, "run": run}),
        )?;
        // Older saves are no longer needed.
        if let Ok(entries) = std::fs::read_dir(state_dir(out)) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if name.starts_with("step-") && name != folder {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }
    Ok(())
}

/// Restores this rank's trainable tensors and optimiser from the saved state.
fn load_state(m: &Model, opt: &mut AdamW, params: &[Tensor], out: &Path, step: u64) -> Result<()> {
    let (rank, _) = m.rank_and_size();
    let path = state_dir(out)
        .join(format!("step-{step}"))
        .join(format!("rank{rank}.safetensors"));
    let state = read_rank_state(&path, step, params.len())?;
    opt.load_state(state)
        .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))
}

/// One rank's saved optimiser state (`count` tensors, each with its two moments) at `step`,
/// as `save_state` wrote it. Shapes are checked against the model by [`AdamW::load_state`].
pub fn read_rank_state(path: &Path, step: u64, count: usize) -> Result<AdamWState> {
    let bytes =
        std::fs::read(path).map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    let saved = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get("step"))
        .and_then(|s| s.parse::<u64>().ok());
    if saved != Some(step) {
        return Err(Error::Invalid(format!(
            "{}: holds step {saved:?}, the run's state names step {step}",
            path.display()
        )));
    }
    let get = |name: &str| -> Result<Tensor> {
        let view = st
            .tensor(name)
            .map_err(|e| Error::Invalid(format!("{}: {name}: {e}", path.display())))?;
        Ok(candle::safetensors::Load::load(
            &view,
            &candle::Device::Cpu,
        )?)
    };
    let mut values = Vec::new();
    let mut moments = Vec::new();
    for i in 0..count {
        values.push(get(&format!("{i}.param"))?);
        moments.push((get(&format!("{i}.m"))?, get(&format!("{i}.v"))?));
    }
    Ok(AdamWState {
        step,
        values,
        moments,
    })
}

/// What a fine-tuning run works on.
pub struct Job<'a> {
    pub ck: &'a Checkpoint,
    pub data: &'a Dataset,
    /// The data as the user named it (recorded in the saved state).
    pub data_name: &'a str,
    pub cfg: &'a TrainConfig,
    /// The output folder.
    pub out: &'a Path,
    /// What else the run depends on (placement, mode, pruning, sequence length, dtype...):
    /// a resumed run must bring the same.
    pub settings: &'a Value,
}

/// Runs the loop on this rank from step `start` (0: a fresh run; else the saved step to
/// resume from) until step `until` (at most the run's steps), saving there: a run stopped
/// early continues with `--resume`. `report` gets every step's report, on every rank.
/// Collective.
pub fn train(
    m: &Model,
    job: &Job,
    start: u64,
    until: u64,
    report: &mut dyn FnMut(u64, &StepReport) -> Result<()>,
) -> Result<()> {
    let Job {
        ck,
        data,
        data_name,
        cfg,
        out,
        settings,
    } = *job;
    let schedule = cfg.validate()?;
    let (rank, size) = m.rank_and_size();
    let params = m.trainable_params();
    if params.is_empty() {
        return Err(Error::Invalid("the model has no trainable tensors".into()));
    }
    let adamw = AdamWConfig {
        weight_decay: cfg.weight_decay,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(&params, adamw)?;
    let run = cfg.fingerprint(&ck.name, data_name, size, settings);
    if start > 0 {
        load_state(m, &mut opt, &params, out, start)?;
    }
    let until = until.min(cfg.steps);
    for step in start..until {
        let global = global_batch(data.examples.len(), cfg.batch_size, cfg.seed, step)?;
        let share: Vec<&Example> = rank_share(&global, rank, size)
            .iter()
            .map(|&i| &data.examples[i])
            .collect();
        let settings = StepSettings {
            lr: schedule.lr(step),
            max_norm: cfg.max_grad_norm,
            micro: cfg.grad_accum,
            aux: cfg.aux_loss.then_some(m.cfg.moe.aux_loss),
        };
        let r = train_step(m, &mut opt, &share, &settings)?;
        report(step, &r)?;
        let done = step + 1;
        if done == until || cfg.save_every.is_some_and(|n| done % n == 0) {
            save_model(m, ck, out)?;
            save_state(m, &opt, out, &run)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> TrainConfig {
        TrainConfig {
            steps: 10,
            batch_size: 4,
            grad_accum: 1,
            lr: 1e-4,
            warmup: 2,
            min_lr_ratio: 0.1,
            weight_decay: 0.0,
            max_grad_norm: Some(1.0),
            seed: 0,
            aux_loss: false,
            save_every: None,
        }
    }

    /// Each setting's bound on its own, at its edge.
    #[test]
    fn every_setting_is_checked_at_its_edge() {
        assert!(good().validate().is_ok());
        let norm = |n: f64| {
            TrainConfig {
                max_grad_norm: Some(n),
                ..good()
            }
            .validate()
        };
        for bad in [0.0, -1.0, f64::INFINITY, f64::NAN] {
            let e = norm(bad).unwrap_err().to_string();
            assert!(e.contains("--max-grad-norm"), "{bad}: {e}");
        }
        assert!(norm(1e-9).is_ok());
        let decay = |w: f64| {
            TrainConfig {
                weight_decay: w,
                ..good()
            }
            .validate()
        };
        for bad in [-0.1, f64::INFINITY, f64::NAN] {
            let e = decay(bad).unwrap_err().to_string();
            assert!(e.contains("--weight-decay"), "{bad}: {e}");
        }
        assert!(decay(0.0).is_ok() && decay(0.1).is_ok());
        for (cfg, flag) in [
            (
                TrainConfig {
                    batch_size: 0,
                    ..good()
                },
                "--batch-size",
            ),
            (
                TrainConfig {
                    grad_accum: 0,
                    ..good()
                },
                "--grad-accum",
            ),
            (
                TrainConfig {
                    save_every: Some(0),
                    ..good()
                },
                "--save-every",
            ),
        ] {
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(flag), "{e}");
        }
    }
}
