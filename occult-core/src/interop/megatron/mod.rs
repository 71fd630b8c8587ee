//! Megatron-Core: its routing trace (`--moe-routing-trace-path`, one JSONL file per rank),
//! read as routing ([`router_trace`]). Megatron shards experts contiguously: a renumbered
//! checkpoint ([`super::checkpoint`]) serves a placement there.

pub mod router_trace;
