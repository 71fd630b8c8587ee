#![doc = include_str!("../README.md")]

pub mod aux_loss;
pub mod batches;
pub mod dataset;
mod error;
pub mod examples;
pub mod grad_norm;
pub mod heldout;
pub mod log;
pub mod optim;
pub mod run;
pub mod save;
pub mod schedule;
pub mod step;

pub use error::{Error, Result};
