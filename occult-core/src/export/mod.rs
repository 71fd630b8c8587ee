//! Placements that travel to other engines: a checkpoint whose experts are renumbered so that
//! an engine's contiguous expert sharding realises an Occult placement ([`checkpoint`], with the
//! renumbering itself in [`renumbering`]), and SGLang's expert-location file ([`sglang`]).

pub mod checkpoint;
pub mod renumbering;
pub mod sglang;

pub use checkpoint::{export_checkpoint, ExpertLayout, ExportSummary};
pub use renumbering::{
    ExpertGroups, LayerRenumbering, Renumbering, RENUMBERING_FILE, RENUMBERING_FORMAT,
};
