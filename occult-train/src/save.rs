//! Writing a fine-tuned model in the layout it was read in: every tensor of the source
//! checkpoint under its own name, shape and dtype, with the trained values (routed experts,
//! per expert or fused as the source stores them, and every trainable replicated tensor:
//! routers, shared experts and their gate, and under `--train all` the rest) in place of the
//! old ones; `config.json` and the tokenizer files beside it. So
//! transformers and every occult command load it as they load the source. Placement changes
//! no names: experts are gathered from their owners and written in global order.
//!
//! Everything is written to one `model.safetensors` (a sharded source is written whole), atomically,
//! by rank 0. Collective on D ranks. gpt-oss's experts are written in its fused, interleaved
//! layout with their biases; from an MXFP4 source, trained experts are written unquantized (as
//! gpt-oss's bf16 checkpoints store them) and `quantization_config` leaves `config.json`.

use crate::{Error, Result};
use candle::{DType, Tensor};
use occult_core::atomic::write_atomic;
use occult_core::ep::dispatch::ExpertLocations;
use occult_core::ep::swiglu::{ExpertBiases, SwigluStack};
use occult_core::models::gpt_oss_experts;
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::{Mlp, Model, MoeExec};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Files copied from the source folder when present.
const BESIDE: [&str; 5] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
];

fn f32s(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// A tensor's values in a safetensors dtype, as little-endian bytes.
pub(crate) fn bytes_as(t: &Tensor, dtype: safetensors::Dtype) -> Result<Vec<u8>> {
    let flat = t.flatten_all()?;
    Ok(match dtype {
        safetensors::Dtype::F32 => flat
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        safetensors::Dtype::BF16 => flat
            .to_dtype(DType::BF16)?
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        safetensors::Dtype::F16 => flat
            .to_dtype(DType::F16)?
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        other => {
            return Err(Error::Invalid(format!(
                "cannot write a tensor stored as {other:?}"
            )))
        }
    })
}

/// The model's trained tensors, named as the checkpoint names them: every rank's routed
/// experts gathered on rank 0, and the replicated trainable tensors (other ranks return an
/// empty map).
fn trained_tensors(m: &Model, ck: &Checkpoint) -> Result<BTreeMap<String, Tensor>> {
    let cfg = &ck.cfg;
    let names = cfg.family.names;
    let (rank, size) = m.rank_and_size();
    let (e, i, h) = (
        cfg.moe.num_experts,
        cfg.moe.expert_intermediate,
        cfg.hidden_size,
    );
    let mut out = BTreeMap::new();
    for (l, layer) in m.layers.iter().enumerate() {
        let Mlp::Moe(block) = &layer.mlp else {
            continue;
        };
        let (w, owners) = match &block.exec {
            MoeExec::Reference { weights, .. } => (&**weights, None),
            MoeExec::Parallel(ep) => (&ep.weights, Some(&ep.locations)),
        };
        let p = format!("model.layers.{l}.{}", names.block);
        // The routed experts in global order, gathered from their owners on rank 0.
        let mut stacks = Vec::new();
        for (_, t) in w.experts.tensors() {
            let mine = f32s(t)?;
            let per = t.dims()[1..].iter().product();
            let all = match (owners, m.comm().filter(|_| size > 1)) {
                (Some(loc), Some(c)) => {
                    let bytes: Vec<u8> = mine.iter().flat_map(|x| x.to_le_bytes()).collect();
                    let blocks = c.gather_v_bytes_to_root(&bytes)?;
                    if rank != 0 {
                        continue;
                    }
                    global_order(loc, &blocks, per)?
                }
                _ => mine,
            };
            let mut dims = t.dims().to_vec();
            dims[0] = e;
            stacks.push(Tensor::from_vec(all, dims, t.device())?);
        }
        if rank != 0 {
            continue;
        }
        let (gate, up, down) = (&stacks[0], &stacks[1], &stacks[2]);
        if cfg.moe.experts.interleaved_gate_up {
            // gpt-oss's own layout (unquantized; an MXFP4 source's blocks are replaced).
            let bias = (stacks.len() == 6).then(|| ExpertBiases {
                gate: stacks[3].clone(),
                up: stacks[4].clone(),
                down: stacks[5].clone(),
            });
            let all = SwigluStack::new(gate.clone(), up.clone(), down.clone())?
                .with_form(cfg.moe.experts.activation, bias)?;
            for (suffix, t) in gpt_oss_experts::fused_tensors(&all)? {
                out.insert(format!("{p}.experts.{suffix}"), t);
            }
            continue;
        }
        let n = names.experts;
        if ck
            .weights
            .contains(&format!("{p}.experts.0.{}.weight", n.gate))
        {
            for j in 0..e {
                out.insert(format!("{p}.experts.{j}.{}.weight", n.gate), gate.get(j)?);
                out.insert(format!("{p}.experts.{j}.{}.weight", n.up), up.get(j)?);
                out.insert(format!("{p}.experts.{j}.{}.weight", n.down), down.get(j)?);
            }
        } else {
            let gate_up_name = format!("{p}.experts.gate_up_proj");
            let gate_up = Tensor::cat(&[gate, up], 1)?;
            // As the loader decides: by both shapes (one alone is ambiguous when H = 2I).
            let down_name = format!("{p}.experts.down_proj");
            let standard = ck.weights.shape(&gate_up_name) == Some(vec![e, 2 * i, h])
                && ck.weights.shape(&down_name) == Some(vec![e, h, i]);
            let transposed = !standard
                && ck.weights.shape(&gate_up_name) == Some(vec![e, h, 2 * i])
                && ck.weights.shape(&down_name) == Some(vec![e, i, h]);
            if transposed {
                out.insert(gate_up_name, gate_up.transpose(1, 2)?.contiguous()?);
                out.insert(down_name, down.transpose(1, 2)?.contiguous()?);
            } else {
                out.insert(gate_up_name, gate_up);
                out.insert(down_name, down.clone());
            }
        }
    }
    if rank == 0 {
        // Everything else that trains (routers, shared experts; all of it under --train all)
        // is replicated: rank 0's copy, under its checkpoint name.
        for (name, t) in m.replicated_params() {
            if t.is_variable() {
                out.insert(name, t);
            }
        }
    }
    Ok(out)
}

/// The tensors stored as MXFP4 (`{base}_blocks` with `{base}_scales`), by base name.
fn mxfp4_bases(names: &[String]) -> Vec<String> {
    names
        .iter()
        .filter_map(|n| n.strip_suffix("_blocks"))
        .filter(|b| names.iter().any(|n| *n == format!("{b}_scales")))
        .map(String::from)
        .collect()
}

/// Every rank's experts (`blocks[r]`: rank r's, in slot order, `per` values each) in global
/// expert order.
fn global_order(loc: &ExpertLocations, blocks: &[Vec<u8>], per: usize) -> Result<Vec<f32>> {
    let e = loc.rank_of.len();
    let mut all = vec![0f32; e * per];
    for (r, block) in blocks.iter().enumerate() {
        let vals: Vec<f32> = block
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let experts = &loc.experts_of[r];
        if vals.len() != experts.len() * per {
            return Err(Error::Invalid(format!(
                "rank {r} sent {} expert values, expected {}",
                vals.len(),
                experts.len() * per
            )));
        }
        for (slot, &x) in experts.iter().enumerate() {
            let x = x as usize;
            all[x * per..(x + 1) * per].copy_from_slice(&vals[slot * per..(slot + 1) * per]);
        }
    }
    Ok(all)
}

/// A tensor to write: name, shape, dtype and little-endian bytes.
pub(crate) type Entry = (String, Vec<usize>, safetensors::Dtype, Vec<u8>);

/// Writes `entries` as one safetensors file, atomically.
pub(crate) fn write_safetensors(
    path: &Path,
    entries: &[Entry],
    meta: Option<HashMap<String, String>>,
) -> Result<()> {
    let views = entries
        .iter()
        .map(|(n, s, d, b)| {
            safetensors::tensor::TensorView::new(*d, s.clone(), b).map(|v| (n.clone(), v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Invalid(format!("{}: building the tensors: {e}", path.display())))?;
    let bytes = safetensors::serialize(views, meta)
        .map_err(|e| Error::Invalid(format!("{}: serialising: {e}", path.display())))?;
    write_atomic(path, |w| w.write_all(&bytes))?;
    Ok(())
}

/// Writes the model's trained tensors over the source checkpoint into `dir` (created if
/// needed). Collective: every rank must call it; rank 0 writes.
pub fn save_model(m: &Model, ck: &Checkpoint, dir: &Path) -> Result<()> {
    let trained = trained_tensors(m, ck)?;
    if m.rank_and_size().0 != 0 {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::Invalid(format!("{}: {e}", dir.display())))?;
    let mut names: Vec<String> = ck.weights.names().map(String::from).collect();
    // MXFP4 experts are written trained and unquantized, under their unquantized names (in
    // the dtype of their biases, as gpt-oss's bf16 checkpoints store them), and config.json
    // loses its quantization_config.
    let mut dequantized = false;
    for base in mxfp4_bases(&names) {
        if trained.contains_key(&base) {
            for suffix in ["_blocks", "_scales"] {
                names.retain(|n| *n != format!("{base}{suffix}"));
            }
            names.push(base);
            dequantized = true;
        }
    }
    names.sort();
    let mut data: Vec<Entry> = Vec::new();
    for name in names {
        if dequantized && !ck.weights.contains(&name) {
            let t = &trained[&name];
            let dtype = ck
                .weights
                .source_dtype(&format!("{name}_bias"))
                .unwrap_or(safetensors::Dtype::F32);
            data.push((name, t.dims().to_vec(), dtype, bytes_as(t, dtype)?));
            continue;
        }
        let dtype = ck
            .weights
            .source_dtype(&name)
            .ok_or_else(|| Error::Invalid(format!("{name} has no dtype")))?;
        let shape = ck.weights.shape(&name).unwrap_or_default();
        let t = match trained.get(&name) {
            Some(t) => {
                if t.dims() != shape.as_slice() {
                    return Err(Error::Invalid(format!(
                        "trained {name} has shape {:?}, the checkpoint {shape:?}",
                        t.dims()
                    )));
                }
                t.clone()
            }
            None => ck.weights.raw(&name)?,
        };
        data.push((name, shape, dtype, bytes_as(&t, dtype)?));
    }
    let missing: Vec<&String> = trained
        .keys()
        .filter(|k| !data.iter().any(|(n, ..)| n == *k))
        .collect();
    if !missing.is_empty() {
        return Err(Error::Invalid(format!(
            "trained tensors the checkpoint does not hold: {missing:?}"
        )));
    }
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    write_safetensors(&dir.join("model.safetensors"), &data, Some(meta))?;
    for f in BESIDE {
        let src = ck.files.dir.join(f);
        if f == "config.json" && dequantized {
            let mut config = occult_core::models::checkpoint::read_config(&src)?;
            if let Some(c) = config.as_object_mut() {
                c.remove("quantization_config");
            }
            occult_core::atomic::write_json_atomic(&dir.join(f), &config)?;
            continue;
        }
        if src.is_file() {
            let text = std::fs::read(&src)
                .map_err(|e| Error::Invalid(format!("{}: {e}", src.display())))?;
            write_atomic(&dir.join(f), |w| w.write_all(&text))?;
        }
    }
    Ok(())
}
