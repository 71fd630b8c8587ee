//! Expert placements: which device holds each expert, per layer; their validation, their JSON
//! file (format `occult.placement.v1`) and the placement methods ([`Method::place`] runs one on
//! a layer's routing).
//!
//! A valid map is *balanced*: every device holds `floor(E/D)` or `ceil(E/D)` experts, so there
//! are never more devices than experts.

pub mod eplb;
mod greedy;
mod maps;
mod nodes;
pub mod replica_search;
pub mod replicas;
mod search;

pub use greedy::greedy;
pub use maps::{
    capacities, check_sizes, contiguous, experts_by_device, random_balanced, validate_map,
};
pub use nodes::{
    devices_and_nodes, node_progress_steps, node_search, two_level_cost, NodeLevel, NodeOutcome,
    DEFAULT_INTER_WEIGHT,
};
pub use search::{
    progress_steps, random_balanced_within, search, search_with_progress, search_within_groups,
    SearchConfig, SearchOutcome,
};

use crate::analysis::collab::CoActivation;
use crate::atomic::write_json_atomic;
use crate::{bail, Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The value of the `format` key of a placement file.
pub const PLACEMENT_FORMAT: &str = "occult.placement.v1";

/// The placement methods `occult place` offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Expert e on device e / (E/D), what frameworks do without profiling.
    Contiguous,
    /// The paper's Algorithm 1 on the co-activation matrix.
    Greedy,
    /// Ours: swap search on the exact E[C_T] from several starts (greedy's among them), never
    /// worse than greedy on the trace it is given. Given a node size
    /// ([`SearchConfig::nodes`]), it places for fewest nodes per token first ([`node_search`]).
    Occult,
}

impl Method {
    /// Every method, in the order benchmarks compare them.
    pub const ALL: [Method; 3] = [Method::Contiguous, Method::Greedy, Method::Occult];

    pub fn name(self) -> &'static str {
        match self {
            Method::Contiguous => "contiguous",
            Method::Greedy => "greedy",
            Method::Occult => "occult",
        }
    }

    /// Progress steps [`Method::place`] reports for one layer: the search's [`progress_steps`]
    /// for [`Method::Occult`], one for the others.
    pub fn progress_steps(self, cfg: &SearchConfig) -> usize {
        match self {
            Method::Occult if cfg.nodes.is_some() => node_progress_steps(cfg),
            Method::Occult => progress_steps(cfg),
            Method::Contiguous | Method::Greedy => 1,
        }
    }

    /// Places one layer's `num_experts` experts on `num_devices` devices from the layer's
    /// routing `ids` (`[tokens, top_k]`, row-major; the co-activation counts greedy and the
    /// search start from are taken from it). `cfg` serves [`Method::Occult`]'s search only.
    /// Calls `on_step` [`Method::progress_steps`] times as the work goes. Returns the map and,
    /// for [`Method::Occult`], the search's outcome (whose `map` is the same).
    pub fn place(
        self,
        ids: &[u32],
        top_k: usize,
        num_experts: usize,
        num_devices: usize,
        cfg: &SearchConfig,
        on_step: &(dyn Fn() + Sync),
    ) -> Result<(Vec<u32>, Option<SearchOutcome>)> {
        check_sizes(num_experts, num_devices)?;
        let co = || CoActivation::from_ids(ids, top_k, num_experts);
        let map = match self {
            Method::Contiguous => contiguous(num_experts, num_devices),
            Method::Greedy => greedy(&co(), num_devices),
            Method::Occult => {
                let out = match cfg.nodes {
                    Some(level) => {
                        node_search(ids, top_k, &co(), num_devices, level, cfg, on_step)?.search
                    }
                    None => search_with_progress(ids, top_k, &co(), num_devices, cfg, on_step)?,
                };
                return Ok((out.map.clone(), Some(out)));
            }
        };
        on_step();
        Ok((map, None))
    }
}

/// Quality figures of one layer's placement, stored beside it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementMetrics {
    pub ect: f64,
    #[serde(default)]
    pub intra_ratio: Option<f64>,
    pub max_load_ratio: f64,
}

/// One layer's expert -> device map.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerPlacement {
    pub layer: usize,
    pub device_of_expert: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<PlacementMetrics>,
}

/// A placement file: per-layer maps, how they were made, and what they reached.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    pub format: String,
    pub num_experts: usize,
    pub num_devices: usize,
    pub method: String,
    /// Where it came from (trace path, seed, options): free-form.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub source: serde_json::Map<String, serde_json::Value>,
    pub layers: Vec<LayerPlacement>,
}

impl Placement {
    /// A placement with the same map for each listed layer.
    pub fn uniform(layers: &[usize], map: Vec<u32>, num_devices: usize, method: &str) -> Self {
        Placement {
            format: PLACEMENT_FORMAT.into(),
            num_experts: map.len(),
            num_devices,
            method: method.into(),
            source: Default::default(),
            layers: layers
                .iter()
                .map(|&layer| LayerPlacement {
                    layer,
                    device_of_expert: map.clone(),
                    metrics: None,
                })
                .collect(),
        }
    }

    /// The map of the model's layer `layer`.
    pub fn layer(&self, layer: usize) -> Result<&[u32]> {
        self.layers
            .iter()
            .find(|l| l.layer == layer)
            .map(|l| l.device_of_expert.as_slice())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "the placement has no entry for layer {layer} (it covers layers {:?})",
                    self.layers.iter().map(|l| l.layer).collect::<Vec<_>>()
                ))
            })
    }

    /// Checks the format tag, the sizes and every layer's map.
    pub fn validate(&self) -> Result<()> {
        if self.format != PLACEMENT_FORMAT {
            bail!("format is {:?}, expected {PLACEMENT_FORMAT:?}", self.format);
        }
        check_sizes(self.num_experts, self.num_devices)?;
        if self.layers.is_empty() {
            bail!("the placement lists no layers");
        }
        let mut seen = std::collections::BTreeSet::new();
        for l in &self.layers {
            if !seen.insert(l.layer) {
                bail!("layer {} is listed twice", l.layer);
            }
            validate_map(&l.device_of_expert, self.num_experts, self.num_devices)
                .map_err(|e| Error::invalid(format!("layer {}: {e}", l.layer)))?;
        }
        Ok(())
    }

    /// Reads and validates a placement file.
    pub fn read(path: &Path) -> Result<Placement> {
        let text = crate::input::read_text(path)?;
        let p: Placement = serde_json::from_str(&text)
            .map_err(|e| Error::bad_file(path, format!("not a valid placement file: {e}")))?;
        p.validate()
            .map_err(|e| Error::bad_file(path, e.to_string()))?;
        Ok(p)
    }

    /// Writes the placement as JSON, atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        self.validate()?;
        write_json_atomic(path, self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_is_balanced_and_in_order() {
        assert_eq!(contiguous(8, 4), vec![0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!(contiguous(7, 3), vec![0, 0, 0, 1, 1, 2, 2]);
        for e in 1..30 {
            for d in 1..=e {
                validate_map(&contiguous(e, d), e, d).unwrap();
            }
        }
    }

    #[test]
    fn invalid_maps_are_rejected_with_reasons() {
        let err = |m: &[u32], e, d| validate_map(m, e, d).unwrap_err().to_string();
        assert!(err(&[0, 0, 1], 4, 2).contains("3 entries"));
        assert!(err(&[0, 0, 0, 1], 4, 2).contains("unbalanced"));
        assert!(err(&[0, 0, 2, 1], 4, 2).contains("only 2 devices"));
        assert!(err(&[0, 1], 2, 3).contains("3 devices for 2 experts"));
        assert!(err(&[], 0, 1).contains("at least 1"));
    }
}
