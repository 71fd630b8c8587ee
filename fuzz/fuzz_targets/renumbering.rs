#![no_main]
//! Fuzz target: an exported checkpoint's `occult.renumbering.json` (read by `occult trace remap`
//! and by an export of an export), and the same bytes as SGLang's expert-location JSON.
use libfuzzer_sys::fuzz_target;
use occult_core::interop::checkpoint::renumbering::Renumbering;

fuzz_target!(|data: &[u8]| {
    let _ = Renumbering::read(&occult_fuzz::put("occult.renumbering.json", data));
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = occult_core::interop::sglang::location::check_location_file(&v, 4, 8, 2);
    }
});
