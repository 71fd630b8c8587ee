//! The decoder shared by every family: embeddings, pre-norm attention and MLP blocks, the
//! final norm and the LM head, giving logits at every position. MLP blocks are dense SwiGLU or
//! MoE; MoE blocks run the single-device reference or the expert-parallel layer
//! ([`crate::ep::EpMoe`]) in either dispatch mode, with optional collaboration pruning.
//!
//! Under expert parallelism each rank runs its own sequences through the whole model (data +
//! expert parallel): it holds the dense weights and only its own experts, and only
//! the MoE blocks talk to other ranks. Every path is differentiable. Forwards are collective;
//! [`super::data_parallel`] keeps ranks with different amounts of work in step and reduces
//! gradients.
//!
//! | module | holds |
//! |---|---|
//! | `decoder` | [`Model`] and its layers, and the state its forwards keep |
//! | `dense` | [`DenseParts`], what every rank holds in full, read from a checkpoint |
//! | `moe` | [`MoeSetup`], how MoE blocks compute, and [`MoeExec`], what each runs |
//! | `assemble` | [`Model::assemble`]: one rank's model from its dense parts and experts |
//! | `same_layout` | the check that every rank assembles the same model, and [`fingerprint`] |
//! | `params` | the model's tensors by checkpoint name, tagged as routed experts or not |
//! | `copies` | replicated experts in training: their copies' gradients summed, counted once |
//! | `forward` | [`Model::forward`]: ids to [`Logits`] through every layer |
//! | `ragged` | [`Model::forward_ragged`]: one step of sequences of their own lengths and caches |
//! | `cache` | [`KvCache`], the key/value caches of all layers |
//! | `recorder` | [`RoutingRecorder`] and [`RouterTap`], routing recorded by forwards |
//!
//! Lockstep with peers, gradient reduction and gathering results are
//! [`super::data_parallel`]'s.

mod assemble;
mod cache;
mod copies;
mod decoder;
mod dense;
mod forward;
mod moe;
mod params;
mod ragged;
mod recorder;
mod same_layout;

pub use cache::KvCache;
pub use decoder::{Layer, Mlp, Model};
pub use dense::{layer_routers, selection_bias, DenseLayer, DenseMlp, DenseParts};
pub use forward::Logits;
pub use moe::{MoeBlock, MoeExec, MoeSetup};
pub use recorder::{LayerRouting, RouterTap, RoutingRecorder};
pub use same_layout::fingerprint;
