#![no_main]
//! Fuzz target:  an evaluation task file (TOML), multiple-choice or generative. Where it names
//! a task with built-in samples, its items are prepared from them, 1-shot, as `occult eval`
//! would.
use libfuzzer_sys::fuzz_target;
use occult_eval::harness::evaluate::{prepare_any, PrepareOptions, TaskFile};

fuzz_target!(|data: &[u8]| {
    let path = occult_fuzz::put("task.toml", data);
    let entry = path.display().to_string();
    let mut opts = PrepareOptions {
        data: Default::default(),
        samples: false,
        num_fewshot: Some(1),
        limit: None,
        seed: 1234,
        max_gen_toks: None,
    };
    let text = String::from_utf8_lossy(data);
    if let Ok(spec) = TaskFile::parse(&text, &entry) {
        let name = spec.name();
        let samples = occult_fuzz::fixtures().join("../../tasks/samples").join(name);
        if name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && samples.is_dir() {
            opts.data.insert(entry.clone(), samples);
        }
    }
    let _ = prepare_any(&entry, &opts);
});
