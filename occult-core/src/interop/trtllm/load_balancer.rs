//! TensorRT-LLM's static load-balancer file, the YAML its WIDEEP MoE backend reads through
//! `moe_config: {backend: WIDEEP, load_balancer: FILE}` (read at NVIDIA/TensorRT-LLM
//! `tensorrt_llm/llmapi/llm_args.py`, `MoeLoadBalancerConfig`, and the fused-MoE modules'
//! checks; written as `examples/wide_ep/ep_load_balancer/generate_eplb_config.py` writes it):
//!
//! ```yaml
//! initial_global_assignments:
//!   3: [0, 1, 2, 3, 0, 1]
//!   4: [3, 2, 1, 0, 3, 2]
//! layer_updates_per_iter: 0
//! num_slots: 6
//! ```
//!
//! Keys are the model's decoder-layer indices (DeepSeek-R1's start at 3: its first layers are
//! dense), every MoE layer present; each list is `num_slots` logical expert ids, slot `s` on
//! rank `s / (num_slots / ep_size)`, every expert at least once. `layer_updates_per_iter: 0`
//! keeps the assignment static. The engine takes exactly these three keys (a strict pydantic
//! model): `ep_size` comes from its own parallel settings. TensorRT-LLM's co-occurrence
//! generator also writes `ep_size`, which the engine refuses; the reader here takes it as the
//! EP size, and [`check_servable`] names it.

use crate::analysis::placement::Placement;
use crate::interop::slots::{layer_rows, placement_from_rows};
use crate::{bail, Error, Result};
use serde::Deserialize;
use std::collections::BTreeMap;

/// The file as TensorRT-LLM's generators write it (`yaml.dump` with flow-style lists: keys
/// sorted, one layer a line), from a placement whose layers are the model's MoE layers.
pub fn load_balancer_file(p: &Placement) -> Result<String> {
    let rows = layer_rows(p)?;
    let num_slots = rows.first().map_or(0, |r| r.1.len());
    let mut text = String::from("initial_global_assignments:\n");
    for (layer, row) in &rows {
        let ids: Vec<String> = row.iter().map(u32::to_string).collect();
        text += &format!("  {layer}: [{}]\n", ids.join(", "));
    }
    text += &format!("layer_updates_per_iter: 0\nnum_slots: {num_slots}\n");
    Ok(text)
}

/// The file's fields (the engine's three, and the co-occurrence generator's `ep_size`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadBalancerFile {
    pub num_slots: Option<usize>,
    pub initial_global_assignments: Option<BTreeMap<usize, Vec<u32>>>,
    #[serde(default)]
    pub layer_updates_per_iter: i64,
    pub ep_size: Option<usize>,
}

/// Parses the YAML, naming the line of a syntax error and any key the engine does not take.
pub fn parse(text: &str) -> Result<LoadBalancerFile> {
    serde_norway::from_str(text).map_err(|e| {
        Error::invalid(format!(
            "not a TensorRT-LLM load-balancer file (keys num_slots, \
             initial_global_assignments, layer_updates_per_iter): {e}"
        ))
    })
}

/// The placement the file stands for on `ep_size` ranks (`None`: the file's own `ep_size`,
/// which only the co-occurrence generator writes), checked as TensorRT-LLM checks it: a list of
/// `num_slots` ids for every layer, `num_slots` a multiple of the EP size and at least the
/// experts, every expert `0..E` at least once (E: the distinct ids, the same in every layer).
pub fn placement_of(f: &LoadBalancerFile, ep_size: Option<usize>) -> Result<Placement> {
    let Some(num_slots) = f.num_slots else {
        bail!("num_slots is not set (TensorRT-LLM refuses a load balancer without it)");
    };
    let Some(assign) = &f.initial_global_assignments else {
        bail!(
            "initial_global_assignments is not set: the file places nothing (TensorRT-LLM then \
             starts from its own round-robin assignment)"
        );
    };
    let ep = match (ep_size, f.ep_size) {
        (Some(a), Some(b)) if a != b => {
            bail!("the EP size given ({a}) differs from the file's ep_size ({b})")
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => bail!(
            "the file does not say its EP size (TensorRT-LLM takes it from the serving \
             settings): give it"
        ),
    };
    if ep == 0 || num_slots % ep != 0 {
        bail!("num_slots {num_slots} is not a multiple of the EP size {ep}");
    }
    let mut num_experts = None;
    let mut rows = Vec::with_capacity(assign.len());
    for (&layer, row) in assign {
        if row.len() != num_slots {
            bail!(
                "layer {layer}: {} expert ids for num_slots = {num_slots}",
                row.len()
            );
        }
        let distinct: std::collections::BTreeSet<u32> = row.iter().copied().collect();
        let e = distinct.len();
        if distinct.last().is_some_and(|&m| m as usize != e - 1) {
            bail!(
                "layer {layer}: its ids are not every expert 0..{} (TensorRT-LLM requires each \
                 logical expert at least once)",
                distinct.last().map_or(0, |&m| m)
            );
        }
        match num_experts {
            None => num_experts = Some(e),
            Some(n) if n != e => bail!("layer {layer} holds {e} experts, an earlier layer {n}"),
            Some(_) => {}
        }
        rows.push((layer, row.clone()));
    }
    let e = num_experts.ok_or_else(|| Error::invalid("initial_global_assignments is empty"))?;
    placement_from_rows(&rows, e, ep, "trtllm-load-balancer")
}

/// What TensorRT-LLM would refuse or misread in a file it is to serve for a model whose MoE
/// layers are `moe_layers` with `num_experts` experts on `ep_size` ranks: keys it does not take
/// (`ep_size`), a missing MoE layer, a dynamic update rate where a static placement is meant,
/// and the checks of [`placement_of`].
pub fn check_servable(
    text: &str,
    moe_layers: &[usize],
    num_experts: usize,
    ep_size: usize,
) -> Result<Placement> {
    let f = parse(text)?;
    if f.ep_size.is_some() {
        bail!(
            "the key ep_size: TensorRT-LLM's MoeLoadBalancerConfig takes only num_slots, \
             initial_global_assignments and layer_updates_per_iter (its co-occurrence generator \
             writes ep_size anyway): remove that line"
        );
    }
    if f.layer_updates_per_iter != 0 {
        bail!(
            "layer_updates_per_iter is {}: TensorRT-LLM would move experts while serving, \
             starting from this assignment; 0 keeps it as placed",
            f.layer_updates_per_iter
        );
    }
    let p = placement_of(&f, Some(ep_size))?;
    if p.num_experts != num_experts {
        bail!(
            "the file places {} experts, the model has {num_experts}",
            p.num_experts
        );
    }
    for &l in moe_layers {
        if p.layers.iter().all(|x| x.layer != l) {
            bail!("MoE layer {l} of the model has no assignment (TensorRT-LLM needs every one)");
        }
    }
    if let Some(x) = p.layers.iter().find(|x| !moe_layers.contains(&x.layer)) {
        bail!("layer {} is not an MoE layer of the model", x.layer);
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_is_written_as_the_generator_writes_it_and_reads_back() {
        let p = Placement::uniform(&[3, 4], vec![1, 0, 1, 0], 2, "x");
        let text = load_balancer_file(&p).unwrap();
        assert_eq!(
            text,
            "initial_global_assignments:\n  3: [1, 3, 0, 2]\n  4: [1, 3, 0, 2]\n\
             layer_updates_per_iter: 0\nnum_slots: 4\n"
        );
        let back = check_servable(&text, &[3, 4], 4, 2).unwrap();
        assert_eq!(back.layers, p.layers);
        // Block-style lists and the generator's ep_size read too.
        let block = "num_slots: 6\nep_size: 2\ninitial_global_assignments:\n  0:\n  - 0\n  - 1\n  \
                     - 2\n  - 3\n  - 0\n  - 1\n";
        let r = placement_of(&parse(block).unwrap(), None).unwrap();
        assert_eq!((r.num_experts, r.num_devices), (4, 2));
        assert_eq!(r.layers[0].slots.as_deref(), Some(&[0, 1, 2, 3, 0, 1][..]));
    }

    /// Held to TensorRT-LLM's own writer and reader: PyYAML's `yaml.dump` as its generator calls
    /// it wrote each fixture, and `yaml.safe_load` (the engine's read) gave back the same rows
    /// (`scripts/make_trtllm_load_balancer_fixtures.py`).
    #[test]
    fn the_files_are_the_bytes_tensorrt_llms_generator_writes() {
        let v = crate::test_util::fixture_json("trtllm/load_balancer.json");
        for c in v["cases"].as_array().unwrap() {
            let rows: Vec<(usize, Vec<u32>)> = serde_json::from_value(c["layers"].clone()).unwrap();
            let (e, ep) = (
                c["experts"].as_u64().unwrap() as usize,
                c["ep_size"].as_u64().unwrap() as usize,
            );
            let p = placement_from_rows(&rows, e, ep, "x").unwrap();
            let text = load_balancer_file(&p).unwrap();
            assert_eq!(text, c["yaml"].as_str().unwrap());
            let back = placement_of(&parse(&text).unwrap(), Some(ep)).unwrap();
            assert_eq!(crate::interop::slots::layer_rows(&back).unwrap(), rows);
        }
    }

    #[test]
    fn what_tensorrt_llm_refuses_is_named() {
        let ok = "initial_global_assignments:\n  1: [0, 1, 2, 3]\nnum_slots: 4\n";
        let cases = [
            ("nums_slots: 4\n", "unknown field"),
            (
                "initial_global_assignments:\n  1: [0, 1]\n",
                "num_slots is not set",
            ),
            ("num_slots: 4\n", "initial_global_assignments is not set"),
            (
                "initial_global_assignments:\n  1: [0, 1, 2]\nnum_slots: 4\n",
                "3 expert ids",
            ),
            (
                "initial_global_assignments:\n  1: [0, 1, 2, 5]\nnum_slots: 4\n",
                "not every expert",
            ),
            (
                "initial_global_assignments:\n  1: [0, 1, 2, 3\n",
                "not a TensorRT-LLM",
            ),
        ];
        for (text, want) in cases {
            let err = parse(text)
                .and_then(|f| placement_of(&f, Some(2)))
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{text:?}: {err}");
        }
        let err =
            |t: &str, layers: &[usize]| check_servable(t, layers, 4, 2).unwrap_err().to_string();
        assert!(err(ok, &[1, 2]).contains("MoE layer 2"));
        let two =
            "initial_global_assignments:\n  1: [0, 1, 2, 3]\n  2: [0, 1, 2, 3]\nnum_slots: 4\n";
        assert!(err(two, &[1]).contains("layer 2 is not an MoE layer"));
        assert!(err(&format!("{ok}ep_size: 2\n"), &[1]).contains("remove that line"));
        assert!(err(&format!("{ok}layer_updates_per_iter: 5\n"), &[1]).contains("move experts"));
        assert!(check_servable(ok, &[1], 8, 2)
            .unwrap_err()
            .to_string()
            .contains("has 8"));
        assert!(placement_of(&parse(ok).unwrap(), None)
            .unwrap_err()
            .to_string()
            .contains("EP size"));
    }
}
