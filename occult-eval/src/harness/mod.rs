//! The evaluation harness: lm-evaluation-harness-compatible multiple-choice scoring.
//!
//! - [`task`]: task files (`tasks/*.toml`) and the items they make of documents;
//! - [`template`] and [`preprocess`]: prompts, and the per-task document rules;
//! - [`data`]: documents from JSONL/JSON files or folders, and the built-in samples;
//! - [`scorer`]: log-likelihoods of the requests, with or without context reuse;
//! - [`metrics`]: `acc`, `acc_norm`, standard errors, pooled groups.

pub mod data;
pub mod metrics;
pub mod preprocess;
pub mod scorer;
pub mod task;
pub mod template;
