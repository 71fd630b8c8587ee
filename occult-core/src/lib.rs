//! Occult: collaboration-aware expert parallelism for mixture-of-experts models, on candle.
//!
//! The crate has three parts; data flows from the first to the last.
//!
//! - [`analysis`]: host-side and tensor-free. Router rules, routing traces, co-activation and
//!   E[C_T], expert placement, collaboration pruning, link profiles and projected times. Behind
//!   `occult collab`, `place`, `prune`, `project`.
//! - [`ep`]: expert parallelism on tensors. Dispatch plans, communicators (threads, MPI), the
//!   differentiable row exchange, grouped expert compute, the EP MoE layer in named stages
//!   (route, plan, dispatch, compute, combine) and its single-device oracle.
//! - [`models`]: Hugging Face MoE checkpoints. Resolving and reading them (`checkpoint`,
//!   `weights`), one file per family with its own rules, the shared decoder whose MoE blocks run
//!   the reference or the EP layer, tokenizers and synthetic checkpoints.
//!
//! Beside them: [`kernels`] (`x · wᵀ` on AVX2, AVX-512 and AMX, with a portable path), [`atomic`] (files
//! written whole or not at all), [`input`] (reading untrusted files), [`records`] (dataset
//! records from the hub's file formats, for evaluation and fine-tuning) and the crate's one
//! [`Error`].
//!
//! # Notation
//!
//! Shapes in brackets and names in code follow one vocabulary:
//!
//! ```text
//! T     tokens on this rank (rows of x)            H     hidden size
//! E     routed experts of a layer                  k     experts per token (top-k)
//! I     one expert's intermediate size             D     ranks (devices) in the EP group
//! C_T   for one token, the distinct ranks holding  E[C_T] its mean over tokens
//!       its experts
//! rank  a device: a thread, an MPI process or a GPU
//! slot  an expert's index among its rank's local experts (ascending global id)
//! kpos  an expert's position in its token's top-k (where its gate weight sits)
//! row   what one dispatch sends: standard, one per (token, expert); Occult, one per
//!       (token, rank), carrying that rank's slots and the token's k gate weights
//! pair  one (received row, local expert) unit of expert compute
//! ```

pub mod analysis;
pub mod atomic;
pub mod ep;
mod error;
pub mod fault;
pub mod input;
pub mod kernels;
pub mod models;
pub mod records;
#[cfg(test)]
mod test_util;

pub use error::{Error, Result};
