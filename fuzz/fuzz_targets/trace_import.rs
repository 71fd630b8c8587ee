#![no_main]
//! Fuzz target: routing arrays from other frameworks (`occult trace import`): the first byte
//! picks the format (.npz, .npy, .safetensors, SGLang's .pt dump), the rest is the file.
use libfuzzer_sys::fuzz_target;
use occult_core::interop::routing_import::{import, ImportOptions};

fuzz_target!(|data: &[u8]| {
    let Some((&pick, file)) = data.split_first() else {
        return;
    };
    let ext = ["npz", "npy", "safetensors", "pt"][pick as usize % 4];
    let path = occult_fuzz::put(&format!("routing.{ext}"), file);
    let opts = ImportOptions {
        num_experts: 1 + pick as usize % 64,
        ..Default::default()
    };
    let _ = import(&path, &opts);
});
