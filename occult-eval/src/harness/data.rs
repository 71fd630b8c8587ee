//! Documents for a task, in the formats the Hugging Face hub publishes: Parquet, a JSONL file
//! (one JSON object per line), or a JSON file (a list of objects, or an object with a `data`
//! list). They come from a file (the eval split), a folder with a file or shards per split
//! (`validation.jsonl`, `test-00000-of-00001.parquet`, `ARC-Easy/test-....parquet`), or a
//! dataset already in the Hugging Face cache (`datasets--org--name`, offline). The built-in
//! tasks and their small hand-written samples (`tasks/`) are compiled in, so
//! `occult eval --samples` runs anywhere.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

macro_rules! builtin {
    ($($name:literal),* $(,)?) => {
        /// The built-in task files: (name, TOML).
        pub const TASKS: &[(&str, &str)] = &[
            $(($name, include_str!(concat!("../../../tasks/", $name, ".toml")))),*
        ];
    };
}

builtin!(
    "arc_challenge",
    "arc_easy",
    "boolq",
    "copa",
    "hellaswag",
    "mathqa",
    "mmlu",
    "openbookqa",
    "piqa",
    "race",
    "rte",
    "sciq",
    "winogrande",
    "wsc",
);

macro_rules! samples {
    ($(($task:literal, $split:literal)),* $(,)?) => {
        /// The built-in sample data: (task, split, JSONL).
        pub const SAMPLES: &[(&str, &str, &str)] = &[
            $(($task, $split, include_str!(concat!("../../../tasks/samples/", $task, "/", $split, ".jsonl")))),*
        ];
    };
}

samples!(
    ("arc_challenge", "test"),
    ("arc_challenge", "train"),
    ("arc_easy", "test"),
    ("arc_easy", "train"),
    ("boolq", "validation"),
    ("boolq", "train"),
    ("copa", "validation"),
    ("copa", "train"),
    ("hellaswag", "validation"),
    ("hellaswag", "train"),
    ("mathqa", "test"),
    ("mathqa", "train"),
    ("mmlu", "test"),
    ("mmlu", "dev"),
    ("openbookqa", "test"),
    ("openbookqa", "train"),
    ("piqa", "validation"),
    ("piqa", "train"),
    ("race", "test"),
    ("rte", "validation"),
    ("rte", "train"),
    ("sciq", "test"),
    ("sciq", "train"),
    ("winogrande", "validation"),
    ("winogrande", "train"),
    ("wsc", "validation"),
    ("wsc", "train"),
);

/// Parses JSONL or JSON text into documents; `origin` names the source in errors.
pub fn parse_docs(text: &str, origin: &str, jsonl: bool) -> Result<Vec<Value>> {
    let docs: Vec<Value> = if jsonl {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                serde_json::from_str(l)
                    .with_context(|| format!("{origin} line {}: not valid JSON", i + 1))
            })
            .collect::<Result<_>>()?
    } else {
        let v: Value =
            serde_json::from_str(text).with_context(|| format!("{origin}: not valid JSON"))?;
        match v {
            Value::Array(a) => a,
            Value::Object(mut o) => match o.remove("data") {
                Some(Value::Array(a)) => a,
                _ => bail!(
                    "{origin}: a JSON file must be a list of documents or {{\"data\": [...]}}"
                ),
            },
            _ => bail!("{origin}: a JSON file must be a list of documents"),
        }
    };
    if let Some((i, _)) = docs.iter().enumerate().find(|(_, d)| !d.is_object()) {
        bail!("{origin}: document {i} is not a JSON object");
    }
    Ok(docs)
}

/// Reads a Parquet file's rows as JSON objects (lists become arrays, structs objects).
pub fn read_parquet(path: &Path) -> Result<Vec<Value>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let f = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let r = SerializedFileReader::new(f)
        .with_context(|| format!("{}: not a readable Parquet file", path.display()))?;
    let rows = r
        .get_row_iter(None)
        .with_context(|| format!("{}: reading rows", path.display()))?;
    rows.enumerate()
        .map(|(i, row)| {
            row.map(|r| r.to_json_value())
                .with_context(|| format!("{}: row {i}", path.display()))
        })
        .collect()
}

/// Reads one file of documents (Parquet, JSONL or JSON, by extension).
pub fn read_file(path: &Path) -> Result<Vec<Value>> {
    if path.extension().is_some_and(|e| e == "parquet") {
        return read_parquet(path);
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    parse_docs(&text, &path.display().to_string(), jsonl)
}

/// Every file below `dir`.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push(p);
            }
        }
    }
}

/// The files holding `split` below `dir`: named `split.EXT` or `split-*.EXT` (shards), with
/// EXT parquet, jsonl or json; under a folder named `config` when one is given and exists.
pub fn split_files(dir: &Path, split: &str, config: Option<&str>) -> Vec<PathBuf> {
    let mut all = Vec::new();
    walk(dir, &mut all);
    let mut hits: Vec<PathBuf> = all
        .into_iter()
        .filter(|p| {
            let ext_ok = p
                .extension()
                .is_some_and(|e| e == "parquet" || e == "jsonl" || e == "json");
            let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or("");
            ext_ok && (stem == split || stem.starts_with(&format!("{split}-")))
        })
        .collect();
    if let Some(c) = config {
        let under: Vec<PathBuf> = hits
            .iter()
            .filter(|p| {
                p.strip_prefix(dir)
                    .is_ok_and(|r| r.components().any(|x| x.as_os_str() == c))
            })
            .cloned()
            .collect();
        hits = if under.is_empty() {
            // No folder for this configuration: only files that belong to no other
            // configuration (at the top, or under `data/`) will do.
            hits.into_iter()
                .filter(|p| {
                    let rel = p.strip_prefix(dir).unwrap_or(p);
                    let parts: Vec<_> = rel.components().collect();
                    parts.len() == 1 || (parts.len() == 2 && parts[0].as_os_str() == "data")
                })
                .collect()
        } else {
            under
        };
    }
    hits.sort();
    hits
}

/// Documents with where each came from (file and row), for error messages.
#[derive(Clone, Debug, Default)]
pub struct Docs {
    pub docs: Vec<Value>,
    pub origins: Vec<String>,
}

impl Docs {
    fn add(&mut self, origin: &str, docs: Vec<Value>) {
        self.origins
            .extend((0..docs.len()).map(|r| format!("{origin} row {r}")));
        self.docs.extend(docs);
    }

    fn of(origin: &str, docs: Vec<Value>) -> Self {
        let mut d = Docs::default();
        d.add(origin, docs);
        d
    }
}

/// The documents of `split` below `dir` (all its shards, in name order), if any.
fn read_split(dir: &Path, split: &str, config: Option<&str>) -> Result<Option<Docs>> {
    let files = split_files(dir, split, config);
    if files.is_empty() {
        return Ok(None);
    }
    let mut docs = Docs::default();
    for f in files {
        docs.add(&f.display().to_string(), read_file(&f)?);
    }
    Ok(Some(docs))
}

/// The snapshot folder of dataset `repo` (`org/name`) in the Hugging Face cache.
pub fn hub_dataset_dir(repo: &str, revision: Option<&str>) -> Result<PathBuf> {
    let cache = occult_core::models::checkpoint::hub_cache_dir()
        .context("no Hugging Face cache folder is known (set HF_HUB_CACHE or HF_HOME)")?;
    let folder = cache.join(format!("datasets--{}", repo.replace('/', "--")));
    let rev = revision.unwrap_or("main");
    let commit = std::fs::read_to_string(folder.join("refs").join(rev))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| rev.to_string());
    let snap = folder.join("snapshots").join(&commit);
    if !snap.is_dir() {
        bail!(
            "dataset {repo} is not in the Hugging Face cache at {} (revision {rev:?}); fetch it \
             with `huggingface-cli download --repo-type dataset {repo}`, or give --data TASK=PATH",
            cache.display()
        );
    }
    Ok(snap)
}

/// Where a task's documents come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A file (the eval split; few-shot examples come from it too) or a folder of splits.
    Path(PathBuf),
    /// The built-in samples.
    Samples,
    /// The task's dataset in the Hugging Face cache.
    Hub,
}

/// The eval documents and, if the task has a separate few-shot split there, its documents.
pub fn load(task: &super::task::TaskSpec, source: &Source) -> Result<(Docs, Option<Docs>)> {
    let eval_split = task.data.eval_split.as_str();
    let fewshot_split = task
        .data
        .fewshot_split
        .as_deref()
        .filter(|s| *s != eval_split);
    let config = task.data.config.as_deref();
    let in_dir = |dir: &Path| -> Result<(Docs, Option<Docs>)> {
        let eval = read_split(dir, eval_split, config)?.with_context(|| {
            format!(
                "{}: no {eval_split} split for {} ({eval_split}.jsonl, .json or \
                 {eval_split}-*.parquet)",
                dir.display(),
                task.name
            )
        })?;
        let few = match fewshot_split {
            Some(s) => read_split(dir, s, config)?,
            None => None,
        };
        Ok((eval, few))
    };
    let hub = task.data.hub.as_str();
    let task = task.name.as_str();
    match source {
        Source::Hub => in_dir(&hub_dataset_dir(hub, None)?),
        Source::Samples => {
            let find = |split: &str| {
                SAMPLES
                    .iter()
                    .find(|(t, s, _)| *t == task && *s == split)
                    .map(|(_, _, text)| {
                        parse_docs(text, &format!("samples/{task}/{split}.jsonl"), true)
                    })
                    .transpose()
            };
            let eval =
                find(eval_split)?.with_context(|| format!("no built-in samples for {task}"))?;
            let few = match fewshot_split {
                Some(s) => find(s)?,
                None => None,
            };
            let origin = |s: &str| format!("samples/{task}/{s}.jsonl");
            Ok((
                Docs::of(&origin(eval_split), eval),
                few.map(|f| Docs::of(&origin(fewshot_split.unwrap_or_default()), f)),
            ))
        }
        Source::Path(p) if p.is_dir() => in_dir(p),
        Source::Path(p) => Ok((Docs::of(&p.display().to_string(), read_file(p)?), None)),
    }
}
