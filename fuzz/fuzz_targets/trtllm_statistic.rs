#![no_main]
//! Fuzz target: TensorRT-LLM's expert-statistic dump folder as `occult trace import DIR` and
//! `occult place --loads DIR` read it. The input is `meta_info.json`'s length (2 bytes, little
//! endian), its text, then one safetensors file, written both as rank 0's per-token experts
//! (`token_selected_experts_rank0.safetensors`) and as its expert counts (`rank0.safetensors`).
use libfuzzer_sys::fuzz_target;
use occult_core::interop::routing_import::{import, ImportOptions};
use occult_core::interop::trtllm::statistic::read_statistic_counts;

fuzz_target!(|data: &[u8]| {
    let Some((len, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let n = (u16::from_le_bytes(*len) as usize).min(rest.len());
    let (meta, file) = rest.split_at(n);
    occult_fuzz::put("dump/meta_info.json", meta);
    occult_fuzz::put("dump/token_selected_experts_rank0.safetensors", file);
    let dir = occult_fuzz::put("dump/rank0.safetensors", file)
        .parent()
        .expect("a folder")
        .to_path_buf();
    let opts = ImportOptions {
        num_experts: 16,
        ..Default::default()
    };
    let _ = import(&dir, &opts);
    let _ = read_statistic_counts(&dir);
});
