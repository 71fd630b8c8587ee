//! The speed stage of `occult reproduce`: prefill across token counts (the whole model, and its
//! MoE layers alone), decode across batch sizes, and a training step, each in standard, Occult
//! and pruned dispatch on the recipe's devices under the placement found, measured here and
//! projected onto a link profile (which models the MoE layers: their exchanges and expert
//! compute). The same code as `occult bench model` and `occult bench train`.

use crate::bench::model_ep::{self, EpModelBench};
use crate::bench::modes::ModeSummary;
use crate::bench::train::{self, TrainBench};
use crate::context::ModelSpec;
use anyhow::Result;
use occult_core::analysis::cost::links::LinkProfile;
use occult_core::analysis::run_key::{MoeMode, RunKey};
use serde::{Deserialize, Serialize};

/// What the speed stage measures.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SpeedRecipe {
    pub skip: bool,
    /// Tokens over all ranks of each prefill, in sequences of `prefill_seq_len` (fewer when a
    /// rank's share is shorter) batched on each rank.
    pub prefill_tokens: Vec<usize>,
    pub prefill_seq_len: usize,
    /// The prompt before decoding, and the decode steps measured after it.
    pub decode_prompt_len: usize,
    pub decode_tokens: usize,
    /// Sequences per rank of each decode run.
    pub decode_batches: Vec<usize>,
    pub repeats: usize,
    /// Sequences per rank and their length in the training step.
    pub train_batch_per_rank: usize,
    pub train_seq_len: usize,
    /// The link profile of the projection (a built-in name or a file).
    pub link: String,
}

impl Default for SpeedRecipe {
    fn default() -> Self {
        SpeedRecipe {
            skip: false,
            prefill_tokens: vec![1024, 4096, 16384],
            prefill_seq_len: 256,
            decode_prompt_len: 32,
            decode_tokens: 8,
            decode_batches: vec![1, 4, 16],
            repeats: 2,
            train_batch_per_rank: 8,
            train_seq_len: 128,
            link: "pcie4".into(),
        }
    }
}

/// One measurement.
#[derive(Clone, Debug, Serialize)]
pub struct SpeedRow {
    /// `prefill` (the whole model), `layers` (its MoE layers), `decode` or `train`.
    pub suite: String,
    /// What ran: its mode, pruning and copy rule.
    #[serde(rename = "run")]
    pub key: RunKey,
    /// The key's label.
    pub mode: String,
    pub devices: usize,
    /// Tokens over all ranks (decode: one per sequence).
    pub tokens: usize,
    pub ect: f64,
    pub rows_sent: usize,
    pub bytes_sent: u64,
    /// Measured: the slowest rank (prefill and train: per step; layers: the prefill's MoE
    /// layers, summed; decode: per step).
    pub seconds: f64,
    pub projected_seconds: Option<f64>,
    pub link: String,
}

/// The speed row of run `r` of suite `suite`, projected on `link`.
pub(crate) fn row(suite: &str, r: &ModeSummary, link: &str) -> SpeedRow {
    SpeedRow {
        suite: suite.into(),
        key: r.key,
        mode: r.mode.clone(),
        devices: r.devices,
        tokens: r.tokens,
        ect: r.ect,
        rows_sent: r.rows_sent,
        bytes_sent: r.bytes_sent,
        seconds: r.seconds,
        projected_seconds: r.projected_seconds,
        link: link.into(),
    }
}

/// Runs the speed stage with `opts` (the model, devices and placement).
pub fn speed(opts: &ModelSpec, s: &SpeedRecipe) -> Result<Vec<SpeedRow>> {
    let link = LinkProfile::load(&s.link)?;
    let mut ck = opts.open()?;
    let mut rows = Vec::new();
    let bench = |prompt_len: usize, batch: usize, decode_tokens: usize| EpModelBench {
        devices: opts.devices,
        batch,
        prompt_len,
        decode_tokens,
        repeats: s.repeats,
        max_devices: 2.min(opts.devices - 1),
        node_limit: None,
        devices_per_node: None,
        seed: 0,
    };
    for &tokens in &s.prefill_tokens {
        let (len, batch) = model_ep::prefill_shape(tokens, opts.devices, s.prefill_seq_len);
        eprintln!(
            "  prefill, {} tokens ({batch} x {len} per rank)",
            opts.devices * batch * len
        );
        let Some(results) = model_ep::run(opts, &ck, &bench(len, batch, 0), Some(&link))? else {
            continue;
        };
        // Every mode, the single-device reference too (a baseline without exchanges).
        for r in &results {
            rows.push(row("prefill", r, &s.link));
            if r.devices > 1 {
                rows.push(SpeedRow {
                    seconds: r.route_s + r.plan_s + r.dispatch_s + r.compute_s + r.combine_s,
                    ..row("layers", r, &s.link)
                });
            }
        }
    }
    for &batch in s.decode_batches.iter().filter(|_| s.decode_tokens > 0) {
        eprintln!("  decode, {batch} sequence(s) per rank");
        let b = bench(s.decode_prompt_len.max(1), batch, s.decode_tokens);
        let Some(results) = model_ep::run(opts, &ck, &b, Some(&link))? else {
            continue;
        };
        for r in &results {
            let Some(d) = &r.decode else { continue };
            rows.push(SpeedRow {
                tokens: r.devices.max(opts.devices) * batch,
                ect: d.decode_ect,
                rows_sent: d.decode_rows_sent,
                bytes_sent: d.decode_bytes_sent,
                seconds: d.decode_ms_per_token / 1e3,
                projected_seconds: d.decode_projected_s,
                ..row("decode", r, &s.link)
            });
        }
    }
    eprintln!("  training step");
    let b = TrainBench {
        devices: opts.devices,
        batch_per_rank: s.train_batch_per_rank,
        seq_len: s.train_seq_len,
        warmup: 1,
        steps: s.repeats,
        seed: 0,
    };
    if let Some(results) = train::run(opts, &mut ck, &b, Some(&link))? {
        rows.extend(results.iter().map(|r| row("train", r, &s.link)));
    }
    Ok(rows)
}

/// Pearson's correlation of E[C_T] with time over the Occult-dispatch rows (exact and pruned,
/// which differ only in E[C_T]; flat, not two-level) of each suite and size, pooled after
/// dividing each time by its group's mean; `measured` picks measured or projected times. `None` with fewer than 3 points.
pub fn ect_time_correlation(rows: &[SpeedRow], measured: bool) -> Option<f64> {
    let mut pts: Vec<(f64, f64)> = Vec::new();
    let mut groups: Vec<(&str, usize)> = Vec::new();
    for r in rows {
        let g = (r.suite.as_str(), r.tokens);
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    for (suite, tokens) in groups {
        let g: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.suite == suite && r.tokens == tokens && r.key.mode == MoeMode::Occult)
            .filter_map(|r| {
                let t = if measured {
                    Some(r.seconds)
                } else {
                    r.projected_seconds
                };
                t.map(|t| (r.ect, t))
            })
            .collect();
        if g.len() < 2 {
            continue;
        }
        let mean = g.iter().map(|p| p.1).sum::<f64>() / g.len() as f64;
        pts.extend(g.iter().map(|&(e, t)| (e, t / mean)));
    }
    pearson(&pts)
}

fn pearson(pts: &[(f64, f64)]) -> Option<f64> {
    if pts.len() < 3 {
        return None;
    }
    let n = pts.len() as f64;
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / n,
        pts.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for &(x, y) in pts {
        sxy += (x - mx) * (y - my);
        sxx += (x - mx) * (x - mx);
        syy += (y - my) * (y - my);
    }
    (sxx > 0.0 && syy > 0.0).then(|| sxy / (sxx * syy).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pearson_by_hand() {
        assert_eq!(pearson(&[(1.0, 2.0), (2.0, 4.0), (3.0, 6.0)]), Some(1.0));
        let r = pearson(&[(1.0, 3.0), (2.0, 2.0), (3.0, 1.0)]).unwrap();
        assert!((r + 1.0).abs() < 1e-12);
        assert_eq!(pearson(&[(1.0, 1.0), (2.0, 1.0), (3.0, 1.0)]), None);
        assert_eq!(pearson(&[(1.0, 1.0)]), None);
    }
}
