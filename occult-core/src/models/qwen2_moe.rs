//! Qwen1.5-MoE and Qwen2-MoE (model_type `qwen2_moe`): softmax routing without renormalisation
//! by default (`norm_topk_prob`), one shared expert of `shared_expert_intermediate_size` whose
//! output is scaled by `sigmoid(x . shared_expert_gate)`, biases on the q, k and v projections
//! (not on o), and dense layers where `mlp_only_layers` or `decoder_sparse_step` say so.
//!
//! `config.json`: experts `num_experts` (transformers v5 may write `num_local_experts`), expert
//! size `moe_intermediate_size`, biases `qkv_bias` (default true); `use_sliding_window` is
//! refused. Qwen3-MoE reads its experts and layers with the helpers here.

use super::config_fields::{AuxLoss, ConfigFields, QkNorm, RouterConfig, SharedConfig};
use super::family_types::{
    softmax_top_k, ConfigEntries, Family, FamilyConfig, MoeNames, SynthParts, SynthSizes,
};
use super::weights::GATE_UP_DOWN;
use crate::{Error, Result};
use serde_json::json;

pub const FAMILY: Family = Family {
    model_type: "qwen2_moe",
    architecture: "Qwen2MoeForCausalLM",
    names: MoeNames {
        block: "mlp",
        router: "gate",
        experts: GATE_UP_DOWN,
        shared: Some("shared_expert"),
        shared_gate: Some("shared_expert_gate"),
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
    let (num_experts, expert_intermediate) = experts(f)?;
    Ok(FamilyConfig {
        head_dim: None,
        num_experts,
        expert_intermediate,
        renormalize: f.bool_or("norm_topk_prob", false)?,
        shared: Some(SharedConfig {
            intermediate: f.usize("shared_expert_intermediate_size")?,
            gated: true,
        }),
        moe_layers: moe_layers(f, num_layers)?,
        sliding_window: no_sliding_window(f)?,
        attention_bias: f.bool_or("qkv_bias", true)?,
        aux_loss: AuxLoss::read_all_layers(f, 0.001)?,
        qk_norm: None,
        partial_rotary_factor: 1.0,
        router: RouterConfig::default(),
        mla: None,
        attention: Default::default(),
        experts: Default::default(),
    })
}

/// `(num_experts, moe_intermediate_size)`; transformers v5's `to_dict()` writes the experts as
/// `num_local_experts`.
pub(super) fn experts(f: &ConfigFields) -> Result<(usize, usize)> {
    let key = if !f.present("num_experts") && f.present("num_local_experts") {
        "num_local_experts"
    } else {
        "num_experts"
    };
    Ok((f.usize(key)?, f.usize("moe_intermediate_size")?))
}

/// Layer l is MoE unless listed in `mlp_only_layers`, when `(l + 1) % decoder_sparse_step == 0`.
pub(super) fn moe_layers(f: &ConfigFields, num_layers: usize) -> Result<Vec<bool>> {
    let step = f.usize_or("decoder_sparse_step", 1)?.max(1);
    let dense = f.usize_list("mlp_only_layers")?;
    Ok((0..num_layers)
        .map(|l| !dense.contains(&l) && (l + 1) % step == 0)
        .collect())
}

/// Qwen's sliding window is refused rather than silently ignored.
pub(super) fn no_sliding_window(f: &ConfigFields) -> Result<Option<usize>> {
    if f.bool_or("use_sliding_window", false)? {
        return Err(Error::bad_file(
            f.origin,
            "use_sliding_window = true is not supported for Qwen models",
        ));
    }
    Ok(None)
}

/// The fields Qwen2-MoE and Qwen3-MoE share in a synthetic `config.json`.
pub(super) fn synth_common(s: &SynthSizes) -> ConfigEntries {
    let dense: Vec<usize> = (0..s.dense_layers).collect();
    vec![
        ("num_experts", json!(s.experts)),
        ("moe_intermediate_size", json!(s.expert_intermediate)),
        ("intermediate_size", json!(s.dense_intermediate)),
        ("decoder_sparse_step", json!(1)),
        ("mlp_only_layers", json!(dense)),
    ]
}

fn synth_config(s: &SynthSizes) -> Result<ConfigEntries> {
    let mut c = synth_common(s);
    c.push((
        "shared_expert_intermediate_size",
        json!(s.shared_intermediate),
    ));
    c.push(("norm_topk_prob", json!(false)));
    Ok(c)
}
