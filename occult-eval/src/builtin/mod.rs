//! The built-in default model of `occult reproduce`: a small MoE with OLMoE's routing shape
//! (64 experts, top-8), pre-trained from scratch by occult-train on text the project generates
//! about four domains, with calibration text, Alpaca-format instructions and one
//! multiple-choice task per domain. Built on first use and cached.
//!
//! [`world`] is the closed world the text talks about, [`data`] the text, instructions and task
//! items made of it, [`vocab`] the tokenizer's vocabulary, [`build`] the recipe, the cache and
//! the build itself, and [`committed`] the default recipe's trained weights as committed, with
//! what they were built from.

pub mod build;
pub mod committed;
pub mod data;
pub mod vocab;
pub mod world;

pub use build::{default_dir, dir_for, ensure, ensure_cached, Builtin, BuiltinRecipe, Provenance};
