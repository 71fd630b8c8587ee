//! A loaded model ([`Model`], one rank's part under expert parallelism): its layers, each
//! pre-norm attention and an MLP (dense SwiGLU or an MoE block), and the state its forwards
//! keep (the EP layers' statistics, routing taps), with their accessors.

use super::dense::DenseMlp;
use super::moe::MoeBlock;
use super::recorder::RouterTap;
use crate::ep::comm::Communicator;
use crate::ep::StepStats;
use crate::models::attention::Attention;
use crate::models::config::ModelConfig;
use crate::models::layers::Rope;
use candle::Tensor;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A layer's MLP.
pub enum Mlp {
    Dense(DenseMlp),
    Moe(Box<MoeBlock>),
}

/// One decoder layer.
pub struct Layer {
    pub input_norm: Tensor,
    pub attn: Attention,
    pub post_norm: Tensor,
    pub mlp: Mlp,
}

/// A loaded model (one rank's part under expert parallelism).
pub struct Model {
    pub cfg: ModelConfig,
    pub embed: Tensor,
    pub layers: Vec<Layer>,
    pub norm: Tensor,
    /// `[V, H]`; the embedding itself when tied.
    pub lm_head: Tensor,
    pub(super) rope: Rope,
    pub(super) comm: Option<Arc<dyn Communicator>>,
    /// Use candle's fused kernels (no backward); false as soon as a weight is trainable.
    pub fused: bool,
    /// The EP layers' statistics per MoE layer, summed over forwards since the last take.
    pub(super) ep_stats: Mutex<BTreeMap<usize, StepStats>>,
    /// The routing of each MoE layer on the graph, collected while [`Model::tap_routers`] is on.
    pub(super) router_taps: Mutex<Option<Vec<RouterTap>>>,
}

impl Model {
    /// Starts (or stops) keeping each MoE layer's routing of the following forwards on the
    /// graph, for [`Model::take_router_taps`]. Off by default.
    pub fn tap_routers(&self, on: bool) {
        if let Ok(mut taps) = self.router_taps.lock() {
            *taps = on.then(Vec::new);
        }
    }

    /// The routing kept since the last take, in forward order (one per MoE layer and forward).
    pub fn take_router_taps(&self) -> Vec<RouterTap> {
        self.router_taps
            .lock()
            .ok()
            .and_then(|mut t| t.as_mut().map(std::mem::take))
            .unwrap_or_default()
    }

    /// The EP layers' statistics (rows, pairs, C_T, stage times) summed over every MoE layer
    /// and forward since the last call; resets them.
    pub fn take_ep_stats(&self) -> StepStats {
        let mut sum = StepStats::default();
        for s in self.take_ep_stats_by_layer().values() {
            sum.add(s);
        }
        sum
    }

    /// The EP layers' statistics per MoE layer (by the model's layer index) since the last
    /// take; resets them.
    pub fn take_ep_stats_by_layer(&self) -> BTreeMap<usize, StepStats> {
        self.ep_stats
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default()
    }

    /// The communicator under expert parallelism.
    pub fn comm(&self) -> Option<&Arc<dyn Communicator>> {
        self.comm.as_ref()
    }
}
