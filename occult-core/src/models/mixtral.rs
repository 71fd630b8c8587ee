//! Mixtral (model_type `mixtral`): every layer's MLP is `block_sparse_moe` with 8 experts
//! (`w1` gate, `w3` up, `w2` down), top-2, softmax weights always renormalised over the chosen
//! experts; grouped-query attention with an optional sliding window.
//!
//! `config.json`: experts `num_local_experts`, expert size `intermediate_size`, an optional
//! `head_dim` (newer configs), `sliding_window`, RoPE theta 1e6 by default.

use super::config_fields::{AuxLoss, ConfigFields, QkNorm, RouterConfig};
use super::family_types::{
    softmax_top_k, ConfigEntries, Family, FamilyConfig, MoeNames, SynthParts, SynthSizes,
};
use super::weights::W1_W3_W2;
use crate::Result;
use serde_json::{json, Value};

pub const FAMILY: Family = Family {
    model_type: "mixtral",
    architecture: "MixtralForCausalLM",
    names: MoeNames {
        block: "block_sparse_moe",
        router: "gate",
        experts: W1_W3_W2,
        shared: None,
        shared_gate: None,
    },
    qk_norm: QkNorm::None,
    default_rms_norm_eps: 1e-5,
    default_rope_theta: 1e6,
    read_config,
    synth_config,
    router_rule: softmax_top_k,
    synth_parts: SynthParts {
        shared_experts: false,
        dense_layers: false,
    },
};

fn read_config(f: &ConfigFields, num_layers: usize) -> Result<FamilyConfig> {
    Ok(FamilyConfig {
        head_dim: optional(f, "head_dim")?,
        num_experts: f.usize("num_local_experts")?,
        expert_intermediate: f.usize("intermediate_size")?,
        // Mixtral always renormalises over the chosen experts.
        renormalize: true,
        shared: None,
        moe_layers: vec![true; num_layers],
        sliding_window: optional(f, "sliding_window")?,
        attention_bias: f.bool_or("attention_bias", false)?,
        aux_loss: AuxLoss::read_all_layers(f, 0.001)?,
        qk_norm: None,
        partial_rotary_factor: 1.0,
        router: RouterConfig::default(),
        mla: None,
        attention: Default::default(),
        experts: Default::default(),
    })
}

fn optional(f: &ConfigFields, key: &str) -> Result<Option<usize>> {
    f.present(key).then(|| f.usize(key)).transpose()
}

fn synth_config(s: &SynthSizes) -> Result<ConfigEntries> {
    Ok(vec![
        ("num_local_experts", json!(s.experts)),
        ("intermediate_size", json!(s.expert_intermediate)),
        ("sliding_window", Value::Null),
    ])
}
