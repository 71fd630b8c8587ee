//! TensorRT-LLM's expert-statistic dump (`EXPERT_STATISTIC_PATH=DIR`,
//! `EXPERT_STATISTIC_ITER_RANGE=start-stop`; `tensorrt_llm/_torch/expert_statistic.py`). The
//! folder holds `meta_info.json` (`num_experts`, `num_experts_per_token`) and, per rank `R`,
//! `rank{R}.safetensors`: each key `"{iter}_{layer}"` a count of tokens per expert. The
//! co-occurrence variant of the dump (its `examples/wide_ep/ep_load_balancer` tooling) also
//! writes `token_selected_experts_rank{R}.safetensors`, the same keys each holding the
//! `[tokens, top_k]` experts of that iteration and layer. Another version of the writer keeps
//! the ids as `rank{R}_raw.safetensors` (read by its `utils.py`'s `load_raw_expert_statistic`),
//! one tensor per key: where a layer ran in several chunks in an iteration, the last chunk's.
//!
//! Read two ways: the per-token experts as routing ([`read_statistic_dir`]: per layer,
//! iterations in order, ranks in order), which placement for E[C_T] needs; and the counts
//! alone as each layer's expert loads ([`read_statistic_counts`], summed as TensorRT-LLM's
//! `generate_eplb_config.py` sums them), which give balance but not which experts a token uses
//! together (`occult place --loads`). The ids are slots, not experts, where TensorRT-LLM's load
//! balancer was on: record without it.

use super::super::arrays::{read_safetensors, Array, Values};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What `meta_info.json` says: the experts and each token's top-k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DumpMeta {
    pub num_experts: usize,
    pub top_k: usize,
}

/// Reads `meta_info.json`'s text.
pub fn parse_meta(text: &str) -> Result<DumpMeta, String> {
    let meta: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let field = |k: &str| {
        meta[k]
            .as_u64()
            .filter(|&n| n > 0 && n <= crate::analysis::trace::MAX_EXPERTS as u64)
            .map(|n| n as usize)
            .ok_or_else(|| format!("no {k} (a positive count)"))
    };
    Ok(DumpMeta {
        num_experts: field("num_experts")?,
        top_k: field("num_experts_per_token")?,
    })
}

/// One file's tensors: each `(layer, iter)` key's integers, flat.
pub type Keyed = Vec<((usize, usize), Vec<i64>)>;

/// A key `"{iter}_{layer}"` as `(iter, layer)`.
fn iter_layer(key: &str) -> Result<(usize, usize), String> {
    key.split_once('_')
        .and_then(|(i, l)| Some((i.parse::<usize>().ok()?, l.parse::<usize>().ok()?)))
        .ok_or_else(|| format!("{key}: not \"{{iter}}_{{layer}}\""))
}

/// One `token_selected_experts_rank{R}.safetensors`: each `(layer, iter)`'s `[tokens, top_k]`
/// expert ids, flat.
pub fn parse_ids_file(bytes: &[u8], meta: DumpMeta) -> Result<Keyed, String> {
    let k = meta.top_k;
    let mut out = Vec::new();
    for (key, a) in read_safetensors(bytes)? {
        let (iter, layer) = iter_layer(&key)?;
        let Values::Ints(ids) = a.values else {
            return Err(format!("{key}: holds floats, not expert ids"));
        };
        if a.shape.len() != 2 || a.shape[1] != k {
            return Err(format!(
                "{key}: shape {:?}, not [tokens, {k}] (num_experts_per_token)",
                a.shape
            ));
        }
        out.push(((layer, iter), ids));
    }
    Ok(out)
}

/// One plain `rank{R}.safetensors`: each `(layer, iter)`'s tokens per expert.
pub fn parse_counts_file(bytes: &[u8], meta: DumpMeta) -> Result<Keyed, String> {
    let e = meta.num_experts;
    let mut out = Vec::new();
    for (key, a) in read_safetensors(bytes)? {
        let (iter, layer) = iter_layer(&key)?;
        let Values::Ints(counts) = a.values else {
            return Err(format!("{key}: holds floats, not token counts"));
        };
        if a.shape != [e] {
            return Err(format!(
                "{key}: shape {:?}, not [{e}] (num_experts)",
                a.shape
            ));
        }
        if let Some(c) = counts.iter().find(|&&c| c < 0) {
            return Err(format!("{key}: count {c}"));
        }
        out.push(((layer, iter), counts));
    }
    Ok(out)
}

/// A dump folder: its meta and each rank's files of each kind, in rank order.
struct Dump {
    meta: DumpMeta,
    /// `token_selected_experts_rank{R}.safetensors` (the co-occurrence variant).
    ids: BTreeMap<usize, PathBuf>,
    /// `rank{R}_raw.safetensors` (a variant that keeps each key's last batch of ids).
    raw: BTreeMap<usize, PathBuf>,
    /// `rank{R}.safetensors`: tokens per expert.
    counts: BTreeMap<usize, PathBuf>,
}

/// The rank in `name` if it is `{prefix}{R}{suffix}` (`R` decimal digits).
fn rank_of(name: &str, prefix: &str, suffix: &str) -> Option<usize> {
    let r = name.strip_prefix(prefix)?.strip_suffix(suffix)?;
    if r.is_empty() || !r.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    r.parse().ok()
}

fn open(dir: &Path) -> Result<Dump, String> {
    let text = std::fs::read_to_string(dir.join("meta_info.json"))
        .map_err(|e| format!("meta_info.json: {e} (not an expert-statistic dump?)"))?;
    let meta = parse_meta(&text).map_err(|e| format!("meta_info.json: {e}"))?;
    let mut dump = Dump {
        meta,
        ids: BTreeMap::new(),
        raw: BTreeMap::new(),
        counts: BTreeMap::new(),
    };
    let entries = std::fs::read_dir(dir).map_err(|e| e.to_string())?;
    for entry in entries {
        let path = entry
            .map_err(|e| format!("listing the folder: {e}"))?
            .path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let (kind, r) =
            if let Some(r) = rank_of(&name, "token_selected_experts_rank", ".safetensors") {
                (&mut dump.ids, r)
            } else if let Some(r) = rank_of(&name, "rank", "_raw.safetensors") {
                (&mut dump.raw, r)
            } else if let Some(r) = rank_of(&name, "rank", ".safetensors") {
                (&mut dump.counts, r)
            } else {
                continue;
            };
        if let Some(other) = kind.insert(r, path) {
            return Err(format!(
                "{name} and {} are both rank {r}'s",
                other
                    .file_name()
                    .map_or(String::new(), |n| n.to_string_lossy().to_string())
            ));
        }
    }
    Ok(dump)
}

/// A parser of one rank's file.
type Parse = fn(&[u8], DumpMeta) -> Result<Keyed, String>;

/// Every `(layer, iter, rank)`'s integers.
type ByKey = BTreeMap<(usize, usize, usize), Vec<i64>>;

/// Every `(layer, iter, rank)`'s values in the files `ranked`, each file parsed by `parse`.
fn read_all(
    ranked: &BTreeMap<usize, PathBuf>,
    meta: DumpMeta,
    parse: Parse,
) -> Result<ByKey, String> {
    let mut by_key = BTreeMap::new();
    for (&r, path) in ranked {
        let name = path
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().to_string());
        let bytes = std::fs::read(path).map_err(|e| format!("{name}: {e}"))?;
        for ((layer, iter), v) in parse(&bytes, meta).map_err(|e| format!("{name}: {e}"))? {
            by_key.insert((layer, iter, r), v);
        }
    }
    Ok(by_key)
}

/// The routing in a dump folder, as `layers.{L}.topk_ids` arrays: from the co-occurrence
/// variant's `token_selected_experts_rank{R}.safetensors`, else from `rank{R}_raw.safetensors`.
/// Errors name the file, not the folder (the caller does).
pub fn read_statistic_dir(dir: &Path) -> Result<BTreeMap<String, Array>, String> {
    let dump = open(dir)?;
    let ranked = if dump.ids.is_empty() {
        &dump.raw
    } else {
        &dump.ids
    };
    if ranked.is_empty() {
        return Err(if dump.counts.is_empty() {
            "no token_selected_experts_rank*.safetensors (nor rank*_raw.safetensors)".to_string()
        } else {
            format!(
                "{} rank files of expert counts, which give loads but not which experts a \
                 token uses together: place for load alone with `occult place --loads {}`, or \
                 dump with TensorRT-LLM's co-occurrence statistics \
                 (token_selected_experts_rank*.safetensors) for a trace",
                dump.counts.len(),
                dir.display()
            )
        });
    }
    let k = dump.meta.top_k;
    let mut layers: BTreeMap<usize, Vec<i64>> = BTreeMap::new();
    for ((layer, _, _), ids) in read_all(ranked, dump.meta, parse_ids_file)? {
        layers.entry(layer).or_default().extend(ids);
    }
    Ok(layers
        .into_iter()
        .map(|(l, ids)| {
            (
                format!("layers.{l}.topk_ids"),
                Array {
                    shape: vec![ids.len() / k, k],
                    values: Values::Ints(ids),
                },
            )
        })
        .collect())
}

/// Each layer's tokens per expert in a dump folder's plain `rank{R}.safetensors`, summed over
/// its iterations and ranks (as TensorRT-LLM's `generate_eplb_config.py` sums them), and the
/// expert count.
pub fn read_statistic_counts(dir: &Path) -> Result<(usize, BTreeMap<usize, Vec<f64>>), String> {
    let dump = open(dir)?;
    if dump.counts.is_empty() {
        return Err("no rank*.safetensors of expert counts".into());
    }
    let e = dump.meta.num_experts;
    let mut layers: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for ((layer, _, _), counts) in read_all(&dump.counts, dump.meta, parse_counts_file)? {
        let sum = layers.entry(layer).or_insert_with(|| vec![0.0; e]);
        for (s, c) in sum.iter_mut().zip(counts) {
            *s += c as f64;
        }
    }
    if layers.is_empty() {
        return Err("the rank files hold no counts".into());
    }
    Ok((e, layers))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_ids(path: &Path, tensors: &[(&str, Vec<i32>, usize)]) {
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .map(|(name, ids, k)| {
                let bytes: &[u8] = bytemuck::cast_slice(ids);
                (
                    name.to_string(),
                    safetensors::tensor::TensorView::new(
                        safetensors::Dtype::I32,
                        vec![ids.len() / k, *k],
                        bytes,
                    )
                    .unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    #[test]
    fn iterations_then_ranks_join_per_layer() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("meta_info.json"),
            r#"{"num_experts": 8, "num_experts_per_token": 2}"#,
        )
        .unwrap();
        write_ids(
            &d.path().join("token_selected_experts_rank1.safetensors"),
            &[("100_3", vec![6, 7], 2), ("101_3", vec![0, 1], 2)],
        );
        write_ids(
            &d.path().join("token_selected_experts_rank0.safetensors"),
            &[("100_3", vec![2, 3, 4, 5], 2), ("100_4", vec![1, 2], 2)],
        );
        write_ids(&d.path().join("rank0.safetensors"), &[]);
        let a = read_statistic_dir(d.path()).unwrap();
        assert_eq!(
            a["layers.3.topk_ids"].values,
            Values::Ints(vec![2, 3, 4, 5, 6, 7, 0, 1])
        );
        assert_eq!(a["layers.4.topk_ids"].shape, vec![1, 2]);
    }

    #[test]
    fn counts_alone_and_bad_keys_are_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        assert!(read_statistic_dir(d.path())
            .unwrap_err()
            .contains("meta_info.json"));
        std::fs::write(d.path().join("meta_info.json"), r#"{"num_experts": 8}"#).unwrap();
        assert!(read_statistic_dir(d.path())
            .unwrap_err()
            .contains("num_experts_per_token"));
        std::fs::write(
            d.path().join("meta_info.json"),
            r#"{"num_experts": 8, "num_experts_per_token": 2}"#,
        )
        .unwrap();
        write_ids(&d.path().join("rank0.safetensors"), &[]);
        assert!(read_statistic_dir(d.path())
            .unwrap_err()
            .contains("give loads but not"));
        write_ids(
            &d.path().join("token_selected_experts_rank0.safetensors"),
            &[("x_3", vec![1, 2], 2)],
        );
        assert!(read_statistic_dir(d.path()).unwrap_err().contains("x_3"));
        write_ids(
            &d.path().join("token_selected_experts_rank0.safetensors"),
            &[("1_3", vec![1, 2, 3], 3)],
        );
        assert!(read_statistic_dir(d.path())
            .unwrap_err()
            .contains("not [tokens, 2]"));
    }

    fn write_counts(path: &Path, tensors: &[(&str, Vec<i64>)]) {
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .map(|(name, c)| {
                let bytes: &[u8] = bytemuck::cast_slice(c);
                let view = safetensors::tensor::TensorView::new(
                    safetensors::Dtype::I64,
                    vec![c.len()],
                    bytes,
                )
                .unwrap();
                (name.to_string(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    /// The plain dump's counts sum per layer over iterations and ranks; the trace reader points
    /// to the load-only placement, and a count of the wrong width is named.
    #[test]
    fn counts_sum_per_layer_over_iterations_and_ranks() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("meta_info.json"),
            r#"{"num_experts": 4, "num_experts_per_token": 2}"#,
        )
        .unwrap();
        write_counts(
            &d.path().join("rank0.safetensors"),
            &[
                ("10_3", vec![1, 0, 2, 1]),
                ("11_3", vec![0, 4, 0, 0]),
                ("10_5", vec![2, 2, 0, 0]),
            ],
        );
        write_counts(
            &d.path().join("rank1.safetensors"),
            &[("10_3", vec![3, 3, 0, 0])],
        );
        let (e, layers) = read_statistic_counts(d.path()).unwrap();
        assert_eq!(e, 4);
        assert_eq!(layers[&3], vec![4.0, 7.0, 2.0, 1.0]);
        assert_eq!(layers[&5], vec![2.0, 2.0, 0.0, 0.0]);
        let err = read_statistic_dir(d.path()).unwrap_err();
        assert!(err.contains("occult place --loads"), "{err}");
        write_counts(
            &d.path().join("rank1.safetensors"),
            &[("10_3", vec![3, 3, 0])],
        );
        let err = read_statistic_counts(d.path()).unwrap_err();
        assert!(
            err.contains("rank1.safetensors: 10_3: shape [3], not [4]"),
            "{err}"
        );
        write_counts(
            &d.path().join("rank1.safetensors"),
            &[("10_3", vec![3, -1, 0, 0])],
        );
        assert!(read_statistic_counts(d.path())
            .unwrap_err()
            .contains("count -1"));
    }

    /// A dump written by TensorRT-LLM's own `expert_statistic.py` (the co-occurrence writer, 2
    /// ranks, steps 100..102, MoE layers 1 and 3; scripts/make_trtllm_statistic_fixtures.py)
    /// reads back as the seeded routing: per layer iterations in order then ranks in order, and
    /// the counts summed over both.
    #[test]
    fn trtllm_written_dump_reads_as_its_routing() {
        let dir = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/trtllm/expert_statistic"
        ));
        let want: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.with_extension("expected.json")).unwrap(),
        )
        .unwrap();
        let k = want["top_k"].as_u64().unwrap() as usize;
        let layers = want["layers"].as_object().unwrap();
        let ids = read_statistic_dir(dir).unwrap();
        assert_eq!(ids.len(), layers.len());
        let (e, counts) = read_statistic_counts(dir).unwrap();
        assert_eq!(e as u64, want["num_experts"].as_u64().unwrap());
        assert_eq!(counts.len(), layers.len());
        for (l, w) in layers {
            let rows = w["topk_ids"].as_array().unwrap();
            let flat: Vec<i64> = rows
                .iter()
                .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_i64().unwrap()))
                .collect();
            let got = &ids[&format!("layers.{l}.topk_ids")];
            assert_eq!(got.shape, vec![rows.len(), k], "layer {l}");
            assert_eq!(got.values, Values::Ints(flat), "layer {l}");
            let sums: Vec<f64> = w["counts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            assert_eq!(counts[&l.parse::<usize>().unwrap()], sums, "layer {l}");
        }
    }

    /// The raw variant's `rank{R}_raw.safetensors` read as the ids beside the counts; two files
    /// that name one rank are refused by name.
    #[test]
    fn raw_ids_read_and_a_rank_named_twice_is_refused() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("meta_info.json"),
            r#"{"num_experts": 4, "num_experts_per_token": 2}"#,
        )
        .unwrap();
        write_counts(
            &d.path().join("rank0.safetensors"),
            &[("1_2", vec![1, 1, 0, 0])],
        );
        write_ids(
            &d.path().join("rank0_raw.safetensors"),
            &[("1_2", vec![0, 1], 2)],
        );
        let a = read_statistic_dir(d.path()).unwrap();
        assert_eq!(a["layers.2.topk_ids"].values, Values::Ints(vec![0, 1]));
        assert_eq!(
            read_statistic_counts(d.path()).unwrap().1[&2],
            vec![1.0, 1.0, 0.0, 0.0]
        );
        write_counts(
            &d.path().join("rank00.safetensors"),
            &[("1_2", vec![5, 0, 0, 0])],
        );
        let err = read_statistic_counts(d.path()).unwrap_err();
        assert!(err.contains("are both rank 0's"), "{err}");
        std::fs::remove_file(d.path().join("rank00.safetensors")).unwrap();
        // Not a rank: left alone.
        write_counts(
            &d.path().join("rank+1.safetensors"),
            &[("1_2", vec![5, 0, 0, 0])],
        );
        assert_eq!(
            read_statistic_counts(d.path()).unwrap().1[&2],
            vec![1.0, 1.0, 0.0, 0.0]
        );
    }
}
