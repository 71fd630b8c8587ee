//! Assembling one rank's model from its dense parts and, for each MoE layer, the experts the
//! setup's placement gives it (all of them in the reference mode), after checking that every
//! rank assembles the same model ([`super::same_layout`]).

use super::decoder::{Layer, Mlp, Model};
use super::dense::DenseParts;
use super::moe::{MoeBlock, MoeExec, MoeSetup};
use super::same_layout::check_same_layout;
use crate::analysis::placement::validate_map;
use crate::ep::comm::Communicator;
use crate::ep::{EpMoe, EpSettings, MoeWeights};
use crate::models::config::ModelConfig;
use crate::models::weights::Weights;
use crate::{bail, Error, Result};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

impl Model {
    /// Assembles one rank's model: the dense parts plus, for each MoE layer, the experts the
    /// placement gives this rank (all of them in the reference mode). `comm` is required for
    /// the EP modes and its size must equal `setup.num_devices`.
    pub fn assemble(
        dense: DenseParts,
        w: &Weights,
        setup: &MoeSetup,
        comm: Option<Arc<dyn Communicator>>,
    ) -> Result<Self> {
        let cfg = dense.cfg.clone();
        let names = cfg.family.names;
        let e = cfg.moe.num_experts;
        let rule = cfg.router_rule();
        match (setup.mode, &comm) {
            (Some(_), None) => bail!("the expert-parallel modes need a communicator"),
            (Some(_), Some(c)) if c.size() != setup.num_devices => bail!(
                "the placement is for {} devices, the run has {}",
                setup.num_devices,
                c.size()
            ),
            _ => {}
        }
        if let (Some(_), Some(c)) = (setup.mode, &comm) {
            check_same_layout(c.as_ref(), &dense, setup)?;
        }
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (l, d) in dense.layers.into_iter().enumerate() {
            let router_bias = d.router_bias;
            let mlp = match (d.dense, d.router) {
                (Some(m), _) => Mlp::Dense(m),
                (None, Some(router)) => {
                    // The layer's own selection bias, where its router has one.
                    let mut rule = rule.clone();
                    rule.selection_bias = d.selection_bias;
                    let prefix = format!("model.layers.{l}.{}", names.block);
                    let map = setup.map(l, e);
                    let replicas = setup.replicas.get(&l).cloned();
                    let prune = setup.prune.get(&l).cloned();
                    if replicas.is_none() {
                        validate_map(&map, e, setup.num_devices)
                            .map_err(|err| Error::invalid(format!("layer {l}: {err}")))?;
                    } else if setup.mode.is_none() && prune.is_some() {
                        bail!(
                            "layer {l}: collaboration pruning does not run on placements with \
                             replicas yet: place without --replicas to prune"
                        );
                    }
                    let exec = match (setup.mode, &comm) {
                        (Some(mode), Some(c)) => {
                            let settings = EpSettings {
                                rule: rule.clone(),
                                device_of_expert: map,
                                mode,
                                prune,
                                devices_per_node: setup.devices_per_node.or(c.node_size()),
                                replicas,
                            };
                            let locs = settings.locations(c.size());
                            let mine = &locs.experts_of[c.rank()];
                            let weights = MoeWeights {
                                router,
                                router_bias,
                                experts: w.model_experts(&prefix, &cfg, mine)?,
                                shared: d.shared,
                            };
                            MoeExec::Parallel(Box::new(EpMoe::new(weights, settings, c.clone())?))
                        }
                        _ => {
                            let all: Vec<u32> = (0..e as u32).collect();
                            let experts = w.model_experts(&prefix, &cfg, &all)?;
                            MoeExec::Reference {
                                weights: Box::new(MoeWeights {
                                    router,
                                    router_bias,
                                    experts,
                                    shared: d.shared,
                                }),
                                prune: prune.map(|p| (p, map, setup.num_devices)),
                            }
                        }
                    };
                    Mlp::Moe(Box::new(MoeBlock {
                        layer: l,
                        rule,
                        exec,
                    }))
                }
                (None, None) => bail!("layer {l} has neither a dense MLP nor a router"),
            };
            layers.push(Layer {
                input_norm: d.input_norm,
                attn: d.attn,
                post_norm: d.post_norm,
                mlp,
            });
        }
        let mut m = Model {
            cfg,
            embed: dense.embed,
            layers,
            norm: dense.norm,
            lm_head: dense.lm_head,
            rope: dense.rope,
            comm,
            fused: true,
            ep_stats: Mutex::new(BTreeMap::new()),
            router_taps: Mutex::new(None),
        };
        let trainable = m.params().iter().any(|(_, t)| t.is_variable());
        m.fused = !trainable;
        if trainable {
            // Ranks must agree on which reverse exchanges to run, whatever they computed.
            for layer in &mut m.layers {
                if let Mlp::Moe(block) = &mut layer.mlp {
                    if let MoeExec::Parallel(ep) = &mut block.exec {
                        ep.anchor_reverse_exchanges()?;
                    }
                }
            }
        }
        Ok(m)
    }

    /// Loads a whole model on one device in the reference mode.
    pub fn load_reference(w: &Weights, cfg: &ModelConfig) -> Result<Self> {
        Self::assemble(DenseParts::load(w, cfg)?, w, &MoeSetup::reference(), None)
    }
}
