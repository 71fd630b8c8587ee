//! TensorRT-LLM: the static load-balancer YAML its WIDEEP backend reads ([`load_balancer`],
//! written from a placement and read back into one).

pub mod load_balancer;
