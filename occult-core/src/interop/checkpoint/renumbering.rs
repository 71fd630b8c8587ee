//! The renumbering that carries a placement to an engine that shards experts contiguously
//! (vLLM's default `linear` placement, Megatron-Core, DeepSpeed): per MoE layer, new expert id
//! -> original id, with device 0's experts first, then device 1's, and so on (each device's in
//! ascending original id). Contiguous sharding of the renumbered model over D devices then puts
//! every expert where the placement puts it.
//!
//! On disk it is `occult.renumbering.json` (format `occult.renumbering.v1`) beside an exported
//! checkpoint. It also maps a trace recorded on the exported model back to the original ids
//! ([`Renumbering::to_original`]) and the other way ([`Renumbering::to_exported`]).

use crate::analysis::placement::Placement;
use crate::analysis::trace::{LayerTrace, Trace};
use crate::atomic::write_json_atomic;
use crate::{bail, Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The value of the `format` key of a renumbering file.
pub const RENUMBERING_FORMAT: &str = "occult.renumbering.v1";

/// The renumbering's file name inside an exported checkpoint.
pub const RENUMBERING_FILE: &str = "occult.renumbering.json";

/// The trace metadata key naming the numbering a trace's ids are in, when it is not the
/// original one (the exported model's renumbering).
pub const TRACE_NUMBERING_KEY: &str = "expert_numbering";

/// One layer's renumbering.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerRenumbering {
    /// The model's layer index.
    pub layer: usize,
    /// `new_to_original[new id]` = the original id of the expert stored under `new id`.
    pub new_to_original: Vec<u32>,
}

impl LayerRenumbering {
    /// `original_to_new[original id]` = its new id.
    pub fn original_to_new(&self) -> Vec<u32> {
        let mut inv = vec![0u32; self.new_to_original.len()];
        for (new, &orig) in self.new_to_original.iter().enumerate() {
            inv[orig as usize] = new as u32;
        }
        inv
    }
}

/// A checkpoint's renumbering, per MoE layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Renumbering {
    pub format: String,
    pub num_experts: usize,
    /// The devices the placement was made for: contiguous sharding over this many devices
    /// realises it.
    pub num_devices: usize,
    /// Where it came from (model, placement, provenance): free-form.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub source: serde_json::Map<String, serde_json::Value>,
    pub layers: Vec<LayerRenumbering>,
}

/// DeepSeek-V2/V3's group-limited routing: `n_group` groups of consecutive expert ids; each token
/// first keeps its best `topk_group` groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertGroups {
    pub n_group: usize,
    pub topk_group: usize,
}

impl ExpertGroups {
    /// The first run of `E / n_group` new ids (by `new_to_original`) that mixes experts of two
    /// original groups: `(run, its first expert, the expert of another group)`.
    pub fn first_mixed_run(&self, new_to_original: &[u32]) -> Option<(usize, u32, u32)> {
        let size = (new_to_original.len() / self.n_group.max(1)).max(1);
        new_to_original
            .chunks(size)
            .enumerate()
            .find_map(|(b, run)| {
                let group = run[0] as usize / size;
                run.iter()
                    .find(|&&x| x as usize / size != group)
                    .map(|&other| (b, run[0], other))
            })
    }
}

impl Renumbering {
    /// The renumbering that realises `placement` under contiguous sharding over its devices.
    ///
    /// Refuses a placement that contiguous sharding cannot realise (D does not divide E, as
    /// engines require), and, with `groups`, one whose renumbering would break an expert group:
    /// every run of `E / n_group` new ids must hold exactly one original group, which needs each
    /// device to hold whole groups (groups no larger than a device's share) or each group to
    /// fill whole devices.
    pub fn from_placement(placement: &Placement, groups: Option<ExpertGroups>) -> Result<Self> {
        placement.validate()?;
        if placement.has_replicas() {
            bail!(
                "the placement has replicas, and a renumbered checkpoint holds each expert once, \
                 so it cannot hold them: export it for SGLang (`occult export sglang`), whose \
                 file has a slot for every copy"
            );
        }
        let (e, d) = (placement.num_experts, placement.num_devices);
        if !e.is_multiple_of(d) {
            bail!(
                "the placement puts {e} experts on {d} devices; engines shard experts contiguously \
                 only when the device count divides the expert count, so no renumbering realises it"
            );
        }
        let mut layers = Vec::with_capacity(placement.layers.len());
        for lp in &placement.layers {
            let mut order: Vec<u32> = (0..e as u32).collect();
            order.sort_by_key(|&x| (lp.device_of_expert[x as usize], x));
            if let Some(g) = groups {
                check_groups(lp.layer, &order, &lp.device_of_expert, e, d, g)?;
            }
            layers.push(LayerRenumbering {
                layer: lp.layer,
                new_to_original: order,
            });
        }
        let mut source = serde_json::Map::new();
        source.insert("placement_method".into(), placement.method.clone().into());
        Ok(Renumbering {
            format: RENUMBERING_FORMAT.into(),
            num_experts: e,
            num_devices: d,
            source,
            layers,
        })
    }

    /// The renumbering of the model's layer `layer`, if it has one.
    pub fn layer(&self, layer: usize) -> Option<&LayerRenumbering> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// Checks the format tag and that every layer's map is a permutation of `0..E`.
    pub fn validate(&self) -> Result<()> {
        if self.format != RENUMBERING_FORMAT {
            bail!(
                "format is {:?}, expected {RENUMBERING_FORMAT:?}",
                self.format
            );
        }
        if self.num_experts == 0 || self.num_devices == 0 {
            bail!("num_experts and num_devices must be at least 1");
        }
        if self.layers.is_empty() {
            bail!("the renumbering lists no layers");
        }
        let mut seen_layers = std::collections::BTreeSet::new();
        for l in &self.layers {
            if !seen_layers.insert(l.layer) {
                bail!("layer {} is listed twice", l.layer);
            }
            if l.new_to_original.len() != self.num_experts {
                bail!(
                    "layer {}: new_to_original has {} entries, expected num_experts = {}",
                    l.layer,
                    l.new_to_original.len(),
                    self.num_experts
                );
            }
            let mut seen = vec![false; self.num_experts];
            for (new, &orig) in l.new_to_original.iter().enumerate() {
                let o = orig as usize;
                if o >= self.num_experts || std::mem::replace(&mut seen[o], true) {
                    bail!(
                        "layer {}: new id {new} maps to original id {orig}, which is {}",
                        l.layer,
                        if o >= self.num_experts {
                            "out of range"
                        } else {
                            "already taken: not a permutation"
                        }
                    );
                }
            }
        }
        Ok(())
    }

    /// Reads and validates a renumbering file.
    pub fn read(path: &Path) -> Result<Self> {
        let text = crate::input::read_text(path)?;
        let r: Renumbering = serde_json::from_str(&text)
            .map_err(|e| Error::bad_file(path, format!("not a valid renumbering file: {e}")))?;
        r.validate()
            .map_err(|e| Error::bad_file(path, e.to_string()))?;
        Ok(r)
    }

    /// Writes it as JSON, atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        self.validate()?;
        write_json_atomic(path, self)
    }

    /// A trace recorded on the exported model, in the original model's expert ids: top-k ids
    /// mapped back, router logits' columns put back in original order. Refuses a trace whose
    /// sizes differ or that lists a layer the renumbering does not cover.
    pub fn to_original(&self, trace: &Trace) -> Result<Trace> {
        self.map_trace(trace, false)
    }

    /// The inverse of [`Renumbering::to_original`]: a trace of the original model in the
    /// exported model's ids.
    pub fn to_exported(&self, trace: &Trace) -> Result<Trace> {
        self.map_trace(trace, true)
    }

    fn map_trace(&self, trace: &Trace, forward: bool) -> Result<Trace> {
        let e = self.num_experts;
        if trace.meta.num_experts != e {
            bail!(
                "the trace has {} experts per layer, the renumbering {e}",
                trace.meta.num_experts
            );
        }
        let mut out = trace.clone();
        for lt in &mut out.layers {
            let lr = self.layer(lt.layer).ok_or_else(|| {
                Error::invalid(format!(
                    "the trace has layer {}, which the renumbering does not cover (it covers {:?})",
                    lt.layer,
                    self.layers.iter().map(|l| l.layer).collect::<Vec<_>>()
                ))
            })?;
            // `id_map[id in the trace]` = the id in the other numbering.
            let id_map = if forward {
                lr.original_to_new()
            } else {
                lr.new_to_original.clone()
            };
            map_layer(lt, &id_map, e);
        }
        Ok(out)
    }
}

/// Renames one layer's expert ids by `id_map` and moves its router logits' columns with them.
fn map_layer(lt: &mut LayerTrace, id_map: &[u32], e: usize) {
    for id in &mut lt.topk_ids {
        *id = id_map[*id as usize];
    }
    if let Some(logits) = &mut lt.router_logits {
        for row in logits.chunks_exact_mut(e) {
            let old = row.to_vec();
            for (from, &to) in id_map.iter().enumerate() {
                row[to as usize] = old[from];
            }
        }
    }
}

/// Checks that every run of `E / n_group` new ids is one original group (see
/// [`Renumbering::from_placement`]).
fn check_groups(
    layer: usize,
    order: &[u32],
    device_of: &[u32],
    e: usize,
    d: usize,
    g: ExpertGroups,
) -> Result<()> {
    if g.n_group == 0 || !e.is_multiple_of(g.n_group) {
        bail!(
            "n_group = {} does not divide the {e} experts into equal groups",
            g.n_group
        );
    }
    let size = e / g.n_group;
    if let Some((b, first, other)) = g.first_mixed_run(order) {
        let (block, group) = (&order[b * size..(b + 1) * size], first as usize / size);
        let devices: std::collections::BTreeSet<u32> =
            block.iter().map(|&x| device_of[x as usize]).collect();
        bail!(
                "layer {layer}: the renumbering would put experts {first} (group {group}) and {other} \
                 (group {}) into one group of new ids ({}..{}, on devices {devices:?}); the model's \
                 group-limited routing (n_group = {}, topk_group = {}) needs every group of {size} \
                 experts kept whole: each device must hold whole groups ({} experts per device \
                 here) or each group fill whole devices",
                other as usize / size,
                b * size,
                (b + 1) * size,
                g.n_group,
                g.topk_group,
                e / d
            );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::placement::{random_balanced, LayerPlacement, PLACEMENT_FORMAT};
    use crate::analysis::trace::TraceMeta;
    use rand::SeedableRng;

    fn placement(maps: &[Vec<u32>], d: usize) -> Placement {
        Placement {
            format: PLACEMENT_FORMAT.into(),
            num_experts: maps[0].len(),
            num_devices: d,
            method: "test".into(),
            source: Default::default(),
            layers: maps
                .iter()
                .enumerate()
                .map(|(l, m)| LayerPlacement {
                    layer: l + 1,
                    device_of_expert: m.clone(),
                    metrics: None,
                    slots: None,
                    expert_load: None,
                })
                .collect(),
        }
    }

    /// Hand-checked: device 0 holds {1, 3}, device 1 {0, 2}.
    #[test]
    fn devices_come_in_order_and_contiguous_sharding_realises_the_placement() {
        let r = Renumbering::from_placement(&placement(&[vec![1, 0, 1, 0]], 2), None).unwrap();
        assert_eq!(r.layers[0].new_to_original, vec![1, 3, 0, 2]);
        assert_eq!(r.layers[0].original_to_new(), vec![2, 0, 3, 1]);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for _ in 0..20 {
            let (e, d) = (16, 4);
            let map = random_balanced(e, d, &mut rng);
            let r = Renumbering::from_placement(&placement(std::slice::from_ref(&map), d), None)
                .unwrap();
            for (new, &orig) in r.layers[0].new_to_original.iter().enumerate() {
                assert_eq!(new / (e / d), map[orig as usize] as usize);
            }
        }
    }

    #[test]
    fn uneven_shares_and_broken_groups_are_refused_with_reasons() {
        let e = Renumbering::from_placement(&placement(&[vec![0, 0, 1, 1, 2]], 3), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("5 experts on 3 devices"), "{e}");
        let groups = Some(ExpertGroups {
            n_group: 4,
            topk_group: 2,
        });
        // Groups {0,1} {2,3} {4,5} {6,7}; 2 devices of 4: whole groups per device are kept...
        let ok = placement(&[vec![1, 1, 0, 0, 0, 0, 1, 1]], 2);
        assert!(Renumbering::from_placement(&ok, groups).is_ok());
        // ... and on 8 devices every group fills two devices.
        let ok8 = placement(&[vec![6, 7, 0, 1, 3, 2, 5, 4]], 8);
        assert!(Renumbering::from_placement(&ok8, groups).is_ok());
        let bad = placement(&[vec![0, 1, 0, 0, 1, 1, 0, 1]], 2);
        let e = Renumbering::from_placement(&bad, groups)
            .unwrap_err()
            .to_string();
        assert!(e.contains("layer 1") && e.contains("n_group = 4"), "{e}");
        let bad8 = placement(&[vec![0, 2, 1, 3, 4, 5, 6, 7]], 8);
        assert!(Renumbering::from_placement(&bad8, groups).is_err());
    }

    #[test]
    fn traces_map_back_and_forth() {
        let r = Renumbering::from_placement(&placement(&[vec![1, 0, 1, 0]], 2), None).unwrap();
        let original = Trace {
            meta: TraceMeta {
                num_experts: 4,
                top_k: 2,
                ..Default::default()
            },
            layers: vec![LayerTrace {
                layer: 1,
                tokens: 2,
                topk_ids: vec![0, 3, 2, 1],
                topk_weights: Some(vec![0.6, 0.4, 0.7, 0.3]),
                router_logits: Some(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]),
            }],
        };
        let exported = r.to_exported(&original).unwrap();
        // Original 0 -> new 2, 3 -> 1, 2 -> 3, 1 -> 0; logits column new j = original n2o[j].
        assert_eq!(exported.layers[0].topk_ids, vec![2, 1, 3, 0]);
        assert_eq!(
            exported.layers[0].router_logits.as_deref(),
            Some(&[1.0, 3.0, 0.0, 2.0, 5.0, 7.0, 4.0, 6.0][..])
        );
        assert_eq!(r.to_original(&exported).unwrap(), original);
        let mut other = original.clone();
        other.layers[0].layer = 5;
        assert!(r
            .to_original(&other)
            .unwrap_err()
            .to_string()
            .contains("layer 5"));
    }

    #[test]
    fn files_are_validated() {
        let mut r = Renumbering::from_placement(&placement(&[vec![1, 0, 1, 0]], 2), None).unwrap();
        r.layers[0].new_to_original = vec![1, 1, 0, 2];
        assert!(r
            .validate()
            .unwrap_err()
            .to_string()
            .contains("permutation"));
        r.layers[0].new_to_original = vec![1, 9, 0, 2];
        assert!(r
            .validate()
            .unwrap_err()
            .to_string()
            .contains("out of range"));
        r.format = "x".into();
        assert!(r.validate().is_err());
    }

    /// What `occult place --expert-groups` writes for a group-limited model, the export
    /// renumbers without refusing, in both layouts; the unconstrained search's map is refused.
    #[test]
    fn group_whole_placements_always_export() {
        use crate::analysis::placement::groups::place_groups_whole;
        use crate::analysis::placement::SearchConfig;
        use crate::analysis::synth::{synth_trace, SynthConfig};
        let mut c = SynthConfig::olmoe_like(1500, 4);
        c.layers = 1;
        c.group_limit = Some(crate::analysis::routing::GroupLimit {
            num_groups: 8,
            topk_groups: 3,
            score: crate::analysis::routing::GroupScore::Top2Sum,
        });
        let t = synth_trace(&c, &|| ()).unwrap();
        let ids = &t.layers[0].topk_ids;
        let groups = ExpertGroups {
            n_group: 8,
            topk_group: 3,
        };
        for d in [2, 4, 8, 16, 32] {
            let cfg = SearchConfig::default();
            let out = place_groups_whole(ids, 8, 64, d, 8, &cfg, &|| ()).unwrap();
            let p = placement(&[out.map], d);
            Renumbering::from_placement(&p, Some(groups)).unwrap_or_else(|e| panic!("D={d}: {e}"));
        }
        // A map that splits groups is refused: the check is live.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let split = random_balanced(64, 16, &mut rng);
        assert!(Renumbering::from_placement(&placement(&[split], 16), Some(groups)).is_err());
    }
}
