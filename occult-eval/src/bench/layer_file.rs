//! The benchmark layer written out for another engine (`occult bench layer --layer-out FILE`):
//! its router `[E, H]`, experts' `gate` and `up` `[E, I, H]` and `down` `[E, H, I]`, every
//! rank's tokens in rank order (`tokens` `[D T, H]`: rank r's are rows `r T ..`), and the
//! layer's output on them (`output`, the single-device reference of the bench's routing rule),
//! f32 safetensors with the settings in the metadata, and the bench's placement
//! (`device_of_expert` `[E]`, i64: the rank that holds each expert, E / D each), so that the
//! other engine can hold the same experts on the same ranks. `scripts/bench_deepspeed_moe.py --layer
//! FILE` runs DeepSpeed-MoE on the same weights and tokens and holds its output to `output`.

use super::layer::{LayerBench, Setup};
use anyhow::{Context, Result};
use candle::{Device, Tensor};
use occult_core::ep::reference_forward;
use std::collections::HashMap;
use std::path::Path;

/// Writes `setup`'s layer, tokens and reference output to `path` (atomically).
pub fn write(bench: &LayerBench, setup: &Setup, path: &Path) -> Result<()> {
    let (e, h) = (bench.experts, bench.hidden);
    let total = bench.tokens * bench.devices;
    let x = Tensor::from_slice(&setup.x, (total, h), &Device::Cpu)?;
    let y = reference_forward(&setup.weights, &setup.rule, &x, None)?;
    let w = &setup.weights;
    let tensors = [
        ("router", w.router.clone()),
        ("gate", w.experts.gate.clone()),
        ("up", w.experts.up.clone()),
        ("down", w.experts.down.clone()),
        ("tokens", x),
        ("output", y),
    ];
    let mut data = Vec::new();
    for (name, t) in tensors {
        let shape = t.dims().to_vec();
        let values = t.flatten_all()?.to_vec1::<f32>()?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        data.push((name.to_string(), shape, bytes));
    }
    let map: Vec<u8> = setup
        .map
        .iter()
        .flat_map(|&d| (d as i64).to_le_bytes())
        .collect();
    let views = data
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
        })
        .chain([
            safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![e], &map)
                .map(|v| ("device_of_expert".to_string(), v)),
        ])
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let md: HashMap<String, String> = [
        ("format", "occult.layer.v1".to_string()),
        ("experts", e.to_string()),
        ("top_k", bench.top_k.to_string()),
        ("ranks", bench.devices.to_string()),
        ("tokens_per_rank", bench.tokens.to_string()),
        ("renormalize", setup.rule.renormalize.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let bytes = safetensors::serialize(views, Some(md)).context("serialising the layer")?;
    occult_core::atomic::write_atomic(path, |w| w.write_all(&bytes))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
