//! Opening a checkpoint: resolve the model (folder or Hugging Face cache id), read and check
//! `config.json`, map the weights in the chosen dtype, and read the tokenizer if there is one.

use super::config::ModelConfig;
use super::tokenizer::TextTokenizer;
use crate::checkpoint::{resolve, ModelFiles};
use crate::weights::Weights;
use crate::{Error, Result};
use candle::{DType, Device};

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
    /// Opens `model` (a folder, or a hub id at `revision` in the local cache).
    pub fn open(model: &str, revision: Option<&str>, dtype: DType) -> Result<Self> {
        let files = resolve(model, revision)?;
        Self::from_files(model, files, dtype)
    }

    /// Opens resolved files.
    pub fn from_files(name: &str, files: ModelFiles, dtype: DType) -> Result<Self> {
        let cfg = ModelConfig::read(&files.config)?;
        let weights = Weights::open_as(&files.weights, &Device::Cpu, dtype)?;
        let tokenizer = files
            .tokenizer
            .as_deref()
            .map(|p| {
                TextTokenizer::read(
                    p,
                    cfg.vocab_size,
                    cfg.bos_token_id,
                    cfg.eos_token_ids.clone(),
                )
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
