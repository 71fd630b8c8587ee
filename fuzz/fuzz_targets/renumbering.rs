#![no_main]
//! Fuzz target: an exported checkpoint's `occult.renumbering.json` (read by `occult trace remap`
//! and by an export of an export), and the same bytes as SGLang's expert-location JSON (SGLang's
//! own checks, and `occult export sglang --check`'s: the width, an expert twice on a GPU).
use libfuzzer_sys::fuzz_target;
use occult_core::interop::checkpoint::renumbering::Renumbering;

fuzz_target!(|data: &[u8]| {
    let _ = Renumbering::read(&occult_fuzz::put("occult.renumbering.json", data));
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        use occult_core::interop::sglang::location;
        let _ = location::check_location_file(&v, 4, 8, 2);
        let layout = occult_core::interop::checkpoint::ExpertLayout {
            model_type: "qwen2_moe".into(),
            num_experts: 8,
            num_layers: 4,
            moe_layers: vec![1, 2, 3],
            block: "mlp".into(),
            router: "gate".into(),
            groups: None,
        };
        for (ep, redundant) in [(1, None), (2, None), (4, Some(4)), (3, Some(0))] {
            let _ = location::check_servable(&v, &layout, ep, redundant);
        }
    }
});
