//! Other engines' files, both ways: what Occult writes for an engine to serve a placement, and
//! what it reads of the routing an engine recorded. One folder per engine or convention, each
//! holding both directions.
//!
//! | module | holds |
//! |---|---|
//! | [`arrays`] | arrays as frameworks write them (`.npy`, `.npz`, safetensors), read into plain values |
//! | [`routing_import`] | routing arrays (or an engine's dump) read into an `occult.trace.v1` trace |
//! | [`checkpoint`] | the renumbered checkpoint: contiguous expert sharding (vLLM, Megatron-Core, DeepSpeed) realises a placement |
//! | [`sglang`] | SGLang: its `--init-expert-location` file (written) and its per-token routing dump (read) |
//! | [`r3`] | the routed experts vLLM and SGLang return with a completion (read) |
//! | [`megatron`] | Megatron-Core: its routing trace (`router_trace_rank*.jsonl`, read) |
//! | [`trtllm`] | TensorRT-LLM: its WIDEEP static load-balancer YAML (written and read) |
//! | [`vllm`] | vLLM: the placement files of its open pull requests #49572 and #34811 (written and read) |
//! | [`slots`] | a placement as each layer's physical slots, the rows every engine's file holds |
//! | [`engine_placement`] | any engine's placement file read back, its format told by its content |
//! | [`routes`] | every route to an engine side by side: a placement written, read back, and its copy rule |
//!
//! A new engine's format goes in a folder of its own here (see the README's "Where a change
//! goes"); [`crate::analysis`] stays free of every engine and of candle.

pub mod arrays;
pub mod checkpoint;
pub mod engine_placement;
pub mod megatron;
pub mod r3;
pub mod routes;
pub mod routing_import;
pub mod sglang;
pub mod slots;
pub mod trtllm;
pub mod vllm;
