//! Hugging Face MoE models: finding and reading checkpoints, one file per family with the rules
//! particular to it, and the shared decoder whose MoE blocks run the reference or the EP layer.
//!
//! | family | file | MoE block | router | experts | shared experts |
//! |---|---|---|---|---|---|
//! | OLMoE | [`olmoe`] | `mlp` | `gate` | `gate_proj`/`up_proj`/`down_proj` | none |
//! | Qwen1.5/2-MoE | [`qwen2_moe`] | `mlp` | `gate` | same | `shared_expert`, gated by `shared_expert_gate` |
//! | DeepSeek-MoE v1 | [`deepseek`] | `mlp` | `gate` | same | `shared_experts` |
//! | Mixtral | [`mixtral`] | `block_sparse_moe` | `gate` | `w1`/`w3`/`w2` | none |
//! | Qwen3-MoE | [`qwen3_moe`] | `mlp` | `gate` | same as OLMoE | none |
//! | DeepSeek-V2 | [`deepseek_v2`] | `mlp` | `gate` (softmax, optional groups by their best) | same as OLMoE | `shared_experts` |
//! | DeepSeek-V3/R1, Kimi-K2 | [`deepseek_v3`] | `mlp` | `gate` (sigmoid, groups, `e_score_correction_bias`) | same as OLMoE | `shared_experts` |
//! | GLM-4.5/4.6 | [`glm4_moe`] | `mlp` | `gate` (sigmoid, groups, `e_score_correction_bias`) | same as OLMoE | `shared_experts` |
//! | gpt-oss | [`gpt_oss`] | `mlp` | `router` (with a bias) | fused and interleaved, with biases, bf16 or MXFP4 ([`gpt_oss_experts`]) | none |
//!
//! Experts may also be stored fused (`experts.gate_up_proj`, `experts.down_proj`), as
//! transformers v5 saves them; [`weights::Weights::experts`] reads both.
//!
//! The other modules, by concern:
//! - files: [`checkpoint`] (a folder or a hub id in the local cache), [`weights`] (safetensors,
//!   mapped, in the chosen dtype, a rank's experts only), [`tokenizer`], [`loader`] (all of it
//!   opened and checked together), [`layout`] (the tensors a config implies), [`synth`]
//!   (random checkpoints), [`mxfp4`] (gpt-oss's packed expert weights, dequantized as
//!   transformers does) and [`gpt_oss_experts`] (gpt-oss's expert layout, read and written);
//! - configuration: [`config_fields`] (the parts of `config.json` families read in their own
//!   ways), [`family_types`] (what a family is: the record each family file fills in),
//!   [`config`] (the fields every family shares, in one typed config) and [`family`] (the
//!   registry, and reading the config of any family);
//! - the decoder: [`layers`] (norms, RoPE, masks), [`rope_scaling`] (RoPE's frequencies:
//!   plain or YaRN), [`attention_latent`] (DeepSeek-V3's latent attention beside the grouped
//!   one in [`attention`]), [`attention`], [`layer_cache`] (a layer's KV cache, appended in
//!   place), [`model`];
//!   at inference on CPU (nothing on the graph), [`attention_infer`] (attention's core),
//!   [`attention_ragged`] (a continuously batched step's, every sequence at once) and
//!   [`rope_infer`] (RoPE with Qwen3's per-head norms) run on slices instead of candle's
//!   tensor ops;
//! - running: [`data_parallel`] (D ranks in step, each with its own tokens, and the digests
//!   they compare before a run), [`memory`] (the guard that refuses a model that will not
//!   fit, before its weights are read) and [`decode_reads`] (the bytes a decode step reads,
//!   which `bench model` holds against the machine's read rate).

pub mod attention;
pub mod attention_infer;
pub mod attention_latent;
pub mod attention_ragged;
pub mod checkpoint;
pub mod config;
pub mod config_fields;
pub mod data_parallel;
pub mod decode_reads;
pub mod family;
pub mod family_types;
pub mod gpt_oss_experts;
pub mod layer_cache;
pub mod layers;
pub mod layout;
pub mod loader;
pub mod memory;
pub mod model;
pub mod mxfp4;
pub mod rope_infer;
pub mod rope_scaling;
pub mod synth;
pub mod tokenizer;
pub mod weights;

// The families, one file each; listed in [`family::FAMILIES`].
pub mod deepseek;
pub mod deepseek_v2;
pub mod deepseek_v3;
pub mod glm4_moe;
pub mod gpt_oss;
pub mod mixtral;
pub mod olmoe;
pub mod qwen2_moe;
pub mod qwen3_moe;

pub use family::{family, Family, MoeNames, FAMILIES};
