//! What one decode step reads from memory, to hold its time against the machine's read rate:
//! every weight the step multiplies (attention's, the routers', the shared experts' and dense
//! MLPs', the norms and the LM head), the routed experts' at `top_k` of `num_experts` (a
//! token's experts are distinct), one row of the embeddings (all of them where the LM head is
//! tied to them), and the key/value cache at the step's context. Weights are counted in the
//! compute dtype, as they are held, from the checkpoint's header (MXFP4 experts as
//! dequantized); multi-token-prediction layers, which are not run, are left out.

use super::config::ModelConfig;
use super::memory::{held_elements, is_routed_expert};
use super::weights::Weights;
use candle::DType;

/// Bytes one decode step reads: `weights`, and `per_position` for each cached position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeReads {
    pub weights: u64,
    pub per_position: u64,
}

impl DecodeReads {
    /// Bytes a step reads with `context` positions cached.
    pub fn at(&self, context: usize) -> u64 {
        self.weights
            .saturating_add(self.per_position.saturating_mul(context as u64))
    }
}

/// The layer a tensor name belongs to (`model.layers.{i}.`), if any.
fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("model.layers.")?;
    rest.split('.').next()?.parse().ok()
}

/// What a decode step of one token reads with the weights `w` of `cfg`, held in `dtype`.
pub fn decode_reads(w: &Weights, cfg: &ModelConfig, dtype: DType) -> DecodeReads {
    let width = dtype.size_in_bytes() as u64;
    let tied = !w.names().any(|n| n == "lm_head.weight");
    let (k, e) = (cfg.moe.top_k as u64, cfg.moe.num_experts.max(1) as u64);
    let mut elements = 0u64;
    for name in w.names() {
        if layer_of(name).is_some_and(|l| l >= cfg.num_layers) {
            continue;
        }
        let n = held_elements(w, name);
        let read = if is_routed_expert(name) {
            n.saturating_mul(k.min(e)) / e
        } else if name.ends_with("embed_tokens.weight") && !tied {
            cfg.hidden_size as u64
        } else {
            n
        };
        elements = elements.saturating_add(read);
    }
    // Keys and values of every layer, as the cache holds them: latent attention (DeepSeek-V3)
    // caches each query head's key and value expanded.
    let per_layer = match &cfg.mla {
        Some(m) => cfg.num_heads * (m.qk_head_dim() + m.v_head_dim),
        None => 2 * cfg.num_kv_heads * cfg.head_dim,
    };
    DecodeReads {
        weights: elements.saturating_mul(width),
        per_position: (cfg.num_layers * per_layer) as u64 * width,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::models::loader::Checkpoint;
    use crate::models::synth::SynthModel;

    fn open(name: &str, dtype: DType) -> (tempfile::TempDir, Checkpoint) {
        let dir = tempfile::tempdir().unwrap();
        let family = crate::models::family::family(name).unwrap();
        SynthModel::tiny(family).write(dir.path()).unwrap();
        let ck = Checkpoint::open(dir.path().to_str().unwrap(), None, dtype).unwrap();
        (dir, ck)
    }

    /// The tiny Qwen3-MoE counted by hand: hidden 64, 2 layers, 4 query and 2 key/value heads
    /// of 16, 8 experts of 32 (top-2), vocabulary 128, an untied LM head.
    #[test]
    fn a_decode_step_reads_what_the_model_multiplies() {
        let attention = 64 * 64 + 2 * (32 * 64) + 64 * 64 + 2 * 16; // q, k, v, o, q/k norms
        let norms = 2 * 64;
        let router = 8 * 64;
        let experts = 2 * 3 * 32 * 64; // top-2 of 8, gate, up and down
        let layer = attention + norms + router + experts;
        let whole = 2 * layer + 64 + 128 * 64 + 64; // an embedding row, the LM head, the norm
        for (dtype, width) in [(DType::F32, 4), (DType::BF16, 2)] {
            let (_dir, ck) = open("qwen3_moe", dtype);
            assert!(!ck.cfg.tie_word_embeddings);
            let r = decode_reads(&ck.weights, &ck.cfg, dtype);
            assert_eq!(r.weights, whole * width, "{dtype:?}");
            // Keys and values: 2 layers x 2 heads x 16 features, twice.
            assert_eq!(r.per_position, 2 * 2 * 2 * 16 * width);
            assert_eq!(r.at(10), r.weights + 10 * r.per_position);
        }
        // Latent attention caches every query head's key and value expanded.
        let (_dir, ck) = open("deepseek_v3", DType::F32);
        let m = ck.cfg.mla.unwrap();
        let r = decode_reads(&ck.weights, &ck.cfg, DType::F32);
        let per = ck.cfg.num_layers * ck.cfg.num_heads * (m.qk_head_dim() + m.v_head_dim) * 4;
        assert_eq!(r.per_position, per as u64);
    }

    #[test]
    fn layers_are_read_from_names() {
        assert_eq!(layer_of("model.layers.12.mlp.gate.weight"), Some(12));
        assert_eq!(layer_of("model.embed_tokens.weight"), None);
        assert_eq!(layer_of("model.layers.x.mlp"), None);
    }
}
