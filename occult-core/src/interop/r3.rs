//! Routed experts returned with a completion ("routing replay", R3): an engine serving with it
//! on returns, per request, the logical top-k experts of every token at every layer, so every
//! served request is a trace. Read here from the JSON responses as each API returns them, one
//! response, a JSON list of them, or one a line:
//!
//! - **vLLM** (`--enable-return-routed-experts`; `vllm/entrypoints/openai/completion/protocol.py`):
//!   `choices[i].routed_experts`, a base64 `.npy` file, `(tokens - 1, num_hidden_layers, top_k)`,
//!   its dtype in its header; earlier releases (v0.21's `docs/training/routed_experts_replay.md`)
//!   return nested lists, the prompt's in `prompt_routed_experts` beside the choices.
//! - **SGLang** (`--enable-return-routed-experts`; `srt/managers/tokenizer_manager.py`):
//!   `meta_info.routed_experts` from `/generate`; from its OpenAI endpoints `sglext.routed_experts`
//!   beside the choices (the first request's only: with `n > 1` the others' are not returned), or
//!   with chat's `return_meta_info` each choice's `meta_info.routed_experts`: base64 of the raw
//!   int32 bytes, `(tokens - 1, num_hidden_layers, top_k)`.
//!
//! Both capture the ids before expert-parallel load balancing maps them (logical ids), and lay
//! out every hidden layer, dense ones included (rows never written): the model's layout says
//! which are MoE layers. TensorRT-LLM returns `routed_experts` from its LLM API (PR 18397, int16
//! `(tokens - 1, moe_layers, top_k)`, -1 where missing); how `trtllm-serve` puts it in JSON is not
//! read here yet.

use super::arrays::{parse_npy, Array, Values};
use base64::Engine;
use serde_json::Value;
use std::collections::BTreeMap;

/// What the responses do not say, from the model: its hidden layers, which of them are MoE
/// layers, and its top-k.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelLayers {
    pub num_layers: usize,
    pub moe_layers: Vec<usize>,
    pub top_k: usize,
}

/// One request's routing: `[tokens, layers, k]` ids.
struct Routed {
    tokens: usize,
    layers: usize,
    k: usize,
    ids: Vec<i64>,
}

/// The routing of every response in `text` (one JSON value, a list of them, or one a line),
/// each request's tokens after the last's, as `layers.{L}.topk_ids` arrays of the model's MoE
/// layers.
pub fn read_r3(text: &str, model: &ModelLayers) -> Result<BTreeMap<String, Array>, String> {
    let (num_layers, moe_layers, top_k) = (model.num_layers, &model.moe_layers[..], model.top_k);
    let responses: Vec<Value> = match serde_json::from_str::<Value>(text) {
        Ok(Value::Array(items)) => items,
        Ok(v) => vec![v],
        Err(_) => text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                serde_json::from_str(l).map_err(|e| format!("line {}: not JSON: {e}", i + 1))
            })
            .collect::<Result<_, _>>()?,
    };
    let mut per_layer: Vec<Vec<i64>> = vec![Vec::new(); moe_layers.len()];
    let mut requests = 0;
    for (n, r) in responses.iter().enumerate() {
        for routed in payloads(r, num_layers, top_k).map_err(|e| format!("response {n}: {e}"))? {
            if routed.layers != num_layers || routed.k != top_k {
                return Err(format!(
                    "response {n}: routing of {} layers x top-{}, the model has {num_layers} \
                     layers x top-{top_k}",
                    routed.layers, routed.k
                ));
            }
            for (slot, &l) in moe_layers.iter().enumerate() {
                if l >= num_layers {
                    return Err(format!("MoE layer {l} of {num_layers}"));
                }
                for t in 0..routed.tokens {
                    let at = (t * num_layers + l) * top_k;
                    per_layer[slot].extend_from_slice(&routed.ids[at..at + top_k]);
                }
            }
            requests += 1;
        }
    }
    if requests == 0 {
        return Err(
            "no routed experts in the responses (choices[].routed_experts, \
                    meta_info.routed_experts or sglext.routed_experts): serve with \
                    --enable-return-routed-experts"
                .into(),
        );
    }
    Ok(moe_layers
        .iter()
        .zip(per_layer)
        .map(|(&l, ids)| {
            (
                format!("layers.{l}.topk_ids"),
                Array {
                    shape: vec![ids.len() / top_k, top_k],
                    values: Values::Ints(ids),
                },
            )
        })
        .collect())
}

/// Every request's routing in one response: SGLang's `/generate` (`meta_info`) or OpenAI
/// endpoints (`sglext` beside the choices, the first request's; chat with `return_meta_info`,
/// each choice's `meta_info`), vLLM's choices.
fn payloads(r: &Value, num_layers: usize, top_k: usize) -> Result<Vec<Routed>, String> {
    let mut out = Vec::new();
    for at in ["/meta_info/routed_experts", "/sglext/routed_experts"] {
        if let Some(s) = r.pointer(at).filter(|v| !v.is_null()) {
            out.push(decode(s, None, num_layers, top_k).map_err(|e| format!("{at}: {e}"))?);
        }
    }
    if let Some(choices) = r.get("choices").and_then(Value::as_array) {
        let prompt = r.get("prompt_routed_experts");
        for (i, c) in choices.iter().enumerate() {
            let field = c
                .get("routed_experts")
                .or_else(|| c.pointer("/meta_info/routed_experts"));
            match field {
                Some(Value::Null) | None => {}
                Some(v) => out.push(
                    decode(v, prompt, num_layers, top_k).map_err(|e| format!("choice {i}: {e}"))?,
                ),
            }
        }
    }
    Ok(out)
}

/// One payload: a base64 `.npy` (vLLM), base64 raw int32 (SGLang), or nested lists with the
/// prompt's before them (vLLM v0.21).
fn decode(
    v: &Value,
    prompt: Option<&Value>,
    num_layers: usize,
    top_k: usize,
) -> Result<Routed, String> {
    match v {
        Value::String(s) => {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(s.trim())
                .map_err(|e| format!("routed_experts is not base64: {e}"))?;
            if bytes.starts_with(b"\x93NUMPY") {
                let a = parse_npy(&bytes)?;
                let Values::Ints(ids) = a.values else {
                    return Err("routed_experts holds floats".into());
                };
                let [tokens, layers, k] = a.shape[..] else {
                    return Err(format!(
                        "routed_experts is {:?}, not [tokens, layers, k]",
                        a.shape
                    ));
                };
                return Ok(Routed {
                    tokens,
                    layers,
                    k,
                    ids,
                });
            }
            if bytes.len() % 4 != 0 || bytes.len() % (4 * num_layers * top_k).max(1) != 0 {
                return Err(format!(
                    "{} bytes of int32 routing do not divide into tokens of {num_layers} layers x \
                     top-{top_k}",
                    bytes.len()
                ));
            }
            let ids: Vec<i64> = bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                .collect();
            Ok(Routed {
                tokens: ids.len() / (num_layers * top_k).max(1),
                layers: num_layers,
                k: top_k,
                ids,
            })
        }
        Value::Array(_) => {
            let mut rows = Vec::new();
            for part in prompt.into_iter().chain([v]) {
                rows.extend(nested(part)?);
            }
            let layers = rows.first().map_or(num_layers, Vec::len);
            let k = rows.first().and_then(|t| t.first()).map_or(top_k, Vec::len);
            let mut ids = Vec::with_capacity(rows.len() * layers * k);
            for (t, row) in rows.iter().enumerate() {
                if row.len() != layers || row.iter().any(|l| l.len() != k) {
                    return Err(format!("token {t}: not {layers} layers x {k} experts"));
                }
                ids.extend(row.iter().flatten());
            }
            Ok(Routed {
                tokens: rows.len(),
                layers,
                k,
                ids,
            })
        }
        other => Err(format!("routed_experts is {other}, not base64 or lists")),
    }
}

/// `[tokens][layers][k]` integers.
fn nested(v: &Value) -> Result<Vec<Vec<Vec<i64>>>, String> {
    serde_json::from_value(v.clone())
        .map_err(|e| format!("routed_experts is not [tokens][layers][k] integers: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn model(moe_layers: &[usize]) -> ModelLayers {
        ModelLayers {
            num_layers: 3,
            moe_layers: moe_layers.to_vec(),
            top_k: 2,
        }
    }

    fn b64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    /// `.npy` bytes of a u8 `[t, l, k]` array, as numpy's `np.save` writes them.
    fn npy_u8(shape: [usize; 3], data: &[u8]) -> Vec<u8> {
        let header = format!(
            "{{'descr': '|u1', 'fortran_order': False, 'shape': ({}, {}, {}), }}",
            shape[0], shape[1], shape[2]
        );
        let mut h = header.into_bytes();
        while (10 + h.len() + 1) % 64 != 0 {
            h.push(b' ');
        }
        h.push(b'\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((h.len() as u16).to_le_bytes());
        out.extend(h);
        out.extend(data);
        out
    }

    #[test]
    fn each_engines_payload_reads_to_the_moe_layers() {
        // 3 hidden layers (layer 0 dense), top-2; two tokens.
        let ids: [i32; 12] = [0, 0, 1, 2, 3, 4, 0, 0, 5, 6, 7, 1];
        let raw: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
        let sglang = json!({"text": "..", "meta_info": {"routed_experts": b64(&raw)}});
        let u8s: Vec<u8> = ids.iter().map(|&x| x as u8).collect();
        let vllm =
            json!({"choices": [{"index": 0, "routed_experts": b64(&npy_u8([2, 3, 2], &u8s))}]});
        let lists = json!({"prompt_routed_experts": [[[0, 0], [1, 2], [3, 4]]],
            "choices": [{"routed_experts": [[[0, 0], [5, 6], [7, 1]]]}]});
        let openai = json!({"choices": [{"text": ".."}], "sglext": {"routed_experts": b64(&raw)}});
        let chat = json!({"choices": [{"meta_info": {"routed_experts": b64(&raw)}}]});
        for v in [&sglang, &vllm, &lists, &openai, &chat] {
            let a = read_r3(&v.to_string(), &model(&[1, 2])).unwrap();
            assert_eq!(
                a["layers.1.topk_ids"].values,
                Values::Ints(vec![1, 2, 5, 6]),
                "{v}"
            );
            assert_eq!(a["layers.2.topk_ids"].shape, vec![2, 2]);
        }
        // Several responses, a list or one a line: requests in order.
        let two = format!("{sglang}\n{vllm}\n");
        assert_eq!(
            read_r3(&two, &model(&[1, 2])).unwrap()["layers.1.topk_ids"].shape,
            vec![4, 2]
        );
        let list = json!([sglang, vllm]).to_string();
        assert_eq!(
            read_r3(&list, &model(&[1, 2])).unwrap()["layers.2.topk_ids"].shape,
            vec![4, 2]
        );
    }

    #[test]
    fn what_does_not_fit_the_model_is_named() {
        let raw: Vec<u8> = [1i32, 2, 3].iter().flat_map(|x| x.to_le_bytes()).collect();
        let cases = [
            (
                json!({"meta_info": {"routed_experts": b64(&raw)}}),
                "12 bytes of int32",
            ),
            (json!({"meta_info": {"routed_experts": "%%"}}), "not base64"),
            (
                json!({"choices": [{"routed_experts": null}]}),
                "no routed experts",
            ),
            (
                json!({"choices": [{"routed_experts": [[[1, 2]]]}]}),
                "1 layers x top-2",
            ),
            (
                json!({"choices": [{"routed_experts": 5}]}),
                "not base64 or lists",
            ),
        ];
        for (v, want) in cases {
            let err = read_r3(&v.to_string(), &model(&[1, 2])).unwrap_err();
            assert!(err.contains(want), "{v}: {err}");
        }
        assert!(read_r3("{\"a\": 1}\nnot json\n", &model(&[1]))
            .unwrap_err()
            .contains("line 2"));
    }

    /// Responses the engines' own code encoded (`scripts/make_r3_fixtures.py`: SGLang 0.5.23,
    /// vLLM 0.34.0) read to the seeded routing in `expected.json`.
    #[test]
    fn the_engines_own_responses_read_to_the_seeded_routing() {
        let expected: Value =
            serde_json::from_str(include_str!("../../../tests/fixtures/r3/expected.json")).unwrap();
        let fixtures = [
            (
                "sglang_generate.json",
                include_str!("../../../tests/fixtures/r3/sglang_generate.json"),
            ),
            (
                "vllm_completion.json",
                include_str!("../../../tests/fixtures/r3/vllm_completion.json"),
            ),
            (
                "sglang_openai_completion.json",
                include_str!("../../../tests/fixtures/r3/sglang_openai_completion.json"),
            ),
        ];
        for (name, text) in fixtures {
            let e = &expected["fixtures"][name];
            let ints = |v: &Value| -> Vec<usize> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as usize)
                    .collect()
            };
            let model = ModelLayers {
                num_layers: e["num_layers"].as_u64().unwrap() as usize,
                moe_layers: ints(&e["moe_layers"]),
                top_k: e["top_k"].as_u64().unwrap() as usize,
            };
            let got = read_r3(text, &model).unwrap_or_else(|err| panic!("{name}: {err}"));
            assert_eq!(got.len(), model.moe_layers.len(), "{name}");
            let tokens = e["tokens"].as_u64().unwrap() as usize;
            for &l in &model.moe_layers {
                let want: Vec<i64> = e["layers"][l.to_string()]
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()))
                    .collect();
                let a = &got[&format!("layers.{l}.topk_ids")];
                assert_eq!(a.shape, vec![tokens, model.top_k], "{name} layer {l}");
                assert_eq!(a.values, Values::Ints(want), "{name} layer {l}");
            }
        }
    }
}
