//! OLMoE (`allenai/OLMoE-1B-7B`, model_type `olmoe`): 64 experts, top-8, softmax weights used
//! as they are (`norm_topk_prob` false), no shared experts. Attention normalises q and k with
//! RMSNorm over the *whole* projection (`q_norm` `[heads * head_dim]`, `k_norm`
//! `[kv_heads * head_dim]`) before splitting heads, then clips q, k and v to `±clip_qkv` if set
//! (after the norms, as transformers does).

use super::MoeNames;
use crate::weights::GATE_UP_DOWN;

pub const NAMES: MoeNames = MoeNames {
    block: "mlp",
    router: "gate",
    experts: GATE_UP_DOWN,
    shared: None,
    shared_gate: None,
};
