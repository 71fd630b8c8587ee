//! candle-transformers' own qwen2_moe, mixtral and qwen3_moe, built in this process from the
//! same files, as a [`Decoder`](crate::bench::timing::Decoder) (with the
//! `candle-transformers` feature; without it, a clear error). Their configs need fields
//! Hugging Face configs may lack; the defaults given here change nothing for these checkpoints
//! (no sliding window, SiLU).

#[cfg(feature = "candle-transformers")]
pub use built::load;
#[cfg(not(feature = "candle-transformers"))]
pub use unavailable::load;

#[cfg(not(feature = "candle-transformers"))]
mod unavailable {
    use crate::bench::timing::Decoder;
    use anyhow::{bail, Result};
    use occult_core::models::loader::Checkpoint;

    pub fn load(_: &Checkpoint) -> Result<Box<dyn Decoder>> {
        bail!(
            "this build has no candle-transformers: rebuild with \
             `cargo build --release -p occult-eval --features candle-transformers`"
        )
    }
}

#[cfg(feature = "candle-transformers")]
mod built {
    use crate::bench::timing::Decoder;
    use anyhow::{bail, Result};
    use candle::{DType, Device, Tensor};
    use candle_transformers::models::{mixtral, qwen2_moe, qwen3_moe};
    use occult_core::models::loader::Checkpoint;
    use serde_json::Value;

    enum Inner {
        Qwen2(qwen2_moe::Model),
        Mixtral(mixtral::Model),
        Qwen3(qwen3_moe::ModelForCausalLM),
    }

    struct Theirs {
        inner: Inner,
        fresh: Box<dyn Fn() -> Result<Inner>>,
    }

    impl Decoder for Theirs {
        fn name(&self) -> String {
            "candle-transformers".into()
        }
        fn reset(&mut self) {
            match &mut self.inner {
                Inner::Qwen2(m) => m.clear_kv_cache(),
                Inner::Qwen3(m) => m.clear_kv_cache(),
                // Mixtral has no cache reset: rebuild it (weights are shared, not copied).
                Inner::Mixtral(_) => {
                    if let Ok(m) = (self.fresh)() {
                        self.inner = m;
                    }
                }
            }
        }
        fn step(&mut self, ids: &[u32], offset: usize) -> Result<Vec<f32>> {
            let t = Tensor::from_slice(ids, (1, ids.len()), &Device::Cpu)?;
            let l = match &mut self.inner {
                Inner::Qwen2(m) => m.forward(&t, offset)?,
                Inner::Mixtral(m) => m.forward(&t, offset)?,
                Inner::Qwen3(m) => m.forward(&t, offset)?,
            };
            Ok(l.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?)
        }
    }

    pub fn load(ck: &Checkpoint) -> Result<Box<dyn Decoder>> {
        let text = std::fs::read_to_string(&ck.files.config)?;
        let mut v: Value = serde_json::from_str(&text)?;
        let c = &ck.cfg;
        let o = v.as_object_mut().expect("config.json is an object");
        let max = c.max_positions.unwrap_or(4096);
        for (k, d) in [
            ("sliding_window", Value::from(max)),
            ("max_window_layers", Value::from(c.num_layers)),
            ("use_sliding_window", Value::from(false)),
            ("hidden_act", Value::from("silu")),
            ("use_flash_attn", Value::from(false)),
            ("attention_bias", Value::from(false)),
            ("head_dim", Value::from(c.head_dim)),
            ("max_position_embeddings", Value::from(max)),
            ("rope_theta", Value::from(c.rope_theta)),
            ("tie_word_embeddings", Value::from(c.tie_word_embeddings)),
        ] {
            if o.get(k).is_none_or(Value::is_null) {
                o.insert(k.to_string(), d);
            }
        }
        let files = ck.files.weights.clone();
        let dtype = ck.weights.dtype();
        // SAFETY: read-only mapping of the checkpoint, as for our own loader.
        let vb =
            unsafe { candle_nn::VarBuilder::from_mmaped_safetensors(&files, dtype, &Device::Cpu)? };
        let (inner, fresh): (Inner, Box<dyn Fn() -> Result<Inner>>) = match c.family.model_type {
            "qwen2_moe" => {
                let cfg: qwen2_moe::Config = serde_json::from_value(v)?;
                (
                    Inner::Qwen2(qwen2_moe::Model::new(&cfg, vb)?),
                    Box::new(|| bail!("unused")),
                )
            }
            "qwen3_moe" => {
                let cfg: qwen3_moe::Config = serde_json::from_value(v)?;
                (
                    Inner::Qwen3(qwen3_moe::ModelForCausalLM::new(&cfg, vb)?),
                    Box::new(|| bail!("unused")),
                )
            }
            "mixtral" => {
                let cfg: mixtral::Config = serde_json::from_value(v)?;
                let m = mixtral::Model::new(&cfg, vb.clone())?;
                (
                    Inner::Mixtral(m),
                    Box::new(move || Ok(Inner::Mixtral(mixtral::Model::new(&cfg, vb.clone())?))),
                )
            }
            other => bail!("candle-transformers has no {other} model to compare with"),
        };
        Ok(Box::new(Theirs { inner, fresh }))
    }
}
