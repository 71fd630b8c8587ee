//! The host-side, tensor-free half of Occult: what routing does to traffic, and how to change it.
//!
//! | module | holds |
//! |---|---|
//! | [`routing`] | router rules: softmax/sigmoid scores, top-k, renormalisation, group limits |
//! | [`trace`] | routing traces on disk (`occult.trace.v1`) |
//! | [`synth`] | synthetic traces with latent expert clusters |
//! | [`ranks`] | which source rank each token of a trace belongs to |
//! | [`collab`] | co-activation matrices, C_T and E[C_T], row and byte counts per link |
//! | [`links`] | link profiles (a machine's devices and links), and a measured step's projection onto them |
//! | [`cluster`] | two-level (intra- and inter-node) dispatch traffic and its projected time |
//! | [`placement`] | expert -> device maps, their JSON file, and the placement methods |
//! | [`pruning`] | device-limited routing (router-score and similarity rules) |
//! | [`similarity`] | the expert-similarity tables the similarity rule reads |
//! | [`projection`] | layer and training-step times projected for D devices on a machine |
//! | [`whole_trace`] | drivers that apply the per-layer functions to every layer of a trace |
//! | [`replica_trace`] | the same for placements with replicas: adding them, and counting under a copy rule |
//! | [`replica_projection`] | one placement's projected layer time on a machine, copies chosen by a rule |
//!
//! Nothing here touches a tensor: the functions take ids, logits and maps as plain slices, so
//! they are cheap, deterministic and tested by properties over random routings.

pub mod cluster;
pub mod collab;
pub mod links;
pub mod placement;
pub mod projection;
pub mod pruning;
pub mod ranks;
pub mod replica_projection;
pub mod replica_trace;
pub mod routing;
pub mod sglang_dump;
pub mod similarity;
pub mod synth;
pub mod trace;
pub mod trace_import;
pub mod whole_trace;

pub use placement::{Method, Placement};
pub use pruning::{PruneLimit, PruneRule, Pruner};
pub use routing::RouterRule;
pub use trace::Trace;
pub use whole_trace::{
    check_placement_fits, check_router_matches, layer_similarity, place_steps_per_layer,
    place_trace, prune_trace, prune_trace_to, source_split, trace_node_stats, trace_stats,
    PlaceInfo, PruneLayer, PruneReport, TraceNodeStats, TraceStats,
};
