//! DeepSeek-V2 and V2-Lite (model_type `deepseek_v2`, transformers' `DeepseekV2ForCausalLM`):
//! DeepSeek-V3's multi-head latent attention ([`super::attention_latent`]; V2 rotates its pairs
//! as complex numbers and keeps them interleaved, which leaves every score as V3's order does),
//! the first `first_k_dense_replace` layers dense, then MoE blocks with a softmax router: the
//! top-k of all experts (`topk_method` `greedy`) or of the best `topk_group` of `n_group` groups,
//! each scored by its best expert (`group_limited_greedy`), renormalised only if
//! `norm_topk_prob`, scaled by `routed_scaling_factor`; `n_shared_experts` shared experts fused
//! into one ungated MLP.
//!
//! `config.json`: as DeepSeek-V3's (latent sizes, experts), with V2's defaults; `mlp_bias` must
//! be false.

use super::config_fields::{read_groups, AuxForm, AuxLoss, ConfigFields, QkNorm, RouterConfig};
use super::deepseek_v3::{latent_synth, read_mla};
use super::family_types::{
    configured_top_k, ConfigEntries, Family, FamilyConfig, MoeNames, SynthParts, SynthSizes,
};
use super::glm4_moe::{shared_experts, whole_shared_experts};
use super::weights::GATE_UP_DOWN;
use crate::analysis::routing::{GroupLimit, GroupScore, Scoring};
use crate::Result;
use serde_json::{json, Value};

pub const FAMILY: Family = Family {
    model_type: "deepseek_v2",
    architecture: "DeepseekV2ForCausalLM",
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

fn read_config(f: &ConfigFields, num_layers: usize) -> Result<FamilyConfig> {
    let num_experts = f.usize("n_routed_experts")?;
    let expert_intermediate = f.usize("moe_intermediate_size")?;
    let first_dense = f.usize_or("first_k_dense_replace", 0)?;
    if f.bool_or("mlp_bias", false)? {
        return Err(f.bad("mlp_bias", "false (MLPs with biases are not run)"));
    }
    let group_limit = match f.v.get("topk_method").and_then(Value::as_str) {
        None | Some("greedy") => None,
        Some("group_limited_greedy") => {
            let (n_group, topk_group) = read_groups(f, num_experts, (1, 1))?;
            Some(GroupLimit {
                num_groups: n_group,
                topk_groups: topk_group,
                score: GroupScore::Max,
            })
        }
        Some(_) => return Err(f.bad("topk_method", "\"greedy\" or \"group_limited_greedy\"")),
    };
    let scaling_factor = f.f64_or("routed_scaling_factor", 1.0)?;
    if !(scaling_factor.is_finite() && scaling_factor > 0.0) {
        return Err(f.bad("routed_scaling_factor", "a positive number"));
    }
    let mla = read_mla(f)?;
    Ok(FamilyConfig {
        head_dim: Some(mla.qk_head_dim()),
        num_experts,
        expert_intermediate,
        renormalize: f.bool_or("norm_topk_prob", false)?,
        shared: shared_experts(f, expert_intermediate, 2)?,
        moe_layers: (0..num_layers).map(|l| l >= first_dense).collect(),
        sliding_window: None,
        attention_bias: f.bool_or("attention_bias", false)?,
        // transformers' V2 adds no auxiliary loss; fine-tuning adds transformers' form only
        // with a coefficient given.
        aux_loss: AuxLoss {
            form: AuxForm::AllLayers,
            coef: 0.0,
        },
        qk_norm: None,
        partial_rotary_factor: 1.0,
        router: RouterConfig {
            scoring: Scoring::Softmax,
            group_limit,
            scaling_factor: scaling_factor as f32,
            selection_bias: false,
            logit_bias: false,
        },
        // V2 always pairs its rotated features.
        mla: Some(super::config_fields::MlaConfig {
            rope_interleave: true,
            ..mla
        }),
        attention: Default::default(),
        experts: Default::default(),
    })
}

fn synth_config(s: &SynthSizes) -> Result<ConfigEntries> {
    let shared = whole_shared_experts(s, "DeepSeek-V2")?;
    let mut c = latent_synth(s, "DeepSeek-V2")?;
    c.extend([
        ("n_routed_experts", json!(s.experts)),
        ("n_shared_experts", json!(shared)),
        ("moe_intermediate_size", json!(s.expert_intermediate)),
        ("intermediate_size", json!(s.dense_intermediate)),
        ("first_k_dense_replace", json!(s.dense_layers)),
        ("topk_method", json!("greedy")),
        ("norm_topk_prob", json!(false)),
        ("routed_scaling_factor", json!(1.0)),
    ]);
    Ok(c)
}

#[cfg(test)]
mod tests {
    use crate::analysis::routing::{GroupScore, Scoring};
    use crate::models::config::ModelConfig;
    use serde_json::{json, Value};

    /// DeepSeek-V2-Lite's published `config.json` (its MoE and latent fields).
    fn v2(extra: Value) -> crate::Result<ModelConfig> {
        let mut v = json!({"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
            "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
            "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
            "n_routed_experts": 64, "routed_scaling_factor": 1.0, "kv_lora_rank": 512,
            "q_lora_rank": null, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
            "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1,
            "norm_topk_prob": false, "scoring_func": "softmax", "max_position_embeddings": 163840,
            "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
                "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                "type": "yarn"}});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        ModelConfig::from_json(&v, "config.json")
    }

    #[test]
    fn deepseek_v2_lite_reads_as_transformers_builds_it() {
        let c = v2(json!({})).unwrap();
        let m = c.mla.unwrap();
        assert_eq!((c.head_dim, c.rotary_dim, m.q_lora_rank), (192, 64, None));
        assert_eq!(c.moe.shared.unwrap().intermediate, 2 * 1408);
        assert_eq!(c.moe_layers.iter().filter(|&&x| !x).count(), 1);
        let rule = c.router_rule();
        assert_eq!(rule.scoring, Scoring::Softmax);
        assert_eq!(
            (rule.top_k, rule.renormalize, rule.group_limit),
            (6, false, None)
        );
        assert!(rule.selection_bias.is_none());
        // DeepSeek-V2 (the full model) keeps 3 of 8 groups by their best expert.
        let g = v2(json!({"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}))
            .unwrap()
            .router_rule()
            .group_limit
            .unwrap();
        assert_eq!(
            (g.num_groups, g.topk_groups, g.score),
            (8, 3, GroupScore::Max)
        );
    }

    #[test]
    fn bad_v2_configs_are_named() {
        for (extra, says) in [
            (json!({"topk_method": "noaux_tc"}), "topk_method"),
            (
                json!({"topk_method": "group_limited_greedy", "n_group": 7}),
                "n_group",
            ),
            (json!({"mlp_bias": true}), "mlp_bias"),
            (
                json!({"routed_scaling_factor": 0.0}),
                "routed_scaling_factor",
            ),
        ] {
            let err = v2(extra.clone()).unwrap_err().to_string();
            assert!(err.contains(says), "{extra}: {err}");
        }
    }
}
