//! Occult core: the exact, tensor-free analysis of expert-parallel MoE routing.
//!
//! - [`routing`]: router rules (softmax/sigmoid, top-k, renormalisation, group limits);
//! - [`trace`]: routing traces on disk; [`synth`]: synthetic traces;
//! - [`collab`]: co-activation, C_T, E[C_T], row counts; [`ranks`]: source ranks of tokens;
//! - [`placement`]: expert -> device maps and the placement methods;
//! - [`pruning`] and [`similarity`]: collaboration pruning to at most N devices per token.

pub mod analysis;
pub mod atomic;
pub mod checkpoint;
pub mod collab;
pub mod comm;
pub mod cost;
pub mod dispatch;
mod error;
pub mod exchange;
pub mod experts;
pub mod models;
pub mod moe;
pub mod placement;
pub mod pruning;
pub mod ranks;
pub mod routing;
pub mod similarity;
pub mod synth;
pub mod trace;
pub mod weights;

pub use error::{Error, Result};
