//! DeepSeek-MoE v1 (`deepseek-ai/deepseek-moe-16b-base`, model_type `deepseek`, remote code in
//! the hub repository): Llama attention, the first `first_k_dense_replace` layers dense, then
//! an MoE block every `moe_layer_freq` layers with softmax routing (renormalised only if
//! `norm_topk_prob`), and `n_shared_experts` shared experts fused into one MLP of
//! `n_shared_experts * moe_intermediate_size`, added without a gate.

use super::MoeNames;
use crate::weights::GATE_UP_DOWN;

pub const NAMES: MoeNames = MoeNames {
    block: "mlp",
    router: "gate",
    experts: GATE_UP_DOWN,
    shared: Some("shared_experts"),
    shared_gate: None,
};
