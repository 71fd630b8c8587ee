//! Typed entry points: each takes values (a model's [`ModelSpec`](crate::context::ModelSpec)
//! and a job, or a trace) and returns values, for the commands and the pipelines alike.
//!
//! - [`profile`]: calibration text through a model, its routing trace back;
//! - [`fine_tune`]: fine-tuning on a model's ranks, the model and its log written;
//! - [`generate`]: prompts continued, greedily or sampled;
//! - [`eval`]: tasks scored as lm-evaluation-harness scores them, the results back;
//! - [`project`]: layer and step times of each dispatch projected onto clusters.

pub mod eval;
pub mod fine_tune;
pub mod generate;
pub mod profile;
pub mod project;
