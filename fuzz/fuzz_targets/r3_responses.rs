#![no_main]
//! Fuzz target: the routed experts vLLM and SGLang return with completions, as `occult trace
//! import responses.json --model M` reads them (base64 `.npy`, base64 int32, nested lists; one
//! response, a list, or one a line), for a model of 4 hidden layers (MoE layers 1 to 3), top-2.
use libfuzzer_sys::fuzz_target;
use occult_core::interop::r3::ModelLayers;
use occult_core::interop::routing_import::{import, ImportOptions};

fuzz_target!(|data: &[u8]| {
    let path = occult_fuzz::put("responses.json", data);
    let opts = ImportOptions {
        num_experts: 8,
        layers: Some(ModelLayers {
            num_layers: 4,
            moe_layers: vec![1, 2, 3],
            top_k: 2,
        }),
        ..Default::default()
    };
    let _ = import(&path, &opts);
});
