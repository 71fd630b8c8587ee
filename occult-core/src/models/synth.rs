//! Synthetic checkpoints: a `config.json` in a family's own field names (with the model class
//! in `architectures`), random weights under the names real checkpoints use (per-expert or
//! fused experts) and a small BPE tokenizer ([`tokenizer_json`]), written atomically. For
//! tests, benchmarks (transformers and llama.cpp's converter read them too) and trying the
//! tools without a download.

use super::config::ModelConfig;
use super::family_types::{Family, SynthSizes};
use crate::atomic::{write_atomic, write_json_atomic};
use crate::{bail, Error, Result};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

/// The largest synthetic checkpoint `write` makes (it holds the weights twice in memory).
pub const MAX_SYNTH_BYTES: usize = 8_000_000_000;

/// The shape of a synthetic model.
#[derive(Clone, Debug)]
pub struct SynthModel {
    pub family: &'static Family,
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    /// Intermediate size of dense layers.
    pub dense_intermediate: usize,
    /// Shared-expert intermediate size (Qwen2-MoE; DeepSeek: a multiple of the expert size).
    pub shared_intermediate: usize,
    /// The first this many layers are dense (DeepSeek `first_k_dense_replace`, Qwen
    /// `mlp_only_layers`).
    pub dense_layers: usize,
    /// Store experts fused (`experts.gate_up_proj`, `experts.down_proj`).
    pub fused: bool,
    /// `f32`, `bf16` or `f16`.
    pub dtype: safetensors::Dtype,
    pub seed: u64,
    /// Standard deviation of the weights.
    pub std: f32,
    /// `rms_norm_eps` (the family's default in [`SynthModel::tiny`]: transformers' and, for
    /// OLMoE, the one llama.cpp's converter writes whatever the config says).
    pub rms_norm_eps: f64,
}

impl SynthModel {
    /// A tiny model of `family` (hidden 64, 2 layers, 8 experts, top-2).
    pub fn tiny(family: &'static Family) -> Self {
        SynthModel {
            family,
            vocab: 128,
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            experts: 8,
            top_k: 2,
            expert_intermediate: 32,
            dense_intermediate: 96,
            shared_intermediate: 64,
            dense_layers: 0,
            fused: false,
            dtype: safetensors::Dtype::F32,
            seed: 0,
            std: 0.1,
            rms_norm_eps: family.default_rms_norm_eps,
        }
    }

    /// The family's `model_type`.
    pub fn model_type(&self) -> &'static str {
        self.family.model_type
    }

    /// The sizes the family writes in its own field names.
    fn sizes(&self) -> SynthSizes {
        SynthSizes {
            hidden: self.hidden,
            heads: self.heads,
            experts: self.experts,
            expert_intermediate: self.expert_intermediate,
            dense_intermediate: self.dense_intermediate,
            shared_intermediate: self.shared_intermediate,
            dense_layers: self.dense_layers,
        }
    }

    /// `config.json` in the family's own field names.
    pub fn config_json(&self) -> Result<Value> {
        for (flag, value) in [
            ("--layers", self.layers),
            ("--heads", self.heads),
            ("--hidden", self.hidden),
            ("--vocab", self.vocab),
        ] {
            if value == 0 {
                bail!("{flag} must be at least 1");
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            bail!(
                "--hidden {} is not a whole number of --heads {}",
                self.hidden,
                self.heads
            );
        }
        let mut c = json!({
            "architectures": [self.family.architecture],
            "model_type": self.model_type(),
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "num_experts_per_tok": self.top_k,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": false,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "torch_dtype": match self.dtype {
                safetensors::Dtype::BF16 => "bfloat16",
                safetensors::Dtype::F16 => "float16",
                _ => "float32",
            },
        });
        let o = c.as_object_mut().expect("an object");
        for (key, value) in (self.family.synth_config)(&self.sizes())? {
            o.insert(key.to_string(), value);
        }
        Ok(c)
    }

    /// Writes `config.json`, `model.safetensors` and (with a vocabulary of 2 or more)
    /// [`tokenizer_json`]'s `tokenizer.json` with its `tokenizer_config.json` into `dir`
    /// (created if needed), refusing weights over [`MAX_SYNTH_BYTES`] before creating anything.
    /// Returns the configuration and the weights' size in bytes.
    pub fn write(&self, dir: &Path) -> Result<(ModelConfig, u64)> {
        let config = self.config_json()?;
        let cfg =
            ModelConfig::from_family_json(&config, "the synthetic configuration", self.family)?;
        let width = match self.dtype {
            safetensors::Dtype::F32 => 4,
            safetensors::Dtype::BF16 | safetensors::Dtype::F16 => 2,
            other => bail!("synthetic weights are f32, bf16 or f16, not {other:?}"),
        };
        if self.fused && cfg.moe.experts.interleaved_gate_up {
            bail!(
                "synthetic {} checkpoints store their experts unquantized, fused as the family \
                 does: leave out --fused",
                self.family.model_type
            );
        }
        let shapes = super::layout::tensors(&cfg, self.fused);
        // Every tensor's size, checked before anything is allocated or created: the weights are
        // held twice while serialising.
        let total = shapes.iter().try_fold(0usize, |sum, (_, shape)| {
            shape
                .iter()
                .try_fold(width as usize, |n: usize, &d| n.checked_mul(d))
                .and_then(|n| sum.checked_add(n))
        });
        match total {
            Some(t) if t <= MAX_SYNTH_BYTES => {}
            _ => bail!(
                "these sizes make {} of weights; synthetic checkpoints are limited to {} GB",
                total.map_or("more than 2^64 bytes".into(), |t| format!(
                    "{:.1} GB",
                    t as f64 / 1e9
                )),
                MAX_SYNTH_BYTES / 1_000_000_000
            ),
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let normal = Normal::new(0.0f32, self.std)
            .map_err(|e| Error::invalid(format!("weight std {}: {e}", self.std)))?;
        let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(shapes.len());
        for (k, (name, shape)) in shapes.into_iter().enumerate() {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.seed ^ ((k as u64) << 20));
            let n: usize = shape.iter().product();
            // Norm weights sit near 1, as trained ones do.
            let is_norm = name.ends_with("norm.weight");
            let mut bytes = Vec::with_capacity(n * width);
            for _ in 0..n {
                let mut x = normal.sample(&mut rng);
                if is_norm {
                    x += 1.0;
                }
                match self.dtype {
                    safetensors::Dtype::BF16 => bytes.extend(half::bf16::from_f32(x).to_le_bytes()),
                    safetensors::Dtype::F16 => bytes.extend(half::f16::from_f32(x).to_le_bytes()),
                    _ => bytes.extend(x.to_le_bytes()),
                }
            }
            data.push((name, shape, bytes));
        }
        let views = data
            .iter()
            .map(|(n, s, b)| {
                safetensors::tensor::TensorView::new(self.dtype, s.clone(), b)
                    .map(|v| (n.clone(), v))
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::invalid(format!("building the synthetic tensors: {e}")))?;
        let md: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        let bytes = safetensors::serialize(views, Some(md))
            .map_err(|e| Error::invalid(format!("serialising the synthetic weights: {e}")))?;
        let size = bytes.len() as u64;
        drop(data);
        write_atomic(&dir.join("model.safetensors"), |w| w.write_all(&bytes))?;
        if let Some(tokenizer) = tokenizer_json(self.vocab) {
            write_json_atomic(&dir.join("tokenizer.json"), &tokenizer)?;
            // The class named, so that transformers does not take the family's own tokenizer
            // class, which may add tokens of its own (OLMoE's GPT-NeoX adds a padding token).
            let special = json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>",
                "unk_token": "<unk>",
            });
            write_json_atomic(&dir.join("tokenizer_config.json"), &special)?;
        }
        write_json_atomic(&dir.join("config.json"), &config)?;
        Ok((cfg, size))
    }
}

/// The characters a synthetic tokenizer spells its tokens with.
const ALPHABET: &str = "abcdefghijklmnopqrstuvwxyz0123456789";

/// The `tokenizer.json` of a synthetic checkpoint with `vocab` ids, or `None` below 2:
/// `<|endoftext|>` (id 0, the synthetic config's BOS and EOS) and `<unk>` (1), then the 36
/// lower-case letters and digits, then their runs of two, three, ... characters (`aa`, `ab`,
/// ...), each made by a byte-pair merge of its first characters with its last, until `vocab`
/// ids are used. A real BPE model with its merges, lower-casing and splitting on whitespace and
/// punctuation, so that transformers, llama.cpp's converter (which wants the merges of a
/// GPT-2-style tokenizer) and every occult command read it; characters outside the alphabet
/// become `<unk>`.
pub fn tokenizer_json(vocab: usize) -> Option<Value> {
    const SPECIAL: [&str; 2] = ["<|endoftext|>", "<unk>"];
    if vocab < SPECIAL.len() {
        return None;
    }
    let mut tokens: Vec<String> = SPECIAL.iter().map(|t| t.to_string()).collect();
    let mut merges: Vec<String> = Vec::new();
    let mut level: Vec<String> = ALPHABET.chars().map(String::from).collect();
    tokens.extend(level.iter().take(vocab - tokens.len()).cloned());
    while tokens.len() < vocab {
        let mut next = Vec::new();
        'fill: for prefix in &level {
            for c in ALPHABET.chars() {
                if tokens.len() == vocab {
                    break 'fill;
                }
                let token = format!("{prefix}{c}");
                merges.push(format!("{prefix} {c}"));
                tokens.push(token.clone());
                next.push(token);
            }
        }
        level = next;
    }
    let ids: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = SPECIAL
        .iter()
        .enumerate()
        .map(|(id, content)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    Some(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": SPECIAL[1],
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": ids,
            "merges": merges,
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synthetic_tokenizer_fills_the_vocabulary_and_reads_back() {
        assert!(tokenizer_json(1).is_none());
        // Specials only, part of the alphabet, two-character runs, three-character runs.
        for vocab in [2, 20, 128, 1024, 2000] {
            let json = tokenizer_json(vocab).unwrap().to_string();
            let tok = tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap();
            assert_eq!(tok.get_vocab_size(true), vocab, "{vocab}");
            let ids = tok.encode("Ab c9 zz!", false).unwrap().get_ids().to_vec();
            assert!(
                ids.iter().all(|&i| (i as usize) < vocab),
                "{vocab}: {ids:?}"
            );
            if vocab >= 2 + 36 + 36 * 36 {
                // "ab", "c9", "zz" merged; "!" is outside the alphabet.
                let want: Vec<u32> = ["ab", "c9", "zz"]
                    .iter()
                    .map(|t| tok.token_to_id(t).unwrap())
                    .chain([1])
                    .collect();
                assert_eq!(ids, want);
                assert_eq!(tok.token_to_id("aaa"), Some(2 + 36 + 36 * 36));
                assert_eq!(tok.token_to_id("abc"), Some(2 + 36 + 36 * 36 + 36 + 2));
            }
        }
        let tok =
            tokenizers::Tokenizer::from_bytes(tokenizer_json(64).unwrap().to_string()).unwrap();
        assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));
        assert_eq!(tok.token_to_id("<unk>"), Some(1));
        assert_eq!(tok.token_to_id("a"), Some(2));
        assert_eq!(tok.token_to_id("aa"), Some(2 + 36));
    }
}
