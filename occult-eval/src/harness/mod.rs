//! The evaluation harness: lm-evaluation-harness-compatible multiple-choice scoring and
//! generative (`generate_until`) tasks.
//!
//! - [`task`]: task files (`tasks/*.toml`), the items they make of documents, and the
//!   metrics they report (each metric's name and JSON key);
//! - [`template`] and [`preprocess`]: prompts, and the per-task document rules;
//! - [`pyrandom`]: CPython's `random.Random` bit for bit (in occult-core, which SGLang's
//!   dispatch table also needs), so that few-shot examples are drawn as the harness draws them;
//! - [`data`]: documents from JSONL/JSON files or folders, and the built-in samples;
//! - [`loglik`]: one request's log-likelihood by the harness's rule (tokenising the context
//!   and continuation, the input window, the score and `is_greedy`);
//! - [`scorer`]: log-likelihoods of the requests, with or without context reuse;
//! - [`evaluate`]: the steps of a task's evaluation: its items prepared, then scored;
//! - [`extract`]: what the harness does with a generated answer (`generate_until` tasks such
//!   as GSM8K): the cut at stop strings, the filters, `exact_match` and its standard error;
//! - [`gen_task`]: generative task files and the requests they make (contexts, the tokens fed);
//! - [`generate_until`]: greedy generation until a stop string, as the harness's HF backend,
//!   one request at a time or continuously batched;
//! - [`gen_eval`]: a generative task's items prepared, encoded and generated on D ranks;
//! - [`gen_results`]: a generative task's answers filtered and scored, its results JSON and
//!   samples lines;
//! - [`metrics`]: `acc`, `acc_norm` of an item, means with standard errors, pooled groups;
//! - [`paired`]: two models' difference on the same items, with a paired bootstrap interval;
//! - [`results`]: a task's aggregation: per task, group and category, as the results JSON
//!   and the samples lines, and a task's outcome of either kind.

pub mod data;
pub mod evaluate;
pub mod extract;
pub mod gen_eval;
pub mod gen_results;
pub mod gen_task;
pub mod generate_until;
pub mod loglik;
pub mod metrics;
pub mod paired;
pub mod preprocess;
pub use occult_core::pyrandom;
pub mod results;
pub mod scorer;
pub mod task;
pub mod template;
