//! What a model family is. A [`Family`] is plain data: the `model_type` it answers to, where its
//! checkpoints keep the MoE weights, its defaults, and the functions that read its part of
//! `config.json`, write a synthetic `config.json` and give its router rule. Each family defines
//! one in its own file with the types here; the registry ([`super::family`]) lists them.

use super::config_fields::{
    AttentionExtras, AuxLoss, ConfigFields, ExpertForm, MlaConfig, MoeConfig, QkNorm, RouterConfig,
    SharedConfig,
};
use super::weights::ExpertNames;
use crate::analysis::routing::RouterRule;
use crate::Result;
use serde_json::Value;

/// `config.json` fields as (key, value) pairs.
pub type ConfigEntries = Vec<(&'static str, Value)>;

/// Where a family keeps its MoE weights inside `model.layers.{l}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeNames {
    /// The MoE block (`mlp` or `block_sparse_moe`).
    pub block: &'static str,
    /// The router inside the block.
    pub router: &'static str,
    /// Per-expert projection names.
    pub experts: ExpertNames,
    /// The shared experts' MLP inside the block.
    pub shared: Option<&'static str>,
    /// The shared experts' sigmoid gate inside the block.
    pub shared_gate: Option<&'static str>,
}

/// What a family reads from `config.json` in its own way; the fields every family shares are
/// read by [`super::config::ModelConfig::from_family_json`].
#[derive(Clone, Debug, PartialEq)]
pub struct FamilyConfig {
    /// `None`: `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    pub num_experts: usize,
    pub expert_intermediate: usize,
    pub renormalize: bool,
    pub shared: Option<SharedConfig>,
    /// Whether each layer's MLP is an MoE block (else a dense MLP).
    pub moe_layers: Vec<bool>,
    pub sliding_window: Option<usize>,
    pub attention_bias: bool,
    pub aux_loss: AuxLoss,
    /// `None`: the family's [`Family::qk_norm`] (GLM-4.5 reads `use_qk_norm`).
    pub qk_norm: Option<QkNorm>,
    /// The share of each head's features RoPE rotates (the first ones; GLM-4.5's
    /// `partial_rotary_factor`), 1 elsewhere.
    pub partial_rotary_factor: f64,
    pub router: RouterConfig,
    /// Latent attention (DeepSeek-V3) instead of grouped-query attention.
    pub mla: Option<MlaConfig>,
    /// Attention sinks, an output bias, per-layer windows (gpt-oss).
    pub attention: AttentionExtras,
    /// The experts' activation and biases.
    pub experts: ExpertForm,
}

/// One model family.
pub struct Family {
    /// `config.json`'s `model_type`.
    pub model_type: &'static str,
    /// The model class a Hugging Face `config.json` names in `architectures` (a synthetic
    /// checkpoint names it too, as converters such as llama.cpp's look a model up by it).
    pub architecture: &'static str,
    pub names: MoeNames,
    pub qk_norm: QkNorm,
    /// transformers' defaults when `config.json` is silent.
    pub default_rms_norm_eps: f64,
    pub default_rope_theta: f64,
    /// Reads the family's own fields of `config.json`.
    pub read_config: fn(&ConfigFields, num_layers: usize) -> Result<FamilyConfig>,
    /// The family's own fields of a synthetic `config.json`.
    pub synth_config: fn(&SynthSizes) -> Result<ConfigEntries>,
    /// The router rule of the family's MoE blocks.
    pub router_rule: fn(&MoeConfig) -> RouterRule,
    /// Which optional parts of a synthetic model the family has; a size for a part it lacks
    /// is refused rather than ignored.
    pub synth_parts: SynthParts,
}

/// The sizes of a synthetic model that a family writes into its `config.json` in its own field
/// names (from [`super::synth::SynthModel`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynthSizes {
    pub hidden: usize,
    pub heads: usize,
    pub experts: usize,
    pub expert_intermediate: usize,
    /// Intermediate size of dense layers.
    pub dense_intermediate: usize,
    /// Shared-expert intermediate size.
    pub shared_intermediate: usize,
    /// The first this many layers are dense.
    pub dense_layers: usize,
}

/// Optional parts of a family's synthetic model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynthParts {
    /// Shared experts (`--shared-intermediate`).
    pub shared_experts: bool,
    /// Leading dense layers (`--dense-layers`, `--dense-intermediate`).
    pub dense_layers: bool,
}

impl PartialEq for Family {
    fn eq(&self, other: &Self) -> bool {
        self.model_type == other.model_type
    }
}

impl Eq for Family {}

impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type)
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type)
    }
}

/// Softmax over the experts, then top-k, renormalised if the config says so, then scaled: the
/// rule of the five families of 2024 (GLM-4.5 takes [`configured_top_k`]).
pub fn softmax_top_k(moe: &MoeConfig) -> RouterRule {
    let mut rule = RouterRule::softmax_topk(moe.num_experts, moe.top_k, moe.renormalize);
    rule.scaling_factor = moe.router.scaling_factor;
    rule
}

/// The router `moe.router` describes (sigmoid with groups for GLM-4.5), top-k, renormalised if
/// the config says so, then scaled. The selection bias is each layer's own (read with the
/// router's weights), not part of this rule.
pub fn configured_top_k(moe: &MoeConfig) -> RouterRule {
    let mut rule = softmax_top_k(moe);
    rule.scoring = moe.router.scoring;
    rule.group_limit = moe.router.group_limit;
    rule
}
