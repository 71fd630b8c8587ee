//! Occult fine-tuning: standard and collaboration-pruned fine-tuning of MoE models on the data +
//! expert parallel path (`occult_core::models::data_parallel`).
//!
//! What is here so far (the fine-tuning loop and its command build on these):
//! - [`optim`]: AdamW with decoupled weight decay, whose moments can be saved and restored so
//!   that a resumed run continues bit-identically;
//! - [`schedule`]: linear warm-up and cosine decay of the learning rate;
//! - [`grad_norm`]: the global gradient norm over all ranks, and clipping by it;
//! - [`examples`]: Alpaca instruction examples (loss on the response and EOS) and packed
//!   plain text;
//! - [`dataset`]: training data from files, folders or the Hugging Face cache (read with
//!   `occult_core::records`, which the evaluation harness shares), as examples;
//! - [`batches`]: the seeded order of examples, global batches and each rank's share;
//! - [`aux_loss`]: the model's load-balancing loss over the global batch's real tokens;
//! - [`step`]: one optimiser step on D ranks (masked loss over the global batch, backward,
//!   gradient reduction, clipping, AdamW);
//! - [`heldout`]: the mean loss of held-out examples under the model's routing, on D ranks;
//! - [`save`]: a fine-tuned model written in the source checkpoint's own layout;
//! - [`run`]: the loop, with periodic saves and exact resumption.

pub mod aux_loss;
pub mod batches;
pub mod dataset;
mod error;
pub mod examples;
pub mod grad_norm;
pub mod heldout;
pub mod optim;
pub mod run;
pub mod save;
pub mod schedule;
pub mod step;

pub use error::{Error, Result};
