#![no_main]
//! Fuzz target:  an evaluation task file (TOML). Where it names a task with built-in samples,
//! its items are prepared from them, 1-shot, as `occult eval` would.
use libfuzzer_sys::fuzz_target;
use occult_eval::harness::evaluate::{prepare, PrepareOptions};
use occult_eval::harness::task::TaskSpec;

fuzz_target!(|data: &[u8]| {
    let path = occult_fuzz::put("task.toml", data);
    let entry = path.display().to_string();
    let mut opts = PrepareOptions {
        data: Default::default(),
        samples: false,
        num_fewshot: Some(1),
        limit: None,
        seed: 1234,
    };
    if let Ok(spec) = TaskSpec::read(&path) {
        let samples = occult_fuzz::fixtures().join("../../tasks/samples").join(&spec.name);
        if spec.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && samples.is_dir() {
            opts.data.insert(entry.clone(), samples);
        }
    }
    let _ = prepare(&entry, &opts);
});
