//! A checkpoint's `tokenizer.json` (the `tokenizers` crate), checked against the model's
//! vocabulary, with the encode rule lm-evaluation-harness uses for Hugging Face causal LMs: no
//! special tokens unless asked for.

use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// A tokenizer and the special ids the model uses.
pub struct TextTokenizer {
    tok: tokenizers::Tokenizer,
    path: PathBuf,
    vocab_size: usize,
    /// The beginning-of-sequence id, if the model has one.
    pub bos: Option<u32>,
    /// End-of-sequence ids (generation stops at any of them).
    pub eos: Vec<u32>,
}

impl TextTokenizer {
    /// Reads `tokenizer.json`; every id it can produce must be below `vocab_size`.
    pub fn read(path: &Path, vocab_size: usize) -> Result<Self> {
        // The tokenizers crate panics on some malformed files (a decoder entry cut short).
        let tok = crate::input::contain_panics(|| tokenizers::Tokenizer::from_file(path))
            .map_err(|msg| {
                Error::bad_file(
                    path,
                    format!("not a readable tokenizer.json (the tokenizers crate stopped: {msg})"),
                )
            })?
            .map_err(|e| Error::bad_file(path, format!("not a readable tokenizer.json: {e}")))?;
        let max_id = tok.get_vocab(true).values().copied().max();
        if let Some(m) = max_id.filter(|&m| m as usize >= vocab_size) {
            return Err(Error::bad_file(
                path,
                format!(
                    "the tokenizer does not match the model: it has token id {m}, the model's \
                     vocabulary has {vocab_size} entries"
                ),
            ));
        }
        Ok(TextTokenizer {
            tok,
            path: path.to_path_buf(),
            vocab_size,
            bos: None,
            eos: Vec::new(),
        })
    }

    /// Sets the special ids, which must be inside the vocabulary.
    pub fn set_special(&mut self, bos: Option<u32>, eos: Vec<u32>) -> Result<()> {
        for &id in bos.iter().chain(eos.iter()) {
            if id as usize >= self.vocab_size {
                return Err(Error::bad_file(
                    &self.path,
                    format!(
                        "special token id {id} is outside the vocabulary of {}",
                        self.vocab_size
                    ),
                ));
            }
        }
        self.bos = bos;
        self.eos = eos;
        Ok(())
    }

    /// Token ids of `text`; special tokens (such as BOS) only if `add_special`.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .tok
            .encode(text, add_special)
            .map_err(|e| Error::bad_file(&self.path, format!("encoding {text:?} failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tok
            .decode(ids, true)
            .map_err(|e| Error::bad_file(&self.path, format!("decoding failed: {e}")))
    }

    /// The text of `ids` with special tokens kept (how lm-evaluation-harness reads the tail
    /// of a generation for its stop strings, and the EOS token's text).
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String> {
        self.tok
            .decode(ids, false)
            .map_err(|e| Error::bad_file(&self.path, format!("decoding failed: {e}")))
    }

    /// The token that stands for "no context": BOS, else the first EOS
    /// (lm-evaluation-harness's `prefix_token_id`).
    pub fn prefix_token(&self) -> Option<u32> {
        self.bos.or(self.eos.first().copied())
    }

    /// The id of a token string, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tok.token_to_id(token)
    }
}
