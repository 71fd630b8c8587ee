//! GLM-4.5 and GLM-4.6 (model_type `glm4_moe`, transformers' `Glm4MoeForCausalLM`): Llama-style
//! attention with q/k/v biases (`attention_bias`), optional RMSNorm of q and k per head
//! (`use_qk_norm`) and RoPE on the first half of each head only (`partial_rotary_factor`, 0.5
//! when absent); the first `first_k_dense_replace` layers dense, then MoE blocks with
//! DeepSeek-V3's router (sigmoid scores, each layer's `e_score_correction_bias` for selection,
//! `n_group` groups of which each token keeps `topk_group`, `norm_topk_prob`,
//! `routed_scaling_factor`) and `n_shared_experts` shared experts fused into one ungated MLP.
//!
//! `config.json`: experts `n_routed_experts` (the hub's name; transformers also takes
//! `num_local_experts`), expert size `moe_intermediate_size`. The multi-token-prediction layer
//! the released checkpoints store after the decoder (`num_nextn_predict_layers`) is not run.

use super::config_fields::{AuxForm, AuxLoss, ConfigFields, QkNorm, RouterConfig, SharedConfig};
use super::family_types::{
    configured_top_k, ConfigEntries, Family, FamilyConfig, MoeNames, SynthParts, SynthSizes,
};
use super::weights::GATE_UP_DOWN;
use crate::{bail, Result};
use serde_json::json;

pub const FAMILY: Family = Family {
    model_type: "glm4_moe",
    architecture: "Glm4MoeForCausalLM",
    names: MoeNames {
        block: "mlp",
        router: "gate",
        experts: GATE_UP_DOWN,
        shared: Some("shared_experts"),
        shared_gate: None,
    },
    // `use_qk_norm` decides (read_config); none when absent, as transformers' default.
    qk_norm: QkNorm::None,
    default_rms_norm_eps: 1e-5,
    default_rope_theta: 10000.0,
    read_config,
    synth_config,
    router_rule: configured_top_k,
    synth_parts: SynthParts {
        shared_experts: true,
        dense_layers: true,
    },
};

/// transformers' default `partial_rotary_factor` for GLM-4.5.
const DEFAULT_PARTIAL_ROTARY: f64 = 0.5;

fn read_config(f: &ConfigFields, num_layers: usize) -> Result<FamilyConfig> {
    let num_experts = if f.present("n_routed_experts") {
        f.usize("n_routed_experts")?
    } else {
        f.usize("num_local_experts")?
    };
    let expert_intermediate = f.usize("moe_intermediate_size")?;
    let first_dense = f.usize_or("first_k_dense_replace", 1)?;
    // transformers v5 keeps it in `rope_parameters`; older configs at the top level.
    let partial = match f
        .v
        .get("rope_parameters")
        .and_then(|p| p.get("partial_rotary_factor"))
    {
        Some(v) if !v.is_null() => v.as_f64().ok_or_else(|| {
            f.bad(
                "rope_parameters",
                "an object whose partial_rotary_factor is a number",
            )
        })?,
        _ => f.f64_or("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)?,
    };
    Ok(FamilyConfig {
        head_dim: f
            .present("head_dim")
            .then(|| f.usize("head_dim"))
            .transpose()?,
        num_experts,
        expert_intermediate,
        renormalize: f.bool_or("norm_topk_prob", true)?,
        shared: shared_experts(f, expert_intermediate, 1)?,
        moe_layers: (0..num_layers).map(|l| l >= first_dense).collect(),
        sliding_window: None,
        attention_bias: f.bool_or("attention_bias", false)?,
        // Balanced by the selection bias, without an auxiliary loss (`noaux_tc`); fine-tuning
        // adds transformers' form only with a coefficient given.
        aux_loss: AuxLoss {
            form: AuxForm::AllLayers,
            coef: 0.0,
        },
        qk_norm: Some(if f.bool_or("use_qk_norm", false)? {
            QkNorm::PerHead
        } else {
            QkNorm::None
        }),
        partial_rotary_factor: partial,
        // transformers' Glm4MoeConfig defaults: one group, no scaling.
        router: RouterConfig::read_noaux_tc(f, num_experts, (1, 1, 1.0))?,
        mla: None,
        attention: Default::default(),
        experts: Default::default(),
    })
}

/// `n_shared_experts` (`default` when absent) experts of `expert_intermediate`, fused into one
/// ungated MLP, as DeepSeek-V2/V3 and GLM-4.5 keep them.
pub(super) fn shared_experts(
    f: &ConfigFields,
    expert_intermediate: usize,
    default: usize,
) -> Result<Option<SharedConfig>> {
    Ok(match f.usize_or("n_shared_experts", default)? {
        0 => None,
        n => Some(SharedConfig {
            intermediate: n * expert_intermediate,
            gated: false,
        }),
    })
}

fn synth_config(s: &SynthSizes) -> Result<ConfigEntries> {
    let mut c = noaux_synth(s, "GLM-4.5")?;
    c.extend([
        ("head_dim", json!(s.hidden / s.heads)),
        ("use_qk_norm", json!(true)),
        ("attention_bias", json!(true)),
        (
            "rope_parameters",
            json!({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        ),
    ]);
    Ok(c)
}

/// How many whole experts the synthetic shared-expert size makes (`name`'s shared experts are
/// whole experts).
pub(super) fn whole_shared_experts(s: &SynthSizes, name: &str) -> Result<usize> {
    if s.expert_intermediate == 0 || !s.shared_intermediate.is_multiple_of(s.expert_intermediate) {
        bail!(
            "{name}'s shared experts are whole experts: {} is not a multiple of {}",
            s.shared_intermediate,
            s.expert_intermediate
        );
    }
    Ok(s.shared_intermediate / s.expert_intermediate)
}

/// The fields of a synthetic config that DeepSeek-V3 and GLM-4.5 (`name`) share: experts, whole
/// shared experts, dense first layers, and the `noaux_tc` router with groups of at least 2
/// experts of which each token keeps half (GLM-4.5 itself has one group, DeepSeek-V3 8 keeping
/// 4).
pub(super) fn noaux_synth(s: &SynthSizes, name: &str) -> Result<ConfigEntries> {
    let shared = whole_shared_experts(s, name)?;
    let groups = [4usize, 2, 1]
        .into_iter()
        .find(|g| s.experts.is_multiple_of(*g) && s.experts / g >= 2)
        .unwrap_or(1);
    Ok(vec![
        ("n_routed_experts", json!(s.experts)),
        ("n_shared_experts", json!(shared)),
        ("moe_intermediate_size", json!(s.expert_intermediate)),
        ("intermediate_size", json!(s.dense_intermediate)),
        ("first_k_dense_replace", json!(s.dense_layers)),
        ("norm_topk_prob", json!(true)),
        ("routed_scaling_factor", json!(2.5)),
        ("n_group", json!(groups)),
        ("topk_group", json!(groups.div_ceil(2))),
        ("num_nextn_predict_layers", json!(0)),
    ])
}

#[cfg(test)]
mod tests {
    use crate::analysis::routing::{GroupScore, Scoring};
    use crate::models::config::{ModelConfig, QkNorm};
    use serde_json::{json, Value};

    fn glm(extra: Value) -> crate::Result<ModelConfig> {
        let mut v = json!({"model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
            "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 10944, "moe_intermediate_size": 1408,
            "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "norm_topk_prob": true, "routed_scaling_factor": 2.5,
            "n_group": 1, "topk_group": 1, "use_qk_norm": true, "attention_bias": true,
            "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rope_theta": 1000000});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        ModelConfig::from_json(&v, "config.json")
    }

    /// GLM-4.5-Air's published `config.json` as Occult reads it.
    #[test]
    fn glm_4_5_reads_as_transformers_builds_it() {
        let c = glm(json!({})).unwrap();
        assert_eq!((c.head_dim, c.rotary_dim), (128, 64));
        assert_eq!(c.qk_norm, QkNorm::PerHead);
        assert!(c.attention_bias);
        assert_eq!(c.moe_layers.iter().filter(|&&m| !m).count(), 3);
        assert_eq!(c.mtp_layers, 1);
        assert_eq!(c.moe.shared.unwrap().intermediate, 1408);
        let rule = c.router_rule();
        assert_eq!(rule.scoring, Scoring::Sigmoid);
        assert_eq!(
            (rule.top_k, rule.scaling_factor, rule.renormalize),
            (8, 2.5, true)
        );
        // One group: no group limit.
        assert_eq!(rule.group_limit, None);
        // transformers v5 keeps the factor in rope_parameters; 0.5 when absent.
        let c = glm(json!({"partial_rotary_factor": null,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}}))
        .unwrap();
        assert_eq!(c.rotary_dim, 32);
        assert_eq!(
            glm(json!({"partial_rotary_factor": null}))
                .unwrap()
                .rotary_dim,
            64
        );
        let g = glm(json!({"n_group": 8, "topk_group": 4}))
            .unwrap()
            .router_rule();
        let g = g.group_limit.unwrap();
        assert_eq!(
            (g.num_groups, g.topk_groups, g.score),
            (8, 4, GroupScore::Top2Sum)
        );
    }

    #[test]
    fn bad_glm_configs_are_named() {
        for (extra, says) in [
            (json!({"n_group": 3}), "n_group"),
            (json!({"n_group": 8, "topk_group": 9}), "topk_group"),
            (json!({"n_group": 128}), "n_group"),
            (
                json!({"routed_scaling_factor": -1.0}),
                "routed_scaling_factor",
            ),
            (
                json!({"partial_rotary_factor": 0.0}),
                "partial_rotary_factor",
            ),
            (
                json!({"partial_rotary_factor": 1.5}),
                "partial_rotary_factor",
            ),
            (
                json!({"head_dim": 6, "partial_rotary_factor": 0.5}),
                "partial_rotary_factor",
            ),
            (json!({"n_routed_experts": null}), "num_local_experts"),
        ] {
            let err = glm(extra.clone()).unwrap_err().to_string();
            assert!(err.contains(says), "{extra}: {err}");
        }
    }
}
