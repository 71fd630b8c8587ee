//! Records (JSON objects) from the files the Hugging Face hub publishes datasets in: Parquet, a
//! JSONL file (one object per line) or a JSON file (a list of objects, or an object with a
//! `data` list); from one file, a folder with a file or shards per split
//! (`train.jsonl`, `train-00000-of-00002.parquet`, `CONFIG/test-....parquet`, `data/...`), or a
//! dataset already in the Hugging Face cache (`datasets--org--name`, offline). The evaluation
//! harness reads its tasks' documents with these, and fine-tuning its training data.

use crate::{Error, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

mod page_headers;
mod parquet_file;

pub use parquet_file::read_parquet;

fn bad(msg: String) -> Error {
    Error::Invalid(msg)
}

/// Parses JSONL or JSON text into records; `origin` names the source in errors.
pub fn parse_docs(text: &str, origin: &str, jsonl: bool) -> Result<Vec<Value>> {
    let docs: Vec<Value> = if jsonl {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                serde_json::from_str(l)
                    .map_err(|e| bad(format!("{origin} line {}: not valid JSON: {e}", i + 1)))
            })
            .collect::<Result<_>>()?
    } else {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| bad(format!("{origin}: not valid JSON: {e}")))?;
        match v {
            Value::Array(a) => a,
            Value::Object(mut o) => match o.remove("data") {
                Some(Value::Array(a)) => a,
                _ => {
                    return Err(bad(format!(
                        "{origin}: a JSON file must be a list of documents or {{\"data\": [...]}}"
                    )))
                }
            },
            _ => {
                return Err(bad(format!(
                    "{origin}: a JSON file must be a list of documents"
                )))
            }
        }
    };
    if let Some((i, _)) = docs.iter().enumerate().find(|(_, d)| !d.is_object()) {
        return Err(bad(format!("{origin}: document {i} is not a JSON object")));
    }
    Ok(docs)
}

/// Reads one file of records (Parquet, JSONL or JSON, by extension).
pub fn read_file(path: &Path) -> Result<Vec<Value>> {
    if path.extension().is_some_and(|e| e == "parquet") {
        return read_parquet(path);
    }
    let text = crate::input::read_text(path)?;
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

/// Records with where each came from (file and row), for error messages.
#[derive(Clone, Debug, Default)]
pub struct Docs {
    pub docs: Vec<Value>,
    pub origins: Vec<String>,
}

impl Docs {
    /// Appends the records of one source.
    pub fn add(&mut self, origin: &str, docs: Vec<Value>) {
        self.origins
            .extend((0..docs.len()).map(|r| format!("{origin} row {r}")));
        self.docs.extend(docs);
    }

    /// The records of one source.
    pub fn of(origin: &str, docs: Vec<Value>) -> Self {
        let mut d = Docs::default();
        d.add(origin, docs);
        d
    }
}

/// The records of `split` below `dir` (all its shards, in name order), if any.
pub fn read_split(dir: &Path, split: &str, config: Option<&str>) -> Result<Option<Docs>> {
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

/// The snapshot folder of dataset `repo` (`org/name`) in the Hugging Face cache. `hint` ends
/// the message when it is missing (what else the user can give).
pub fn hub_dataset_dir(repo: &str, revision: Option<&str>, hint: &str) -> Result<PathBuf> {
    let cache = crate::models::checkpoint::hub_cache_dir().ok_or_else(|| {
        bad("no Hugging Face cache folder is known (set HF_HUB_CACHE or HF_HOME)".into())
    })?;
    let folder = cache.join(format!("datasets--{}", repo.replace('/', "--")));
    let rev = revision.unwrap_or("main");
    let commit = std::fs::read_to_string(folder.join("refs").join(rev))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| rev.to_string());
    let snap = folder.join("snapshots").join(&commit);
    if !snap.is_dir() {
        return Err(bad(format!(
            "dataset {repo} is not in the Hugging Face cache at {} (revision {rev:?}); fetch it \
             with `huggingface-cli download --repo-type dataset {repo}`, or {hint}",
            cache.display()
        )));
    }
    Ok(snap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_and_jsonl_records_with_named_faults() {
        let l = parse_docs("{\"a\": 1}\n\n{\"a\": 2}\n", "f.jsonl", true).unwrap();
        assert_eq!(l.len(), 2);
        let j = parse_docs("{\"data\": [{\"a\": 1}]}", "f.json", false).unwrap();
        assert_eq!(j[0]["a"], 1);
        let e = parse_docs("{\"a\": 1}\nnope\n", "f.jsonl", true)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("f.jsonl line 2: not valid JSON"), "{e}");
        let e = parse_docs("[1]", "f.json", false).unwrap_err().to_string();
        assert!(e.contains("document 0 is not a JSON object"), "{e}");
    }
}
