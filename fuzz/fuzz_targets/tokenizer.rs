#![no_main]
//! Fuzz target:  a checkpoint's `tokenizer.json` beside a good OLMoE checkpoint; the tokenizer
//! encodes and decodes a sentence when it loads.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = occult_fuzz::model_dir(b"");
    std::fs::write(dir.join("tokenizer.json"), data).expect("scratch write");
    occult_fuzz::open_model(&dir);
});
