//! Synthetic checkpoints: a `config.json` in a family's own field names and random weights under
//! the names real checkpoints use (per-expert or fused experts), written atomically. For tests,
//! benchmarks and trying the tools without a download.

use super::config::ModelConfig;
use super::family::Family;
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
        }
    }

    /// The family's `model_type`.
    pub fn model_type(&self) -> &'static str {
        self.family.model_type
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
            "model_type": self.model_type(),
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "num_experts_per_tok": self.top_k,
            "rms_norm_eps": 1e-6,
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
        for (key, value) in (self.family.synth_config)(self)? {
            o.insert(key.to_string(), value);
        }
        Ok(c)
    }

    /// Writes `config.json` and `model.safetensors` into `dir` (created if needed), refusing
    /// weights over [`MAX_SYNTH_BYTES`] before creating anything. Returns the
    /// configuration and the weights' size in bytes.
    pub fn write(&self, dir: &Path) -> Result<(ModelConfig, u64)> {
        let config = self.config_json()?;
        let cfg = ModelConfig::from_json(&config, "the synthetic configuration")?;
        let width = match self.dtype {
            safetensors::Dtype::F32 => 4,
            safetensors::Dtype::BF16 | safetensors::Dtype::F16 => 2,
            other => bail!("synthetic weights are f32, bf16 or f16, not {other:?}"),
        };
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
        write_json_atomic(&dir.join("config.json"), &config)?;
        Ok((cfg, size))
    }
}
