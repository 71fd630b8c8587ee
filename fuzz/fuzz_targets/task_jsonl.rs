#![no_main]
//! Fuzz target:  an evaluation task's data as a .jsonl file (`--data arc_easy=FILE`), prepared
//! 1-shot as `occult eval` would.
use libfuzzer_sys::fuzz_target;
use occult_eval::harness::evaluate::{prepare, PrepareOptions};

fuzz_target!(|data: &[u8]| {
    let path = occult_fuzz::put("test.jsonl", data);
    let opts = PrepareOptions {
        data: [("arc_easy".to_string(), path)].into(),
        samples: false,
        num_fewshot: Some(1),
        limit: None,
        seed: 1234,
    };
    let _ = prepare("arc_easy", &opts);
});
