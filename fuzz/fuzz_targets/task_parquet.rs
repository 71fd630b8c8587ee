#![no_main]
//! Fuzz target:  an evaluation task's data as a .parquet file (`--data arc_easy=FILE`), prepared
//! 1-shot as `occult eval` would.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| occult_fuzz::prepare_task_data("test-00000-of-00001.parquet", data));
