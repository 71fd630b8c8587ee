#![doc = include_str!("../README.md")]

pub mod analysis;
pub mod atomic;
pub mod ep;
mod error;
pub mod fault;
pub mod input;
pub mod interop;
pub mod kernels;
pub mod models;
pub mod pyrandom;
pub mod records;
#[cfg(test)]
mod test_util;

pub use error::{Error, Result};
