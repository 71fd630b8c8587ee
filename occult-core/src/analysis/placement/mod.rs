//! Expert placements: which device holds each expert, per layer; their validation, their JSON
//! file (format `occult.placement.v1`, or `v2` where a layer has replicas: its `slots`, E + R
//! physical slots in device order, the same number on each device, instead of
//! `device_of_expert`) and the placement methods ([`Method::place`] runs one on a layer's
//! routing; [`replica_search`], [`eplb`] and [`cooccurrence`] (TensorRT-LLM's) add replicas,
//! [`replicas`] holds a layer's replicated slots and the copy rules that pick a copy for each
//! token, and [`sglang_dispatch`] builds SGLang's static dispatch table as SGLang does;
//! [`groups`] keeps a group-limited model's expert groups whole).
//!
//! A valid map is *balanced*: every device holds `floor(E/D)` or `ceil(E/D)` experts, so there
//! are never more devices than experts.

mod config;
pub mod cooccurrence;
pub mod eplb;
mod greedy;
pub mod groups;
mod maps;
mod nodes;
pub mod replica_search;
pub mod replicas;
mod search;
pub mod sglang_dispatch;
mod torch_sort;

pub use config::{NodeLevel, SearchConfig};
pub use greedy::greedy;
pub use maps::{
    capacities, check_sizes, contiguous, experts_by_device, random_balanced, validate_map,
};
pub use nodes::{
    devices_and_nodes, node_progress_steps, node_search, two_level_cost, NodeOutcome,
    DEFAULT_INTER_WEIGHT,
};
pub use search::{
    progress_steps, random_balanced_within, search, search_with_progress, search_within_groups,
    SearchOutcome,
};

use crate::analysis::collab::CoActivation;
use crate::atomic::write_json_atomic;
use crate::{bail, Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The value of the `format` key of a placement file.
pub const PLACEMENT_FORMAT: &str = "occult.placement.v1";

/// The format of a placement file whose layers may have replicas (a v1 file reads as v2).
pub const PLACEMENT_FORMAT_V2: &str = "occult.placement.v2";

impl LayerPlacement {
    /// A layer placed as a partition: `map[e]` is expert e's device, nothing else recorded.
    pub fn partition(layer: usize, map: Vec<u32>) -> Self {
        LayerPlacement {
            layer,
            device_of_expert: map,
            metrics: None,
            slots: None,
            expert_load: None,
        }
    }
}

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
    /// DeepSeek's EPLB ([`eplb`]): load only, from each expert's token count (its global
    /// policy; without replicas, a balanced packing of the experts).
    Eplb,
    /// TensorRT-LLM's co-occurrence placement ([`cooccurrence`]): its replication by load,
    /// then ranks grown from their heaviest expert by co-occurrence (alpha 0.8).
    #[cfg_attr(feature = "clap", value(name = "trtllm-cooccurrence"))]
    #[serde(rename = "trtllm-cooccurrence")]
    Cooccurrence,
}

impl Method {
    /// Every method, in the order benchmarks compare them.
    pub const ALL: [Method; 3] = [Method::Contiguous, Method::Greedy, Method::Occult];

    pub fn name(self) -> &'static str {
        match self {
            Method::Contiguous => "contiguous",
            Method::Greedy => "greedy",
            Method::Occult => "occult",
            Method::Eplb => "eplb",
            Method::Cooccurrence => "trtllm-cooccurrence",
        }
    }

    /// Progress steps [`Method::place`] reports for one layer: the search's [`progress_steps`]
    /// for [`Method::Occult`], one for the others.
    pub fn progress_steps(self, cfg: &SearchConfig) -> usize {
        match self {
            Method::Occult if cfg.nodes.is_some() => node_progress_steps(cfg),
            Method::Occult => progress_steps(cfg),
            Method::Contiguous | Method::Greedy | Method::Eplb | Method::Cooccurrence => 1,
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
            Method::Eplb => {
                let m = eplb::eplb_map(ids, num_experts, num_devices, 0, 1, 1)?;
                let per = m.slots_per_device();
                let mut map = vec![0u32; num_experts];
                for (p, &e) in m.slot_expert.iter().enumerate() {
                    map[e as usize] = (p / per) as u32;
                }
                map
            }
            Method::Cooccurrence => {
                let m = cooccurrence::cooccurrence_map(ids, top_k, num_experts, num_devices, 0)?;
                let per = m.slots_per_device();
                let mut map = vec![0u32; num_experts];
                for (p, &e) in m.slot_expert.iter().enumerate() {
                    map[e as usize] = (p / per) as u32;
                }
                map
            }
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

/// One layer's expert -> device map, or (v2) its replicated slots.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerPlacement {
    pub layer: usize,
    /// The device of each expert; empty in a layer with `slots`.
    pub device_of_expert: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<PlacementMetrics>,
    /// v2, a layer with replicas: the expert in each of the E + R physical slots, device 0's
    /// first (slot p on device `p / ((E + R) / D)`), as SGLang's `physical_to_logical_map`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<Vec<u32>>,
    /// v2, a layer with replicas: each expert's load (token count) on the trace it was placed
    /// from, which orders the cover rule's ties between devices. Stored so that the analysis,
    /// the dispatch plans and an engine reading the file pick the same copies; absent: all
    /// equal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_load: Option<Vec<f64>>,
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
                    slots: None,
                    expert_load: None,
                })
                .collect(),
        }
    }

    /// The entry of the model's layer `layer`.
    fn entry(&self, layer: usize) -> Result<&LayerPlacement> {
        self.layers
            .iter()
            .find(|l| l.layer == layer)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "the placement has no entry for layer {layer} (it covers layers {:?})",
                    self.layers.iter().map(|l| l.layer).collect::<Vec<_>>()
                ))
            })
    }

    /// The map of the model's layer `layer`; refused, with the reason, for a layer with
    /// replicas (the commands that run them read [`Placement::replica_map`]).
    pub fn layer(&self, layer: usize) -> Result<&[u32]> {
        let l = self.entry(layer)?;
        if l.slots.is_some() {
            bail!(
                "layer {layer} of the placement has replicas ({} slots for {} experts); this \
                 command runs placements without replicas so far: place without --replicas",
                l.slots.as_ref().map_or(0, Vec::len),
                self.num_experts
            );
        }
        Ok(&l.device_of_expert)
    }

    /// Checks that the placement has an entry for the model's layer `layer` (with or without
    /// replicas).
    pub fn covers(&self, layer: usize) -> Result<()> {
        self.entry(layer).map(|_| ())
    }

    /// Whether any layer has replicas.
    pub fn has_replicas(&self) -> bool {
        self.layers.iter().any(|l| l.slots.is_some())
    }

    /// The model's layer `layer` as a replica map (a partition is one slot per expert), its
    /// stored expert loads ordering the cover rule's ties, and, for `rule` SGLang's, SGLang's
    /// table built as SGLang builds it from this file on one node ([`Placement::replica_maps`]):
    /// the copies a token uses are a function of the file alone. To read several layers, call
    /// [`Placement::replica_maps`] once.
    pub fn replica_map(
        &self,
        layer: usize,
        rule: replicas::CopyRule,
    ) -> Result<replicas::ReplicaMap> {
        self.entry(layer)?;
        let maps = self.replica_maps(rule, None)?;
        let at = self
            .sorted_layers()
            .iter()
            .position(|l| l.layer == layer)
            .expect("listed");
        Ok(maps.into_iter().nth(at).expect("one map per layer"))
    }

    /// The layers in ascending order.
    fn sorted_layers(&self) -> Vec<&LayerPlacement> {
        let mut layers: Vec<&LayerPlacement> = self.layers.iter().collect();
        layers.sort_by_key(|l| l.layer);
        layers
    }

    /// Every layer as a replica map, in ascending layer order; for `rule` SGLang's, its tables
    /// chained as SGLang chains them ([`sglang_dispatch`]): the hidden layers the file does not
    /// list (dense ones) are fed as SGLang's own rows for them (slot p holds expert p % E), as
    /// the export writes them. `gpus_per_node`: SGLang's `ep_size / nnodes` over several nodes.
    pub fn replica_maps(
        &self,
        rule: replicas::CopyRule,
        gpus_per_node: Option<usize>,
    ) -> Result<Vec<replicas::ReplicaMap>> {
        let mut state = sglang_dispatch::SglangState::start(self.num_devices, gpus_per_node);
        let mut next = 0;
        let mut out = Vec::with_capacity(self.layers.len());
        for l in self.sorted_layers() {
            let mut map = match &l.slots {
                Some(slots) => replicas::ReplicaMap::new(
                    slots.clone(),
                    self.num_experts,
                    self.num_devices,
                    l.expert_load.as_deref(),
                )
                .map_err(|err| {
                    Error::invalid(format!("layer {} of the placement: {err}", l.layer))
                })?,
                None => {
                    replicas::ReplicaMap::from_partition(&l.device_of_expert, self.num_devices)?
                }
            };
            if rule == replicas::CopyRule::Sglang {
                let width = map.slot_expert.len();
                feed_dense_rows(&mut state, next..l.layer, width, self.num_experts);
                map.set_sglang_state(&mut state);
            }
            next = l.layer + 1;
            out.push(map);
        }
        Ok(out)
    }

    /// Checks the format tag, the sizes and every layer's map.
    pub fn validate(&self) -> Result<()> {
        if self.format != PLACEMENT_FORMAT && self.format != PLACEMENT_FORMAT_V2 {
            bail!(
                "format is {:?}, expected {PLACEMENT_FORMAT:?} or {PLACEMENT_FORMAT_V2:?}",
                self.format
            );
        }
        if self.has_replicas() && self.format != PLACEMENT_FORMAT_V2 {
            bail!("layers with replicas (slots) need format {PLACEMENT_FORMAT_V2:?}");
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
            let checked = match &l.slots {
                Some(_) if !l.device_of_expert.is_empty() => Err(Error::invalid(
                    "a layer with slots has an empty device_of_expert".to_string(),
                )),
                Some(slots) => replicas::ReplicaMap::new(
                    slots.clone(),
                    self.num_experts,
                    self.num_devices,
                    l.expert_load.as_deref(),
                )
                .map(|_| ()),
                None if l.expert_load.is_some() => Err(Error::invalid(
                    "expert_load is given for a layer without slots (it orders the copy \
                     rule's ties among replicas)"
                        .to_string(),
                )),
                None => validate_map(&l.device_of_expert, self.num_experts, self.num_devices),
            };
            checked.map_err(|e| Error::invalid(format!("layer {}: {e}", l.layer)))?;
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

/// Feeds SGLang's generators the rows of the dense hidden layers `layers` (slot p holds expert
/// p % E, `width` slots), as SGLang sees them in a file written for the model.
pub fn feed_dense_rows(
    state: &mut sglang_dispatch::SglangState,
    layers: std::ops::Range<usize>,
    width: usize,
    num_experts: usize,
) {
    let row: Vec<u32> = (0..width).map(|p| (p % num_experts) as u32).collect();
    for _ in layers {
        state.next_layer(&row, num_experts);
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

    /// A v2 file with a replicated layer round-trips; its layer is refused by readers of
    /// partitions with the reason, and read as a replica map; a v1 tag with slots, slots that
    /// leave an expert out, or both forms in one layer are refused.
    #[test]
    fn replicated_layers_read_back_and_are_refused_where_not_run() {
        let mut p = Placement::uniform(&[0, 1], vec![0, 0, 1, 1], 2, "occult");
        p.format = PLACEMENT_FORMAT_V2.into();
        p.layers[1].device_of_expert.clear();
        p.layers[1].slots = Some(vec![0, 1, 2, 2, 3, 0]);
        p.validate().unwrap();
        let back: Placement = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert_eq!(p.layer(0).unwrap(), &[0, 0, 1, 1]);
        let e = p.layer(1).unwrap_err().to_string();
        assert!(e.contains("has replicas (6 slots for 4 experts)"), "{e}");
        let cover = replicas::CopyRule::Cover;
        assert_eq!(p.replica_map(1, cover).unwrap().devices_of(0), &[0, 1]);
        assert_eq!(p.replica_map(0, cover).unwrap().slots_per_device(), 2);
        let mut bad = p.clone();
        bad.format = PLACEMENT_FORMAT.into();
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("need format"));
        let mut bad = p.clone();
        bad.layers[1].slots = Some(vec![0, 1, 2, 2, 0, 1]);
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("expert 3 has no slot"));
        let mut bad = p.clone();
        bad.layers[1].device_of_expert = vec![0, 0, 1, 1];
        assert!(bad.validate().is_err());
    }

    /// Under SGLang's rule each layer's table is the one SGLang builds after the layers before
    /// it, the unlisted (dense) layer fed as SGLang's own row, as the export writes the file.
    #[test]
    fn sglang_tables_chain_over_the_files_layers() {
        let rows = [[0u32, 1, 2, 3, 0, 1], [2, 0, 1, 3, 2, 1]];
        let mut p = Placement::uniform(&[1, 2], vec![0, 0, 1, 1, 2, 2], 3, "t");
        p.num_experts = 4;
        p.format = PLACEMENT_FORMAT_V2.into();
        for (l, row) in p.layers.iter_mut().zip(rows) {
            l.device_of_expert.clear();
            l.slots = Some(row.to_vec());
        }
        p.validate().unwrap();
        let maps = p.replica_maps(replicas::CopyRule::Sglang, None).unwrap();
        let mut st = sglang_dispatch::SglangState::start(3, None);
        st.next_layer(&[0, 1, 2, 3, 0, 1], 4); // layer 0: SGLang's own row for 6 slots
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for (map, row) in maps.iter().zip(rows) {
            let table = st.next_layer(&row, 4);
            for source in 0..3u32 {
                for e in 0..4u32 {
                    map.choose(&[e], source, replicas::CopyRule::Sglang, &mut got);
                    want.push(table[source as usize * 4 + e as usize] / 2);
                    assert_eq!(got[0], *want.last().unwrap(), "source {source} expert {e}");
                }
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
