//! The MoE setup a [`ModelSpec`] asks for: the mode, each MoE layer's placement map and its
//! pruning (with the similarity rule's tables from a calibration trace), checked against the
//! model before any weight is placed.

use super::spec::ModelSpec;
use anyhow::{bail, Context, Result};
use occult_core::analysis::pruning::PruneRule;
use occult_core::analysis::run_key::MoeMode;
use occult_core::analysis::similarity::SimilarityTable;
use occult_core::analysis::trace::Trace;
use occult_core::ep::{PruneSpec, Replicas};
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::MoeSetup;
use std::collections::BTreeMap;
use std::sync::Arc;

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
        let mode = self.mode();
        if self.devices == 0 {
            bail!("--devices must be at least 1");
        }
        if mode == MoeMode::Reference && self.devices > 1 {
            bail!("--mode reference runs on one device; use --mode occult or standard with --devices {}", self.devices);
        }
        let moe_layers: Vec<usize> = (0..cfg.num_layers).filter(|&l| cfg.moe_layers[l]).collect();
        let placed = self.placed(ck, mode, &moe_layers)?;
        self.check_nodes(mode)?;
        if self.prune.is_some() && placed.num_devices == 1 {
            bail!(
                "--max-devices and --max-nodes prune across devices: give --devices D > 1, or a \
                 --placement to prune the one-device reference as that placement would"
            );
        }
        if self.calibration.is_some() && self.prune_rule != PruneRule::Similarity {
            eprintln!("note: --calibration is only used by --prune-rule similarity");
        }
        Ok(MoeSetup {
            mode: mode.dispatch(),
            maps: placed.maps,
            num_devices: placed.num_devices,
            prune: self.prune_specs(ck, &moe_layers)?,
            devices_per_node: self.devices_per_node,
            replicas: placed.replicas,
        })
    }

    /// Each MoE layer's map (or its replicas, with the copy rule) from the placement, checked
    /// against the model and the run; contiguous blocks on the run's devices without one.
    fn placed(&self, ck: &Checkpoint, mode: MoeMode, moe_layers: &[usize]) -> Result<Placed> {
        let e = ck.cfg.moe.num_experts;
        let Some(pl) = &self.placement else {
            occult_core::analysis::placement::check_sizes(e, self.devices)?;
            return Ok(Placed {
                maps: BTreeMap::new(),
                num_devices: self.devices,
                replicas: BTreeMap::new(),
            });
        };
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
        let (mut maps, mut replicas) = (BTreeMap::new(), BTreeMap::new());
        // Every layer's copies at once (SGLang's tables chain from layer to layer).
        let all = match pl.has_replicas() {
            true => pl
                .replica_maps(self.copy_rule, None)
                .with_context(|| name.clone())?,
            false => Vec::new(),
        };
        for &l in moe_layers {
            pl.covers(l).with_context(|| name.clone())?;
            if pl.layers.iter().any(|x| x.layer == l && x.slots.is_some()) {
                let at = pl.layers.iter().filter(|x| x.layer < l).count();
                let map = all[at].clone();
                let rule = self.copy_rule;
                replicas.insert(l, Replicas { map, rule });
            } else {
                maps.insert(l, pl.layer(l).with_context(|| name.clone())?.to_vec());
            }
        }
        Ok(Placed {
            maps,
            num_devices: pl.num_devices,
            replicas,
        })
    }

    /// Checks the node size against the devices, and that the two-level exchange has one.
    fn check_nodes(&self, mode: MoeMode) -> Result<()> {
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
        Ok(())
    }

    /// The calibration trace the similarity rule's tables come from: the one in memory, else
    /// the file read; `None` without a calibration.
    fn calibration_trace(&self) -> Result<Option<Arc<Trace>>> {
        match (&self.calibration_trace, &self.calibration) {
            (Some(t), _) => Ok(Some(t.clone())),
            (None, Some(p)) => Ok(Some(Arc::new(Trace::read(p)?))),
            (None, None) => Ok(None),
        }
    }

    /// Each MoE layer's pruning: the limit and rule, with the similarity rule's table from the
    /// calibration trace's router logits of that layer.
    fn prune_specs(
        &self,
        ck: &Checkpoint,
        moe_layers: &[usize],
    ) -> Result<BTreeMap<usize, PruneSpec>> {
        let mut prune = BTreeMap::new();
        let Some(limit) = self.prune else {
            return Ok(prune);
        };
        let e = ck.cfg.moe.num_experts;
        let rule = self.prune_rule;
        let calib = match rule {
            PruneRule::Similarity => Some(self.calibration_trace()?.context(
                "--prune-rule similarity needs --calibration TRACE (router logits from `occult profile`)",
            )?),
            PruneRule::Router => None,
        };
        let source = self.calibration.as_ref().map_or_else(
            || "the calibration trace".into(),
            |p| p.display().to_string(),
        );
        for &l in moe_layers {
            let similarity = match &calib {
                Some(t) => {
                    let lt = t
                        .layer(l)
                        .with_context(|| format!("{source}: no routing for MoE layer {l}"))?;
                    let logits = lt
                        .router_logits
                        .as_ref()
                        .with_context(|| format!("{source}: layer {l} has no router logits"))?;
                    if t.meta.num_experts != e {
                        bail!(
                            "{source}: the trace is for {} experts, the model has {e}",
                            t.meta.num_experts
                        );
                    }
                    Some(SimilarityTable::from_logits(logits, e)?)
                }
                None => None,
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
        Ok(prune)
    }
}

/// The placement's part of a MoE setup.
struct Placed {
    maps: BTreeMap<usize, Vec<u32>>,
    num_devices: usize,
    replicas: BTreeMap<usize, Replicas>,
}
