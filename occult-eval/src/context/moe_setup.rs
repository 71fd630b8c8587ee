//! The MoE setup a [`ModelSpec`] asks for: the mode, each MoE layer's placement map and its
//! pruning (with the similarity rule's tables from a calibration trace), checked against the
//! model before any weight is placed.

use super::spec::ModelSpec;
use anyhow::{bail, Context, Result};
use occult_core::analysis::pruning::PruneRule;
use occult_core::analysis::similarity::SimilarityTable;
use occult_core::analysis::trace::Trace;
use occult_core::ep::{PruneSpec, Replicas};
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::MoeMode;
use occult_core::models::model::MoeSetup;
use std::collections::BTreeMap;

impl ModelSpec {
    /// The placement in words for errors: its file, or "the placement".
    fn placement_name(&self) -> String {
        self.placement_file
            .as_ref()
            .map_or_else(|| "the placement".into(), |p| p.display().to_string())
    }

    /// The MoE setup this asks for, checked against the model.
    pub fn setup(&self, ck: &Checkpoint) -> Result<MoeSetup> {
        let cfg = &ck.cfg;
        let e = cfg.moe.num_experts;
        let mode = self.mode();
        if self.devices == 0 {
            bail!("--devices must be at least 1");
        }
        if mode == MoeMode::Reference && self.devices > 1 {
            bail!("--mode reference runs on one device; use --mode occult or standard with --devices {}", self.devices);
        }
        let moe_layers: Vec<usize> = (0..cfg.num_layers).filter(|&l| cfg.moe_layers[l]).collect();
        let mut replicas = BTreeMap::new();
        let (maps, num_devices) = match &self.placement {
            Some(pl) => {
                let name = self.placement_name();
                if pl.num_experts != e {
                    bail!(
                        "{name}: the placement is for {} experts, the model has {e}",
                        pl.num_experts
                    );
                }
                if mode != MoeMode::Reference && pl.num_devices != self.devices {
                    bail!(
                        "{name}: the placement is for {} devices, the run has --devices {}",
                        pl.num_devices,
                        self.devices
                    );
                }
                let mut maps = BTreeMap::new();
                for &l in &moe_layers {
                    pl.covers(l).with_context(|| name.clone())?;
                    if pl.layers.iter().any(|x| x.layer == l && x.slots.is_some()) {
                        let map = pl.replica_map(l).with_context(|| name.clone())?;
                        let rule = self.copy_rule;
                        replicas.insert(l, Replicas { map, rule });
                    } else {
                        maps.insert(l, pl.layer(l).with_context(|| name.clone())?.to_vec());
                    }
                }
                (maps, pl.num_devices)
            }
            None => {
                occult_core::analysis::placement::check_sizes(e, self.devices)?;
                (BTreeMap::new(), self.devices)
            }
        };
        if let Some(g) = self.devices_per_node {
            if g == 0 || (mode != MoeMode::Reference && g > self.devices) {
                bail!(
                    "--devices-per-node {g}: give between 1 and --devices ({})",
                    self.devices
                );
            }
        }
        if mode == MoeMode::TwoLevel
            && self.devices_per_node.is_none()
            && self.backend == super::Backend::Local
        {
            bail!(
                "--mode two-level needs the node size: give --devices-per-node G (ranks as threads \
                 are one host; under mpirun with --backend mpi the ranks of one host form a node)"
            );
        }
        if self.prune.is_some() && num_devices == 1 {
            bail!(
                "--max-devices and --max-nodes prune across devices: give --devices D > 1, or a \
                 --placement to prune the one-device reference as that placement would"
            );
        }
        if self.calibration.is_some() && self.prune_rule != PruneRule::Similarity {
            eprintln!("note: --calibration is only used by --prune-rule similarity");
        }
        let mut prune = BTreeMap::new();
        if let Some(limit) = self.prune {
            let rule = self.prune_rule;
            let calib = match (&self.calibration, rule) {
                (Some(p), _) => Some((p, Trace::read(p)?)),
                (None, PruneRule::Similarity) => bail!(
                    "--prune-rule similarity needs --calibration TRACE (router logits from `occult profile`)"
                ),
                (None, PruneRule::Router) => None,
            };
            for &l in &moe_layers {
                let similarity = match &calib {
                    Some((p, t)) if rule == PruneRule::Similarity => {
                        let lt = t.layer(l).with_context(|| {
                            format!("{}: no routing for MoE layer {l}", p.display())
                        })?;
                        let logits = lt.router_logits.as_ref().with_context(|| {
                            format!("{}: layer {l} has no router logits", p.display())
                        })?;
                        if t.meta.num_experts != e {
                            bail!(
                                "{}: the trace is for {} experts, the model has {e}",
                                p.display(),
                                t.meta.num_experts
                            );
                        }
                        Some(SimilarityTable::from_logits(logits, e)?)
                    }
                    _ => None,
                };
                prune.insert(
                    l,
                    PruneSpec {
                        rule,
                        limit,
                        similarity,
                    },
                );
            }
        }
        Ok(MoeSetup {
            mode: mode.dispatch(),
            maps,
            num_devices,
            prune,
            devices_per_node: self.devices_per_node,
            replicas,
        })
    }
}
