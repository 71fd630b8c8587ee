//! `occult bench eval`: the same tasks scored with and without context reuse in one run, side
//! by side: forward tokens per item, forward passes, items/s, and the largest difference in a
//! log-likelihood between the two.

use crate::context::ModelSpec;
use crate::harness::evaluate::{prepare, score_task};
use crate::harness::scorer::ScoreOptions;
use crate::jobs::eval::{choice_work, prepare_options, EvalJob};
use crate::table::Table;
use anyhow::{Context, Result};
use serde_json::json;
use std::path::Path;

/// Scores `job`'s tasks on `spec` twice, with and without context reuse, prints the table and
/// writes it as JSON to `output`.
pub fn run(spec: &ModelSpec, job: &EvalJob, output: Option<&Path>) -> Result<()> {
    let a = job;
    let po = prepare_options(a)?;
    let prepared = a
        .tasks
        .iter()
        .map(|t| prepare(t, &po).with_context(|| format!("task {t}")))
        .collect::<Result<Vec<_>>>()?;
    let ck = spec.open()?;
    let tok = ck.tokenizer()?;
    let mk = |reuse| ScoreOptions {
        reuse_context: reuse,
        batch: a.batch_size,
        add_bos: a.add_bos,
    };
    let work: String = prepared
        .iter()
        .map(|p| format!("{}{}", p.spec.name, choice_work(p)))
        .collect();
    let Some(runs) = spec.run_same(&ck, "tasks or items", work.into_bytes(), |m| {
        let mut out = Vec::new();
        for p in &prepared {
            let mut pair = Vec::new();
            for reuse in [true, false] {
                let (s, _) = score_task(m, tok, mk(reuse), p, None, &|_| {})?;
                pair.push(s.map_err(anyhow::Error::msg)?);
            }
            out.push(pair);
        }
        Ok(out)
    })?
    else {
        return Ok(());
    };
    let mut table = Table::new(&[
        "task",
        "items",
        "tokens/item reuse",
        "tokens/item whole",
        "ratio",
        "passes reuse",
        "passes whole",
        "items/s reuse",
        "items/s whole",
        "max |dll|",
    ]);
    let mut rows = Vec::new();
    for (p, pair) in prepared.iter().zip(&runs) {
        let n = p.items.len() as f64;
        let (r, w) = (&pair[0], &pair[1]);
        let dll = r
            .lls
            .iter()
            .flatten()
            .zip(w.lls.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        let row = json!({
            "task": p.spec.name, "items": p.items.len(),
            "forward_tokens_per_item": {"reuse": r.forward_tokens as f64 / n, "whole": w.forward_tokens as f64 / n},
            "forward_passes": {"reuse": r.forward_passes, "whole": w.forward_passes},
            "items_per_s": {"reuse": n / r.seconds.max(1e-9), "whole": n / w.seconds.max(1e-9)},
            "max_abs_loglikelihood_diff": dll,
        });
        table.row(vec![
            p.spec.name.clone(),
            p.items.len().to_string(),
            format!("{:.1}", r.forward_tokens as f64 / n),
            format!("{:.1}", w.forward_tokens as f64 / n),
            format!(
                "{:.3}",
                r.forward_tokens as f64 / w.forward_tokens.max(1) as f64
            ),
            r.forward_passes.to_string(),
            w.forward_passes.to_string(),
            format!("{:.2}", n / r.seconds.max(1e-9)),
            format!("{:.2}", n / w.seconds.max(1e-9)),
            format!("{dll:.1e}"),
        ]);
        rows.push(row);
    }
    println!("{}", table.render());
    if let Some(out) = output {
        let report = json!({"model": ck.name, "batch_size": a.batch_size, "results": rows});
        super::report::write(out, "eval", report)?;
    }
    Ok(())
}
