#![no_main]
//! Fuzz target:  fine-tuning data (JSONL records: text, or instruction and response), read and
//! cut into examples of 16 tokens with the fixture tokenizer, as `occult train` does.
use libfuzzer_sys::fuzz_target;
use occult_core::models::tokenizer::TextTokenizer;
use occult_train::dataset::{build, read_records};
use std::sync::OnceLock;

fuzz_target!(|data: &[u8]| {
    static TOK: OnceLock<TextTokenizer> = OnceLock::new();
    let tok = TOK.get_or_init(|| {
        TextTokenizer::read(&occult_fuzz::fixtures().join("models/tokenizer.json"), 304)
            .expect("the fixture tokenizer")
    });
    let path = occult_fuzz::put("train.jsonl", data);
    if let Ok(docs) = read_records(&path.display().to_string()) {
        let _ = build(&docs, tok, 16, true);
    }
});
