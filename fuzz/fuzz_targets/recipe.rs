#![no_main]
//! Fuzz target:  an `occult reproduce` recipe (TOML).
use libfuzzer_sys::fuzz_target;
use occult_eval::reproduce::recipe::Recipe;

fuzz_target!(|data: &[u8]| {
    let _ = Recipe::load(Some(&occult_fuzz::put("recipe.toml", data)));
});
