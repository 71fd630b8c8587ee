//! The implementations `occult bench model --against` compares ours with, on the same weights,
//! prompt, dtype and threads:
//!
//! - [`candle_transformers`]: candle-transformers' own models, in this process;
//! - [`process`]: Hugging Face transformers and llama.cpp, each in a Python process beside this
//!   one (`scripts/bench_transformers.py`, `scripts/bench_llama_cpp.py`), speaking one line
//!   protocol, with the CPU level each one's kernels ran at.

pub mod candle_transformers;
pub mod process;
