//! The steps of evaluating a task, as lm-evaluation-harness's `api/task.py` runs them: the
//! task file is found ([`task_file`]: multiple-choice or generative), its data loaded and its
//! items built, with their few-shot examples and the limit per group ([`prepare_any`]), then
//! a multiple-choice task's items are scored by a model ([`score_task`]; on D ranks each
//! scores its share and the scores are gathered in item order). Generating a generative
//! task's answers is [`super::gen_eval`]'s part, aggregating the scores [`super::results`]'s.

use super::data::{self, Source};
use super::gen_eval::{prepare_generative, GenPrepared};
use super::gen_task::GenTaskSpec;
use super::pyrandom::PyRandom;
use super::scorer::{ScoreOptions, Scorer};
use super::task::{DataSpec, Item, TaskSpec};
use super::template::{as_text, lookup};
use anyhow::{bail, Context, Result};
use occult_core::models::model::{Model, RoutingRecorder};
use occult_core::models::tokenizer::TextTokenizer;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Where tasks' documents come from, and how their items are built.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// A task's data (a file, or a folder of split files) by task name: the name given, or
    /// the task file's `name`. Tasks without one read the built-in samples or the Hugging
    /// Face cache.
    pub data: BTreeMap<String, PathBuf>,
    /// Use the built-in sample data for tasks without `data`.
    pub samples: bool,
    /// Few-shot examples per item (default: each task's own).
    pub num_fewshot: Option<usize>,
    /// Score at most this many items per task (per group in grouped tasks).
    pub limit: Option<usize>,
    /// Seed of the few-shot draw.
    pub seed: u64,
    /// Generative tasks: most new tokens (default: each task's own).
    pub max_gen_toks: Option<usize>,
}

/// One task's items, ready to score.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The task file.
    pub spec: TaskSpec,
    /// The items to score, in document order.
    pub items: Vec<Item>,
    /// Few-shot examples per item.
    pub shots: usize,
}

/// One task's scores, and what scoring them cost.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Scored {
    /// Log-likelihoods of each item's requests, in the order of [`Prepared::items`].
    pub lls: Vec<Vec<f64>>,
    /// Real (unpadded) tokens fed to the model.
    pub forward_tokens: u64,
    /// Forward passes run.
    pub forward_passes: u64,
    /// Wall-clock time of the scoring (the slowest rank's).
    pub seconds: f64,
}

impl Scored {
    /// Ranks' scores of consecutive shares of a task, joined in rank order.
    fn join(parts: Vec<Scored>) -> Scored {
        let mut all = Scored {
            lls: Vec::new(),
            forward_tokens: 0,
            forward_passes: 0,
            seconds: 0.0,
        };
        for p in parts {
            all.lls.extend(p.lls);
            all.forward_tokens += p.forward_tokens;
            all.forward_passes += p.forward_passes;
            all.seconds = all.seconds.max(p.seconds);
        }
        all
    }
}

/// A task file of either kind.
#[derive(Clone, Debug)]
pub enum TaskFile {
    /// Multiple choice, scored by log-likelihood.
    Choice(TaskSpec),
    /// Generated answers (`output_type = "generate_until"`).
    Generative(GenTaskSpec),
}

impl TaskFile {
    /// Parses a task file of either kind (a generative one says `output_type =
    /// "generate_until"`); `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self> {
        let generative = toml::from_str::<toml::Table>(text)
            .ok()
            .is_some_and(|t| t.contains_key("output_type"));
        Ok(if generative {
            TaskFile::Generative(GenTaskSpec::parse(text, origin)?)
        } else {
            TaskFile::Choice(TaskSpec::parse(text, origin)?)
        })
    }

    /// The name the file declares.
    pub fn name(&self) -> &str {
        match self {
            TaskFile::Choice(t) => &t.name,
            TaskFile::Generative(t) => &t.name,
        }
    }

    /// Where its data is.
    pub fn data(&self) -> &DataSpec {
        match self {
            TaskFile::Choice(t) => &t.data,
            TaskFile::Generative(t) => &t.data,
        }
    }
}

/// A multiple-choice task by name (see [`task_file`]).
pub fn task_spec(name: &str) -> Result<TaskSpec> {
    match task_file(name)? {
        TaskFile::Choice(t) => Ok(t),
        TaskFile::Generative(_) => bail!(
            "{name} is a generative task (generate_until); only multiple-choice tasks are \
             scored by log-likelihood here"
        ),
    }
}

/// A task by name: a built-in task, or the path of a task file (`*.toml`).
pub fn task_file(name: &str) -> Result<TaskFile> {
    if let Some((_, text)) = data::TASKS.iter().find(|(n, _)| *n == name) {
        return TaskFile::parse(text, &format!("tasks/{name}.toml"));
    }
    let p = Path::new(name);
    if p.extension().is_some_and(|e| e == "toml") && p.exists() {
        let text = occult_core::input::read_text(p)?;
        return TaskFile::parse(&text, &p.display().to_string());
    }
    bail!(
        "unknown task {name:?}: the built-in tasks are {}; or give a path to a task file",
        data::TASKS
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Reads `--data TASK=PATH` flags into sources keyed by the `--tasks` entry each names. A flag
/// may name an entry as given, a task file by its file stem, or a task by the `name` its task
/// file declares; one that names no entry is an error that lists what would have matched.
pub fn data_sources(tasks: &[String], data: &[String]) -> Result<BTreeMap<String, PathBuf>> {
    // Every name each entry answers to (a task file that cannot be read answers to its path
    // and stem only; preparing it reports why).
    let mut unreadable = Vec::new();
    let names: Vec<(String, Vec<String>)> = tasks
        .iter()
        .map(|n| {
            let mut also = vec![n.clone()];
            if let Some(stem) = Path::new(n).file_stem().and_then(|s| s.to_str()) {
                also.push(stem.to_string());
            }
            match task_file(n) {
                Ok(spec) => also.push(spec.name().to_string()),
                Err(e) => unreadable.push(format!("{e:#}")),
            }
            also.dedup();
            (n.clone(), also)
        })
        .collect();
    let mut sources = BTreeMap::new();
    for d in data {
        let (t, p) = d
            .split_once('=')
            .with_context(|| format!("--data {d:?} is not TASK=PATH"))?;
        let Some((entry, _)) = names.iter().find(|(_, also)| also.iter().any(|x| x == t)) else {
            // A task whose file cannot be read may be the one meant: say why it cannot be.
            if let Some(why) = unreadable.first() {
                bail!("--data names {t:?}, which is none of --tasks; {why}");
            }
            let known: Vec<String> = names.iter().flat_map(|(_, also)| also.clone()).collect();
            bail!(
                "--data names {t:?}, which is none of --tasks (a task is named by its entry, \
                 its task file's stem or the name the file declares: {})",
                known.join(", ")
            );
        };
        if sources.insert(entry.clone(), PathBuf::from(p)).is_some() {
            bail!("--data gives task {entry:?} twice");
        }
    }
    Ok(sources)
}

/// One task's items, ready to score or generate.
#[derive(Clone, Debug)]
pub enum PreparedTask {
    Choice(Prepared),
    Generative(GenPrepared),
}

impl PreparedTask {
    /// The task's name.
    pub fn name(&self) -> &str {
        match self {
            PreparedTask::Choice(p) => &p.spec.name,
            PreparedTask::Generative(p) => &p.spec.name,
        }
    }

    /// Its items.
    pub fn len(&self) -> usize {
        match self {
            PreparedTask::Choice(p) => p.items.len(),
            PreparedTask::Generative(p) => p.items.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Task `name`'s items, of either kind (see [`prepare`] and [`prepare_generative`]).
pub fn prepare_any(name: &str, o: &PrepareOptions) -> Result<PreparedTask> {
    Ok(match task_file(name)? {
        TaskFile::Choice(spec) => PreparedTask::Choice(prepare_choice(name, spec, o)?),
        TaskFile::Generative(spec) => {
            let source = source_of(name, &spec.name, o);
            PreparedTask::Generative(prepare_generative(spec, &source, o)?)
        }
    })
}

/// Where task `name` (whose file declares `declared`) reads its documents.
fn source_of(name: &str, declared: &str, o: &PrepareOptions) -> Source {
    match (o.data.get(name).or(o.data.get(declared)), o.samples) {
        (Some(p), _) => Source::Path(p.clone()),
        (None, true) => Source::Samples,
        (None, false) => Source::Hub,
    }
}

/// Refuses `shots` examples from a few-shot split the data lacks.
pub(crate) fn check_fewshot_split(
    task: &str,
    data: &DataSpec,
    few: Option<&data::Docs>,
    shots: usize,
) -> Result<()> {
    let eval_split = &data.eval_split;
    if let Some(fs) = data.fewshot_split.as_ref().filter(|s| *s != eval_split) {
        if few.is_none() && shots > 0 {
            bail!(
                "{shots}-shot {task} needs its {fs} split for the examples, and the data has \
                 none (give --data {task}=FOLDER with {eval_split} and {fs} files, or \
                 --num-fewshot 0)"
            );
        }
    }
    Ok(())
}

/// What "no documents" says of a source.
pub(crate) fn source_name(source: &Source, data: &DataSpec) -> String {
    match source {
        Source::Path(p) => p.display().to_string(),
        Source::Samples => "the built-in samples".into(),
        Source::Hub => format!("the cached {}", data.hub),
    }
}

/// Multiple-choice task `name`'s items: its documents loaded and preprocessed, at most
/// `limit` per group, each with its few-shot examples.
pub fn prepare(name: &str, o: &PrepareOptions) -> Result<Prepared> {
    prepare_choice(name, task_spec(name)?, o)
}

fn prepare_choice(name: &str, spec: TaskSpec, o: &PrepareOptions) -> Result<Prepared> {
    let source = source_of(name, &spec.name, o);
    let (eval, few) = data::load(&spec.name, &spec.data, &source)?;
    let shots = o.num_fewshot.unwrap_or(spec.prompt.num_fewshot);
    check_fewshot_split(&spec.name, &spec.data, few.as_ref(), shots)?;
    let docs = spec.prepare(&eval.docs, &eval.origins)?;
    let few = few.map(|f| spec.prepare(&f.docs, &f.origins)).transpose()?;
    // The limit applies per group (each MMLU subject), as the harness limits each subtask.
    let mut taken: BTreeMap<Option<String>, usize> = BTreeMap::new();
    let group_of = |d: &Value| {
        spec.data
            .group_field
            .as_ref()
            .and_then(|f| lookup(d, f).and_then(as_text))
    };
    let selected: Vec<usize> = (0..docs.len())
        .filter(|&i| {
            let n = taken.entry(group_of(&docs[i])).or_default();
            *n += 1;
            o.limit.is_none_or(|l| *n <= l)
        })
        .collect();
    if selected.is_empty() {
        let from = source_name(&source, &spec.data);
        bail!("no documents to score in {} (from {from})", spec.name);
    }
    // One random.Random(seed) per group (each MMLU subject is a task of its own in the
    // harness), advanced over the group's documents in order.
    let mut rngs: BTreeMap<Option<String>, PyRandom> = BTreeMap::new();
    let items = selected
        .into_iter()
        .map(|i| {
            let rng = rngs
                .entry(group_of(&docs[i]))
                .or_insert_with(|| PyRandom::new(u128::from(o.seed)));
            spec.item(&docs, i, few.as_deref(), shots, rng)
                .with_context(|| eval.origins[i].clone())
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Prepared { spec, items, shots })
}

/// Scores a task's items with `m`: on D ranks, this rank's share of them (see
/// [`Model::shard`]), then every rank's scores are gathered in item order. `rec` records this
/// rank's routing and is handed back. A scoring error is the task's (the other tasks go on);
/// a failure to gather is the run's.
pub fn score_task(
    m: &Model,
    tok: &TextTokenizer,
    opts: ScoreOptions,
    p: &Prepared,
    rec: Option<RoutingRecorder>,
    progress: &dyn Fn(u64),
) -> Result<(Result<Scored, String>, Option<RoutingRecorder>)> {
    let share = &p.items[m.shard(p.items.len())];
    let (mine, rec) = score_items(m, tok, opts, share, rec, progress);
    let all = m.finish_and_gather(vec![mine])?;
    let joined = all
        .into_iter()
        .collect::<Result<Vec<_>, String>>()
        .map(Scored::join);
    Ok((joined, rec))
}

/// Scores `items` on this rank alone.
fn score_items(
    m: &Model,
    tok: &TextTokenizer,
    opts: ScoreOptions,
    items: &[Item],
    rec: Option<RoutingRecorder>,
    progress: &dyn Fn(u64),
) -> (Result<Scored, String>, Option<RoutingRecorder>) {
    let clock = Instant::now();
    let mut sc = Scorer::new(m, tok, opts);
    sc.recorder = rec;
    let mut lls = Vec::with_capacity(items.len());
    for chunk in items.chunks(16) {
        match sc.score(chunk) {
            Ok(l) => lls.extend(l),
            Err(e) => return (Err(format!("{e:#}")), sc.recorder.take()),
        }
        progress(chunk.len() as u64);
    }
    let s = Scored {
        lls,
        forward_tokens: sc.forward_tokens,
        forward_passes: sc.forward_passes,
        seconds: clock.elapsed().as_secs_f64(),
    };
    (Ok(s), sc.recorder.take())
}
