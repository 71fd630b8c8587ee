#![no_main]
//! Fuzz target:  a sharded checkpoint's `model.safetensors.index.json`, beside a good OLMoE
//! `config.json` and one shard (`model-00001-of-00001.safetensors`).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = occult_fuzz::model_dir(b"");
    let single = dir.join("model.safetensors");
    if single.exists() {
        std::fs::rename(&single, dir.join("model-00001-of-00001.safetensors")).expect("rename");
    }
    std::fs::write(dir.join("model.safetensors.index.json"), data).expect("scratch write");
    occult_fuzz::open_model(&dir);
});
