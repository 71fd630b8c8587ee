//! OLMoE (`allenai/OLMoE-1B-7B`, model_type `olmoe`): 64 experts, top-8, softmax weights used
//! as they are (`norm_topk_prob` false), no shared experts. Attention normalises q and k with
//! RMSNorm over the *whole* projection (`q_norm` `[heads * head_dim]`, `k_norm`
//! `[kv_heads * head_dim]`) before splitting heads, then clips q, k and v to `±clip_qkv` if set
//! (after the norms, as transformers does).
//!
//! `config.json`: experts `num_experts`, expert size `intermediate_size`, every layer MoE.

use super::config_fields::{AuxLoss, ConfigFields, QkNorm, RouterConfig};
use super::family_types::{
    softmax_top_k, ConfigEntries, Family, FamilyConfig, MoeNames, SynthParts, SynthSizes,
};
use super::weights::GATE_UP_DOWN;
use crate::Result;
use serde_json::{json, Value};

pub const FAMILY: Family = Family {
    model_type: "olmoe",
    architecture: "OlmoeForCausalLM",
    names: MoeNames {
        block: "mlp",
        router: "gate",
        experts: GATE_UP_DOWN,
        shared: None,
        shared_gate: None,
    },
    qk_norm: QkNorm::Full,
    default_rms_norm_eps: 1e-5,
    default_rope_theta: 10000.0,
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
        head_dim: None,
        num_experts: f.usize("num_experts")?,
        expert_intermediate: f.usize("intermediate_size")?,
        renormalize: f.bool_or("norm_topk_prob", false)?,
        shared: None,
        moe_layers: vec![true; num_layers],
        sliding_window: None,
        attention_bias: f.bool_or("attention_bias", false)?,
        aux_loss: AuxLoss::read_all_layers(f, 0.01)?,
        qk_norm: None,
        partial_rotary_factor: 1.0,
        router: RouterConfig::default(),
        mla: None,
        attention: Default::default(),
        experts: Default::default(),
    })
}

fn synth_config(s: &SynthSizes) -> Result<ConfigEntries> {
    Ok(vec![
        ("num_experts", json!(s.experts)),
        ("intermediate_size", json!(s.expert_intermediate)),
        ("norm_topk_prob", json!(false)),
        ("clip_qkv", Value::Null),
    ])
}
