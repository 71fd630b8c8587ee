//! Megatron-Core's routing trace (`--moe-routing-trace-path DIR`, NVIDIA/Megatron-LM PR 5220,
//! `megatron/core/transformer/moe/router_trace.py`): one `router_trace_rank{R}.jsonl` per rank,
//! one JSON object a line, one line per router call:
//!
//! ```json
//! {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
//!  "num_tokens": 2, "topk": 2, "top_indices": [[12, 45], [3, 7]]}
//! ```
//!
//! In training (the router's forward hook), `layer` is the index in the decoder's layer list
//! (dense layers counted, from 0) and `top_indices` the `[num_tokens, topk]` logical experts of
//! each token in ascending expert order (taken from the routing map), so the trace has no score
//! order and no gate weights: placement and E[C_T] need neither, pruning by the router's scores
//! needs logits. Multi-token-prediction records (`"block": "mtp"`, with `mtp_idx`) are left out
//! and counted: their layer indices are another list's. Held to Megatron's own writer by
//! `tests/fixtures/megatron/` (`scripts/make_megatron_trace_fixtures.py`, Megatron-LM d98e8a64).
//!
//! What the file does not say, and a user must: under pipeline parallelism each stage numbers
//! its layers from 0 (and virtual-pipeline chunks reuse the numbers in one file), so import one
//! stage's ranks at a time; Megatron's inference path records TransformerLayer's global
//! `layer_number` (from 1) with the ids in score order instead. Optional keys (`hs_offset`,
//! `logit_offset`, ... of the sidecar files) are ignored.

use super::super::arrays::{Array, Values};
use serde::Deserialize;
use std::collections::BTreeMap;

/// One router call.
#[derive(Debug, Deserialize)]
struct Record {
    #[serde(default)]
    block: Option<String>,
    layer: usize,
    num_tokens: usize,
    topk: usize,
    top_indices: Vec<Vec<i64>>,
}

/// What a trace file held: each layer's ids as `layers.{L}.topk_ids` arrays (what
/// [`super::super::routing_import::from_arrays`] reads), and the MTP records left out.
pub struct RouterTrace {
    pub arrays: BTreeMap<String, Array>,
    pub mtp_records: usize,
}

/// Reads one rank's JSONL file; every record's tokens appended to its layer in file order.
pub fn read_router_trace(text: &str) -> Result<RouterTrace, String> {
    let mut layers: BTreeMap<usize, (usize, Vec<i64>, usize)> = BTreeMap::new();
    let mut mtp_records = 0;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("line {}", i + 1);
        let r: Record = serde_json::from_str(line).map_err(|e| {
            format!(
                "{}: not a Megatron router-trace record (step, layer, num_tokens, topk, \
                 top_indices): {e}",
                at()
            )
        })?;
        match r.block.as_deref() {
            None | Some("decoder") => {}
            Some("mtp") => {
                mtp_records += 1;
                continue;
            }
            Some(other) => return Err(format!("{}: block {other:?} is not decoder or mtp", at())),
        }
        if r.top_indices.len() != r.num_tokens {
            return Err(format!(
                "{}: {} rows of top_indices for num_tokens = {}",
                at(),
                r.top_indices.len(),
                r.num_tokens
            ));
        }
        if r.topk == 0 {
            return Err(format!("{}: topk is 0", at()));
        }
        let entry = layers.entry(r.layer).or_insert((r.topk, Vec::new(), 0));
        if entry.0 != r.topk {
            return Err(format!(
                "{}: layer {} has topk {}, earlier records {}",
                at(),
                r.layer,
                r.topk,
                entry.0
            ));
        }
        for (t, row) in r.top_indices.iter().enumerate() {
            if row.len() != r.topk {
                return Err(format!(
                    "{}: token {t} has {} experts, topk is {}",
                    at(),
                    row.len(),
                    r.topk
                ));
            }
            entry.1.extend(row);
        }
        entry.2 += r.num_tokens;
    }
    if layers.is_empty() {
        return Err("no decoder router records".into());
    }
    let arrays = layers
        .into_iter()
        .map(|(l, (k, ids, tokens))| {
            (
                format!("layers.{l}.topk_ids"),
                Array {
                    shape: vec![tokens, k],
                    values: Values::Ints(ids),
                },
            )
        })
        .collect();
    Ok(RouterTrace {
        arrays,
        mtp_records,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_join_by_layer_in_file_order() {
        let text = r#"{"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0, "num_tokens": 2, "topk": 2, "top_indices": [[1, 5], [0, 7]]}
{"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 4, "rank": 0, "num_tokens": 1, "topk": 2, "top_indices": [[2, 3]]}
{"step": 1, "stage": "pre_dispatch", "block": "mtp", "mtp_idx": 0, "layer": 0, "rank": 0, "num_tokens": 1, "topk": 2, "top_indices": [[2, 3]]}

{"step": 1, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0, "num_tokens": 1, "topk": 2, "top_indices": [[4, 6]], "hs_offset": 0}
"#;
        let r = read_router_trace(text).unwrap();
        assert_eq!(r.mtp_records, 1);
        let l3 = &r.arrays["layers.3.topk_ids"];
        assert_eq!(l3.shape, vec![3, 2]);
        assert_eq!(l3.values, Values::Ints(vec![1, 5, 0, 7, 4, 6]));
        assert_eq!(r.arrays["layers.4.topk_ids"].shape, vec![1, 2]);
    }

    #[test]
    fn bad_records_are_named_by_line() {
        let rec = |s: &str| format!("{{\"step\": 0, \"layer\": 1, {s}}}\n");
        let cases = [
            (
                rec("\"num_tokens\": 2, \"topk\": 1, \"top_indices\": [[1]]"),
                "1 rows",
            ),
            (
                rec("\"num_tokens\": 1, \"topk\": 2, \"top_indices\": [[1]]"),
                "token 0 has 1",
            ),
            (
                rec("\"num_tokens\": 1, \"topk\": 1"),
                "line 1: not a Megatron",
            ),
            (
                rec("\"block\": \"x\", \"num_tokens\": 1, \"topk\": 1, \"top_indices\": [[1]]"),
                "block \"x\"",
            ),
            (String::new(), "no decoder router records"),
        ];
        for (text, want) in cases {
            let err = read_router_trace(&text).err().unwrap();
            assert!(err.contains(want), "{err} lacks {want}");
        }
        let two = rec("\"num_tokens\": 1, \"topk\": 1, \"top_indices\": [[1]]")
            + &rec("\"num_tokens\": 1, \"topk\": 2, \"top_indices\": [[1, 2]]");
        assert!(read_router_trace(&two)
            .err()
            .unwrap()
            .contains("line 2: layer 1 has topk 2"));
    }

    /// Megatron's own writer (`router_trace.py` at NVIDIA/Megatron-LM d98e8a64, training-mode
    /// hooks, `scripts/make_megatron_trace_fixtures.py`): two ranks' files, joined in rank order,
    /// give the ids the script fed its routers.
    #[test]
    fn megatrons_own_files_give_the_seeded_routing() {
        let ranks = [
            include_str!("../../../../tests/fixtures/megatron/router_trace_rank0.jsonl"),
            include_str!("../../../../tests/fixtures/megatron/router_trace_rank1.jsonl"),
        ];
        let expected: serde_json::Value = serde_json::from_str(include_str!(
            "../../../../tests/fixtures/megatron/expected.json"
        ))
        .unwrap();
        let topk = expected["topk"].as_u64().unwrap() as usize;
        let mut joined: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        let mut mtp = 0;
        for text in ranks {
            let t = read_router_trace(text).unwrap();
            mtp += t.mtp_records;
            for (name, a) in t.arrays {
                assert_eq!(a.shape[1], topk, "{name}");
                let Values::Ints(ids) = a.values else {
                    panic!("{name} is not ids")
                };
                assert_eq!(ids.len(), a.shape[0] * topk, "{name}");
                joined.entry(name).or_default().extend(ids);
            }
        }
        let want: BTreeMap<String, Vec<i64>> = expected["layers"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(l, ids)| {
                let ids = ids.as_array().unwrap().iter();
                (
                    format!("layers.{l}.topk_ids"),
                    ids.map(|i| i.as_i64().unwrap()).collect(),
                )
            })
            .collect();
        assert_eq!(
            joined.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>()
        );
        assert_eq!(joined, want);
        assert_eq!(mtp as u64, expected["mtp_records"].as_u64().unwrap());
    }
}
