//! Qwen1.5-MoE and Qwen2-MoE (model_type `qwen2_moe`): softmax routing without renormalisation
//! by default (`norm_topk_prob`), one shared expert of `shared_expert_intermediate_size` whose
//! output is scaled by `sigmoid(x . shared_expert_gate)`, biases on the q, k and v projections
//! (not on o), and dense layers where `mlp_only_layers` or `decoder_sparse_step` say so.

use super::MoeNames;
use crate::weights::GATE_UP_DOWN;

pub const NAMES: MoeNames = MoeNames {
    block: "mlp",
    router: "gate",
    experts: GATE_UP_DOWN,
    shared: Some("shared_expert"),
    shared_gate: Some("shared_expert_gate"),
};
