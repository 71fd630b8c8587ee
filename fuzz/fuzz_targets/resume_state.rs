#![no_main]
//! Fuzz target:  a fine-tuning run's saved state: `state.json` (an input starting with `{`) or
//! a rank's optimiser state (safetensors), loaded into an optimiser of two tensors, `[2, 3]`
//! and `[4]`, as `occult train --resume` does.
use candle::{Device, Tensor, Var};
use libfuzzer_sys::fuzz_target;
use occult_train::optim::{AdamW, AdamWConfig};
use occult_train::run::{read_rank_state, read_state_record};

fuzz_target!(|data: &[u8]| {
    if data.first() == Some(&b'{') {
        let _ = read_state_record(&occult_fuzz::put("state.json", data));
        return;
    }
    let path = occult_fuzz::put("rank0.safetensors", data);
    if let Ok(state) = read_rank_state(&path, 3, 2) {
        let a = Var::zeros((2, 3), candle::DType::F32, &Device::Cpu).expect("var");
        let b = Var::zeros(4, candle::DType::F32, &Device::Cpu).expect("var");
        let params: Vec<Tensor> = vec![a.as_tensor().clone(), b.as_tensor().clone()];
        let mut opt = AdamW::new(&params, AdamWConfig::default()).expect("optimiser");
        let _ = opt.load_state(state);
    }
});
