//! The Occult harness and the `occult` command line. The binary only parses arguments; each
//! command lives in [`commands`] as a function from parsed options to printed results.

pub mod bench_layer;
pub mod bench_model;
pub mod bench_model_ep;
pub mod bench_peer;
pub mod bench_suite;
pub mod bench_train;
pub mod builtin;
pub mod commands;
pub mod harness;
pub mod loglik;
pub mod progress;
pub mod reproduce;
pub mod table;
pub mod version;
