//! How a model's MoE blocks compute: the setup a model is assembled
//! with ([`MoeSetup`]: the dispatch mode, each layer's placement and pruning) and what each MoE block
//! runs ([`MoeExec`]: the single-device reference or this rank's part of the expert-parallel
//! layer).

use crate::analysis::routing::RouterRule;
use crate::analysis::run_key::DispatchMode;
use crate::ep::{EpMoe, MoeWeights, PruneSpec, Replicas};
use std::collections::BTreeMap;

/// How MoE blocks run: the mode, the placement of each MoE layer's experts, and pruning.
#[derive(Clone, Debug)]
pub struct MoeSetup {
    /// `None`: the single-device reference. Otherwise the EP layer in this dispatch mode.
    pub mode: Option<DispatchMode>,
    /// Per MoE layer, the device of each expert; absent layers use the contiguous map.
    pub maps: BTreeMap<usize, Vec<u32>>,
    /// Devices the maps refer to (the group size under EP).
    pub num_devices: usize,
    /// Pruning per MoE layer (the same rule everywhere, tables per layer).
    pub prune: BTreeMap<usize, PruneSpec>,
    /// Devices per node (two-level mode; otherwise it only splits the row counts by level).
    /// `None`: the communicator's own (under MPI, the ranks of one host).
    pub devices_per_node: Option<usize>,
    /// MoE layers whose placement has replicas (their `maps` entry is not used), with the copy
    /// rule.
    pub replicas: BTreeMap<usize, Replicas>,
}

impl MoeSetup {
    /// The reference mode on one device, no pruning.
    pub fn reference() -> Self {
        MoeSetup {
            mode: None,
            maps: BTreeMap::new(),
            num_devices: 1,
            prune: BTreeMap::new(),
            devices_per_node: None,
            replicas: BTreeMap::new(),
        }
    }

    /// The map of `layer`: the given one, or contiguous blocks.
    pub fn map(&self, layer: usize, num_experts: usize) -> Vec<u32> {
        self.maps.get(&layer).cloned().unwrap_or_else(|| {
            crate::analysis::placement::contiguous(num_experts, self.num_devices)
        })
    }
}

/// How an MoE block computes.
pub enum MoeExec {
    /// The plain single-device loop over experts; `prune` gives the pruning rule with the
    /// placement (map, devices) it refers to.
    Reference {
        weights: Box<MoeWeights>,
        prune: Option<(PruneSpec, Vec<u32>, usize)>,
    },
    /// This rank's part of the expert-parallel layer.
    Parallel(Box<EpMoe>),
}

/// One MoE block.
pub struct MoeBlock {
    /// The model's layer index.
    pub layer: usize,
    pub rule: RouterRule,
    pub exec: MoeExec,
}
