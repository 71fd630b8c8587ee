//! Documents for a task: a JSONL file (one JSON object per line), a JSON file (a list of
//! objects, or an object with a `data` list), or a folder holding one such file per split
//! (`validation.jsonl`, `train.jsonl`, ...). The built-in tasks and their small hand-written
//! samples (`tasks/`) are compiled in, so `occult eval --samples` runs anywhere.

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
    "mmlu",
    "openbookqa",
    "piqa",
    "rte",
    "sciq",
    "winogrande",
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
    ("mmlu", "test"),
    ("mmlu", "dev"),
    ("openbookqa", "test"),
    ("openbookqa", "train"),
    ("piqa", "validation"),
    ("piqa", "train"),
    ("rte", "validation"),
    ("rte", "train"),
    ("sciq", "test"),
    ("sciq", "train"),
    ("winogrande", "validation"),
    ("winogrande", "train"),
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

/// Reads one file of documents.
pub fn read_file(path: &Path) -> Result<Vec<Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    parse_docs(&text, &path.display().to_string(), jsonl)
}

/// The file of `split` in a folder, if any.
fn split_file(dir: &Path, split: &str) -> Option<PathBuf> {
    ["jsonl", "json"]
        .iter()
        .map(|e| dir.join(format!("{split}.{e}")))
        .find(|p| p.is_file())
}

/// Where a task's documents come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A file (the eval split; few-shot examples come from it too) or a folder of splits.
    Path(PathBuf),
    /// The built-in samples.
    Samples,
}

/// The eval documents and, if the task has a few-shot split there, its documents.
pub fn load(
    task: &str,
    source: &Source,
    eval_split: &str,
    fewshot_split: Option<&str>,
) -> Result<(Vec<Value>, Option<Vec<Value>>)> {
    match source {
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
            Ok((eval, few))
        }
        Source::Path(p) if p.is_dir() => {
            let eval = split_file(p, eval_split).with_context(|| {
                format!(
                    "{}: no {eval_split}.jsonl or {eval_split}.json for {task}",
                    p.display()
                )
            })?;
            let few = fewshot_split
                .and_then(|s| split_file(p, s))
                .map(|f| read_file(&f))
                .transpose()?;
            Ok((read_file(&eval)?, few))
        }
        Source::Path(p) => Ok((read_file(p)?, None)),
    }
}
