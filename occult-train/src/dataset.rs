//! Training data: records from a file (JSON list, JSONL, Parquet), a folder (its `train`
//! split, shards included) or a dataset in the Hugging Face cache (`org/name`, offline, such as
//! `tatsu-lab/alpaca`), turned into [`Example`]s. Records with `instruction` and `output` are
//! Alpaca instructions; records with `text` are plain text, packed to the sequence length.

use crate::examples::{pack_text, Example, Instruction};
use crate::{Error, Result};
use occult_core::models::tokenizer::TextTokenizer;
use occult_core::records::{hub_dataset_dir, read_file, read_split, Docs};
use std::path::Path;

/// What kind of records a data set holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataKind {
    /// `instruction`, optional `input`, `output` (Alpaca).
    Instructions,
    /// `text`, packed.
    Text,
}

/// Training examples and what was made of the records.
#[derive(Clone, Debug)]
pub struct Dataset {
    pub kind: DataKind,
    pub examples: Vec<Example>,
    /// Records whose prompt filled the sequence length (no response left to train on).
    pub skipped: usize,
}

/// The records of `source`: a file, a folder's `train` split, or a hub dataset id in the cache.
pub fn read_records(source: &str) -> Result<Docs> {
    let path = Path::new(source);
    let docs = if path.is_file() {
        Docs::of(source, read_file(path)?)
    } else if path.is_dir() {
        read_split(path, "train", None)?.ok_or_else(|| {
            Error::Invalid(format!(
                "{source}: no train split (train.jsonl, train.json, train-*.parquet, ...)"
            ))
        })?
    } else if source.contains('/') && !source.starts_with('.') && !path.is_absolute() {
        let dir = hub_dataset_dir(source, None, "give a file or folder")?;
        read_split(&dir, "train", None)?.ok_or_else(|| {
            Error::Invalid(format!(
                "dataset {source} in the Hugging Face cache has no train split"
            ))
        })?
    } else {
        return Err(Error::Invalid(format!(
            "{source}: no such file or folder (or a dataset id in the Hugging Face cache)"
        )));
    };
    if docs.docs.is_empty() {
        return Err(Error::Invalid(format!("{source}: no records")));
    }
    Ok(docs)
}

/// Turns records into examples of at most `seq_len` tokens.
pub fn build(docs: &Docs, tok: &TextTokenizer, seq_len: usize, add_bos: bool) -> Result<Dataset> {
    let first = &docs.docs[0];
    let kind = if first.get("instruction").is_some() {
        DataKind::Instructions
    } else if first.get("text").is_some() {
        DataKind::Text
    } else {
        return Err(Error::Invalid(format!(
            "{}: neither an instruction record (`instruction`, `output`) nor text (`text`)",
            docs.origins[0]
        )));
    };
    match kind {
        DataKind::Instructions => {
            let mut examples = Vec::with_capacity(docs.docs.len());
            let mut skipped = 0;
            for (record, origin) in docs.docs.iter().zip(&docs.origins) {
                let r = Instruction::from_record(record, origin)?;
                match r.encode(tok, seq_len, add_bos)? {
                    Some(e) => examples.push(e),
                    None => skipped += 1,
                }
            }
            if examples.is_empty() {
                return Err(Error::Invalid(format!(
                    "{}: every prompt fills the sequence length of {seq_len}",
                    docs.origins[0]
                )));
            }
            Ok(Dataset {
                kind,
                examples,
                skipped,
            })
        }
        DataKind::Text => {
            let texts = docs
                .docs
                .iter()
                .zip(&docs.origins)
                .map(|(r, origin)| match r.get("text") {
                    Some(serde_json::Value::String(s)) => Ok(s.clone()),
                    _ => Err(Error::Invalid(format!("{origin}: no string field `text`"))),
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Dataset {
                kind,
                examples: pack_text(&texts, tok, seq_len, add_bos)?,
                skipped: 0,
            })
        }
    }
}
