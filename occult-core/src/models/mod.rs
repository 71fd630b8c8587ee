//! Hugging Face MoE architectures. [`config`] reads `config.json` for every supported family;
//! the architectures themselves (one file each) build on it.

pub mod config;
