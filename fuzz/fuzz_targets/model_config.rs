#![no_main]
//! Fuzz target:  a model's `config.json` (any of the families Occult runs, chosen by the `model_type` the
//! input names), in a folder whose weights and tokenizer are good; the checkpoint is opened and
//! the model built from it.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = occult_fuzz::model_dir(data);
    std::fs::write(dir.join("config.json"), data).expect("scratch write");
    occult_fuzz::open_model(&dir);
});
