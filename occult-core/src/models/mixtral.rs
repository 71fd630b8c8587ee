//! Mixtral (model_type `mixtral`): every layer's MLP is `block_sparse_moe` with 8 experts
//! (`w1` gate, `w3` up, `w2` down), top-2, softmax weights always renormalised over the chosen
//! experts; grouped-query attention with an optional sliding window.

use super::MoeNames;
use crate::weights::W1_W3_W2;

pub const NAMES: MoeNames = MoeNames {
    block: "block_sparse_moe",
    router: "gate",
    experts: W1_W3_W2,
    shared: None,
    shared_gate: None,
};
