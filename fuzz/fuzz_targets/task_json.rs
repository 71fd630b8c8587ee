#![no_main]
//! Fuzz target:  an evaluation task's data as a .json file (`--data arc_easy=FILE`), prepared
//! 1-shot as `occult eval` would.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| occult_fuzz::prepare_task_data("test.json", data));
