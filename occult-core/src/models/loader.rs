//! Opening a checkpoint: resolve the model (folder or Hugging Face cache id), read and check
//! `config.json`, map the weights in the chosen dtype, and read the tokenizer if there is one.

use super::config::ModelConfig;
use super::tokenizer::TextTokenizer;
use crate::models::checkpoint::{resolve, ModelFiles};
use crate::models::weights::Weights;
use crate::{Error, Result};
use candle::{DType, Device};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// An opened checkpoint: its files, configuration, mapped weights and tokenizer.
pub struct Checkpoint {
    /// What the user named (a folder or a hub id).
    pub name: String,
    pub files: ModelFiles,
    pub cfg: ModelConfig,
    pub weights: Weights,
    pub tokenizer: Option<TextTokenizer>,
}

/// Parses a dtype name: `f32`, `bf16` or `f16`.
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" => Ok(DType::F16),
        other => Err(Error::invalid(format!(
            "dtype {other:?} is not one of f32, bf16, f16"
        ))),
    }
}

impl Checkpoint {
    /// Opens `model` (a folder, or a hub id at `revision` in the local cache) on the CPU.
    pub fn open(model: &str, revision: Option<&str>, dtype: DType) -> Result<Self> {
        Self::open_on(model, revision, dtype, &Device::Cpu)
    }

    /// [`Checkpoint::open`], with the weights on `device`.
    pub fn open_on(
        model: &str,
        revision: Option<&str>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let files = resolve(model, revision)?;
        Self::from_files_on(model, files, dtype, device)
    }

    /// Opens resolved files on the CPU.
    pub fn from_files(name: &str, files: ModelFiles, dtype: DType) -> Result<Self> {
        Self::from_files_on(name, files, dtype, &Device::Cpu)
    }

    /// [`Checkpoint::from_files`], with the weights on `device`.
    pub fn from_files_on(
        name: &str,
        files: ModelFiles,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let cfg = ModelConfig::read(&files.config)?;
        let weights = Weights::open_as(&files.weights, device, dtype)?;
        // A tensor the configuration does not explain means they disagree (fewer layers, no
        // biases, another family...): refuse rather than run part of the model.
        let extra = super::layout::unexplained(&cfg, weights.names());
        if !extra.is_empty() {
            return Err(Error::bad_file(
                &files.config,
                format!(
                    "the checkpoint holds {} tensor(s) this configuration does not use, e.g. {}: \
                     config.json and the weights disagree",
                    extra.len(),
                    extra.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
                ),
            ));
        }
        let shape_of = |n: &str| Some((weights.source_dtype(n)?, weights.shape(n)?));
        if let Some((name, fault)) = super::layout::first_misfit(&cfg, &shape_of) {
            return Err(Error::bad_file(
                weights_origin(&files),
                format!("tensor {name} {fault}"),
            ));
        }
        let tokenizer = files
            .tokenizer
            .as_deref()
            .map(|p| {
                let mut t = TextTokenizer::read(p, cfg.vocab_size)?;
                let (bos, eos) = special_ids(&files.dir, &t, &cfg)?;
                t.set_special(bos, eos)?;
                Ok::<_, Error>(t)
            })
            .transpose()?;
        Ok(Checkpoint {
            name: name.to_string(),
            files,
            cfg,
            weights,
            tokenizer,
        })
    }

    /// The tokenizer, or an error saying the checkpoint has none.
    pub fn tokenizer(&self) -> Result<&TextTokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| {
            Error::bad_file(
                &self.files.dir,
                "no tokenizer.json: this command needs the model's tokenizer",
            )
        })
    }
}

/// A `tokenizer_config.json` token entry: a string or `{"content": ...}`.
fn token_text(v: &Value) -> Option<&str> {
    v.as_str()
        .or_else(|| v.get("content").and_then(Value::as_str))
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = crate::input::read_text(path)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::bad_file(path, format!("not valid JSON: {e}")))
}

/// BOS and EOS ids as transformers' tokenizer sees them: `tokenizer_config.json`'s
/// `bos_token`/`eos_token` when present (lm-eval's prefix token comes from there), else
/// `config.json`'s ids. Generation also stops at `generation_config.json`'s `eos_token_id`s.
fn special_ids(
    dir: &Path,
    tok: &TextTokenizer,
    cfg: &ModelConfig,
) -> Result<(Option<u32>, Vec<u32>)> {
    let (mut bos, mut eos) = (cfg.bos_token_id, cfg.eos_token_ids.clone());
    let tc_path = dir.join("tokenizer_config.json");
    if let Some(tc) = read_json(&tc_path)? {
        let id = |key: &str| -> Result<Option<Option<u32>>> {
            match tc.get(key) {
                None => Ok(None),
                Some(Value::Null) => Ok(Some(None)),
                Some(v) => {
                    let text = token_text(v).ok_or_else(|| {
                        Error::bad_file(&tc_path, format!("`{key}` is not a token"))
                    })?;
                    let id = tok.token_id(text).ok_or_else(|| {
                        Error::bad_file(
                            &tc_path,
                            format!("`{key}` {text:?} is not in tokenizer.json's vocabulary"),
                        )
                    })?;
                    Ok(Some(Some(id)))
                }
            }
        };
        if let Some(b) = id("bos_token")? {
            bos = b;
        }
        if let Some(e) = id("eos_token")? {
            eos = e.into_iter().collect();
        }
    }
    if let Some(gc) = read_json(&dir.join("generation_config.json"))? {
        let more: Vec<u32> = match gc.get("eos_token_id") {
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64().map(|x| x as u32))
                .collect(),
            Some(v) => v.as_u64().map(|x| x as u32).into_iter().collect(),
            None => Vec::new(),
        };
        for id in more {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    Ok((bos, eos))
}

/// The weight file (or the folder of the shards) that errors about tensors name.
fn weights_origin(files: &ModelFiles) -> PathBuf {
    match files.weights.as_slice() {
        [one] => one.clone(),
        _ => files.dir.clone(),
    }
}
