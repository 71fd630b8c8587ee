//! The family registry. A [`Family`] is plain data: the `model_type` it answers to, where its
//! checkpoints keep the MoE weights, its defaults, and the functions that read its part of
//! `config.json`, write a synthetic `config.json` and give its router rule. Each family defines
//! one in its own file; [`FAMILIES`] lists them.
//!
//! Adding a family: write `models/NAME.rs` with a `pub const FAMILY: Family`, declare the module
//! in `models/mod.rs`, and add `&NAME::FAMILY` to [`FAMILIES`].

use super::config::{AuxLoss, ConfigFields, ModelConfig, QkNorm, SharedConfig};
use super::synth::SynthModel;
use super::weights::ExpertNames;
use super::{deepseek, mixtral, olmoe, qwen2_moe, qwen3_moe};
use crate::analysis::routing::RouterRule;
use crate::Result;
use serde_json::Value;

/// Every supported family, in the order they are listed to users.
pub const FAMILIES: [&Family; 5] = [
    &olmoe::FAMILY,
    &qwen2_moe::FAMILY,
    &deepseek::FAMILY,
    &mixtral::FAMILY,
    &qwen3_moe::FAMILY,
];

/// The family whose `model_type` this is.
pub fn family(model_type: &str) -> Option<&'static Family> {
    FAMILIES.into_iter().find(|f| f.model_type == model_type)
}

/// The supported `model_type`s, comma-separated (for messages).
pub fn supported() -> String {
    FAMILIES.map(|f| f.model_type).join(", ")
}

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
/// read by [`ModelConfig::from_json`].
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
    pub synth_config: fn(&SynthModel) -> Result<ConfigEntries>,
    /// The router rule of the family's MoE blocks.
    pub router_rule: fn(&ModelConfig) -> RouterRule,
    /// Which optional parts of a synthetic model the family has; a size for a part it lacks
    /// is refused rather than ignored.
    pub synth_parts: SynthParts,
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
/// rule of all five families.
pub fn softmax_top_k(cfg: &ModelConfig) -> RouterRule {
    let moe = &cfg.moe;
    let mut rule = RouterRule::softmax_topk(moe.num_experts, moe.top_k, moe.renormalize);
    rule.scaling_factor = moe.scaling_factor;
    rule
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_is_consistent() {
        for f in FAMILIES {
            assert_eq!(family(f.model_type), Some(f));
        }
        let mut types = FAMILIES.map(|f| f.model_type).to_vec();
        types.sort();
        types.dedup();
        assert_eq!(types.len(), FAMILIES.len(), "model_types are unique");
        assert_eq!(family("llama"), None);
    }

    /// The class each family names in `architectures` is the one transformers wrote into the
    /// reference fixtures (scripts/make_model_fixtures.py), and synthetic configs name it too.
    #[test]
    fn architectures_are_the_reference_checkpoints() {
        let fixtures =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
        for f in FAMILIES {
            let path = fixtures.join(f.model_type).join("config.json");
            let text = std::fs::read_to_string(&path).unwrap();
            let config: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                config["architectures"][0],
                f.architecture,
                "{}",
                path.display()
            );
            let synth = SynthModel::tiny(f).config_json().unwrap();
            assert_eq!(
                synth["architectures"],
                serde_json::json!([f.architecture]),
                "{f}"
            );
        }
    }

    #[test]
    fn every_family_reads_back_its_synthetic_config() {
        for f in FAMILIES {
            let synth = SynthModel::tiny(f);
            let json = synth.config_json().unwrap();
            let cfg = ModelConfig::from_json(&json, "synthetic").unwrap();
            assert_eq!(cfg.family, f);
            assert_eq!(cfg.qk_norm, f.qk_norm);
            assert_eq!((cfg.moe.num_experts, cfg.moe.top_k), (8, 2), "{f}");
            assert_eq!(
                cfg.moe.expert_intermediate, synth.expert_intermediate,
                "{f}"
            );
            assert_eq!(cfg.head_dim, synth.hidden / synth.heads, "{f}");
            assert!(cfg.moe_layers.iter().all(|&m| m), "{f}");
            let rule = cfg.router_rule();
            assert_eq!((rule.num_experts, rule.top_k), (8, 2), "{f}");
        }
    }
}
