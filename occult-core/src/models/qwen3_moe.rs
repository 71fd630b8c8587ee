//! Qwen3-MoE (model_type `qwen3_moe`): softmax routing renormalised over the chosen experts when
//! `norm_topk_prob` (as the released checkpoints set it), no shared experts, an explicit
//! `head_dim`, and RMSNorm of q and k *per head* (`q_norm`, `k_norm` `[head_dim]`) before RoPE.

use super::MoeNames;
use crate::weights::GATE_UP_DOWN;

pub const NAMES: MoeNames = MoeNames {
    block: "mlp",
    router: "gate",
    experts: GATE_UP_DOWN,
    shared: None,
    shared_gate: None,
};
