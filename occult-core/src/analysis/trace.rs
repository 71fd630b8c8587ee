//! Routing traces on disk (format `occult.trace.v1`): a safetensors file with, per MoE layer L,
//! `layers.L.topk_ids` (I32 `[tokens, k]`, best first), optionally `layers.L.topk_weights`
//! (F32 `[tokens, k]`) and `layers.L.router_logits` (F32 `[tokens, E]`), and string metadata
//! `format`, `num_experts`, `top_k` and, where known, `model`, `data`, `num_ranks`.
//!
//! Everything read is validated: ids in range, no expert twice in one token, shapes that agree
//! with the metadata, finite floats. Errors name the file, the tensor and the row.

use crate::atomic::write_atomic;
use crate::{Error, Result};
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The value of the `format` metadata key.
pub const TRACE_FORMAT: &str = "occult.trace.v1";

/// Largest expert count accepted (E x E statistics must fit in memory).
pub const MAX_EXPERTS: usize = 4096;
/// Largest top-k accepted.
pub const MAX_TOP_K: usize = 255;
/// Largest layer index accepted: far past any model's depth, small enough that a table with a
/// row per layer (an engine's file, a model's layout) stays small.
pub const MAX_LAYER_INDEX: usize = 1 << 16;

/// Checks E and k against each other and the limits; `what` prefixes the message.
pub fn check_experts_top_k(num_experts: usize, top_k: usize) -> std::result::Result<(), String> {
    if num_experts == 0 || num_experts > MAX_EXPERTS {
        return Err(format!(
            "num_experts = {num_experts} must be in 1..={MAX_EXPERTS}"
        ));
    }
    if top_k == 0 || top_k > num_experts.min(MAX_TOP_K) {
        return Err(format!(
            "top_k = {top_k} must be in 1..={}",
            num_experts.min(MAX_TOP_K)
        ));
    }
    Ok(())
}

/// Trace-wide facts, stored as safetensors header metadata.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct TraceMeta {
    pub num_experts: usize,
    pub top_k: usize,
    /// Which model produced the routing (a path, a hub id, or `synthetic`).
    pub model: Option<String>,
    /// Which data was routed.
    pub data: Option<String>,
    /// Tokens were split evenly and in order over this many source ranks.
    pub num_ranks: Option<usize>,
    /// Any further metadata, kept as it is on a round trip.
    pub extra: BTreeMap<String, String>,
}

/// The routing of one MoE layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerTrace {
    /// The model's own layer index.
    pub layer: usize,
    pub tokens: usize,
    /// `[tokens, k]`, row-major, best expert first.
    pub topk_ids: Vec<u32>,
    /// `[tokens, k]`, the gate weights as the model applied them.
    pub topk_weights: Option<Vec<f32>>,
    /// `[tokens, E]`, the raw router logits.
    pub router_logits: Option<Vec<f32>>,
}

impl LayerTrace {
    /// The experts of token `t`, best first.
    pub fn ids(&self, t: usize, k: usize) -> &[u32] {
        &self.topk_ids[t * k..(t + 1) * k]
    }
}

/// A routing trace: metadata plus layers in ascending layer order.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    pub meta: TraceMeta,
    pub layers: Vec<LayerTrace>,
}

impl Trace {
    /// The layer with the model's index `layer`.
    pub fn layer(&self, layer: usize) -> Option<&LayerTrace> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// Layer indices, ascending.
    pub fn layer_ids(&self) -> Vec<usize> {
        self.layers.iter().map(|l| l.layer).collect()
    }

    /// Checks every invariant of the format; `origin` names the file in messages.
    pub fn validate(&self, origin: &str) -> Result<()> {
        let (e, k) = (self.meta.num_experts, self.meta.top_k);
        let bad = |msg: String| Error::bad_file(origin, msg);
        check_experts_top_k(e, k).map_err(bad)?;
        if self.layers.is_empty() {
            return Err(bad("the trace holds no layers".into()));
        }
        if self.meta.num_ranks == Some(0) {
            return Err(bad("num_ranks must be at least 1".into()));
        }
        let mut seen = vec![u32::MAX; e];
        for (i, l) in self.layers.iter().enumerate() {
            if i > 0 && self.layers[i - 1].layer >= l.layer {
                return Err(bad("layers must be unique and in ascending order".into()));
            }
            let name = |t: &str| format!("layers.{}.{t}", l.layer);
            if l.layer > MAX_LAYER_INDEX {
                return Err(bad(format!(
                    "layer index {} is past {MAX_LAYER_INDEX}: no model has that many layers",
                    l.layer
                )));
            }
            // Every statistic is per token: a layer without tokens would report zeros.
            if l.tokens == 0 {
                return Err(bad(format!(
                    "{} holds no tokens; a trace needs at least one per layer",
                    name("topk_ids")
                )));
            }
            if l.topk_ids.len() != l.tokens * k {
                return Err(bad(format!(
                    "{} has {} values, expected tokens x top_k = {} x {k}",
                    name("topk_ids"),
                    l.topk_ids.len(),
                    l.tokens
                )));
            }
            for t in 0..l.tokens {
                for &x in l.ids(t, k) {
                    if x as usize >= e {
                        return Err(bad(format!(
                            "{} row {t}: expert id {x} is out of range for {e} experts",
                            name("topk_ids")
                        )));
                    }
                    if seen[x as usize] == t as u32 {
                        return Err(bad(format!(
                            "{} row {t}: expert {x} appears twice in one token",
                            name("topk_ids")
                        )));
                    }
                    seen[x as usize] = t as u32;
                }
                // Reset so that the marker of a token never aliases the next layer's.
                for &x in l.ids(t, k) {
                    seen[x as usize] = u32::MAX;
                }
            }
            check_floats(origin, &name("topk_weights"), &l.topk_weights, l.tokens, k)?;
            check_floats(
                origin,
                &name("router_logits"),
                &l.router_logits,
                l.tokens,
                e,
            )?;
        }
        Ok(())
    }

    /// Reads and validates a trace file.
    pub fn read(path: &Path) -> Result<Trace> {
        let origin = path.display().to_string();
        let bytes = crate::input::read_bytes(path)?;
        let bad = |msg: String| Error::bad_file(path, msg);
        if let Some(name) = crate::input::duplicate_header_name(&bytes) {
            return Err(bad(format!("the header names tensor {name:?} twice")));
        }
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(format!("not a readable safetensors file ({e})")))?;
        let (_, header) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| bad(format!("not a readable safetensors file ({e})")))?;
        let mut md: BTreeMap<String, String> = header
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        match md.remove("format") {
            Some(f) if f == TRACE_FORMAT => {}
            Some(f) => return Err(bad(format!("format is {f:?}, expected {TRACE_FORMAT:?}"))),
            None => {
                return Err(bad(format!(
                    "no `format` metadata: not an Occult routing trace ({TRACE_FORMAT})"
                )))
            }
        }
        let num = |md: &mut BTreeMap<String, String>, key: &str| -> Result<Option<usize>> {
            md.remove(key)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| bad(format!("metadata {key} = {v:?} is not a count")))
                })
                .transpose()
        };
        let num_experts =
            num(&mut md, "num_experts")?.ok_or_else(|| bad("no num_experts metadata".into()))?;
        let top_k = num(&mut md, "top_k")?.ok_or_else(|| bad("no top_k metadata".into()))?;
        check_experts_top_k(num_experts, top_k).map_err(bad)?;
        let num_ranks = num(&mut md, "num_ranks")?;
        let model = md.remove("model");
        let data = md.remove("data");
        let meta = TraceMeta {
            num_experts,
            top_k,
            model,
            data,
            num_ranks,
            extra: md,
        };

        // Group tensors by layer.
        let mut parts: BTreeMap<usize, HashMap<&str, safetensors::tensor::TensorView>> =
            BTreeMap::new();
        for (name, view) in st.iter() {
            let mut it = name.splitn(3, '.');
            let (Some("layers"), Some(idx), Some(kind)) = (it.next(), it.next(), it.next()) else {
                return Err(bad(format!(
                    "unexpected tensor {name:?} in a routing trace"
                )));
            };
            let layer: usize = idx
                .parse()
                .ok()
                .filter(|l: &usize| l.to_string() == idx)
                .ok_or_else(|| bad(format!("tensor {name:?}: {idx:?} is not a layer index")))?;
            if !matches!(kind, "topk_ids" | "topk_weights" | "router_logits") {
                return Err(bad(format!(
                    "unexpected tensor {name:?} in a routing trace"
                )));
            }
            if parts.entry(layer).or_default().insert(kind, view).is_some() {
                return Err(bad(format!("tensor {name:?} appears twice")));
            }
        }
        let mut layers = Vec::with_capacity(parts.len());
        for (layer, mut p) in parts {
            let name = |t: &str| format!("layers.{layer}.{t}");
            let ids_view = p
                .remove("topk_ids")
                .ok_or_else(|| bad(format!("{} is missing", name("topk_ids"))))?;
            let shape = ids_view.shape().to_vec();
            if shape.len() != 2 || shape[1] != top_k {
                return Err(bad(format!(
                    "{} has shape {shape:?}, expected [tokens, {top_k}]",
                    name("topk_ids")
                )));
            }
            let tokens = shape[0];
            let topk_ids = read_ids(&ids_view, &name("topk_ids"), num_experts).map_err(bad)?;
            let mut floats = |kind: &str, width: usize| -> Result<Option<Vec<f32>>> {
                let Some(v) = p.remove(kind) else {
                    return Ok(None);
                };
                if v.shape() != [tokens, width] {
                    return Err(bad(format!(
                        "{} has shape {:?}, expected [{tokens}, {width}]",
                        name(kind),
                        v.shape()
                    )));
                }
                if v.dtype() != Dtype::F32 {
                    return Err(bad(format!(
                        "{} has dtype {:?}, expected F32",
                        name(kind),
                        v.dtype()
                    )));
                }
                Ok(Some(
                    v.data()
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                ))
            };
            let topk_weights = floats("topk_weights", top_k)?;
            let router_logits = floats("router_logits", num_experts)?;
            layers.push(LayerTrace {
                layer,
                tokens,
                topk_ids,
                topk_weights,
                router_logits,
            });
        }
        let trace = Trace { meta, layers };
        trace.validate(&origin)?;
        Ok(trace)
    }

    /// Writes the trace atomically (temporary file, then rename).
    pub fn write(&self, path: &Path) -> Result<()> {
        self.validate("trace to write")?;
        let k = self.meta.top_k;
        let e = self.meta.num_experts;
        let mut buffers: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for l in &self.layers {
            let ids: Vec<u8> = l
                .topk_ids
                .iter()
                .flat_map(|&x| (x as i32).to_le_bytes())
                .collect();
            buffers.push((
                format!("layers.{}.topk_ids", l.layer),
                Dtype::I32,
                vec![l.tokens, k],
                ids,
            ));
            for (kind, v, w) in [
                ("topk_weights", &l.topk_weights, k),
                ("router_logits", &l.router_logits, e),
            ] {
                if let Some(v) = v {
                    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    buffers.push((
                        format!("layers.{}.{kind}", l.layer),
                        Dtype::F32,
                        vec![l.tokens, w],
                        b,
                    ));
                }
            }
        }
        let views = buffers
            .iter()
            .map(|(n, dt, shape, b)| {
                safetensors::tensor::TensorView::new(*dt, shape.clone(), b).map(|v| (n.clone(), v))
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::invalid(format!("building trace tensors: {e}")))?;
        let mut md: HashMap<String, String> = self.meta.extra.clone().into_iter().collect();
        md.insert("format".into(), TRACE_FORMAT.into());
        md.insert("num_experts".into(), e.to_string());
        md.insert("top_k".into(), k.to_string());
        if let Some(m) = &self.meta.model {
            md.insert("model".into(), m.clone());
        }
        if let Some(d) = &self.meta.data {
            md.insert("data".into(), d.clone());
        }
        if let Some(r) = self.meta.num_ranks {
            md.insert("num_ranks".into(), r.to_string());
        }
        let bytes = safetensors::serialize(views, Some(md))
            .map_err(|e| Error::invalid(format!("serialising trace: {e}")))?;
        write_atomic(path, |w| w.write_all(&bytes))
    }
}

/// Expert ids as I32 (the format) or I64 (what numpy writes by default).
fn read_ids(
    v: &safetensors::tensor::TensorView,
    name: &str,
    e: usize,
) -> std::result::Result<Vec<u32>, String> {
    let raw: Vec<i64> = match v.dtype() {
        Dtype::I32 => v
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect(),
        Dtype::I64 => v
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect(),
        other => return Err(format!("{name} has dtype {other:?}, expected I32")),
    };
    let width = v.shape()[1].max(1);
    raw.into_iter()
        .enumerate()
        .map(|(i, x)| {
            if x < 0 || x as u64 >= e as u64 {
                Err(format!(
                    "{name} row {}: expert id {x} is out of range for {e} experts",
                    i / width
                ))
            } else {
                Ok(x as u32)
            }
        })
        .collect()
}

fn check_floats(
    origin: &str,
    name: &str,
    v: &Option<Vec<f32>>,
    rows: usize,
    width: usize,
) -> Result<()> {
    let Some(v) = v else { return Ok(()) };
    if v.len() != rows * width {
        return Err(Error::bad_file(
            origin,
            format!("{name} has {} values, expected {rows} x {width}", v.len()),
        ));
    }
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(Error::bad_file(
            origin,
            format!("{name} row {}: value {} is not finite", i / width, v[i]),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::analysis::synth::{synth_trace, SynthConfig};

    /// A layer index past any model's depth is refused before a table per layer is sized from it.
    #[test]
    fn a_layer_index_past_any_model_is_refused() {
        let mut c = SynthConfig::olmoe_like(20, 1);
        c.layers = 1;
        let mut t = synth_trace(&c, &|| ()).unwrap();
        t.layers[0].layer = super::MAX_LAYER_INDEX;
        t.validate("t").unwrap();
        t.layers[0].layer = 5_000_000_000;
        let err = t.validate("t").unwrap_err().to_string();
        assert!(
            err.contains("layer index 5000000000 is past 65536"),
            "{err}"
        );
    }
}
