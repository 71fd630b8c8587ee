//! DeepSeek-V3 and R1, and Kimi-K2 (model_type `deepseek_v3`, or `kimi_k2` with V3's
//! architecture; transformers' `DeepseekV3ForCausalLM`): multi-head latent attention
//! ([`super::attention_latent`]) with YaRN's softmax scale where `rope_scaling` says so; the
//! first `first_k_dense_replace` layers dense, then MoE blocks every `moe_layer_freq` layers with
//! the `noaux_tc` router (sigmoid scores, each layer's `e_score_correction_bias` for selection
//! only, `n_group` groups of which each token keeps `topk_group`, scored by their two best
//! biased scores, `norm_topk_prob`, `routed_scaling_factor`) and `n_shared_experts` shared
//! experts fused into one ungated MLP.
//!
//! `config.json`: experts `n_routed_experts`, expert size `moe_intermediate_size`; latent sizes
//! `q_lora_rank` (null: one `q_proj`), `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`,
//! `v_head_dim`, `rope_interleave`; transformers' defaults where a field is absent. The
//! multi-token-prediction layer stored after the decoder (`num_nextn_predict_layers`) is not
//! run. The balance of fine-tuning is the selection bias's, as V3 trains: no auxiliary loss.

use super::config_fields::{AuxForm, AuxLoss, ConfigFields, MlaConfig, QkNorm, RouterConfig};
use super::family_types::{
    configured_top_k, ConfigEntries, Family, FamilyConfig, MoeNames, SynthParts, SynthSizes,
};
use super::glm4_moe::{noaux_synth, shared_experts};
use super::weights::GATE_UP_DOWN;
use crate::{bail, Result};
use serde_json::json;

pub const FAMILY: Family = Family {
    model_type: "deepseek_v3",
    architecture: "DeepseekV3ForCausalLM",
    names: MoeNames {
        block: "mlp",
        router: "gate",
        experts: GATE_UP_DOWN,
        shared: Some("shared_experts"),
        shared_gate: None,
    },
    qk_norm: QkNorm::None,
    default_rms_norm_eps: 1e-6,
    default_rope_theta: 10000.0,
    read_config,
    synth_config,
    router_rule: configured_top_k,
    synth_parts: SynthParts {
        shared_experts: true,
        dense_layers: true,
    },
};

/// Other `model_type`s that are DeepSeek-V3's architecture.
pub const ALIASES: [&str; 1] = ["kimi_k2"];

fn read_config(f: &ConfigFields, num_layers: usize) -> Result<FamilyConfig> {
    let num_experts = f.usize("n_routed_experts")?;
    let expert_intermediate = f.usize("moe_intermediate_size")?;
    let first_dense = f.usize_or("first_k_dense_replace", 3)?;
    let freq = f.usize_or("moe_layer_freq", 1)?.max(1);
    let mla = read_mla(f)?;
    Ok(FamilyConfig {
        head_dim: Some(mla.qk_head_dim()),
        num_experts,
        expert_intermediate,
        renormalize: f.bool_or("norm_topk_prob", true)?,
        shared: shared_experts(f, expert_intermediate, 1)?,
        moe_layers: (0..num_layers)
            .map(|l| l >= first_dense && l % freq == 0)
            .collect(),
        sliding_window: None,
        attention_bias: f.bool_or("attention_bias", false)?,
        aux_loss: AuxLoss {
            form: AuxForm::AllLayers,
            coef: 0.0,
        },
        qk_norm: None,
        partial_rotary_factor: 1.0,
        // transformers' DeepseekV3Config defaults: 8 groups keeping 4, scaled by 2.5.
        router: RouterConfig::read_noaux_tc(f, num_experts, (8, 4, 2.5))?,
        mla: Some(mla),
        attention: Default::default(),
        experts: Default::default(),
    })
}

/// Multi-head latent attention's sizes, with transformers' defaults where a field is absent
/// (DeepSeek-V2's and V3's are the same): `q_lora_rank` (null: one `q_proj`), `kv_lora_rank`,
/// `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`.
pub(super) fn read_mla(f: &ConfigFields) -> Result<MlaConfig> {
    let q_lora_rank = match f.v.get("q_lora_rank") {
        Some(v) if v.is_null() => None,
        None => Some(1536),
        Some(_) => Some(f.usize("q_lora_rank")?),
    };
    let mla = MlaConfig {
        q_lora_rank,
        kv_lora_rank: f.usize_or("kv_lora_rank", 512)?,
        qk_nope_head_dim: f.usize_or("qk_nope_head_dim", 128)?,
        qk_rope_head_dim: f.usize_or("qk_rope_head_dim", 64)?,
        v_head_dim: f.usize_or("v_head_dim", 128)?,
        rope_interleave: f.bool_or("rope_interleave", true)?,
    };
    for (key, value) in [
        ("kv_lora_rank", mla.kv_lora_rank),
        ("qk_rope_head_dim", mla.qk_rope_head_dim),
        ("v_head_dim", mla.v_head_dim),
        ("q_lora_rank", mla.q_lora_rank.unwrap_or(1)),
    ] {
        if value == 0 {
            return Err(f.bad(key, "at least 1"));
        }
    }
    if mla.qk_rope_head_dim % 2 == 1 {
        return Err(f.bad("qk_rope_head_dim", "even (RoPE rotates pairs)"));
    }
    Ok(mla)
}

fn synth_config(s: &SynthSizes) -> Result<ConfigEntries> {
    let mut c = noaux_synth(s, "DeepSeek-V3")?;
    c.extend(latent_synth(s, "DeepSeek-V3")?);
    c.extend([
        ("moe_layer_freq", json!(1)),
        ("rope_interleave", json!(true)),
        ("topk_method", json!("noaux_tc")),
        ("scoring_func", json!("sigmoid")),
    ]);
    Ok(c)
}

/// The latent attention of a synthetic DeepSeek-V2 or V3 (`name`): each head's features split
/// into an unrotated and a rotated half, values as wide as the head, the query rank half the
/// hidden size and the latent a quarter; a key and value per head.
pub(super) fn latent_synth(s: &SynthSizes, name: &str) -> Result<ConfigEntries> {
    let head = s.hidden / s.heads;
    if head < 4 || !head.is_multiple_of(4) {
        bail!(
            "a synthetic {name} splits each head of --hidden / --heads = {head} features into a \
             rotated and an unrotated half of even widths: give a multiple of 4"
        );
    }
    Ok(vec![
        // Every head has its own key and value from the latent: transformers repeats them by
        // `num_attention_heads / num_key_value_heads`, so the two must be equal.
        ("num_key_value_heads", json!(s.heads)),
        ("q_lora_rank", json!(s.hidden / 2)),
        ("kv_lora_rank", json!(s.hidden / 4)),
        ("qk_nope_head_dim", json!(head / 2)),
        ("qk_rope_head_dim", json!(head / 2)),
        ("v_head_dim", json!(head)),
    ])
}

#[cfg(test)]
mod tests {
    use crate::analysis::routing::{GroupScore, Scoring};
    use crate::models::config::ModelConfig;
    use crate::models::rope_scaling::RopeScaling;
    use serde_json::{json, Value};

    /// DeepSeek-V3's published `config.json`, its fields as the hub has them.
    fn v3(extra: Value) -> crate::Result<ModelConfig> {
        let mut v = json!({"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
            "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
            "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
            "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
            "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
            "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
            "norm_topk_prob": true, "scoring_func": "sigmoid", "num_nextn_predict_layers": 1,
            "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-6,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
            "attention_bias": false, "tie_word_embeddings": false});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        ModelConfig::from_json(&v, "config.json")
    }

    #[test]
    fn deepseek_v3_reads_as_transformers_builds_it() {
        let c = v3(json!({})).unwrap();
        let m = c.mla.unwrap();
        assert_eq!((c.head_dim, c.rotary_dim), (192, 64));
        assert_eq!(
            (m.q_lora_rank, m.kv_lora_rank, m.v_head_dim),
            (Some(1536), 512, 128)
        );
        assert!(m.rope_interleave);
        assert_eq!(c.moe_layers.iter().filter(|&&x| !x).count(), 3);
        assert_eq!(c.mtp_layers, 1);
        assert!(matches!(c.rope_scaling, RopeScaling::Yarn(_)));
        let rule = c.router_rule();
        assert_eq!(rule.scoring, Scoring::Sigmoid);
        assert_eq!(
            (rule.top_k, rule.scaling_factor, rule.renormalize),
            (8, 2.5, true)
        );
        let g = rule.group_limit.unwrap();
        assert_eq!(
            (g.num_groups, g.topk_groups, g.score),
            (8, 4, GroupScore::Top2Sum)
        );
        // Kimi-K2 names its own model_type over V3's architecture.
        let k2 = v3(
            json!({"model_type": "kimi_k2", "n_routed_experts": 384, "n_group": 1,
            "topk_group": 1, "routed_scaling_factor": 2.827}),
        )
        .unwrap();
        assert_eq!(k2.family.model_type, "deepseek_v3");
        assert_eq!(k2.router_rule().group_limit, None);
        // A direct query projection.
        assert_eq!(
            v3(json!({"q_lora_rank": null}))
                .unwrap()
                .mla
                .unwrap()
                .q_lora_rank,
            None
        );
    }

    #[test]
    fn bad_v3_configs_are_named() {
        for (extra, says) in [
            (json!({"qk_rope_head_dim": 63}), "qk_rope_head_dim"),
            (json!({"kv_lora_rank": 0}), "kv_lora_rank"),
            (json!({"q_lora_rank": 0}), "q_lora_rank"),
            (json!({"n_group": 7}), "n_group"),
            (json!({"topk_group": 9}), "topk_group"),
            (
                json!({"rope_scaling": {"type": "dynamic", "factor": 2}}),
                "dynamic",
            ),
            (json!({"n_routed_experts": null}), "n_routed_experts"),
        ] {
            let err = v3(extra.clone()).unwrap_err().to_string();
            assert!(err.contains(says), "{extra}: {err}");
        }
    }
}
