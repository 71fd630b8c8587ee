//! Documents for a task: its eval split and its few-shot split, from a file (the eval split), a
//! folder with a file or shards per split (`validation.jsonl`, `test-00000-of-00001.parquet`,
//! `ARC-Easy/test-....parquet`), a dataset already in the Hugging Face cache
//! (`datasets--org--name`, offline), or the built-in samples. The file formats are read by
//! `occult_core::records`. The built-in tasks and their small hand-written samples (`tasks/`)
//! are compiled in, so `occult eval --samples` runs anywhere.

use anyhow::{Context, Result};
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
    "gsm8k",
    "gsm8k_cot",
    "gsm8k_cot_zeroshot",
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
    ("gsm8k", "test"),
    ("gsm8k", "train"),
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

/// Built-in tasks that read another's samples (the same dataset): (task, samples of).
const SAMPLES_OF: &[(&str, &str)] = &[("gsm8k_cot", "gsm8k"), ("gsm8k_cot_zeroshot", "gsm8k")];

pub use occult_core::records::Docs;
use occult_core::records::{hub_dataset_dir, parse_docs, read_file, read_split};

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

/// Task `task`'s eval documents and, if it has a separate few-shot split there, its documents,
/// as `data` says where they are.
pub fn load(
    task: &str,
    data: &super::task::DataSpec,
    source: &Source,
) -> Result<(Docs, Option<Docs>)> {
    let eval_split = data.eval_split.as_str();
    let fewshot_split = data.fewshot_split.as_deref().filter(|s| *s != eval_split);
    let config = data.config.as_deref();
    let in_dir = |dir: &Path| -> Result<(Docs, Option<Docs>)> {
        let eval = read_split(dir, eval_split, config)?.with_context(|| {
            format!(
                "{}: no {eval_split} split for {} ({eval_split}.jsonl, .json or \
                 {eval_split}-*.parquet)",
                dir.display(),
                task
            )
        })?;
        let few = match fewshot_split {
            Some(s) => read_split(dir, s, config)?,
            None => None,
        };
        Ok((eval, few))
    };
    let hub = data.hub.as_str();
    // Tasks that share another's dataset share its samples.
    let task = SAMPLES_OF
        .iter()
        .find(|(t, _)| *t == task)
        .map_or(task, |(_, of)| *of);
    match source {
        Source::Hub => in_dir(&hub_dataset_dir(hub, None, "give --data TASK=PATH")?),
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
