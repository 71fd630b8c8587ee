//! The host-side, tensor-free half of Occult: what routing does to traffic, and how to change it.
//!
//! | module | holds |
//! |---|---|
//! | [`routing`] | router rules: softmax/sigmoid scores, top-k, renormalisation, group limits |
//! | [`run_key`] | what a run is: the dispatch and MoE modes, a run's key and label, and the runs a benchmark makes |
//! | [`trace`] | routing traces on disk (`occult.trace.v1`) |
//! | [`synth`] | synthetic traces with latent expert clusters |
//! | [`ranks`] | which source rank each token of a trace belongs to |
//! | [`collab`] | co-activation matrices, C_T and E[C_T], row and byte counts per link |
//! | [`placement`] | expert -> device maps, their JSON file, and the placement methods |
//! | [`pruning`] | device-limited routing (router-score and similarity rules) |
//! | [`similarity`] | the expert-similarity tables the similarity rule reads |
//! | [`cost`] | the cost model: link profiles, two-level cluster traffic and E[C_N], projected layer and step times |
//! | [`drivers`] | the per-layer functions applied to every layer of a trace, with and without replicas |
//!
//! Nothing here touches a tensor: the functions take ids, logits and maps as plain slices, so
//! they are cheap, deterministic and tested by properties over random routings.

pub mod collab;
pub mod cost;
pub mod drivers;
pub mod placement;
pub mod pruning;
pub mod ranks;
pub mod routing;
pub mod run_key;
pub mod similarity;
pub mod synth;
pub mod trace;

pub use cost::cluster::{trace_node_stats, TraceNodeStats};
pub use drivers::whole_trace::{
    check_placement_fits, check_router_matches, layer_similarity, place_steps_per_layer,
    place_trace, place_trace_groups, place_trace_shared, prune_trace, prune_trace_to, source_split,
    trace_stats, PlaceInfo, PruneLayer, PruneReport, TraceStats,
};
pub use placement::{Method, Placement};
pub use pruning::{PruneLimit, PruneRule, Pruner};
pub use routing::RouterRule;
pub use run_key::{DispatchMode, MoeMode, RunKey};
pub use trace::Trace;
