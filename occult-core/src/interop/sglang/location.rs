//! SGLang's expert-location file, the JSON its `--init-expert-location` reads (checked against
//! sglang 0.5.23, `srt/eplb/expert_location.py`): `{"physical_to_logical_map": [[...], ...]}`,
//! one row per hidden layer (dense layers included), entry `[l][p]` the logical expert held in
//! physical slot `p`. Physical slot `p` lives on GPU `p / (P / ep_size)`, P the row length; P
//! may exceed the logical expert count (replicas), and every row must hold every logical
//! expert. The file must hold that one key: SGLang passes the whole object as keyword arguments.
//!
//! SGLang reads it only for model classes that define `get_model_config_for_expert_location`:
//! among the families here, DeepSeek-V2/V3 (and Kimi-K2), GLM-4.5 (`Glm4MoeForCausalLM`, its
//! layers all hidden layers), gpt-oss (`GptOssForCausalLM`), Qwen2-MoE and Qwen3-MoE; not
//! Mixtral, OLMoE or DeepSeek-MoE v1 ([`SGLANG_TYPES`]).

use crate::analysis::placement::Placement;
use crate::interop::checkpoint::ExpertLayout;
use crate::{bail, Result};
use serde_json::{json, Value};

/// The `model_type`s whose SGLang model class reads an expert-location file.
pub const SGLANG_TYPES: [&str; 7] = [
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k2",
    "glm4_moe",
    "gpt_oss",
    "qwen2_moe",
    "qwen3_moe",
];

/// The key of the one array the file holds.
pub const KEY: &str = "physical_to_logical_map";

/// The expert-location file that puts each layer's experts where `placement` does, with one
/// physical slot per logical expert (device d's experts in slots `d*E/D ..`, ascending); dense
/// layers get the identity row SGLang itself would use. Serve with `--ep-size` equal to the
/// placement's devices.
pub fn location_file(layout: &ExpertLayout, placement: &Placement) -> Result<Value> {
    if !SGLANG_TYPES.contains(&layout.model_type.as_str()) {
        bail!(
            "SGLang reads expert locations only for models whose class defines \
             get_model_config_for_expert_location ({}; checked in sglang 0.5.23), not {}: \
             export a renumbered checkpoint instead (`occult export checkpoint`)",
            SGLANG_TYPES.join(", "),
            layout.model_type
        );
    }
    if placement.has_replicas() {
        return replicated_file(layout, placement);
    }
    // SGLang picks experts (groups included) on logical ids and only then maps them to physical
    // slots, so a placement need not keep DeepSeek's expert groups whole here.
    let ren = crate::interop::checkpoint::Renumbering::from_placement(placement, None)?;
    let ungrouped = ExpertLayout {
        groups: None,
        ..layout.clone()
    };
    crate::interop::checkpoint::export::check_fits(&ungrouped, &ren)?;
    let e = layout.num_experts as u32;
    let rows: Vec<Vec<u32>> = (0..layout.num_layers)
        .map(|l| match ren.layer(l) {
            Some(lr) => lr.new_to_original.clone(),
            None => (0..e).collect(),
        })
        .collect();
    Ok(json!({ KEY: rows }))
}

/// A placement with replicas: each MoE layer's row is its slots (E + R, the same for every
/// layer); dense layers get the row SGLang itself would use for that width (slot p holds
/// expert p % E, its `init_trivial`).
fn replicated_file(layout: &ExpertLayout, placement: &Placement) -> Result<Value> {
    let e = layout.num_experts;
    if placement.num_experts != e {
        bail!(
            "the placement is for {} experts per layer, the model has {e}",
            placement.num_experts
        );
    }
    let mut width = None;
    let mut moe_rows = std::collections::BTreeMap::new();
    for &l in &layout.moe_layers {
        let map = placement
            .replica_map(l, crate::analysis::placement::replicas::CopyRule::Cover)
            .map_err(|err| crate::Error::invalid(format!("MoE layer {l} of the model: {err}")))?;
        let p = *width.get_or_insert(map.slot_expert.len());
        if map.slot_expert.len() != p {
            bail!(
                "MoE layer {l} has {} physical slots, an earlier one {p}: SGLang takes one \
                 slot count for every layer",
                map.slot_expert.len()
            );
        }
        moe_rows.insert(l, map.slot_expert);
    }
    if let Some(l) = placement
        .layers
        .iter()
        .map(|l| l.layer)
        .find(|l| !layout.moe_layers.contains(l))
    {
        bail!(
            "the placement lists layer {l}, which is not an MoE layer of the model (its MoE \
             layers are {:?})",
            layout.moe_layers
        );
    }
    let p = width.unwrap_or(e);
    let rows: Vec<Vec<u32>> = (0..layout.num_layers)
        .map(|l| {
            moe_rows
                .remove(&l)
                .unwrap_or_else(|| (0..p).map(|s| (s % e) as u32).collect())
        })
        .collect();
    Ok(json!({ KEY: rows }))
}

/// The file's text: one row per line.
pub fn to_text(v: &Value) -> String {
    let rows: Vec<String> = v[KEY]
        .as_array()
        .map(|rows| rows.iter().map(|r| format!("    {r}")).collect())
        .unwrap_or_default();
    format!("{{\n  \"{KEY}\": [\n{}\n  ]\n}}\n", rows.join(",\n"))
}

/// SGLang's own checks on a location file for a model of `num_layers` hidden layers and
/// `num_logical` experts served with `ep_size` (`_init_common`, `__post_init__` and
/// `_compute_logical_to_all_physical_map`), plus what it needs without checking: one key, a row
/// per layer, every logical expert in every row. Returns `[layers][physical slots]`.
pub fn check_location_file(
    v: &Value,
    num_layers: usize,
    num_logical: usize,
    ep_size: usize,
) -> Result<Vec<Vec<u32>>> {
    let obj = v
        .as_object()
        .ok_or_else(|| crate::Error::invalid("an expert-location file is a JSON object"))?;
    if obj.len() != 1 || !obj.contains_key(KEY) {
        bail!(
            "an expert-location file holds exactly the key {KEY:?} (SGLang passes the object as \
             keyword arguments); it has {:?}",
            obj.keys().collect::<Vec<_>>()
        );
    }
    let rows = obj[KEY]
        .as_array()
        .ok_or_else(|| crate::Error::invalid(format!("{KEY} is not an array of rows")))?;
    if rows.len() != num_layers {
        bail!(
            "{KEY} has {} rows, the model {num_layers} hidden layers",
            rows.len()
        );
    }
    let mut out = Vec::with_capacity(rows.len());
    let mut width = None;
    for (l, row) in rows.iter().enumerate() {
        let row: Vec<u32> = row
            .as_array()
            .ok_or_else(|| crate::Error::invalid(format!("{KEY}[{l}] is not an array")))?
            .iter()
            .map(|x| {
                x.as_u64()
                    .filter(|&x| (x as usize) < num_logical)
                    .map(|x| x as u32)
                    .ok_or_else(|| {
                        crate::Error::invalid(format!(
                            "{KEY}[{l}] holds {x}, not a logical expert id in 0..{num_logical}"
                        ))
                    })
            })
            .collect::<Result<_>>()?;
        let p = *width.get_or_insert(row.len());
        if row.len() != p {
            bail!("{KEY}[{l}] has {} slots, row 0 has {p}", row.len());
        }
        if p < num_logical || ep_size == 0 || p % ep_size != 0 {
            bail!(
                "{p} physical slots for {num_logical} logical experts on ep_size {ep_size}: SGLang \
                 asserts num_physical_experts % ep_size == 0, with at least one slot per expert"
            );
        }
        let mut seen = vec![false; num_logical];
        for &x in &row {
            seen[x as usize] = true;
        }
        if let Some(missing) = seen.iter().position(|s| !s) {
            bail!("{KEY}[{l}] holds no copy of logical expert {missing}");
        }
        out.push(row);
    }
    Ok(out)
}

/// What SGLang would serve from a location file, checked as it would misload it: SGLang's own
/// checks ([`check_location_file`]), then, for a model of `layout` served with `ep_size` GPUs and
/// `redundant` (`--ep-num-redundant-experts`; `None`: the count the file's width implies), that
/// the width is the experts plus exactly the redundant slots (SGLang accepts a wider file
/// without the flag, and the slots past E then land on no GPU), and that no GPU holds an MoE
/// layer's expert twice (under DeepEP SGLang loads one copy and still routes to the other).
/// Returns the redundant-slot count to serve with.
pub fn check_servable(
    v: &Value,
    layout: &ExpertLayout,
    ep_size: usize,
    redundant: Option<usize>,
) -> Result<usize> {
    let rows = check_location_file(v, layout.num_layers, layout.num_experts, ep_size)?;
    let e = layout.num_experts;
    let width = rows.first().map_or(e, Vec::len);
    let implied = width - e;
    if let Some(r) = redundant.filter(|&r| r != implied) {
        bail!(
            "the file has {width} physical slots per layer, {e} experts + {implied} redundant, \
             but --ep-num-redundant-experts is {r}: SGLang would place {} slots and misload the \
             rest; serve with --ep-num-redundant-experts {implied}",
            e + r
        );
    }
    let per = width / ep_size;
    for &l in &layout.moe_layers {
        for (g, gpu) in rows[l].chunks(per).enumerate() {
            for (i, &x) in gpu.iter().enumerate() {
                if gpu[..i].contains(&x) {
                    bail!(
                        "{KEY}[{l}]: GPU {g} holds expert {x} twice (slots {} and {}): under an \
                         all-to-all backend (DeepEP) SGLang loads one copy and still routes \
                         tokens to the other",
                        g * per + gpu.iter().position(|&y| y == x).expect("present"),
                        g * per + i
                    );
                }
            }
        }
    }
    Ok(implied)
}

/// The placement an expert-location file stands for on `ep_size` GPUs, for the MoE layers of
/// `layout` (the way back from [`location_file`]): a partition where the rows are E wide, the
/// slots with their replicas where they are wider.
pub fn placement_of(layout: &ExpertLayout, v: &Value, ep_size: usize) -> Result<Placement> {
    let rows = check_location_file(v, layout.num_layers, layout.num_experts, ep_size)?;
    let moe_rows: Vec<(usize, Vec<u32>)> = layout
        .moe_layers
        .iter()
        .map(|&l| (l, rows[l].clone()))
        .collect();
    crate::interop::slots::placement_from_rows(&moe_rows, layout.num_experts, ep_size, "sglang")
}

#[cfg(test)]
mod tests {
    /// A placement with replicas exports its slots as the MoE rows (dense rows as SGLang's own
    /// for that width), passes SGLang's checks, and is refused by the renumbered checkpoint.
    #[test]
    fn replicated_placements_export_their_slots() {
        let layout = ExpertLayout {
            model_type: "qwen2_moe".into(),
            num_experts: 4,
            num_layers: 3,
            moe_layers: vec![1, 2],
            block: "mlp".into(),
            router: "gate".into(),
            groups: None,
        };
        let mut p = Placement::uniform(&[1, 2], vec![0, 0, 1, 1], 2, "occult");
        p.format = crate::analysis::placement::PLACEMENT_FORMAT_V2.into();
        for (l, slots) in p
            .layers
            .iter_mut()
            .zip([[0, 1, 2, 3, 0, 1], [2, 0, 1, 3, 2, 1]])
        {
            l.device_of_expert.clear();
            l.slots = Some(slots.to_vec());
        }
        let v = location_file(&layout, &p).unwrap();
        let rows = check_location_file(&v, 3, 4, 2).unwrap();
        assert_eq!(rows[0], vec![0, 1, 2, 3, 0, 1]);
        assert_eq!(rows[1], vec![0, 1, 2, 3, 0, 1]);
        assert_eq!(rows[2], vec![2, 0, 1, 3, 2, 1]);
        let e = crate::interop::checkpoint::Renumbering::from_placement(&p, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot hold them"), "{e}");
        // One MoE layer without a copy: the slot counts differ, which SGLang cannot take.
        p.layers[1].slots = None;
        p.layers[1].device_of_expert = vec![0, 0, 1, 1];
        let e = location_file(&layout, &p).unwrap_err().to_string();
        assert!(e.contains("one slot count for every layer"), "{e}");
    }

    use super::*;
    use crate::analysis::placement::random_balanced;
    use crate::analysis::placement::{LayerPlacement, PLACEMENT_FORMAT};
    use rand::SeedableRng;

    fn layout(model_type: &str) -> ExpertLayout {
        ExpertLayout {
            model_type: model_type.into(),
            num_experts: 8,
            num_layers: 3,
            moe_layers: vec![1, 2],
            block: "mlp".into(),
            router: "gate".into(),
            groups: None,
        }
    }

    #[test]
    fn the_file_puts_each_expert_on_its_gpu_and_reads_back() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for d in [1, 2, 4, 8] {
            let lay = layout("qwen3_moe");
            let maps: Vec<Vec<u32>> = (0..2).map(|_| random_balanced(8, d, &mut rng)).collect();
            let p = Placement {
                format: PLACEMENT_FORMAT.into(),
                num_experts: 8,
                num_devices: d,
                method: "test".into(),
                source: Default::default(),
                layers: maps
                    .iter()
                    .enumerate()
                    .map(|(i, m)| LayerPlacement {
                        layer: i + 1,
                        device_of_expert: m.clone(),
                        metrics: None,
                        slots: None,
                        expert_load: None,
                    })
                    .collect(),
            };
            let v = location_file(&lay, &p).unwrap();
            assert_eq!(serde_json::from_str::<Value>(&to_text(&v)).unwrap(), v);
            let rows = check_location_file(&v, 3, 8, d).unwrap();
            assert_eq!(rows[0], (0..8).collect::<Vec<u32>>(), "dense layer 0");
            for (i, m) in maps.iter().enumerate() {
                for (slot, &x) in rows[i + 1].iter().enumerate() {
                    // SGLang: _compute_gpu_id_of_physical_expert = id // local experts.
                    assert_eq!(slot / (8 / d), m[x as usize] as usize);
                }
            }
            let back = placement_of(&lay, &v, d).unwrap();
            assert_eq!(
                back.layers
                    .iter()
                    .map(|l| &l.device_of_expert)
                    .collect::<Vec<_>>(),
                maps.iter().collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn sglangs_checks_and_unsupported_models_are_refused_with_reasons() {
        let p = crate::analysis::placement::Placement::uniform(
            &[1, 2],
            crate::analysis::placement::contiguous(8, 2),
            2,
            "contiguous",
        );
        let e = location_file(&layout("mixtral"), &p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not mixtral") && e.contains("checkpoint"), "{e}");
        let v = location_file(&layout("qwen2_moe"), &p).unwrap();
        assert!(check_location_file(&v, 3, 8, 3)
            .unwrap_err()
            .to_string()
            .contains("% ep_size"));
        assert!(check_location_file(&v, 4, 8, 2)
            .unwrap_err()
            .to_string()
            .contains("3 rows"));
        let mut extra = v.clone();
        extra["logical_count"] = json!([]);
        assert!(check_location_file(&extra, 3, 8, 2).is_err());
        let mut gap = v.clone();
        gap[KEY][1][0] = json!(1);
        assert!(check_location_file(&gap, 3, 8, 2)
            .unwrap_err()
            .to_string()
            .contains("no copy of logical expert 0"));
        gap[KEY][1][0] = json!(8);
        assert!(check_location_file(&gap, 3, 8, 2).is_err());
    }

    /// The servable check: the width must match --ep-num-redundant-experts, and no GPU of an
    /// MoE layer may hold an expert twice (a dense layer's row may: it is never loaded).
    #[test]
    fn what_sglang_would_misload_is_refused() {
        let layout = ExpertLayout {
            model_type: "qwen2_moe".into(),
            num_experts: 4,
            num_layers: 2,
            moe_layers: vec![1],
            block: "mlp".into(),
            router: "gate".into(),
            groups: None,
        };
        let file = |row: [u32; 6]| serde_json::json!({ KEY: [[0, 1, 2, 3, 0, 1], row] });
        let good = file([0, 1, 2, 3, 2, 1]);
        assert_eq!(check_servable(&good, &layout, 2, None).unwrap(), 2);
        assert_eq!(check_servable(&good, &layout, 2, Some(2)).unwrap(), 2);
        let e = check_servable(&good, &layout, 2, Some(0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--ep-num-redundant-experts 2"), "{e}");
        let twice = file([0, 1, 0, 2, 3, 1]);
        let e = check_servable(&twice, &layout, 2, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("GPU 0 holds expert 0 twice (slots 0 and 2)"),
            "{e}"
        );
        // On 3 GPUs of 2 the same row is fine: expert 0 on GPUs 0 and 1.
        assert!(check_servable(&twice, &layout, 3, None).is_ok());
    }
}
