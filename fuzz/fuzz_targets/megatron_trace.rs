#![no_main]
//! Fuzz target: Megatron-Core's router trace (`router_trace_rank{R}.jsonl`) as `occult trace
//! import` reads it: the records parsed, joined by layer, then checked as a trace.
use libfuzzer_sys::fuzz_target;
use occult_core::interop::routing_import::{import, ImportOptions};

fuzz_target!(|data: &[u8]| {
    let path = occult_fuzz::put("router_trace_rank0.jsonl", data);
    let opts = ImportOptions {
        num_experts: 16,
        ..Default::default()
    };
    let _ = import(&path, &opts);
});
