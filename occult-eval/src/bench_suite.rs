//! `occult bench suite FILE`: benchmark suites from `configs/bench/*.toml`. A suite is a sweep
//! of one kind of step (a prefill over token counts, decode over batch sizes, or a training
//! step over batch sizes) on one model and device count; each point runs every mode (standard,
//! Occult, Occult pruned, and the single-device reference) side by side on the same inputs,
//! measured on the local or MPI backend and projected onto a link profile.

use crate::bench_model_ep::{self, EpModelBench, ModeResult};
use crate::bench_train::{self, TrainBench};
use crate::commands::model_opts::ModelOpts;
use anyhow::{bail, Context, Result};
use occult_core::analysis::links::LinkProfile;
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
    #[serde(default = "four")]
    pub devices: usize,
    /// Prefill: tokens over all ranks at each point.
    #[serde(default)]
    pub tokens: Vec<usize>,
    /// Decode and train: sequences per rank at each point.
    #[serde(default)]
    pub batches: Vec<usize>,
    /// Tokens per sequence (prefill: its prompts, which are batched to reach `tokens`;
    /// decode: the prompt before decoding; train: the sequence).
    #[serde(default = "sequence")]
    pub seq_len: usize,
    /// Decode steps measured per point.
    #[serde(default = "eight")]
    pub decode_tokens: usize,
    /// Prune to this many devices in the pruned mode (0: no pruned mode).
    #[serde(default = "two")]
    pub max_devices: usize,
    #[serde(default = "two")]
    pub repeats: usize,
    /// The link profile of the projection (a built-in name or a file).
    #[serde(default = "pcie4")]
    pub link: String,
    #[serde(default = "f32_name")]
    pub dtype: String,
}

fn four() -> usize {
    4
}
fn two() -> usize {
    2
}
fn eight() -> usize {
    8
}
fn sequence() -> usize {
    128
}
fn pcie4() -> String {
    "pcie4".into()
}
fn f32_name() -> String {
    "f32".into()
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
    pub results: Vec<ModeResult>,
}

/// Runs a suite with `opts` (model, devices, backend, placement). Returns the points on rank 0
/// (an empty list on the other processes of an MPI run).
pub fn run(s: &Suite, opts: &ModelOpts) -> Result<Vec<Point>> {
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
            .map(|&t| bench_model_ep::prefill_shape(t, s.devices, s.seq_len).1)
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
                    seed: 0,
                };
                bench_model_ep::run(opts, &ck, &b, Some(&link))?
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
                bench_train::run(opts, &mut ck, &b, Some(&link))?
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
        let time = |r: &ModeResult| {
            if decode {
                (r.decode_ms_per_token / 1e3, r.decode_projected_s)
            } else {
                (r.seconds, r.projected_seconds)
            }
        };
        let base = p.results.iter().find(|r| r.mode == "standard").map(time);
        for r in &p.results {
            let (measured, projected) = time(r);
            let (ect, bytes) = if decode {
                (r.decode_ect, r.decode_bytes_sent)
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
