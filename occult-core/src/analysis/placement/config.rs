//! The options of a placement search ([`SearchConfig`]) and the cluster a node-aware
//! placement is for ([`NodeLevel`]): plain values that the flat search, the node-aware search
//! and their callers share.

use crate::{bail, Result};
use serde::{Deserialize, Serialize};

/// Options of the search.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchConfig {
    /// Random balanced starts, on top of the greedy and contiguous starts.
    pub restarts: usize,
    pub seed: u64,
    /// Keep every device's (token, expert) load within this factor of the mean.
    pub max_load_factor: Option<f64>,
    /// Place for a cluster of nodes ([`super::node_search`]): fewest nodes per token first.
    pub nodes: Option<NodeLevel>,
}

impl Default for SearchConfig {
    fn default() -> Self {
        SearchConfig {
            restarts: 2,
            seed: 0,
            max_load_factor: None,
            nodes: None,
        }
    }
}

/// The cluster a node-aware placement is for.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeLevel {
    /// G: devices per node (device d is in node d / G).
    pub devices_per_node: usize,
    /// w: the cost of a row across nodes, in rows inside one.
    pub inter_weight: f64,
}

impl NodeLevel {
    /// Checks G against D (G divides D) and the weight (finite, at least 1).
    pub fn check(&self, num_devices: usize) -> Result<()> {
        let g = self.devices_per_node;
        if g == 0 || !num_devices.is_multiple_of(g) {
            bail!("--devices-per-node {g} must divide the {num_devices} devices");
        }
        if !(self.inter_weight.is_finite() && self.inter_weight >= 1.0) {
            bail!(
                "the inter-node row weight must be a number >= 1, got {}",
                self.inter_weight
            );
        }
        Ok(())
    }

    /// The node of each device.
    pub fn node_of_device(&self, num_devices: usize) -> Vec<u32> {
        (0..num_devices)
            .map(|d| (d / self.devices_per_node) as u32)
            .collect()
    }
}
