//! DeepSeek-MoE v1 (`deepseek-ai/deepseek-moe-16b-base`, model_type `deepseek`, remote code in
//! the hub repository): Llama attention, the first `first_k_dense_replace` layers dense, then
//! an MoE block every `moe_layer_freq` layers with softmax routing (renormalised only if
//! `norm_topk_prob`), and `n_shared_experts` shared experts fused into one MLP of
//! `n_shared_experts * moe_intermediate_size`, added without a gate.
//!
//! `config.json`: experts `n_routed_experts`, expert size `moe_intermediate_size`; a
//! `scoring_func` other than softmax (DeepSeek-V2/V3) is refused.

use super::config_fields::{AuxForm, AuxLoss, ConfigFields, QkNorm, RouterConfig, SharedConfig};
use super::family_types::{
    softmax_top_k, ConfigEntries, Family, FamilyConfig, MoeNames, SynthParts, SynthSizes,
};
use super::weights::GATE_UP_DOWN;
use crate::{bail, Error, Result};
use serde_json::{json, Value};

pub const FAMILY: Family = Family {
    model_type: "deepseek",
    architecture: "DeepseekForCausalLM",
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
    router_rule: softmax_top_k,
    synth_parts: SynthParts {
        shared_experts: true,
        dense_layers: true,
    },
};

fn read_config(f: &ConfigFields, num_layers: usize) -> Result<FamilyConfig> {
    let num_experts = f.usize("n_routed_experts")?;
    let expert_intermediate = f.usize("moe_intermediate_size")?;
    let first_dense = f.usize_or("first_k_dense_replace", 0)?;
    let freq = f.usize_or("moe_layer_freq", 1)?.max(1);
    if let Some(sf) = f.v.get("scoring_func").and_then(Value::as_str) {
        if sf != "softmax" {
            return Err(Error::bad_file(
                f.origin,
                format!("scoring_func {sf:?} is not DeepSeek-MoE v1's softmax"),
            ));
        }
    }
    Ok(FamilyConfig {
        head_dim: None,
        num_experts,
        expert_intermediate,
        renormalize: f.bool_or("norm_topk_prob", false)?,
        shared: match f.usize_or("n_shared_experts", 0)? {
            0 => None,
            n => Some(SharedConfig {
                intermediate: n * expert_intermediate,
                gated: false,
            }),
        },
        moe_layers: (0..num_layers)
            .map(|l| l >= first_dense && l % freq == 0)
            .collect(),
        sliding_window: None,
        attention_bias: f.bool_or("attention_bias", false)?,
        aux_loss: read_aux_loss(f)?,
        qk_norm: None,
        partial_rotary_factor: 1.0,
        router: RouterConfig::default(),
        mla: None,
        attention: Default::default(),
        experts: Default::default(),
    })
}

/// DeepSeek-MoE's `aux_loss_alpha` (0.001) and `seq_aux` (true), as its modelling code defaults.
fn read_aux_loss(f: &ConfigFields) -> Result<AuxLoss> {
    let coef = f.f64_or("aux_loss_alpha", 0.001)?;
    if !(coef >= 0.0 && coef.is_finite()) {
        return Err(f.bad("aux_loss_alpha", "a finite number >= 0"));
    }
    let form = if f.bool_or("seq_aux", true)? {
        AuxForm::PerSequence
    } else {
        AuxForm::PerLayer
    };
    Ok(AuxLoss { form, coef })
}

fn synth_config(s: &SynthSizes) -> Result<ConfigEntries> {
    if s.expert_intermediate == 0 || !s.shared_intermediate.is_multiple_of(s.expert_intermediate) {
        bail!(
            "DeepSeek's shared experts are whole experts: {} is not a multiple of {}",
            s.shared_intermediate,
            s.expert_intermediate
        );
    }
    Ok(vec![
        ("n_routed_experts", json!(s.experts)),
        (
            "n_shared_experts",
            json!(s.shared_intermediate / s.expert_intermediate),
        ),
        ("moe_intermediate_size", json!(s.expert_intermediate)),
        ("intermediate_size", json!(s.dense_intermediate)),
        ("first_k_dense_replace", json!(s.dense_layers)),
        ("moe_layer_freq", json!(1)),
        ("norm_topk_prob", json!(false)),
        ("scoring_func", json!("softmax")),
    ])
}
