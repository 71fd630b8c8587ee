//! TensorRT-LLM's expert-statistic dump (`EXPERT_STATISTIC_PATH=DIR`,
//! `EXPERT_STATISTIC_ITER_RANGE=start-stop`; `tensorrt_llm/_torch/expert_statistic.py`), read as
//! routing. The folder holds `meta_info.json` (`num_experts`, `num_experts_per_token`) and, per
//! rank `R`, `rank{R}.safetensors`: each key `"{iter}_{layer}"` a count of tokens per expert.
//! Counts give each expert's load but not which experts a token uses together, which placement
//! for E[C_T] needs; the co-occurrence variant of the dump (its
//! `examples/wide_ep/ep_load_balancer` tooling) also writes `token_selected_experts_rank{R}
//! .safetensors`, the same keys each holding the `[tokens, top_k]` experts of that iteration and
//! layer. Those are read here: per layer, iterations in order, ranks in order. The ids are
//! slots, not experts, where TensorRT-LLM's load balancer was on: record without it.

use super::super::arrays::{read_safetensors, Array, Values};
use std::collections::BTreeMap;
use std::path::Path;

/// The routing in a dump folder, as `layers.{L}.topk_ids` arrays.
pub fn read_statistic_dir(dir: &Path) -> Result<BTreeMap<String, Array>, String> {
    let meta_path = dir.join("meta_info.json");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&meta_path).map_err(|e| {
            format!(
                "{}: {e} (not an expert-statistic dump?)",
                meta_path.display()
            )
        })?)
        .map_err(|e| format!("{}: not JSON: {e}", meta_path.display()))?;
    let k = meta["num_experts_per_token"]
        .as_u64()
        .ok_or_else(|| format!("{}: no num_experts_per_token", meta_path.display()))?
        as usize;
    // The files of each rank, in rank order.
    let mut ranked: BTreeMap<usize, std::path::PathBuf> = BTreeMap::new();
    let mut counts_only = 0;
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        if let Some(r) = name
            .strip_prefix("token_selected_experts_rank")
            .and_then(|s| s.strip_suffix(".safetensors"))
        {
            let r: usize = r.parse().map_err(|_| format!("{name}: not rank{{R}}"))?;
            ranked.insert(r, path);
        } else if name.starts_with("rank") && name.ends_with(".safetensors") {
            counts_only += 1;
        }
    }
    if ranked.is_empty() {
        return Err(if counts_only > 0 {
            format!(
                "{}: {counts_only} rank files of expert counts, which give loads but not which \
                 experts a token uses together; dump with TensorRT-LLM's co-occurrence \
                 statistics (token_selected_experts_rank*.safetensors)",
                dir.display()
            )
        } else {
            format!(
                "{}: no token_selected_experts_rank*.safetensors",
                dir.display()
            )
        });
    }
    // layer -> iter -> rank -> ids
    let mut layers: BTreeMap<usize, Vec<i64>> = BTreeMap::new();
    let mut by_key: BTreeMap<(usize, usize, usize), Vec<i64>> = BTreeMap::new();
    for (&r, path) in &ranked {
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let arrays = read_safetensors(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        for (key, a) in arrays {
            let at = |m: &str| format!("{}: {key}: {m}", path.display());
            let (iter, layer) = key
                .split_once('_')
                .and_then(|(i, l)| Some((i.parse::<usize>().ok()?, l.parse::<usize>().ok()?)))
                .ok_or_else(|| at("not \"{iter}_{layer}\""))?;
            let Values::Ints(ids) = a.values else {
                return Err(at("holds floats, not expert ids"));
            };
            if a.shape.len() != 2 || a.shape[1] != k {
                return Err(at(&format!(
                    "shape {:?}, not [tokens, {k}] (num_experts_per_token)",
                    a.shape
                )));
            }
            by_key.insert((layer, iter, r), ids);
        }
    }
    for ((layer, _, _), ids) in by_key {
        layers.entry(layer).or_default().extend(ids);
    }
    Ok(layers
        .into_iter()
        .map(|(l, ids)| {
            (
                format!("layers.{l}.topk_ids"),
                Array {
                    shape: vec![ids.len() / k.max(1), k],
                    values: Values::Ints(ids),
                },
            )
        })
        .collect())
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
}
