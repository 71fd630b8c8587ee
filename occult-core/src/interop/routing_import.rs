//! Routing recorded by other frameworks, read into an
//! [`occult.trace.v1`](crate::analysis::trace) trace: plain arrays that any framework writes in
//! a few lines (`.npz`, `.npy`, safetensors).
//!
//! Array names (in a `.npz` or safetensors file), either
//! - per layer: `layers.{L}.topk_ids` (integers `[tokens, k]`, best first), optionally
//!   `layers.{L}.topk_weights` (`[tokens, k]`) and `layers.{L}.router_logits` (`[tokens, E]`),
//!   as a trace itself names them; or
//! - stacked: `topk_ids` (`[layers, tokens, k]`), optionally `layer_ids` (`[layers]`, the
//!   model's layer index of each; else 0, 1, ...), `topk_weights` and `router_logits` stacked
//!   alike.
//!
//! A `.npy` file holds one `topk_ids` array, `[layers, tokens, k]` or `[tokens, k]` (one layer).
//! A `.pt` file is SGLang's per_token expert-distribution dump ([`super::sglang::dump`]); a
//! `.jsonl` file is Megatron-Core's router trace ([`super::megatron::router_trace`]); a `.json`
//! file holds the routed experts vLLM or SGLang returned with completions ([`super::r3`]); a
//! folder is TensorRT-LLM's expert-statistic dump ([`super::trtllm::statistic`]).
//!
//! `-1` marks padding, as SGLang's recorder writes it: a row of `-1` (a padded token) is dropped,
//! and so is a column of `-1` in every row of every layer (a top-k narrower than the buffer); a
//! `-1` anywhere else is an error naming the layer and the row. Integers may be any width;
//! floats f16, bf16 (safetensors), f32 or f64 ([`super::arrays`] reads them).

use super::arrays::{parse_npy, read_npz, read_safetensors, Array, Values};
use crate::analysis::trace::{LayerTrace, Trace, TraceMeta};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// What the file does not say.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImportOptions {
    /// Experts per layer (the model's; ids must lie below it).
    pub num_experts: usize,
    /// The model's layer index of a single `[tokens, k]` array (default 0).
    pub layer: Option<usize>,
    /// Recorded in the trace's metadata.
    pub model: Option<String>,
    pub data: Option<String>,
    /// The model's layers and top-k, which routed-expert responses (`.json`) need.
    pub layers: Option<super::r3::ModelLayers>,
}

/// Reads a routing file by its extension (`.npz`, `.npy`, `.safetensors`, `.pt`, `.jsonl`,
/// `.json`), or TensorRT-LLM's expert-statistic folder, into a trace.
pub fn import(path: &Path, opts: &ImportOptions) -> Result<Trace> {
    if path.is_dir() {
        let arrays = super::trtllm::statistic::read_statistic_dir(path)
            .map_err(|m| Error::bad_file(path, m))?;
        let trace = from_arrays(arrays, opts).map_err(|m| Error::bad_file(path, m))?;
        trace.validate(&path.display().to_string())?;
        return Ok(trace);
    }
    let bytes = crate::input::read_bytes(path)?;
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let bad = |msg: String| Error::bad_file(path, msg);
    let arrays = match ext.as_str() {
        "npz" => read_npz(&bytes).map_err(bad)?,
        "npy" => {
            let a = parse_npy(&bytes).map_err(bad)?;
            BTreeMap::from([("topk_ids".to_string(), a)])
        }
        "safetensors" => read_safetensors(&bytes).map_err(bad)?,
        "pt" => super::sglang::dump::read_per_token_dump(&bytes).map_err(bad)?,
        "jsonl" => {
            let text =
                std::str::from_utf8(&bytes).map_err(|e| bad(format!("not UTF-8 text: {e}")))?;
            let t = super::megatron::router_trace::read_router_trace(text).map_err(bad)?;
            if t.mtp_records > 0 {
                eprintln!(
                    "{}: {} multi-token-prediction records left out (their layers are another \
                     list's)",
                    path.display(),
                    t.mtp_records
                );
            }
            t.arrays
        }
        "json" => {
            let Some(layers) = &opts.layers else {
                return Err(bad(
                    "routed-expert responses (vLLM's or SGLang's --enable-return-routed-experts) \
                     need the model (--model: its hidden layers, MoE layers and top-k)"
                        .into(),
                ));
            };
            let text =
                std::str::from_utf8(&bytes).map_err(|e| bad(format!("not UTF-8 text: {e}")))?;
            super::r3::read_r3(text, layers).map_err(bad)?
        }
        other => {
            return Err(bad(format!(
                "extension {other:?}: routing is read from .npz, .npy, .safetensors, SGLang's \
                 per_token dump (.pt), Megatron-Core's router trace (.jsonl) or routed-expert \
                 responses (.json)"
            )))
        }
    };
    let trace = from_arrays(arrays, opts).map_err(bad)?;
    trace.validate(&path.display().to_string())?;
    Ok(trace)
}

/// Reads several routing files (for example one per rank, as SGLang dumps them) into one
/// trace: each layer's tokens in file order. Every file must hold the same layers and top-k.
pub fn import_all(paths: &[std::path::PathBuf], opts: &ImportOptions) -> Result<Trace> {
    let Some((first, rest)) = paths.split_first() else {
        return Err(Error::invalid("no routing files to import"));
    };
    let mut trace = import(first, opts)?;
    for p in rest {
        let t = import(p, opts)?;
        if t.meta.top_k != trace.meta.top_k || t.layer_ids() != trace.layer_ids() {
            return Err(Error::bad_file(
                p,
                format!(
                    "holds layers {:?} with top-{}, {} holds layers {:?} with top-{}",
                    t.layer_ids(),
                    t.meta.top_k,
                    first.display(),
                    trace.layer_ids(),
                    trace.meta.top_k
                ),
            ));
        }
        for (into, from) in trace.layers.iter_mut().zip(t.layers) {
            into.tokens += from.tokens;
            into.topk_ids.extend(from.topk_ids);
            for (a, b) in [
                (&mut into.topk_weights, from.topk_weights),
                (&mut into.router_logits, from.router_logits),
            ] {
                *a = match (a.take(), b) {
                    (Some(mut x), Some(y)) => {
                        x.extend(y);
                        Some(x)
                    }
                    _ => None,
                };
            }
        }
    }
    trace.validate("the imported routing")?;
    Ok(trace)
}

/// One layer's arrays before padding is removed.
struct RawLayer {
    layer: usize,
    ids: Array,
    weights: Option<Array>,
    logits: Option<Array>,
}

/// The trace the arrays describe (see the module's documentation for the names).
pub fn from_arrays(
    mut arrays: BTreeMap<String, Array>,
    opts: &ImportOptions,
) -> std::result::Result<Trace, String> {
    let e = opts.num_experts;
    let mut raw = Vec::new();
    if let Some(ids) = arrays.remove("topk_ids") {
        let one_layer = ids.shape.len() == 2;
        // A one-layer file's arrays may be `[tokens, n]`: one layer of `[layers, tokens, n]`.
        let lift = |a: Array| match a.shape.len() {
            2 if one_layer => Array {
                shape: [&[1], &a.shape[..]].concat(),
                values: a.values,
            },
            _ => a,
        };
        let stacked = match ids.shape.len() {
            3 => ids,
            2 => lift(ids),
            _ => {
                return Err(format!(
                    "topk_ids has shape {:?}, expected [layers, tokens, k] or [tokens, k]",
                    ids.shape
                ))
            }
        };
        let nl = stacked.shape[0];
        let layer_ids: Vec<usize> = match arrays.remove("layer_ids") {
            Some(a) => ints(&a, "layer_ids")?
                .iter()
                .map(|&x| usize::try_from(x).map_err(|_| format!("layer_ids holds {x}")))
                .collect::<std::result::Result<_, _>>()?,
            None if nl == 1 => vec![opts.layer.unwrap_or(0)],
            None => (0..nl).collect(),
        };
        if layer_ids.len() != nl {
            return Err(format!(
                "layer_ids has {} entries for {nl} layers",
                layer_ids.len()
            ));
        }
        let weights = arrays.remove("topk_weights").map(lift);
        let logits = arrays.remove("router_logits").map(lift);
        for (i, &layer) in layer_ids.iter().enumerate() {
            raw.push(RawLayer {
                layer,
                ids: slice(&stacked, i, "topk_ids")?,
                weights: weights
                    .as_ref()
                    .map(|w| slice(w, i, "topk_weights"))
                    .transpose()?,
                logits: logits
                    .as_ref()
                    .map(|w| slice(w, i, "router_logits"))
                    .transpose()?,
            });
        }
    } else {
        // Layer numbers written in plain decimal only (`layers.01.` would name layer 1 twice).
        let mut layers: Vec<usize> = arrays
            .keys()
            .filter_map(|k| {
                let l = k.strip_prefix("layers.")?.strip_suffix(".topk_ids")?;
                l.parse::<usize>().ok().filter(|n| n.to_string() == l)
            })
            .collect();
        layers.sort_unstable();
        if layers.is_empty() {
            return Err(format!(
                "no routing arrays: expected `topk_ids` or `layers.L.topk_ids`, found {:?}",
                arrays.keys().collect::<Vec<_>>()
            ));
        }
        for l in layers {
            let ids = arrays
                .remove(&format!("layers.{l}.topk_ids"))
                .ok_or(format!("layers.{l}.topk_ids is missing"))?;
            raw.push(RawLayer {
                layer: l,
                ids,
                weights: arrays.remove(&format!("layers.{l}.topk_weights")),
                logits: arrays.remove(&format!("layers.{l}.router_logits")),
            });
        }
    }
    if raw.is_empty() {
        return Err("topk_ids holds no layers".into());
    }
    raw.sort_by_key(|r| r.layer);
    if let Some(w) = raw.windows(2).find(|w| w[0].layer == w[1].layer) {
        return Err(format!("layer {} is given twice", w[0].layer));
    }
    // The top-k: the columns that are not padding in every row of every layer.
    let width = raw[0].ids.shape.get(1).copied().unwrap_or(0);
    let mut used = vec![false; width];
    for r in &raw {
        if r.ids.shape.len() != 2 || r.ids.shape[1] != width {
            return Err(format!(
                "layer {}: topk_ids has shape {:?}, expected [tokens, {width}]",
                r.layer, r.ids.shape
            ));
        }
        for row in ints(&r.ids, "topk_ids")?.chunks_exact(width.max(1)) {
            for (c, &x) in row.iter().enumerate() {
                used[c] |= x != -1;
            }
        }
    }
    let k = used.iter().take_while(|&&u| u).count();
    if k == 0 || used[k..].iter().any(|&u| u) {
        return Err(format!(
            "the ids' columns in use are {used:?}: the top-k must come first, padding (-1) after"
        ));
    }
    let mut layers = Vec::with_capacity(raw.len());
    for r in raw {
        layers.push(unpad(r, width, k, e)?);
    }
    Ok(Trace {
        meta: TraceMeta {
            num_experts: e,
            top_k: k,
            model: opts.model.clone(),
            data: opts.data.clone(),
            num_ranks: None,
            extra: Default::default(),
        },
        layers,
    })
}

fn ints<'a>(a: &'a Array, what: &str) -> std::result::Result<&'a [i64], String> {
    match &a.values {
        Values::Ints(v) => Ok(v),
        Values::Floats(_) => Err(format!("{what} holds floats; expert ids are integers")),
    }
}

/// Entry `i` of the first dimension.
fn slice(a: &Array, i: usize, what: &str) -> std::result::Result<Array, String> {
    if a.shape.len() != 3 || i >= a.shape[0] {
        return Err(format!(
            "{what} has shape {:?}, expected [layers, tokens, n]",
            a.shape
        ));
    }
    let per = a.shape[1] * a.shape[2];
    let values = match &a.values {
        Values::Ints(v) => Values::Ints(v[i * per..(i + 1) * per].to_vec()),
        Values::Floats(v) => Values::Floats(v[i * per..(i + 1) * per].to_vec()),
    };
    Ok(Array {
        shape: a.shape[1..].to_vec(),
        values,
    })
}

fn floats(a: &Array, what: &str, layer: usize) -> std::result::Result<Vec<f32>, String> {
    match &a.values {
        Values::Floats(v) => Ok(v.clone()),
        Values::Ints(_) => Err(format!("layer {layer}: {what} holds integers, not floats")),
    }
}

/// A layer without its padded rows and columns.
fn unpad(r: RawLayer, width: usize, k: usize, e: usize) -> std::result::Result<LayerTrace, String> {
    let ids = ints(&r.ids, "topk_ids")?;
    let tokens = r.ids.shape[0];
    let check = |a: &Option<Array>,
                 what: &str,
                 w: usize|
     -> std::result::Result<Option<Vec<f32>>, String> {
        a.as_ref()
            .map(|a| {
                if a.shape != [tokens, w] {
                    return Err(format!(
                        "layer {}: {what} has shape {:?}, expected [{tokens}, {w}]",
                        r.layer, a.shape
                    ));
                }
                floats(a, what, r.layer)
            })
            .transpose()
    };
    let weights = check(&r.weights, "topk_weights", width)?;
    let logits = check(&r.logits, "router_logits", e)?;
    let (mut out_ids, mut out_w, mut out_l) = (Vec::new(), Vec::new(), Vec::new());
    let mut kept = 0;
    for t in 0..tokens {
        let row = &ids[t * width..(t + 1) * width];
        if row.iter().all(|&x| x == -1) {
            continue;
        }
        for (c, &x) in row[..k].iter().enumerate() {
            if x < 0 || x as u64 >= e as u64 {
                return Err(format!(
                    "layer {} row {t} column {c}: id {x} is not an expert in 0..{e}",
                    r.layer
                ));
            }
            out_ids.push(x as u32);
        }
        if let Some(w) = &weights {
            out_w.extend_from_slice(&w[t * width..t * width + k]);
        }
        if let Some(l) = &logits {
            out_l.extend_from_slice(&l[t * e..(t + 1) * e]);
        }
        kept += 1;
    }
    Ok(LayerTrace {
        layer: r.layer,
        tokens: kept,
        topk_ids: out_ids,
        topk_weights: weights.map(|_| out_w),
        router_logits: logits.map(|_| out_l),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interop::arrays::tests::npy;

    fn i64s(v: &[i64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn opts() -> ImportOptions {
        ImportOptions {
            num_experts: 8,
            ..Default::default()
        }
    }

    #[test]
    fn stacked_arrays_with_sglang_padding_become_a_trace() {
        // 2 layers x 3 tokens x 4 columns; top-2 then two padding columns; token 1 of layer 0
        // is a padded row.
        let ids: Vec<i64> = vec![
            1, 2, -1, -1, /**/ -1, -1, -1, -1, /**/ 7, 0, -1, -1, //
            3, 4, -1, -1, /**/ 5, 6, -1, -1, /**/ 0, 1, -1, -1,
        ];
        let a = parse_npy(&npy("<i8", &[2, 3, 4], &i64s(&ids))).unwrap();
        let t = from_arrays(BTreeMap::from([("topk_ids".into(), a)]), &opts()).unwrap();
        assert_eq!(t.meta.top_k, 2);
        assert_eq!((t.layers[0].tokens, t.layers[1].tokens), (2, 3));
        assert_eq!(t.layers[0].topk_ids, vec![1, 2, 7, 0]);
        assert_eq!(t.layers[1].topk_ids, vec![3, 4, 5, 6, 0, 1]);
        t.validate("test").unwrap();
    }

    /// One layer's `[tokens, k]` ids come with `[tokens, k]` weights and `[tokens, E]` logits
    /// (found by review: they were refused as not `[layers, tokens, n]`).
    #[test]
    fn a_one_layer_file_with_two_dimensional_weights_and_logits_imports() {
        let f32s = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let ids = parse_npy(&npy("<i8", &[2, 2], &i64s(&[1, 2, 7, 0]))).unwrap();
        let w = parse_npy(&npy("<f4", &[2, 2], &f32s(&[0.6, 0.4, 0.7, 0.3]))).unwrap();
        let logits = parse_npy(&npy("<f4", &[2, 8], &f32s(&[0.5; 16]))).unwrap();
        let arrays = BTreeMap::from([
            ("topk_ids".into(), ids),
            ("topk_weights".into(), w),
            ("router_logits".into(), logits),
        ]);
        let t = from_arrays(arrays, &opts()).unwrap();
        assert_eq!(t.layers.len(), 1);
        assert_eq!(t.layers[0].topk_ids, vec![1, 2, 7, 0]);
        assert_eq!(
            t.layers[0].topk_weights.as_deref(),
            Some(&[0.6f32, 0.4, 0.7, 0.3][..])
        );
        assert_eq!(t.layers[0].router_logits.as_ref().map(Vec::len), Some(16));
    }

    #[test]
    fn files_of_different_routing_do_not_merge() {
        let t = tempfile::tempdir().unwrap();
        let (a, b) = (t.path().join("a.npy"), t.path().join("b.npy"));
        std::fs::write(&a, npy("<i8", &[2, 2], &i64s(&[0, 1, 2, 3]))).unwrap();
        std::fs::write(&b, npy("<i8", &[1, 3], &i64s(&[0, 1, 2]))).unwrap();
        let both = import_all(&[a.clone(), a.clone()], &opts()).unwrap();
        assert_eq!(both.layers[0].topk_ids, vec![0, 1, 2, 3, 0, 1, 2, 3]);
        let e = import_all(&[a, b], &opts()).unwrap_err().to_string();
        assert!(e.contains("top-3") && e.contains("top-2"), "{e}");
        assert!(import_all(&[], &opts()).is_err());
    }

    #[test]
    fn bad_arrays_are_refused_with_reasons() {
        let err = |b: &[u8]| parse_npy(b).unwrap_err();
        assert!(err(b"not numpy").contains("magic"));
        assert!(err(&npy("<i8", &[1000000, 1000000], &[0; 8])).contains("data bytes"));
        assert!(err(&npy(">i8", &[1], &[0; 8])).contains("big-endian"));
        assert!(err(&npy("<c8", &[1], &[0; 8])).contains("not read"));
        // Found by fuzzing: a zero-byte dtype. Found by review: a dtype that starts with a
        // multi-byte character.
        assert!(err(&npy("<i0", &[3], &[])).contains("not read"));
        assert!(err(&npy("\u{e9}i8", &[1], &[0; 8])).contains("not read"));
        let mut h = npy("<i8", &[1], &[0; 8]);
        h[8] = 255; // a header length past the end
        assert!(err(&h).contains("past the end"));
        let ids = |v: &[i64], shape: &[usize]| {
            let a = parse_npy(&npy("<i8", shape, &i64s(v))).unwrap();
            from_arrays(BTreeMap::from([("topk_ids".into(), a)]), &opts())
        };
        assert!(ids(&[1, 8], &[1, 2])
            .unwrap_err()
            .contains("id 8 is not an expert"));
        assert!(ids(&[-1, 1, -1, 2], &[2, 2])
            .unwrap_err()
            .contains("top-k must come first"));
        assert!(ids(&[1, -1, 2, 3], &[2, 2])
            .unwrap_err()
            .contains("row 0 column 1: id -1"));
        let e = from_arrays(BTreeMap::new(), &opts()).unwrap_err();
        assert!(e.contains("no routing arrays"), "{e}");
        // Found by review: a layer spelled twice, and a stack of no layers.
        let a = parse_npy(&npy("<i8", &[1, 2], &i64s(&[0, 1]))).unwrap();
        let twice = BTreeMap::from([
            ("layers.1.topk_ids".to_string(), a.clone()),
            ("layers.01.topk_ids".to_string(), a.clone()),
        ]);
        let t = from_arrays(twice, &opts()).unwrap();
        assert_eq!(t.layer_ids(), vec![1], "`layers.01.` is not a layer name");
        let none = parse_npy(&npy("<i8", &[0, 3, 2], &[])).unwrap();
        let e = from_arrays(BTreeMap::from([("topk_ids".into(), none)]), &opts()).unwrap_err();
        assert!(e.contains("no layers"), "{e}");
    }
}
