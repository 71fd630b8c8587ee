#![no_main]
//! Fuzz target:  a checkpoint's `model.safetensors` (header and data) beside a good OLMoE
//! `config.json`; the checkpoint is opened and the model built from it.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = occult_fuzz::model_dir(b"");
    std::fs::write(dir.join("model.safetensors"), data).expect("scratch write");
    occult_fuzz::open_model(&dir);
});
