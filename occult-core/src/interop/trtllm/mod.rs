//! TensorRT-LLM: the static load-balancer YAML its WIDEEP backend reads ([`load_balancer`],
//! written from a placement and read back into one), and its expert-statistic dump
//! ([`statistic`], read as routing).

pub mod load_balancer;
pub mod statistic;
