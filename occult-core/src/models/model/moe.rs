//! How a model's MoE blocks compute: the mode ([`MoeMode`]), the setup a model is assembled
//! with ([`MoeSetup`]: the mode, each layer's placement and pruning) and what each MoE block
//! runs ([`MoeExec`]: the single-device reference or this rank's part of the expert-parallel
//! layer).

use crate::analysis::routing::RouterRule;
use crate::ep::{DispatchMode, EpMoe, MoeWeights, PruneSpec, Replicas};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How MoE blocks compute: the one-device reference loop, or expert parallelism with standard
/// or Occult dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum MoeMode {
    /// The single-device reference (a plain loop over experts).
    Reference,
    /// Expert parallelism, one row per (token, expert).
    Standard,
    /// Expert parallelism, one row per (token, device), pre-reduced on the device.
    Occult,
    /// Expert parallelism across nodes: one row per (token, node) to the node's proxy, which
    /// forwards it inside the node; pre-reduced on the device and at the proxy.
    #[serde(rename = "two-level")]
    TwoLevel,
}

impl MoeMode {
    /// The EP layer's dispatch mode, `None` for the reference (as [`MoeSetup::mode`] holds it).
    pub fn dispatch(self) -> Option<DispatchMode> {
        match self {
            MoeMode::Reference => None,
            MoeMode::Standard => Some(DispatchMode::Standard),
            MoeMode::Occult => Some(DispatchMode::Occult),
            MoeMode::TwoLevel => Some(DispatchMode::TwoLevel),
        }
    }

    pub fn name(self) -> &'static str {
        self.dispatch().map_or("reference", DispatchMode::name)
    }
}

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
        weights: MoeWeights,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moe_modes_name_their_dispatch() {
        assert_eq!(MoeMode::Reference.dispatch(), None);
        assert_eq!(MoeMode::Standard.dispatch(), Some(DispatchMode::Standard));
        assert_eq!(MoeMode::Occult.dispatch(), Some(DispatchMode::Occult));
        assert_eq!(MoeMode::TwoLevel.dispatch(), Some(DispatchMode::TwoLevel));
        for (m, name) in [
            (MoeMode::Reference, "reference"),
            (MoeMode::Standard, "standard"),
            (MoeMode::Occult, "occult"),
            (MoeMode::TwoLevel, "two-level"),
        ] {
            assert_eq!(m.name(), name);
            assert_eq!(serde_json::to_value(m).unwrap(), name);
        }
    }

    /// The command-line names of the core's enums are their serde names (`--features clap`).
    #[cfg(feature = "clap")]
    #[test]
    fn command_line_names_are_the_serde_names() {
        use crate::analysis::placement::Method;
        use crate::analysis::pruning::PruneRule;
        use clap::ValueEnum;
        fn check<T: ValueEnum + Serialize>() {
            for v in T::value_variants() {
                let name = v.to_possible_value().unwrap().get_name().to_string();
                assert_eq!(serde_json::to_value(v).unwrap(), name);
            }
        }
        check::<Method>();
        check::<PruneRule>();
        check::<DispatchMode>();
        check::<MoeMode>();
    }
}
