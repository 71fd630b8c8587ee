//! `occult bench suite FILE`: benchmark suites from `configs/bench/*.toml`. A suite is a sweep
//! of one kind of step (a prefill over token counts, decode over batch sizes, or a training
//! step over batch sizes) on one model and device count; each point runs every mode (standard,
//! Occult, Occult pruned, and the single-device reference) side by side on the same inputs,
//! measured on the local or MPI backend and projected onto a link profile.

use super::model_ep::{self, EpModelBench};
use super::modes::ModeSummary;
use super::train::{self, TrainBench};
use crate::context::ModelSpec;
use anyhow::{bail, Context, Result};
use occult_core::analysis::cost::links::LinkProfile;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Which step a suite sweeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SuiteKind {
    /// Prefill over total token counts (`tokens`).
    Prefill,
    /// Decode over sequences per rank (`batches`).
    Decode,
    /// A training step over sequences per rank (`batches`).
    Train,
}

/// A suite file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Suite {
    pub name: String,
    pub suite: SuiteKind,
    /// `builtin` (the built-in model, built on first use), a model folder or a cached hub id.
    pub model: String,
    #[serde(default = "defaults::devices")]
    pub devices: usize,
    /// Prefill: tokens over all ranks at each point.
    #[serde(default)]
    pub tokens: Vec<usize>,
    /// Decode and train: sequences per rank at each point.
    #[serde(default)]
    pub batches: Vec<usize>,
    /// Tokens per sequence (prefill: its prompts, which are batched to reach `tokens`;
    /// decode: the prompt before decoding; train: the sequence).
    #[serde(default = "defaults::seq_len")]
    pub seq_len: usize,
    /// Decode steps measured per point.
    #[serde(default = "defaults::decode_tokens")]
    pub decode_tokens: usize,
    /// Prune to this many devices in the pruned mode (0: no pruned mode).
    #[serde(default = "defaults::max_devices")]
    pub max_devices: usize,
    #[serde(default = "defaults::repeats")]
    pub repeats: usize,
    /// The link profile of the projection (a built-in name or a file).
    #[serde(default = "defaults::link")]
    pub link: String,
    #[serde(default = "defaults::dtype")]
    pub dtype: String,
}

/// The defaults of a suite file's optional fields.
mod defaults {
    /// Expert-parallel ranks.
    pub fn devices() -> usize {
        4
    }
    /// Tokens per sequence.
    pub fn seq_len() -> usize {
        128
    }
    /// Decode steps measured per point.
    pub fn decode_tokens() -> usize {
        8
    }
    /// Devices per token in the pruned mode.
    pub fn max_devices() -> usize {
        2
    }
    /// Measured repeats per point.
    pub fn repeats() -> usize {
        2
    }
    /// The paper's box: four GPUs over PCIe 4.
    pub fn link() -> String {
        "pcie4".into()
    }
    pub fn dtype() -> String {
        "f32".into()
    }
}

impl Suite {
    /// Reads and checks a suite file.
    pub fn read(path: &Path) -> Result<Suite> {
        let text = occult_core::input::read_text(path)?;
        let s: Suite = toml::from_str(&text)
            .with_context(|| format!("{} is not a valid suite", path.display()))?;
        s.check()
            .with_context(|| format!("suite {}", path.display()))?;
        Ok(s)
    }

    fn check(&self) -> Result<()> {
        if self.devices < 2 {
            bail!(
                "devices = {}: the suites compare expert-parallel modes on 2 or more",
                self.devices
            );
        }
        if self.seq_len == 0 || self.repeats == 0 {
            bail!("seq_len and repeats must be at least 1");
        }
        let (points, what) = match self.suite {
            SuiteKind::Prefill => (&self.tokens, "tokens"),
            SuiteKind::Decode | SuiteKind::Train => (&self.batches, "batches"),
        };
        if points.is_empty() || points.contains(&0) {
            bail!("a {:?} suite needs `{what}`, each at least 1", self.suite);
        }
        if self.suite == SuiteKind::Prefill {
            let per = self.devices * self.seq_len;
            if let Some(t) = self.tokens.iter().find(|&&t| t % per != 0) {
                bail!(
                    "tokens = {t} is not a multiple of devices x seq_len = {per} (each rank \
                     prefills whole sequences)"
                );
            }
        }
        if self.suite == SuiteKind::Decode && self.decode_tokens == 0 {
            bail!("a decode suite needs decode_tokens >= 1");
        }
        LinkProfile::load(&self.link)?;
        Ok(())
    }
}

/// One point of a sweep: its size and every mode's result.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    /// Tokens over all ranks per step (decode: one per sequence).
    pub tokens: usize,
    /// Sequences per rank.
    pub batch: usize,
    pub seq_len: usize,
    pub results: Vec<ModeSummary>,
}

/// Runs a suite with `opts` (model, devices, backend, placement). Returns the points on rank 0
/// (an empty list on the other processes of an MPI run).
pub fn run(s: &Suite, opts: &ModelSpec) -> Result<Vec<Point>> {
    let link = LinkProfile::load(&s.link)?;
    let mut ck = opts.open()?;
    let decoded = if s.suite == SuiteKind::Decode {
        s.decode_tokens
    } else {
        0
    };
    if s.seq_len + decoded > ck.cfg.positions() {
        bail!(
            "seq_len {} (+ {decoded} decode tokens) exceeds the model's {} positions",
            s.seq_len,
            ck.cfg.positions()
        );
    }
    let mut points = Vec::new();
    let sizes: Vec<usize> = match s.suite {
        SuiteKind::Prefill => s
            .tokens
            .iter()
            .map(|&t| model_ep::prefill_shape(t, s.devices, s.seq_len).1)
            .collect(),
        _ => s.batches.clone(),
    };
    for (i, &batch) in sizes.iter().enumerate() {
        let tokens = match s.suite {
            SuiteKind::Prefill => s.tokens[i],
            SuiteKind::Decode => s.devices * batch,
            SuiteKind::Train => s.devices * batch * s.seq_len,
        };
        eprintln!(
            "[{}/{}] {} tokens ({batch} sequence(s) per rank)",
            i + 1,
            sizes.len(),
            tokens
        );
        let results = match s.suite {
            SuiteKind::Prefill | SuiteKind::Decode => {
                let b = EpModelBench {
                    devices: s.devices,
                    batch,
                    prompt_len: s.seq_len,
                    decode_tokens: if s.suite == SuiteKind::Decode {
                        s.decode_tokens
                    } else {
                        0
                    },
                    repeats: s.repeats,
                    max_devices: s.max_devices,
                    node_limit: None,
                    devices_per_node: None,
                    seed: 0,
                };
                model_ep::run(opts, &ck, &b, Some(&link))?
            }
            SuiteKind::Train => {
                let b = TrainBench {
                    devices: s.devices,
                    batch_per_rank: batch,
                    seq_len: s.seq_len,
                    warmup: 1,
                    steps: s.repeats,
                    seed: 0,
                };
                train::run(opts, &mut ck, &b, Some(&link))?
            }
        };
        if let Some(results) = results {
            points.push(Point {
                tokens,
                batch,
                seq_len: s.seq_len,
                results,
            });
        }
    }
    Ok(points)
}

/// Each point's modes as one table: measured and projected time, and the ratio of standard's
/// to each (above 1: faster than standard).
pub fn render(s: &Suite, points: &[Point]) -> String {
    let decode = s.suite == SuiteKind::Decode;
    let mut t = crate::table::Table::new(&[
        "tokens",
        "mode",
        "E[C_T]",
        "remote MB",
        "measured ms",
        "x",
        "projected ms",
        "x",
    ]);
    for p in points {
        let time = |r: &ModeSummary| {
            if decode {
                r.decode.as_ref().map_or((0.0, None), |d| {
                    (d.decode_ms_per_token / 1e3, d.decode_projected_s)
                })
            } else {
                (r.seconds, r.projected_seconds)
            }
        };
        let base = p.results.iter().find(|r| r.key.is_baseline()).map(time);
        for r in &p.results {
            let (measured, projected) = time(r);
            let (ect, bytes) = if decode {
                r.decode
                    .as_ref()
                    .map_or((0.0, 0), |d| (d.decode_ect, d.decode_bytes_sent))
            } else {
                (r.ect, r.bytes_sent)
            };
            let ratio = |b: Option<f64>, x: Option<f64>| match (b, x) {
                (Some(b), Some(x)) if x > 0.0 => format!("{:.2}", b / x),
                _ => "-".into(),
            };
            t.row(vec![
                p.tokens.to_string(),
                r.mode.clone(),
                format!("{ect:.3}"),
                format!("{:.3}", bytes as f64 / 1e6),
                format!("{:.3}", measured * 1e3),
                ratio(base.map(|b| b.0), Some(measured)),
                projected.map_or("-".into(), |x| format!("{:.4}", x * 1e3)),
                ratio(base.and_then(|b| b.1), projected),
            ]);
        }
    }
    format!(
        "{} ({:?} on {} ranks; projected on {}; x = standard's time over the mode's)\n{}",
        s.name,
        s.suite,
        s.devices,
        s.link,
        t.render()
    )
}

/// `occult bench suite FILE`: the suite in `file` (its model replaced by `model` when given),
/// on `backend`'s ranks with Occult's placement from `placement` (for the built-in model, made
/// from its calibration text on first use; contiguous for another model without one); prints
/// the table and writes the points as JSON to `json`.
pub fn bench(
    file: &Path,
    model: Option<&str>,
    placement: Option<&Path>,
    backend: crate::context::Backend,
    json: Option<&Path>,
) -> Result<()> {
    let mut s = Suite::read(file)?;
    if let Some(m) = model {
        s.model = m.to_string();
    }
    let mut spec = ModelSpec::local(&s.model);
    let mut placement_file = placement.map(Path::to_path_buf);
    if s.model == "builtin" {
        let recipe = crate::builtin::BuiltinRecipe::default();
        let b = crate::builtin::ensure_cached(&recipe, backend == crate::context::Backend::Local)?;
        spec.model = b.model().display().to_string();
        if placement_file.is_none() {
            placement_file = Some(b.placement(s.devices)?);
        }
    }
    spec = spec.with_placement_file(placement_file.as_deref())?;
    spec.devices = s.devices;
    spec.backend = backend;
    spec.dtype = s.dtype.clone();
    let points = run(&s, &spec)?;
    if points.is_empty() {
        return Ok(());
    }
    println!("{}", render(&s, &points));
    if let Some(p) = json {
        let v = serde_json::json!({
            "file": file.display().to_string(),
            "config": s,
            "model": spec.model,
            "placement": spec.placement_file,
            "backend": backend,
            "projected_with": s.link,
            "points": points,
        });
        super::report::write(p, "suite", v)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_suites_read() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bench");
        let mut kinds = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let s = Suite::read(&p).unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
            kinds.push(s.suite);
        }
        for k in [SuiteKind::Prefill, SuiteKind::Decode, SuiteKind::Train] {
            assert!(kinds.contains(&k), "{k:?}");
        }
    }
}
