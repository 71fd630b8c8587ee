//! `occult eval`: multiple-choice tasks scored as lm-evaluation-harness scores them, with the
//! model options of every model command (so pruned routing can be scored without fine-tuning).
//! Writes results as JSON (per task and metric with standard errors, the configuration, the
//! version and the seed), prints a Markdown table, and with `--log-samples` writes
//! `samples_TASK.jsonl` beside the results. A task that fails is reported and the others go on.
//! The command parses flags, runs the model and prints; the harness prepares and scores the
//! tasks ([`crate::harness::evaluate`]) and aggregates their results
//! ([`crate::harness::results`]).

use super::model_opts::ModelOpts;
use crate::harness::evaluate::{data_sources, prepare, score_task, PrepareOptions};
use crate::harness::results::{summarise, TaskResults};
use crate::harness::scorer::ScoreOptions;
use crate::table::Table;
use anyhow::{bail, Context, Result};
use occult_core::models::model::RoutingRecorder;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    occult eval --model M --tasks piqa,arc_easy --samples          # the built-in sample data\n  \
    occult eval --model M --tasks hellaswag --data hellaswag=hellaswag_val.jsonl --limit 200\n  \
    occult eval --model M --tasks mmlu --data mmlu=mmlu_dir/ --devices 4 --max-devices 2 \\\n      \
    --placement p.json --output results.json --log-samples")]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelOpts,
    /// Tasks, comma-separated: built-in names or paths to task files.
    #[arg(long, value_delimiter = ',', required = true)]
    pub tasks: Vec<String>,
    /// A task's data: TASK=PATH, a Parquet/JSONL/JSON file (the eval split) or a folder of
    /// split files. Without it, the task's dataset is read from the Hugging Face cache.
    #[arg(long)]
    pub data: Vec<String>,
    /// Use the built-in sample data for tasks without --data.
    #[arg(long)]
    pub samples: bool,
    /// Few-shot examples per item (default: each task's own).
    #[arg(long)]
    pub num_fewshot: Option<usize>,
    /// Score at most this many items per task.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Requests per forward pass when contexts are not reused.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Run each request whole instead of running a shared context once.
    #[arg(long)]
    pub no_context_reuse: bool,
    /// Seed of the few-shot draw.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Add BOS when encoding (lm-eval's add_bos_token).
    #[arg(long)]
    pub add_bos: bool,
    /// Write the results JSON here.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Also write per-item log-likelihoods (samples_TASK.jsonl beside --output).
    #[arg(long, requires = "output")]
    pub log_samples: bool,
    /// Print no table on stdout (the results go to --output).
    #[arg(long, requires = "output")]
    pub quiet: bool,
    /// Record the routing of every evaluated token into this trace (one device; requests run
    /// one at a time, whole, so that no padding is recorded).
    #[arg(long)]
    pub trace: Option<PathBuf>,
}

/// The harness's options for preparing tasks: `--data TASK=PATH` sources, each naming one of
/// `--tasks`, and the few-shot, limit and seed flags; checks `--batch-size`.
fn prepare_options(a: &EvalArgs) -> Result<PrepareOptions> {
    if a.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    let sources = data_sources(&a.tasks, &a.data)?;
    Ok(PrepareOptions {
        data: sources,
        samples: a.samples,
        num_fewshot: a.num_fewshot,
        limit: a.limit,
        seed: a.seed,
    })
}

/// `occult eval`: prepares, scores and reports every task; fails if any task failed.
pub fn run(a: EvalArgs) -> Result<()> {
    let po = prepare_options(&a)?;
    // Task files and data are inputs too: no output may replace them.
    let task_files: Vec<&Path> = a
        .tasks
        .iter()
        .map(Path::new)
        .filter(|p| p.extension().is_some_and(|e| e == "toml") && p.exists())
        .chain(po.data.values().map(PathBuf::as_path))
        .collect();
    let more: Vec<Option<&Path>> = task_files.into_iter().map(Some).collect();
    super::check_model_io(&a.model, &more, &[a.output.as_deref(), a.trace.as_deref()])?;
    // Tasks that cannot be prepared are reported; the others go on.
    let mut errors: BTreeMap<String, String> = BTreeMap::new();
    let mut prepared = Vec::new();
    for name in &a.tasks {
        match prepare(name, &po) {
            Ok(p) => prepared.push(p),
            Err(e) => {
                eprintln!("error: task {name}: {e:#}");
                errors.insert(name.clone(), format!("{e:#}"));
            }
        }
    }
    if prepared.is_empty() {
        bail!("no task could be prepared");
    }
    if a.trace.is_some() && a.model.devices != 1 {
        bail!("--trace records on one device (routing does not depend on the device count)");
    }
    let ck = a.model.open()?;
    let tok = ck.tokenizer()?;
    let opts = ScoreOptions {
        reuse_context: !a.no_context_reuse && a.trace.is_none(),
        batch: if a.trace.is_some() { 1 } else { a.batch_size },
        add_bos: a.add_bos,
    };
    let record = a.trace.is_some();
    let work = work_fingerprint(&prepared);
    let Some((scored, routing)) = a.model.run(&ck, |m| {
        m.check_same_work("tasks or items", work)?;
        // Rank 0 shows the progress of its share.
        let mine: usize = prepared.iter().map(|p| m.shard(p.items.len()).len()).sum();
        let bar = crate::progress::rank_bar(m.rank_and_size().0, mine as u64, "items");
        let mut routing = record.then(RoutingRecorder::default);
        let mut out = Vec::new();
        for p in &prepared {
            let (s, r) = score_task(m, tok, opts, p, routing.take(), &|n| bar.inc(n))?;
            routing = r;
            out.push(s);
        }
        bar.finish_and_clear();
        Ok((out, routing))
    })?
    else {
        return Ok(());
    };
    if let (Some(path), Some(rec)) = (&a.trace, routing) {
        let trace = crate::commands::profile::trace_of(
            rec,
            &ck.cfg,
            &ck.name,
            &format!("occult eval --tasks {}", a.tasks.join(",")),
            true,
        );
        trace.write(path)?;
        eprintln!("routing of the evaluated text -> {}", path.display());
    }
    let mut results = serde_json::Map::new();
    let mut table = Table::new(&["task", "n", "shots", "metric", "value", "stderr", "items/s"]);
    let mut all_samples = Vec::new();
    for (p, s) in prepared.iter().zip(scored) {
        let s = match s {
            Ok(s) => s,
            Err(e) => {
                eprintln!("error: task {}: {e}", p.spec.name);
                errors.insert(p.spec.name.clone(), e);
                continue;
            }
        };
        let TaskResults {
            results: r,
            samples,
        } = summarise(p, &s);
        for &m in &p.spec.metrics {
            let key = m.key();
            table.row(vec![
                p.spec.name.clone(),
                p.items.len().to_string(),
                p.shots.to_string(),
                key.into(),
                format!("{:.4}", r[key].as_f64().unwrap_or(f64::NAN)),
                r[m.stderr_key()]
                    .as_f64()
                    .map_or("N/A".into(), |x| format!("{x:.4}")),
                format!("{:.2}", r["speed"]["items_per_s"].as_f64().unwrap_or(0.0)),
            ]);
        }
        results.insert(p.spec.name.clone(), r);
        all_samples.push((p.spec.name.clone(), samples));
    }
    if !a.quiet {
        println!("{}", table.render());
    }
    let report = json!({
        "results": results,
        "errors": errors,
        "config": {
            "model": ck.name,
            "tasks": a.tasks,
            "num_fewshot": a.num_fewshot,
            "limit": a.limit,
            "batch_size": opts.batch,
            "context_reuse": opts.reuse_context,
            "seed": a.seed,
            "add_bos": a.add_bos,
            "devices": a.model.devices,
            "mode": a.model.mode(),
            "placement": a.model.placement,
            "max_devices": a.model.max_devices,
            "prune_rule": a.model.max_devices.map(|_| a.model.prune_rule),
            "dtype": a.model.dtype,
        },
    });
    // With no task scored there are no results to write; the errors say why.
    if let (Some(out), false) = (&a.output, results.is_empty()) {
        super::write_json(out, &super::with_provenance(report))?;
        if a.log_samples {
            let dir = out.parent().unwrap_or(Path::new("."));
            for (task, samples) in &all_samples {
                let path = dir.join(format!("samples_{task}.jsonl"));
                occult_core::atomic::write_atomic(&path, |w| {
                    for s in samples {
                        serde_json::to_writer(&mut *w, s).map_err(std::io::Error::other)?;
                        w.write_all(b"\n")?;
                    }
                    Ok(())
                })?;
            }
        }
    }
    if !errors.is_empty() {
        bail!(
            "{} of {} task(s) failed: {}",
            errors.len(),
            a.tasks.len(),
            errors.keys().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    Ok(())
}

/// `occult bench eval`: the same tasks scored with and without context reuse in one run, side
/// by side: forward tokens per item, forward passes, items/s, and the largest difference in a
/// log-likelihood between the two.
pub fn bench(a: EvalArgs) -> Result<()> {
    let po = prepare_options(&a)?;
    let prepared = a
        .tasks
        .iter()
        .map(|t| prepare(t, &po).with_context(|| format!("task {t}")))
        .collect::<Result<Vec<_>>>()?;
    let ck = a.model.open()?;
    let tok = ck.tokenizer()?;
    let mk = |reuse| ScoreOptions {
        reuse_context: reuse,
        batch: a.batch_size,
        add_bos: a.add_bos,
    };
    let work = work_fingerprint(&prepared);
    let Some(runs) = a.model.run(&ck, |m| {
        m.check_same_work("tasks or items", work)?;
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
    if let Some(out) = &a.output {
        let report = json!({"model": ck.name, "batch_size": a.batch_size, "results": rows});
        super::write_json(out, &super::with_provenance(report))?;
    }
    Ok(())
}

/// What ranks must agree on before they score: each task's name and its items' documents and
/// requests.
fn work_fingerprint(prepared: &[crate::harness::evaluate::Prepared]) -> u64 {
    let mut text = String::new();
    for p in prepared {
        text.push_str(&p.spec.name);
        for it in &p.items {
            text.push_str(&format!("|{}|{}|{:?}", it.doc_id, it.gold, it.contexts));
            text.push_str(&it.continuations.join("|"));
        }
    }
    occult_core::models::data_parallel::fingerprint(text.into_bytes())
}
