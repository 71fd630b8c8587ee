//! gpt-oss (model_type `gpt_oss`, transformers' `GptOssForCausalLM`: gpt-oss-20b and -120b):
//! grouped-query attention with biases on q, k, v and o (`attention_bias`), a learned sink
//! logit per head, and a sliding window (`sliding_window`, 128) on the layers `layer_types`
//! marks `sliding_attention` (every other one from the first, when absent); YaRN RoPE (factor
//! 32, `truncate` false); every layer MoE, with the router `mlp.router` (weight and bias):
//! top-k of the biased logits, softmax over the k; experts fused and interleaved with biases
//! and the clamped SwiGLU (`swiglu_alpha` 1.702, `swiglu_limit` 7), read from bf16 or MXFP4
//! ([`super::gpt_oss_experts`]).
//!
//! `config.json`: experts `num_local_experts`, expert size `intermediate_size`. The published
//! checkpoints' `quantization_config` (`quant_method` `mxfp4`) is honoured by dequantizing the
//! experts on load, as transformers does without a GPU.

use super::config_fields::{
    AttentionExtras, AuxLoss, ConfigFields, ExpertForm, QkNorm, RouterConfig,
};
use super::family_types::{
    softmax_top_k, ConfigEntries, Family, FamilyConfig, MoeNames, SynthParts, SynthSizes,
};
use super::weights::GATE_UP_DOWN;
use crate::ep::swiglu::Activation;
use crate::Result;
use serde_json::json;

pub const FAMILY: Family = Family {
    model_type: "gpt_oss",
    architecture: "GptOssForCausalLM",
    names: MoeNames {
        block: "mlp",
        router: "router",
        // Unused: the experts are fused (`gpt_oss_experts`).
        experts: GATE_UP_DOWN,
        shared: None,
        shared_gate: None,
    },
    qk_norm: QkNorm::None,
    default_rms_norm_eps: 1e-5,
    default_rope_theta: 150000.0,
    read_config,
    synth_config,
    // Top-k of the logits, softmax over the k: the same as softmax over all, renormalised.
    router_rule: softmax_top_k,
    synth_parts: SynthParts {
        shared_experts: false,
        dense_layers: false,
    },
};

/// transformers' defaults for gpt-oss.
const DEFAULT_SLIDING_WINDOW: usize = 128;
const DEFAULT_ALPHA: f64 = 1.702;
const DEFAULT_LIMIT: f64 = 7.0;

fn read_config(f: &ConfigFields, num_layers: usize) -> Result<FamilyConfig> {
    let num_experts = if f.present("num_local_experts") {
        f.usize("num_local_experts")?
    } else {
        f.usize("num_experts")?
    };
    let window = f.usize_or("sliding_window", DEFAULT_SLIDING_WINDOW)?;
    let sliding_layers = if f.present("layer_types") {
        let kinds = f.v["layer_types"].as_array().ok_or_else(|| {
            f.bad(
                "layer_types",
                "a list of \"sliding_attention\" and \"full_attention\"",
            )
        })?;
        kinds
            .iter()
            .map(|k| match k.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(f.bad(
                    "layer_types",
                    "a list of \"sliding_attention\" and \"full_attention\"",
                )),
            })
            .collect::<Result<Vec<bool>>>()?
    } else {
        (0..num_layers).map(|l| l % 2 == 0).collect()
    };
    let alpha = f.f64_or("swiglu_alpha", DEFAULT_ALPHA)?;
    let limit = f.f64_or("swiglu_limit", DEFAULT_LIMIT)?;
    if !(alpha.is_finite() && alpha > 0.0) {
        return Err(f.bad("swiglu_alpha", "a positive number"));
    }
    if !(limit.is_finite() && limit > 0.0) {
        return Err(f.bad("swiglu_limit", "a positive number"));
    }
    let attention_bias = f.bool_or("attention_bias", true)?;
    Ok(FamilyConfig {
        head_dim: f
            .present("head_dim")
            .then(|| f.usize("head_dim"))
            .transpose()?,
        num_experts,
        expert_intermediate: f.usize("intermediate_size")?,
        renormalize: true,
        shared: None,
        moe_layers: vec![true; num_layers],
        sliding_window: Some(window),
        attention_bias,
        aux_loss: AuxLoss::read_all_layers(f, 0.001)?,
        qk_norm: None,
        partial_rotary_factor: 1.0,
        router: RouterConfig {
            logit_bias: true,
            ..RouterConfig::default()
        },
        mla: None,
        attention: AttentionExtras {
            sinks: true,
            output_bias: attention_bias,
            sliding_layers: Some(sliding_layers),
        },
        experts: ExpertForm {
            activation: Activation::ClampedSwiglu {
                alpha: alpha as f32,
                limit: limit as f32,
            },
            biases: true,
            interleaved_gate_up: true,
        },
    })
}

fn synth_config(s: &SynthSizes) -> Result<ConfigEntries> {
    Ok(vec![
        ("num_local_experts", json!(s.experts)),
        ("intermediate_size", json!(s.expert_intermediate)),
        ("head_dim", json!(s.hidden / s.heads)),
        ("sliding_window", json!(DEFAULT_SLIDING_WINDOW)),
        ("attention_bias", json!(true)),
        // A limit the synthetic weights reach, so that the clamps are exercised.
        ("swiglu_limit", json!(1.0)),
        ("swiglu_alpha", json!(DEFAULT_ALPHA)),
        (
            "rope_parameters",
            json!({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                   "truncate": false, "original_max_position_embeddings": 4096}),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use crate::ep::swiglu::Activation;
    use crate::models::config::ModelConfig;
    use crate::models::rope_scaling::RopeScaling;
    use serde_json::{json, Value};

    fn gpt_oss(extra: Value) -> crate::Result<ModelConfig> {
        // gpt-oss-20b's published config.json (quantization_config aside).
        let mut v = json!({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
            "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
            "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
            "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
            "experts_per_token": 4, "sliding_window": 128, "swiglu_limit": 7.0,
            "rms_norm_eps": 1e-05, "rope_theta": 150000, "max_position_embeddings": 131072,
            "initial_context_length": 4096, "attention_bias": true, "tie_word_embeddings": false,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                "full_attention"],
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
            "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
                "quant_method": "mxfp4"}});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        ModelConfig::from_json(&v, "config.json")
    }

    #[test]
    fn gpt_oss_20b_reads_as_transformers_builds_it() {
        let c = gpt_oss(json!({})).unwrap();
        assert_eq!((c.moe.num_experts, c.moe.top_k), (32, 4));
        assert_eq!((c.head_dim, c.num_heads, c.num_kv_heads), (64, 64, 8));
        assert_eq!(c.moe.expert_intermediate, 2880);
        assert!(c.attention_bias && c.attention.output_bias && c.attention.sinks);
        assert!(c.moe.router.logit_bias && c.moe.experts.biases);
        assert_eq!(
            c.moe.experts.activation,
            Activation::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0
            }
        );
        assert_eq!(
            (c.window(0), c.window(1), c.window(22)),
            (Some(128), None, Some(128))
        );
        match &c.rope_scaling {
            RopeScaling::Yarn(y) => assert!(!y.truncate && y.factor == 32.0),
            other => panic!("{other:?}"),
        }
        let rule = c.router_rule();
        assert!(rule.renormalize && rule.group_limit.is_none());
        // Without layer_types: sliding on the even layers, as transformers defaults.
        let d = gpt_oss(json!({"layer_types": null})).unwrap();
        assert_eq!(
            (d.window(0), d.window(1), d.window(2)),
            (Some(128), None, Some(128))
        );
    }

    #[test]
    fn bad_gpt_oss_configs_are_named() {
        for (extra, says) in [
            (json!({"layer_types": ["sliding_attention"]}), "layer_types"),
            (json!({"layer_types": "sliding"}), "layer_types"),
            (
                json!({"layer_types": ["sliding_attention", "chunked_attention"]}),
                "layer_types",
            ),
            (json!({"swiglu_limit": -1.0}), "swiglu_limit"),
            (json!({"swiglu_alpha": 0.0}), "swiglu_alpha"),
            (json!({"num_local_experts": null}), "num_experts"),
        ] {
            let err = gpt_oss(extra.clone()).unwrap_err().to_string();
            assert!(err.contains(says), "{extra}: {err}");
        }
    }
}
