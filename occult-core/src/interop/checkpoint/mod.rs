//! The renumbered checkpoint: a Hugging Face checkpoint whose experts are renumbered so that an
//! engine's contiguous expert sharding (vLLM's `linear`, Megatron-Core, DeepSpeed) realises an
//! Occult placement ([`export`]), and the renumbering itself, with its sidecar file and the
//! mapping of traces recorded on the export back to the original ids ([`renumbering`]).

pub mod export;
pub mod renumbering;

pub use export::{export_checkpoint, ExpertLayout, ExportSummary};
pub use renumbering::{
    ExpertGroups, LayerRenumbering, Renumbering, RENUMBERING_FILE, RENUMBERING_FORMAT,
};
