//! Evaluation: multiple-choice tasks scored as lm-evaluation-harness scores them, on a model's
//! ranks (so pruned routing can be scored without fine-tuning). The harness prepares and
//! scores the tasks ([`crate::harness::evaluate`]) and aggregates their results
//! ([`crate::harness::results`]); this runs them on the model and gathers the results JSON
//! (per task and metric with standard errors, the configuration and the seed), the table, the
//! per-item samples and, when asked, the routing of the evaluated tokens. A task that fails is
//! reported and the others go on.

use crate::context::ModelSpec;
use crate::harness::evaluate::{
    data_sources, prepare_any, score_task, PrepareOptions, Prepared, PreparedTask,
};
use crate::harness::gen_eval::{generate_task, windows};
use crate::harness::gen_results::summarise_generative;
use crate::harness::generate_until::Stopping;
use crate::harness::results::{summarise, TaskOutcome};
use crate::harness::scorer::ScoreOptions;
use crate::table::Table;
use anyhow::{bail, Result};
use occult_core::analysis::pruning::PruneRule;
use occult_core::analysis::run_key::MoeMode;
use occult_core::analysis::trace::Trace;
use occult_core::models::model::RoutingRecorder;
use serde::Serialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use std::path::PathBuf;

/// What to evaluate, and how.
#[derive(Clone, Debug)]
pub struct EvalJob {
    /// Built-in task names or paths to task files.
    pub tasks: Vec<String>,
    /// Task data as `TASK=PATH`; without it, a task's dataset is read from the hub's cache.
    pub data: Vec<String>,
    /// Use the built-in sample data for tasks without data.
    pub samples: bool,
    /// Few-shot examples per item; each task's own when `None`.
    pub num_fewshot: Option<usize>,
    /// Score at most this many items per task.
    pub limit: Option<usize>,
    /// Requests per forward pass when contexts are not reused.
    pub batch_size: usize,
    /// Run a shared context once for all its continuations.
    pub context_reuse: bool,
    /// Seed of the few-shot draw.
    pub seed: u64,
    /// lm-eval's `add_bos_token`: `None` encodes with the tokenizer's special tokens (its BOS,
    /// where its post-processor adds one), as the harness does by default.
    pub add_bos: Option<bool>,
    /// Record the routing of every evaluated token (one device; requests run one at a time,
    /// whole, so that no padding is recorded).
    pub record_routing: bool,
    /// Generative tasks: most new tokens (default: each task's own).
    pub max_gen_toks: Option<usize>,
}

impl EvalJob {
    /// `tasks` at `occult eval`'s defaults.
    pub fn new(tasks: Vec<String>) -> Self {
        EvalJob {
            tasks,
            data: Vec::new(),
            samples: false,
            num_fewshot: None,
            limit: None,
            batch_size: 8,
            context_reuse: true,
            seed: 1234,
            add_bos: None,
            record_routing: false,
            max_gen_toks: None,
        }
    }

    /// The task files and data files it reads.
    pub fn inputs(&self) -> Result<Vec<std::path::PathBuf>> {
        let po = prepare_options(self)?;
        Ok(self
            .tasks
            .iter()
            .map(Path::new)
            .filter(|p| p.extension().is_some_and(|e| e == "toml") && p.exists())
            .map(Path::to_path_buf)
            .chain(po.data.into_values())
            .collect())
    }
}

/// What an evaluation gives, typed: each scored task's results (figures and per-item samples),
/// the tasks that failed and why, the run's configuration and the recorded routing. The
/// results JSON ([`Evaluated::report`]) and the samples lines are made from it where they are
/// written.
#[derive(Debug)]
pub struct Evaluated {
    /// Each scored task's results, in the order the tasks were given.
    pub tasks: Vec<(String, TaskOutcome)>,
    pub errors: BTreeMap<String, String>,
    pub config: EvalConfig,
    pub routing: Option<Trace>,
}

/// The configuration an evaluation ran with, as its results JSON records it (`config`).
#[derive(Clone, Debug, Serialize)]
pub struct EvalConfig {
    pub model: String,
    pub tasks: Vec<String>,
    pub num_fewshot: Option<usize>,
    pub limit: Option<usize>,
    pub batch_size: usize,
    pub context_reuse: bool,
    pub seed: u64,
    pub add_bos: Option<bool>,
    pub devices: usize,
    pub mode: MoeMode,
    pub placement: Option<PathBuf>,
    pub max_devices: Option<usize>,
    pub prune_limit: Option<String>,
    pub prune_rule: Option<PruneRule>,
    pub dtype: String,
    /// Generative tasks' budget of new tokens, where the run set one.
    pub max_gen_toks: Option<usize>,
}

impl Evaluated {
    /// The results JSON: `results` (each task's entry), `errors` and `config`.
    pub fn report(&self) -> serde_json::Value {
        let results: serde_json::Map<String, serde_json::Value> = self
            .tasks
            .iter()
            .map(|(name, t)| (name.clone(), t.to_json()))
            .collect();
        json!({"results": results, "errors": self.errors, "config": self.config})
    }

    /// The table: each task's metrics with their standard errors, and its items per second.
    pub fn table(&self) -> Table {
        let mut table = Table::new(&["task", "n", "shots", "metric", "value", "stderr", "items/s"]);
        for (name, t) in &self.tasks {
            for (key, e) in t.figures() {
                table.row(vec![
                    name.clone(),
                    t.n().to_string(),
                    t.num_fewshot().to_string(),
                    key,
                    format!("{:.4}", e.value),
                    e.stderr.map_or("N/A".into(), |x| format!("{x:.4}")),
                    format!("{:.2}", t.items_per_s()),
                ]);
            }
        }
        table
    }

    /// Writes the results JSON (with provenance) to `out`, and each task's samples as
    /// `samples_TASK.jsonl` beside it when `log_samples`. With no task scored there are no
    /// results to write; the errors say why.
    pub fn write(&self, out: &Path, log_samples: bool) -> Result<()> {
        if self.tasks.is_empty() {
            return Ok(());
        }
        crate::output::write_json(out, &crate::output::with_provenance(self.report()))?;
        if log_samples {
            let dir = out.parent().unwrap_or(Path::new("."));
            for (task, t) in &self.tasks {
                let path = dir.join(format!("samples_{task}.jsonl"));
                occult_core::atomic::write_atomic(&path, |w| {
                    for line in t.sample_lines() {
                        serde_json::to_writer(&mut *w, &line).map_err(std::io::Error::other)?;
                        w.write_all(b"\n")?;
                    }
                    Ok(())
                })?;
            }
        }
        Ok(())
    }

    /// Fails naming the tasks that failed, if any did.
    pub fn check(&self, tasks: usize) -> Result<()> {
        if !self.errors.is_empty() {
            bail!(
                "{} of {tasks} task(s) failed: {}",
                self.errors.len(),
                self.errors.keys().cloned().collect::<Vec<_>>().join(", ")
            );
        }
        Ok(())
    }
}

/// The harness's options for preparing tasks: `TASK=PATH` sources, each naming one of the
/// tasks, and the few-shot, limit and seed settings; checks the batch size.
pub(crate) fn prepare_options(a: &EvalJob) -> Result<PrepareOptions> {
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
        max_gen_toks: a.max_gen_toks,
    })
}

/// Prepares and scores every task of `job` on `spec`'s ranks: rank 0 gets what was scored
/// (tasks that failed among its errors), the other processes of an `mpirun` job `None`.
/// Fails only when no task could be prepared.
pub fn evaluate(spec: &ModelSpec, job: &EvalJob) -> Result<Option<Evaluated>> {
    let a = job;
    let po = prepare_options(a)?;
    // Tasks that cannot be prepared are reported; the others go on.
    let mut errors: BTreeMap<String, String> = BTreeMap::new();
    let mut prepared = Vec::new();
    for name in &a.tasks {
        match prepare_any(name, &po) {
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
    if a.record_routing && spec.devices != 1 {
        bail!("--trace records on one device (routing does not depend on the device count)");
    }
    let generative = prepared
        .iter()
        .any(|p| matches!(p, PreparedTask::Generative(_)));
    if a.record_routing && generative {
        bail!("--trace records multiple-choice scoring only; generative tasks cannot be traced");
    }
    let ck = spec.open()?;
    let tok = ck.tokenizer()?;
    // Generative tasks: the windows fed and when each generation ends, the same on every rank.
    let max_length = ck.cfg.max_positions.unwrap_or(2048);
    let mut gen_inputs = Vec::new();
    for p in &prepared {
        gen_inputs.push(match p {
            PreparedTask::Generative(g) => {
                let windows = windows(g, tok, max_length, a.add_bos)?;
                let g = &g.spec.generation;
                let stopping = Stopping::new(tok, &g.until, g.max_gen_toks)?;
                Some(GenInput { windows, stopping })
            }
            PreparedTask::Choice(_) => None,
        });
    }
    let opts = ScoreOptions {
        reuse_context: a.context_reuse && !a.record_routing,
        batch: if a.record_routing { 1 } else { a.batch_size },
        add_bos: a.add_bos,
    };
    let record = a.record_routing;
    let work = work_bytes(&prepared, &gen_inputs);
    let Some((scored, routing)) = spec.run_same(&ck, "tasks or items", work, |m| {
        // Rank 0 shows the progress of its share.
        let mine: usize = prepared.iter().map(|p| m.shard(p.len()).len()).sum();
        let bar = crate::progress::rank_bar(m.rank_and_size().0, mine as u64, "items");
        let mut routing = record.then(RoutingRecorder::default);
        let mut out = Vec::new();
        for (p, gen) in prepared.iter().zip(&gen_inputs) {
            match (p, gen) {
                (PreparedTask::Choice(p), _) => {
                    let (s, r) = score_task(m, tok, opts, p, routing.take(), &|n| bar.inc(n))?;
                    routing = r;
                    out.push(Scores::Choice(s));
                }
                (PreparedTask::Generative(_), Some(g)) => {
                    let (w, stop) = (&g.windows, &g.stopping);
                    let s = generate_task(m, tok, w, stop, a.batch_size, &|n| bar.inc(n))?;
                    out.push(Scores::Generative(s));
                }
                (PreparedTask::Generative(_), None) => unreachable!("windows made above"),
            }
        }
        bar.finish_and_clear();
        Ok((out, routing))
    })?
    else {
        return Ok(None);
    };
    let routing = routing.map(|rec| {
        crate::jobs::profile::trace_of(
            rec,
            &ck.cfg,
            &ck.name,
            &format!("occult eval --tasks {}", a.tasks.join(",")),
            true,
        )
    });
    let mut tasks = Vec::new();
    for ((p, s), gen) in prepared.iter().zip(scored).zip(&gen_inputs) {
        let name = p.name().to_string();
        let outcome = match (p, s, gen) {
            (PreparedTask::Choice(p), Scores::Choice(s), _) => {
                s.map(|s| TaskOutcome::Choice(summarise(p, &s)))
            }
            (PreparedTask::Generative(p), Scores::Generative(s), Some(g)) => s
                .and_then(|s| {
                    summarise_generative(p, &s, tok, &g.stopping).map_err(|e| format!("{e:#}"))
                })
                .map(TaskOutcome::Generative),
            _ => Err("internal: a task's scores are of the other kind".into()),
        };
        match outcome {
            Ok(o) => tasks.push((name, o)),
            Err(e) => {
                eprintln!("error: task {name}: {e}");
                errors.insert(name, e);
            }
        }
    }
    let config = EvalConfig {
        model: ck.name.clone(),
        tasks: a.tasks.clone(),
        num_fewshot: a.num_fewshot,
        limit: a.limit,
        batch_size: opts.batch,
        context_reuse: opts.reuse_context,
        seed: a.seed,
        add_bos: a.add_bos,
        devices: spec.devices,
        mode: spec.mode(),
        placement: spec.placement_file.clone(),
        max_devices: spec.max_devices(),
        prune_limit: spec.prune.map(|l| l.label()),
        prune_rule: spec.prune.map(|_| spec.prune_rule),
        dtype: spec.dtype.clone(),
        max_gen_toks: a.max_gen_toks,
    };
    Ok(Some(Evaluated {
        tasks,
        errors,
        config,
        routing,
    }))
}

/// A generative task's inputs, the same on every rank: each item's tokens fed, and when its
/// generation ends.
pub(crate) struct GenInput {
    windows: Vec<Vec<u32>>,
    stopping: Stopping,
}

/// A task's scores on this rank's side of the run: a multiple-choice task's log-likelihoods
/// or a generative task's generations (the task's error if it failed).
enum Scores {
    Choice(Result<crate::harness::evaluate::Scored, String>),
    Generative(Result<crate::harness::gen_eval::GenScored, String>),
}

/// What ranks must agree on before they score: each task's name and its items' documents and
/// requests (a generative task's tokens fed and stop strings).
pub(crate) fn work_bytes(prepared: &[PreparedTask], gen: &[Option<GenInput>]) -> Vec<u8> {
    let mut text = String::new();
    for (p, g) in prepared
        .iter()
        .zip(gen.iter().chain(std::iter::repeat(&None)))
    {
        text.push_str(p.name());
        match p {
            PreparedTask::Choice(p) => text.push_str(&choice_work(p)),
            PreparedTask::Generative(_) => {
                if let Some(g) = g {
                    text.push_str(&format!("|{:?}|{:?}", g.windows, g.stopping));
                }
            }
        }
    }
    text.into_bytes()
}

/// A multiple-choice task's items as text, for [`work_bytes`].
pub(crate) fn choice_work(p: &Prepared) -> String {
    let mut text = String::new();
    for it in &p.items {
        text.push_str(&format!("|{}|{}|{:?}", it.doc_id, it.gold, it.contexts));
        text.push_str(&it.continuations.join("|"));
    }
    text
}
