#![no_main]
//! Fuzz target:  a link profile (TOML) for `occult project` and the shaped-link runs.
use libfuzzer_sys::fuzz_target;
use occult_core::analysis::cost::links::LinkProfile;

fuzz_target!(|data: &[u8]| {
    let path = occult_fuzz::put("links.toml", data);
    let _ = LinkProfile::load(&path.display().to_string());
});
