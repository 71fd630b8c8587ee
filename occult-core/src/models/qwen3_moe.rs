//! Qwen3-MoE (model_type `qwen3_moe`): softmax routing renormalised over the chosen experts when
//! `norm_topk_prob` (as the released checkpoints set it), no shared experts, an explicit
//! `head_dim`, and RMSNorm of q and k *per head* (`q_norm`, `k_norm` `[head_dim]`) before RoPE.
//!
//! `config.json`: read as Qwen2-MoE's for experts and MoE layers (see [`super::qwen2_moe`]),
//! plus `head_dim`; no shared experts, no q/k/v biases unless `attention_bias`.

use super::config_fields::{AuxLoss, ConfigFields, QkNorm, RouterConfig};
use super::family_types::{
    softmax_top_k, ConfigEntries, Family, FamilyConfig, MoeNames, SynthParts, SynthSizes,
};
use super::qwen2_moe::{experts, moe_layers, no_sliding_window, synth_common};
use super::weights::GATE_UP_DOWN;
use crate::Result;
use serde_json::json;

pub const FAMILY: Family = Family {
    model_type: "qwen3_moe",
    architecture: "Qwen3MoeForCausalLM",
    names: MoeNames {
        block: "mlp",
        router: "gate",
        experts: GATE_UP_DOWN,
        shared: None,
        shared_gate: None,
    },
    qk_norm: QkNorm::PerHead,
    default_rms_norm_eps: 1e-6,
    default_rope_theta: 10000.0,
    read_config,
    synth_config,
    router_rule: softmax_top_k,
    synth_parts: SynthParts {
        shared_experts: false,
        dense_layers: true,
    },
};

fn read_config(f: &ConfigFields, num_layers: usize) -> Result<FamilyConfig> {
    let (num_experts, expert_intermediate) = experts(f)?;
    Ok(FamilyConfig {
        head_dim: f
            .present("head_dim")
            .then(|| f.usize("head_dim"))
            .transpose()?,
        num_experts,
        expert_intermediate,
        // transformers' default is false; the released checkpoints set it to true.
        renormalize: f.bool_or("norm_topk_prob", false)?,
        shared: None,
        moe_layers: moe_layers(f, num_layers)?,
        sliding_window: no_sliding_window(f)?,
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

fn synth_config(s: &SynthSizes) -> Result<ConfigEntries> {
    let mut c = synth_common(s);
    c.push(("head_dim", json!(s.hidden / s.heads)));
    c.push(("norm_topk_prob", json!(true)));
    Ok(c)
}
