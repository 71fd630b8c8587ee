#![no_main]
//! Fuzz target: an engine's placement file as `occult place --from` reads it, the format told
//! by its content: TensorRT-LLM's load-balancer YAML (parsed, then checked as TensorRT-LLM
//! checks it, on several EP sizes and as `export trtllm --check` does), and the same bytes as
//! vLLM #49572's expert map, vLLM #34811's expert_to_ep_rank and SGLang's location file, read
//! for a model of 8 experts in MoE layers 1 to 3.
use libfuzzer_sys::fuzz_target;
use occult_core::interop::{engine_placement, trtllm::load_balancer};

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(f) = load_balancer::parse(text) {
            for ep in [None, Some(1), Some(2), Some(3)] {
                let _ = load_balancer::placement_of(&f, ep);
            }
        }
        let _ = load_balancer::check_servable(text, &[1, 2, 3], 8, 2);
    }
    let layout = occult_core::interop::checkpoint::ExpertLayout {
        model_type: "qwen2_moe".into(),
        num_experts: 8,
        num_layers: 4,
        moe_layers: vec![1, 2, 3],
        block: "mlp".into(),
        router: "gate".into(),
        groups: None,
    };
    let path = occult_fuzz::put("placement.json", data);
    for ep in [1, 2, 4] {
        let _ = engine_placement::read_engine_placement(&path, Some(&layout), Some(ep));
    }
});
