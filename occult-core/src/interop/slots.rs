//! A placement as each MoE layer's physical slots, the form SGLang, TensorRT-LLM and vLLM's
//! placement proposals all take: slot `p` holds logical expert `row[p]`, the slots divide evenly
//! over the EP ranks, and rank `r` holds slots `r*S/D .. (r+1)*S/D`. Both ways: a placement's
//! rows ([`layer_rows`]), and the placement a set of rows stands for ([`placement_from_rows`]).
//! A row of E slots is a partition (`occult.placement.v1`); a wider one has replicas (v2).

use crate::analysis::placement::{
    experts_by_device, LayerPlacement, Placement, PLACEMENT_FORMAT, PLACEMENT_FORMAT_V2,
};
use crate::{bail, Result};

/// A layer's index in the model and its slot row.
pub type Row = (usize, Vec<u32>);

/// Each layer of `p`, ascending, as `(layer, row)`: its stored slots (replicas), or device 0's
/// experts in ascending order, then device 1's, and so on. An engine gives every rank the same
/// number of slots, so a partition must hold E / D experts on every device.
pub fn layer_rows(p: &Placement) -> Result<Vec<Row>> {
    let mut layers: Vec<&LayerPlacement> = p.layers.iter().collect();
    layers.sort_by_key(|l| l.layer);
    let (e, d) = (p.num_experts, p.num_devices);
    layers
        .into_iter()
        .map(|l| {
            if let Some(slots) = &l.slots {
                return Ok((l.layer, slots.clone()));
            }
            let by_device = experts_by_device(&l.device_of_expert, d);
            if let Some((dev, held)) = by_device
                .iter()
                .enumerate()
                .find(|(_, x)| e % d != 0 || x.len() != e / d)
            {
                bail!(
                    "layer {}: device {dev} holds {} experts, but an engine gives every one of \
                     the {d} ranks the same number of slots ({e} / {d}): place with a load cap \
                     of 1.0 (--max-load-factor 1), or with --replicas",
                    l.layer,
                    held.len()
                );
            }
            let row = by_device.concat();
            Ok((l.layer, row))
        })
        .collect()
}

/// The placement `rows` stand for on `ep_size` ranks, for `num_experts` logical experts: every
/// row as wide, the width a multiple of `ep_size` and at least the experts, every expert in every
/// row, and no rank holding an expert twice.
pub fn placement_from_rows(
    rows: &[Row],
    num_experts: usize,
    ep_size: usize,
    method: &str,
) -> Result<Placement> {
    let Some((_, first)) = rows.first() else {
        bail!("no layers");
    };
    let width = first.len();
    if ep_size == 0 || width == 0 || width % ep_size != 0 {
        bail!("{width} slots do not divide over {ep_size} ranks");
    }
    if width < num_experts {
        bail!("{width} slots cannot hold {num_experts} experts");
    }
    let per = width / ep_size;
    let mut layers = Vec::with_capacity(rows.len());
    for (layer, row) in rows {
        if row.len() != width {
            bail!(
                "layer {layer} has {} slots, the first layer {width}",
                row.len()
            );
        }
        let mut seen = vec![false; num_experts];
        for (p, &x) in row.iter().enumerate() {
            let Some(s) = seen.get_mut(x as usize) else {
                bail!("layer {layer}, slot {p}: expert {x} of {num_experts}");
            };
            *s = true;
            let rank = &row[p - p % per..p];
            if rank.contains(&x) {
                bail!(
                    "layer {layer}: rank {} holds expert {x} twice (slots are rank-major, {per} \
                     a rank)",
                    p / per
                );
            }
        }
        if let Some(x) = seen.iter().position(|s| !s) {
            bail!("layer {layer}: expert {x} is in no slot");
        }
        layers.push(if width == num_experts {
            let mut device_of_expert = vec![0u32; num_experts];
            for (p, &x) in row.iter().enumerate() {
                device_of_expert[x as usize] = (p / per) as u32;
            }
            LayerPlacement {
                layer: *layer,
                device_of_expert,
                metrics: None,
                slots: None,
                expert_load: None,
            }
        } else {
            LayerPlacement {
                layer: *layer,
                device_of_expert: Vec::new(),
                metrics: None,
                slots: Some(row.clone()),
                expert_load: None,
            }
        });
    }
    let p = Placement {
        format: if width == num_experts {
            PLACEMENT_FORMAT
        } else {
            PLACEMENT_FORMAT_V2
        }
        .into(),
        num_experts,
        num_devices: ep_size,
        method: method.into(),
        source: Default::default(),
        layers,
    };
    p.validate()?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_read_back_to_the_same_placement() {
        let p = Placement::uniform(&[1, 3], vec![1, 0, 1, 0, 2, 2], 3, "x");
        let rows = layer_rows(&p).unwrap();
        assert_eq!(rows[0], (1, vec![1, 3, 0, 2, 4, 5]));
        let back = placement_from_rows(&rows, 6, 3, "x").unwrap();
        assert_eq!(back.layers, p.layers);
        // Replicas: 8 slots on 2 ranks.
        let rows = vec![(0, vec![0, 1, 2, 5, 3, 4, 5, 0])];
        let r = placement_from_rows(&rows, 6, 2, "x").unwrap();
        assert_eq!(r.format, PLACEMENT_FORMAT_V2);
        assert_eq!(layer_rows(&r).unwrap(), rows);
    }

    #[test]
    fn what_no_engine_serves_is_refused_by_name() {
        let unbalanced = Placement::uniform(&[0], vec![0, 0, 0, 1], 2, "x");
        assert!(format!("{}", layer_rows(&unbalanced).unwrap_err()).contains("device 0 holds 3"));
        let cases: [(Vec<Row>, usize, &str); 5] = [
            (vec![(0, vec![0, 1, 2])], 2, "do not divide"),
            (
                vec![(0, vec![0, 1, 2, 3]), (1, vec![0, 1])],
                2,
                "layer 1 has 2 slots",
            ),
            (vec![(0, vec![0, 1, 9, 2])], 2, "expert 9 of 4"),
            (
                vec![(0, vec![0, 0, 1, 2])],
                2,
                "rank 0 holds expert 0 twice",
            ),
            (vec![(0, vec![0, 1, 1, 2])], 2, "expert 3 is in no slot"),
        ];
        for (rows, ep, want) in cases {
            let err = placement_from_rows(&rows, 4, ep, "x")
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{err} lacks {want}");
        }
    }
}
