//! The Occult harness and the `occult` command line, in floors; each imports only from the
//! floors below it.
//!
//! 1. [`commands`]: one thin module per `occult` command (flags, progress, printing), each
//!    calling one entry point below.
//! 2. [`reproduce`] and [`builtin`]: the end-to-end recipe as named stages, and the built-in
//!    model; they call the entry points, never a command.
//! 3. [`bench`]: the benchmarks, each comparing methods in one run, and their peers.
//! 4. [`jobs`]: typed entry points that take values and return values: profile, fine-tune,
//!    evaluate, project.
//! 5. [`context`] (the loaded model: checkpoint, dtype, device, ranks, backend, MoE setup) and
//!    [`harness`] (lm-evaluation-harness's scoring, exactly).
//! 6. [`loglik`], [`output`], [`rows`], [`table`], [`progress`], [`version`]: the small parts
//!    every floor uses.

pub mod bench;
pub mod builtin;
pub mod commands;
pub mod context;
pub mod harness;
pub mod jobs;
pub mod loglik;
pub mod output;
pub mod progress;
pub mod reproduce;
pub mod rows;
pub mod table;
pub mod version;
