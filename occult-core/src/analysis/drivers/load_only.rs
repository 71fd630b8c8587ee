//! Placement from expert loads alone: what an engine's per-expert token counts give (TensorRT-LLM's
//! plain statistic dump), without which experts a token uses together. DeepSeek's EPLB balances
//! each layer's loads over the devices, with or without redundant slots (TensorRT-LLM's own
//! `generate_eplb_config.py` also places such counts for load alone, with its C++
//! `do_replication` and `do_placement`). E[C_T] needs the tokens' experts, so only the balance
//! is known, and co-activation cannot guide the map.

use crate::analysis::placement::eplb::{eplb_map_of_loads, EplbGroups};
use crate::analysis::placement::replicas::{max_over_mean_f64, spread_duplicates, ReplicaMap};
use crate::analysis::placement::{
    LayerPlacement, Placement, PLACEMENT_FORMAT, PLACEMENT_FORMAT_V2,
};
use crate::{bail, Result};

/// One MoE layer's load: the tokens that chose each expert.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerLoads {
    pub layer: usize,
    pub loads: Vec<f64>,
}

/// Each layer's EPLB placement on `devices` devices with `replicas` redundant slots (`E + R`
/// must fill the devices evenly): a partition (`occult.placement.v1`) without replicas, slots
/// (v2) with them. Also each layer's busiest device's expected load over the mean.
pub fn place_loads(
    layers: &[LayerLoads],
    devices: usize,
    replicas: usize,
    eplb: EplbGroups,
) -> Result<(Placement, Vec<f64>)> {
    let Some(first) = layers.first() else {
        bail!("no layer loads");
    };
    let e = first.loads.len();
    let mut out = Placement {
        format: if replicas > 0 {
            PLACEMENT_FORMAT_V2
        } else {
            PLACEMENT_FORMAT
        }
        .into(),
        num_experts: e,
        num_devices: devices,
        method: "eplb".into(),
        source: Default::default(),
        layers: Vec::with_capacity(layers.len()),
    };
    let mut balance = Vec::with_capacity(layers.len());
    for l in layers {
        let at = |m: String| crate::Error::invalid(format!("layer {}: {m}", l.layer));
        if l.loads.len() != e {
            return Err(at(format!(
                "{} experts, the first layer {e}",
                l.loads.len()
            )));
        }
        if let Some(x) = l.loads.iter().find(|x| !(x.is_finite() && **x >= 0.0)) {
            return Err(at(format!("load {x} is not a count")));
        }
        let loads: Vec<f32> = l.loads.iter().map(|&x| x as f32).collect();
        let m = eplb_map_of_loads(&loads, devices, replicas, eplb.groups, eplb.nodes)
            .map_err(|err| at(err.to_string()))?;
        let per_node = (eplb.nodes > 1).then(|| devices / eplb.nodes);
        let m = spread_duplicates(&m, per_node).map_err(|err| at(err.to_string()))?;
        balance.push(max_over_mean_f64(&device_loads(&m, &l.loads)));
        out.layers.push(if replicas > 0 {
            LayerPlacement {
                layer: l.layer,
                device_of_expert: Vec::new(),
                metrics: None,
                slots: Some(m.slot_expert.clone()),
                expert_load: Some(l.loads.clone()),
            }
        } else {
            let per = m.slots_per_device();
            let mut device_of_expert = vec![0u32; e];
            for (p, &x) in m.slot_expert.iter().enumerate() {
                device_of_expert[x as usize] = (p / per) as u32;
            }
            LayerPlacement::partition(l.layer, device_of_expert)
        });
    }
    out.source
        .insert("placed_from".into(), "expert loads".into());
    out.source.insert("replicas".into(), replicas.into());
    out.validate()?;
    Ok((out, balance))
}

/// The busiest device's load over the mean under contiguous sharding (device d holds experts
/// `d*E/D ..`), the map without a placement; `None` where D does not divide E or is 0.
pub fn contiguous_balance(loads: &[f64], devices: usize) -> Option<f64> {
    if devices == 0 || !loads.len().is_multiple_of(devices) {
        return None;
    }
    let per_device: Vec<f64> = loads
        .chunks(loads.len() / devices)
        .map(|c| c.iter().sum())
        .collect();
    Some(max_over_mean_f64(&per_device))
}

/// Each device's expected load under `m`: every copy carries its expert's load over its copies.
pub fn device_loads(m: &ReplicaMap, loads: &[f64]) -> Vec<f64> {
    (0..m.num_devices)
        .map(|d| {
            m.device_slots(d)
                .iter()
                .map(|&x| loads[x as usize] / m.devices_of(x).len() as f64)
                .sum()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// EPLB balances skewed loads: without copies the heaviest experts land on different
    /// devices; with copies the hottest expert is split and the balance improves; every
    /// device holds as many slots and no expert twice.
    #[test]
    fn loads_alone_give_a_balanced_placement() {
        let loads: Vec<f64> = vec![80.0, 70.0, 10.0, 10.0, 10.0, 10.0, 5.0, 5.0];
        let layers = [
            LayerLoads {
                layer: 2,
                loads: loads.clone(),
            },
            LayerLoads {
                layer: 3,
                loads: loads.iter().rev().copied().collect(),
            },
        ];
        let (p, bal) = place_loads(&layers, 2, 0, EplbGroups::GLOBAL).unwrap();
        assert_eq!(p.format, PLACEMENT_FORMAT);
        let l2 = &p.layers[0].device_of_expert;
        assert_ne!(l2[0], l2[1], "the two hot experts share a device");
        assert_eq!(l2.iter().filter(|&&d| d == 0).count(), 4);
        assert!(bal[0] < 1.1, "{bal:?}");
        let (p, bal_r) = place_loads(&layers, 2, 2, EplbGroups::GLOBAL).unwrap();
        assert_eq!(p.format, PLACEMENT_FORMAT_V2);
        let slots = p.layers[0].slots.as_ref().unwrap();
        assert_eq!(slots.len(), 10);
        for dev in slots.chunks(5) {
            let mut d = dev.to_vec();
            d.sort_unstable();
            d.dedup();
            assert_eq!(d.len(), 5, "{dev:?}");
        }
        assert!(bal_r[0] <= bal[0] + 1e-9, "{bal_r:?} vs {bal:?}");
        let bad = [LayerLoads {
            layer: 0,
            loads: vec![1.0, f64::NAN],
        }];
        let err = place_loads(&bad, 2, 0, EplbGroups::GLOBAL).unwrap_err();
        assert!(err.to_string().contains("layer 0"), "{err}");
        assert!(place_loads(&layers, 3, 0, EplbGroups::GLOBAL).is_err());
        // Contiguous sharding keeps both hot experts on device 0.
        let c = contiguous_balance(&loads, 2).unwrap();
        assert!((c - 170.0 / 100.0).abs() < 1e-9, "{c}");
        assert!(c > bal[0]);
        assert_eq!(contiguous_balance(&loads, 3), None);
        assert_eq!(contiguous_balance(&loads, 0), None);
    }
}
