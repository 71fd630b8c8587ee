//! The benchmarks, each comparing methods in one run on the same inputs, with exact counts
//! (rows and bytes across links, E[C_T]) beside times:
//!
//! - [`layer`]: one MoE layer on D ranks, every dispatch mode ([`layer_file`]: the layer
//!   written out for another engine);
//! - [`model`]: a model's prefill and decode, against another implementation ([`peers`]) on one
//!   device, or every EP mode on D ranks ([`model_ep`]);
//! - [`train`]: a fine-tuning step in every EP mode;
//! - [`suite`]: sweeps of those from `configs/bench/*.toml`;
//! - [`place`]: the placement methods on the same traces;
//! - [`routes`]: the same placements served by each engine's route (written, read back, counted
//!   under the engine's copy rule);
//! - [`kernels`]: the CPU linear kernels against candle's matmul;
//! - [`eval`]: scoring with and without context reuse;
//! - [`generate`]: the generative harness's batched generation against a plain batched decode.
//!
//! Shared: [`modes`] (each rank's run, the one aggregator into a run's summary, the table),
//! [`model_runs`] (a model benchmark's runs and how each is measured on the ranks),
//! [`timing`] (paired, alternating repeats of two implementations) and [`report`] (the one
//! JSON envelope).

pub mod eval;
pub mod generate;
pub mod kernels;
pub mod layer;
pub mod layer_file;
pub mod model;
pub mod model_ep;
pub mod model_runs;
pub mod modes;
pub mod peers;
pub mod place;
pub mod report;
pub mod routes;
pub mod suite;
pub mod timing;
pub mod train;
