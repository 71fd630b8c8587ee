//! The family registry: every supported family ([`FAMILIES`], one file each), found by its
//! `model_type` ([`family`]), and reading the `config.json` of any of them
//! ([`ModelConfig::from_json`], [`ModelConfig::read`]).
//!
//! Adding a family: write `models/NAME.rs` with a `pub const FAMILY: Family` (the types are in
//! [`super::family_types`]), declare the module in `models/mod.rs`, and add `&NAME::FAMILY` to
//! [`FAMILIES`].

use super::config::ModelConfig;
use super::{
    deepseek, deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe,
};
use crate::{Error, Result};
use serde_json::Value;
use std::path::Path;

pub use super::family_types::{
    configured_top_k, softmax_top_k, ConfigEntries, Family, FamilyConfig, MoeNames, SynthParts,
    SynthSizes,
};

/// Every supported family, in the order they are listed to users.
pub const FAMILIES: [&Family; 9] = [
    &olmoe::FAMILY,
    &qwen2_moe::FAMILY,
    &deepseek::FAMILY,
    &mixtral::FAMILY,
    &qwen3_moe::FAMILY,
    &glm4_moe::FAMILY,
    &deepseek_v3::FAMILY,
    &deepseek_v2::FAMILY,
    &gpt_oss::FAMILY,
];

/// The family whose `model_type` this is (Kimi-K2's `kimi_k2` is DeepSeek-V3's).
pub fn family(model_type: &str) -> Option<&'static Family> {
    if deepseek_v3::ALIASES.contains(&model_type) {
        return Some(&deepseek_v3::FAMILY);
    }
    FAMILIES.into_iter().find(|f| f.model_type == model_type)
}

/// The supported `model_type`s, comma-separated (for messages).
pub fn supported() -> String {
    FAMILIES.map(|f| f.model_type).join(", ")
}

impl ModelConfig {
    /// Reads and checks `config.json`.
    pub fn read(path: &Path) -> Result<Self> {
        let text = crate::input::read_text(path)?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::bad_file(path, format!("not valid JSON: {e}")))?;
        Self::from_json(&v, &path.display().to_string())
    }

    /// Parses a `config.json` value of any supported family (its `model_type` picks it);
    /// `origin` names it in errors.
    pub fn from_json(v: &Value, origin: &str) -> Result<Self> {
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::bad_file(origin, "missing field `model_type`"))?;
        let family = family(model_type).ok_or_else(|| {
            Error::bad_file(
                origin,
                format!(
                    "model_type {model_type:?} is not supported (supported: {})",
                    supported()
                ),
            )
        })?;
        Self::from_family_json(v, origin, family)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::config::{QkNorm, SharedConfig};
    use crate::models::synth::SynthModel;
    use serde_json::json;

    #[test]
    fn registry_is_consistent() {
        for f in FAMILIES {
            assert_eq!(family(f.model_type), Some(f));
        }
        let mut types = FAMILIES.map(|f| f.model_type).to_vec();
        types.sort();
        types.dedup();
        assert_eq!(types.len(), FAMILIES.len(), "model_types are unique");
        assert_eq!(family("llama"), None);
    }

    /// The class each family names in `architectures` is the one transformers wrote into the
    /// reference fixtures (scripts/make_model_fixtures.py), and synthetic configs name it too.
    #[test]
    fn architectures_are_the_reference_checkpoints() {
        let fixtures =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
        for f in FAMILIES {
            let path = fixtures.join(f.model_type).join("config.json");
            let text = std::fs::read_to_string(&path).unwrap();
            let config: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                config["architectures"][0],
                f.architecture,
                "{}",
                path.display()
            );
            let synth = SynthModel::tiny(f).config_json().unwrap();
            assert_eq!(
                synth["architectures"],
                serde_json::json!([f.architecture]),
                "{f}"
            );
        }
    }

    #[test]
    fn every_family_reads_back_its_synthetic_config() {
        for f in FAMILIES {
            let synth = SynthModel::tiny(f);
            let json = synth.config_json().unwrap();
            let cfg = ModelConfig::from_json(&json, "synthetic").unwrap();
            assert_eq!(cfg.family, f);
            // GLM-4.5 reads its q/k norm from `use_qk_norm`, which synthetic configs set.
            let qk_norm = if f.model_type == "glm4_moe" {
                QkNorm::PerHead
            } else {
                f.qk_norm
            };
            assert_eq!(cfg.qk_norm, qk_norm, "{f}");
            assert_eq!((cfg.moe.num_experts, cfg.moe.top_k), (8, 2), "{f}");
            assert_eq!(
                cfg.moe.expert_intermediate, synth.expert_intermediate,
                "{f}"
            );
            assert_eq!(cfg.head_dim, synth.hidden / synth.heads, "{f}");
            assert!(cfg.moe_layers.iter().all(|&m| m), "{f}");
            let rule = cfg.router_rule();
            assert_eq!((rule.num_experts, rule.top_k), (8, 2), "{f}");
        }
    }

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_json(&v, "config.json")
    }

    #[test]
    fn the_five_families() {
        let olmoe = parse(json!({"model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
            "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
            "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
            "norm_topk_prob": false, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "clip_qkv": null}))
        .unwrap();
        assert_eq!(
            (
                olmoe.moe.num_experts,
                olmoe.moe.top_k,
                olmoe.moe.expert_intermediate
            ),
            (64, 8, 1024)
        );
        assert_eq!(olmoe.qk_norm, QkNorm::Full);
        assert!(olmoe.moe_layers.iter().all(|&m| m) && olmoe.clip_qkv.is_none());
        assert!(!olmoe.router_rule().renormalize);

        let qwen2 = parse(
            json!({"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
            "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 16,
            "intermediate_size": 5632, "moe_intermediate_size": 1408, "num_experts": 60,
            "num_experts_per_tok": 4, "shared_expert_intermediate_size": 5632,
            "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
        )
        .unwrap();
        assert_eq!(qwen2.moe_layers, vec![false, true, false, false]);
        assert_eq!(
            qwen2.moe.shared,
            Some(SharedConfig {
                intermediate: 5632,
                gated: true
            })
        );
        assert!(qwen2.attention_bias);

        let ds = parse(
            json!({"model_type": "deepseek", "vocab_size": 102400, "hidden_size": 2048,
            "num_hidden_layers": 4, "num_attention_heads": 16, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "n_routed_experts": 64, "num_experts_per_tok": 6,
            "n_shared_experts": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1}),
        )
        .unwrap();
        assert_eq!(ds.moe_layers, vec![false, true, true, true]);
        assert_eq!(
            ds.moe.shared,
            Some(SharedConfig {
                intermediate: 2816,
                gated: false
            })
        );
        assert_eq!(ds.num_kv_heads, 16);

        let mix = parse(
            json!({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
            "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2}),
        )
        .unwrap();
        assert!(mix.router_rule().renormalize);
        assert_eq!(mix.head_dim, 128);

        let q3 = parse(
            json!({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
            "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": true, "intermediate_size": 6144}),
        )
        .unwrap();
        assert_eq!((q3.head_dim, q3.qk_norm), (128, QkNorm::PerHead));
        assert!(q3.router_rule().renormalize);
        // transformers v5 layout: experts under `num_local_experts`, RoPE in
        // `rope_parameters`, and norm_topk_prob defaulting to false.
        let v5 = parse(
            json!({"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "moe_intermediate_size": 16,
            "num_local_experts": 8, "num_experts_per_tok": 2,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}),
        )
        .unwrap();
        assert_eq!(v5.moe.num_experts, 8);
        assert_eq!(v5.rope_theta, 1e6);
        assert!(!v5.moe.renormalize);
        let yarn = parse(
            json!({"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "moe_intermediate_size": 16,
            "num_experts": 8, "num_experts_per_tok": 2,
            "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}),
        )
        .unwrap_err()
        .to_string();
        assert!(yarn.contains("\"longrope\" is not supported"), "{yarn}");
    }

    #[test]
    fn bad_configs_are_named() {
        // Found by fuzzing: the layer count sized a table before anything else was checked.
        let e = parse(
            json!({"model_type": "olmoe", "hidden_size": 8, "intermediate_size": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 4,
            "num_experts_per_tok": 2, "num_hidden_layers": 66600001232u64, "vocab_size": 304}),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("field `num_hidden_layers` = 66600001232 is not at most 65536"),
            "{e}"
        );
        let e = parse(json!({"model_type": "llama"}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"llama\" is not supported") && e.contains("olmoe, qwen2_moe"),
            "{e}"
        );
        let e = parse(json!({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 32, "num_experts_per_tok": 2, "vocab_size": 10}))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("missing field `num_local_experts` (mixtral)"),
            "{e}"
        );
        let e = parse(json!({"model_type": "olmoe", "hidden_size": "big"}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`hidden_size` = \"big\" is not a non-negative integer"),
            "{e}"
        );
        let e = parse(
            json!({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 3, "intermediate_size": 32,
            "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 10}),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("cannot share 3"), "{e}");
        let e = parse(
            json!({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 32, "num_local_experts": 2,
            "num_experts_per_tok": 3, "vocab_size": 10}),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("top_k = 3"), "{e}");
        assert!(parse(json!({}))
            .unwrap_err()
            .to_string()
            .contains("`model_type`"));
    }
}
