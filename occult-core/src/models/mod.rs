//! Hugging Face MoE models: configuration, the shared decoder, and one file per family with
//! what is particular to it (weight names, routing details).
//!
//! | family | file | MoE block | router | experts | shared experts |
//! |---|---|---|---|---|---|
//! | OLMoE | [`olmoe`] | `mlp` | `gate` | `gate_proj`/`up_proj`/`down_proj` | none |
//! | Qwen1.5/2-MoE | [`qwen2_moe`] | `mlp` | `gate` | same | `shared_expert`, gated by `shared_expert_gate` |
//! | DeepSeek-MoE v1 | [`deepseek`] | `mlp` | `gate` | same | `shared_experts` |
//! | Mixtral | [`mixtral`] | `block_sparse_moe` | `gate` | `w1`/`w3`/`w2` | none |
//! | Qwen3-MoE | [`qwen3_moe`] | `mlp` | `gate` | same as OLMoE | none |
//!
//! Experts may also be stored fused (`experts.gate_up_proj`, `experts.down_proj`), as
//! transformers v5 saves them; [`crate::weights::Weights::experts`] reads both.

pub mod attention;
pub mod config;
pub mod deepseek;
pub mod layers;
pub mod layout;
pub mod loader;
pub mod mixtral;
pub mod model;
pub mod olmoe;
pub mod qwen2_moe;
pub mod qwen3_moe;
pub mod synth;
pub mod tokenizer;

use crate::weights::ExpertNames;
use config::Family;

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

/// The weight names of a family.
pub fn names_of(f: Family) -> MoeNames {
    match f {
        Family::Olmoe => olmoe::NAMES,
        Family::Qwen2Moe => qwen2_moe::NAMES,
        Family::DeepseekMoe => deepseek::NAMES,
        Family::Mixtral => mixtral::NAMES,
        Family::Qwen3Moe => qwen3_moe::NAMES,
    }
}
