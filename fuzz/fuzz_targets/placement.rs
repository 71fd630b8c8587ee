#![no_main]
//! Fuzz target:  a placement file (`occult place`'s JSON).
use libfuzzer_sys::fuzz_target;
use occult_core::analysis::placement::Placement;

fuzz_target!(|data: &[u8]| {
    let _ = Placement::read(&occult_fuzz::put("placement.json", data));
});
