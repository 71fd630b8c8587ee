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
        shared: match f.usize_or("n_shared_experts", 1)? {
            0 => None,
            n => Some(SharedConfig {
                intermediate: n * expert_intermediate,
                gated: false,
            }),
        },
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
        router: RouterConfig::read_noaux_tc(f, num_experts)?,
    })
}

fn synth_config(s: &SynthSizes) -> Result<ConfigEntries> {
    if s.expert_intermediate == 0 || !s.shared_intermediate.is_multiple_of(s.expert_intermediate) {
        bail!(
            "GLM-4.5's shared experts are whole experts: {} is not a multiple of {}",
            s.shared_intermediate,
            s.expert_intermediate
        );
    }
    // Groups of at least 2 experts, each token keeping half of them: the released models' shape
    // (GLM-4.5 itself has one group, DeepSeek-V3 8 keeping 4).
    let groups = [4usize, 2, 1]
        .into_iter()
        .find(|g| s.experts.is_multiple_of(*g) && s.experts / g >= 2)
        .unwrap_or(1);
    Ok(vec![
        ("n_routed_experts", json!(s.experts)),
        (
            "n_shared_experts",
            json!(s.shared_intermediate / s.expert_intermediate),
        ),
        ("moe_intermediate_size", json!(s.expert_intermediate)),
        ("intermediate_size", json!(s.dense_intermediate)),
        ("first_k_dense_replace", json!(s.dense_layers)),
        ("head_dim", json!(s.hidden / s.heads)),
        ("norm_topk_prob", json!(true)),
        ("routed_scaling_factor", json!(2.5)),
        ("n_group", json!(groups)),
        ("topk_group", json!(groups.div_ceil(2))),
        ("use_qk_norm", json!(true)),
        ("attention_bias", json!(true)),
        ("num_nextn_predict_layers", json!(0)),
        (
            "rope_parameters",
            json!({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        ),
    ])
}
