//! vLLM's placement files. Its releases read none: experts are sharded `linear` (contiguous) or
//! `round_robin` (`expert_placement_strategy`), which a renumbered checkpoint serves
//! ([`crate::interop::checkpoint`]). Two open pull requests each propose a file; both formats
//! are written and read here, named by their PR, until one is merged:
//!
//! - **vllm-project/vllm#49572** (`--eplb-config '{"initial_expert_map_path": FILE}'`): a bare
//!   JSON list, either one physical-to-logical row shared by every MoE layer or a list of rows,
//!   one per MoE layer in order; slot `p` on rank `p / (S / ep_size)`, replicas allowed (rows
//!   wider than the experts). The same rows as SGLang's file, without its key and its dense
//!   layers.
//! - **vllm-project/vllm#34811** (`--expert-placement-file FILE`):
//!   `{"expert_to_ep_rank": [r_0, ..., r_{E-1}]}`, the rank of each expert, one map for every
//!   layer and no replicas. A placement per layer does not fit it: `occult place
//!   --shared-across-layers` searches the one map such an engine takes.

use crate::analysis::placement::Placement;
use crate::interop::slots::{layer_rows, placement_from_rows};
use crate::{bail, Result};
use serde_json::{json, Value};

/// The key of PR 34811's file.
pub const EXPERT_TO_EP_RANK: &str = "expert_to_ep_rank";

/// PR 49572's file: one row per MoE layer, or (`shared`) the one row of a placement whose layers
/// all hold the same slots.
pub fn pr49572_file(p: &Placement, shared: bool) -> Result<Value> {
    let rows = layer_rows(p)?;
    if shared {
        let first = &rows[0].1;
        if let Some((l, _)) = rows.iter().find(|(_, r)| r != first) {
            bail!(
                "layer {l} holds other slots than layer {}: a shared row needs one placement \
                 for every layer (occult place --shared-across-layers)",
                rows[0].0
            );
        }
        return Ok(json!(first));
    }
    Ok(json!(rows.into_iter().map(|(_, r)| r).collect::<Vec<_>>()))
}

/// The placement a PR 49572 file stands for on `ep_size` ranks, for a model whose MoE layers
/// are `moe_layers` with `num_experts` experts: a shared row applies to every one, a list of
/// rows needs one per MoE layer.
pub fn pr49572_placement(
    v: &Value,
    moe_layers: &[usize],
    num_experts: usize,
    ep_size: usize,
) -> Result<Placement> {
    let Value::Array(items) = v else {
        bail!("not a vLLM #49572 expert map: a JSON list (one row, or one row per MoE layer)");
    };
    let row = |v: &Value| -> Result<Vec<u32>> {
        let Value::Array(ids) = v else {
            bail!("a row is not a list of expert ids");
        };
        ids.iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| crate::Error::invalid(format!("{x} is not an expert id")))
            })
            .collect()
    };
    let rows: Vec<Vec<u32>> = if items.iter().all(Value::is_array) && !items.is_empty() {
        if items.len() != moe_layers.len() {
            bail!(
                "{} rows for the model's {} MoE layers",
                items.len(),
                moe_layers.len()
            );
        }
        items.iter().map(row).collect::<Result<_>>()?
    } else {
        vec![row(v)?; moe_layers.len()]
    };
    let rows: Vec<(usize, Vec<u32>)> = moe_layers.iter().copied().zip(rows).collect();
    placement_from_rows(&rows, num_experts, ep_size, "vllm-pr49572")
}

/// PR 34811's file, from a placement without replicas whose layers all share one map.
pub fn pr34811_file(p: &Placement) -> Result<Value> {
    if p.has_replicas() {
        bail!("vLLM #34811's expert_to_ep_rank holds one rank per expert: no replicas");
    }
    let first = &p.layers[0];
    if let Some(l) = p
        .layers
        .iter()
        .find(|l| l.device_of_expert != first.device_of_expert)
    {
        bail!(
            "layer {} is placed otherwise than layer {}: vLLM #34811 takes one map for every \
             layer (occult place --shared-across-layers searches it)",
            l.layer,
            first.layer
        );
    }
    Ok(json!({ EXPERT_TO_EP_RANK: first.device_of_expert }))
}

/// The placement a PR 34811 file stands for on `ep_size` ranks over the MoE layers
/// `moe_layers`: every expert's rank below `ep_size`, one entry per expert.
pub fn pr34811_placement(
    v: &Value,
    moe_layers: &[usize],
    num_experts: usize,
    ep_size: usize,
) -> Result<Placement> {
    let Some(map) = v
        .as_object()
        .filter(|o| o.len() == 1)
        .and_then(|o| o.get(EXPERT_TO_EP_RANK))
    else {
        bail!("not a vLLM #34811 placement file: an object with the one key {EXPERT_TO_EP_RANK:?}");
    };
    let Value::Array(ranks) = map else {
        bail!("{EXPERT_TO_EP_RANK} is not a list");
    };
    if ranks.len() != num_experts {
        bail!(
            "{EXPERT_TO_EP_RANK} lists {} experts, the model has {num_experts}",
            ranks.len()
        );
    }
    let map: Vec<u32> = ranks
        .iter()
        .enumerate()
        .map(|(x, r)| match r.as_u64() {
            Some(r) if (r as usize) < ep_size => Ok(r as u32),
            _ => bail!("expert {x}: rank {r} is not one of the {ep_size} EP ranks"),
        })
        .collect::<Result<_>>()?;
    let p = Placement::uniform(moe_layers, map, ep_size, "vllm-pr34811");
    p.validate()?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_formats_read_back_to_the_placement() {
        let p = Placement::uniform(&[1, 2], vec![1, 0, 1, 0], 2, "x");
        let f = pr49572_file(&p, false).unwrap();
        assert_eq!(f, json!([[1, 3, 0, 2], [1, 3, 0, 2]]));
        assert_eq!(
            pr49572_placement(&f, &[1, 2], 4, 2).unwrap().layers,
            p.layers
        );
        let shared = pr49572_file(&p, true).unwrap();
        assert_eq!(shared, json!([1, 3, 0, 2]));
        assert_eq!(
            pr49572_placement(&shared, &[1, 2], 4, 2).unwrap().layers,
            p.layers
        );
        let f = pr34811_file(&p).unwrap();
        assert_eq!(f, json!({"expert_to_ep_rank": [1, 0, 1, 0]}));
        assert_eq!(
            pr34811_placement(&f, &[1, 2], 4, 2).unwrap().layers,
            p.layers
        );
        // Replicas: PR 49572 carries them, PR 34811 cannot.
        let rows = vec![(1, vec![0, 1, 2, 3, 0, 1])];
        let r = placement_from_rows(&rows, 4, 2, "x").unwrap();
        let f = pr49572_file(&r, false).unwrap();
        assert_eq!(pr49572_placement(&f, &[1], 4, 2).unwrap().layers, r.layers);
        assert!(pr34811_file(&r)
            .unwrap_err()
            .to_string()
            .contains("no replicas"));
    }

    #[test]
    fn what_the_proposals_cannot_hold_is_refused_by_name() {
        let mut p = Placement::uniform(&[1, 2], vec![1, 0, 1, 0], 2, "x");
        p.layers[1].device_of_expert = vec![0, 1, 0, 1];
        assert!(pr34811_file(&p)
            .unwrap_err()
            .to_string()
            .contains("--shared-across-layers"));
        assert!(pr49572_file(&p, true)
            .unwrap_err()
            .to_string()
            .contains("layer 2"));
        let err = |v: Value| {
            pr49572_placement(&v, &[1, 2], 4, 2)
                .unwrap_err()
                .to_string()
        };
        assert!(err(json!({"a": 1})).contains("a JSON list"));
        assert!(err(json!([[0, 1, 2, 3]])).contains("1 rows for the model's 2"));
        assert!(err(json!([0, 1, -2, 3])).contains("-2 is not an expert id"));
        let err = |v: Value| pr34811_placement(&v, &[1], 4, 2).unwrap_err().to_string();
        assert!(err(json!({"expert_to_ep_rank": [0, 1, 2, 0]})).contains("expert 2: rank 2"));
        assert!(err(json!({"expert_to_ep_rank": [0, 1]})).contains("lists 2 experts"));
        assert!(err(json!({"expert_to_ep_rank": [0, 1, 0, 1], "x": 1})).contains("one key"));
    }
}
