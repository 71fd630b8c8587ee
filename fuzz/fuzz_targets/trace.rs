#![no_main]
//! Fuzz target:  a routing trace (`occult profile`'s safetensors file), read as every command reads one.
use libfuzzer_sys::fuzz_target;
use occult_core::analysis::trace::Trace;

fuzz_target!(|data: &[u8]| {
    let _ = Trace::read(&occult_fuzz::put("trace.safetensors", data));
});
