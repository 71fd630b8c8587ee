//! The decoder shared by the five families: embeddings, pre-norm attention and MLP blocks, the
//! final norm and the LM head, giving logits at every position. MLP blocks are dense SwiGLU or
//! MoE; MoE blocks run the single-device reference or the expert-parallel layer
//! ([`crate::ep::EpMoe`]) in either dispatch mode, with optional collaboration pruning.
//!
//! Under expert parallelism each rank runs its own sequences through the whole model (data +
//! expert parallel, DESIGN 3.1): it holds the dense weights and only its own experts, and only
//! the MoE blocks talk to other ranks. Every path is differentiable. Forwards are collective;
//! [`super::data_parallel`] keeps ranks with different amounts of work in step and reduces
//! gradients.

use super::attention::{Attention, LayerCache};
use super::config::ModelConfig;
use super::layers::{linear, rms_norm, Rope};
use crate::analysis::routing::RouterRule;
use crate::ep::comm::Communicator;
use crate::ep::dispatch::DispatchMode;
use crate::ep::swiglu::{swiglu, SharedExperts};
use crate::ep::{
    reference_forward_routed, residual_add, EpMoe, EpSettings, MoeWeights, PruneSpec, Routed,
    StepStats,
};
use crate::models::weights::Weights;
use crate::{bail, Error, Result};
use candle::{DType, Tensor};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A dense SwiGLU MLP.
#[derive(Clone, Debug)]
pub struct DenseMlp {
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

/// How an MoE block computes.
pub enum MoeExec {
    /// The plain single-device loop over experts; `prune` gives the pruning rule with the
    /// placement (map, devices) it refers to.
    Reference {
        weights: MoeWeights,
        prune: Option<(PruneSpec, Vec<u32>, usize)>,
    },
    /// This rank's part of the expert-parallel layer.
    Parallel(EpMoe),
}

/// One MoE block.
pub struct MoeBlock {
    /// The model's layer index.
    pub layer: usize,
    pub rule: RouterRule,
    pub exec: MoeExec,
}

/// A layer's MLP.
pub enum Mlp {
    Dense(DenseMlp),
    Moe(Box<MoeBlock>),
}

/// One decoder layer.
pub struct Layer {
    pub input_norm: Tensor,
    pub attn: Attention,
    pub post_norm: Tensor,
    pub mlp: Mlp,
}

/// The key/value caches of all layers.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    pub layers: Vec<LayerCache>,
}

impl KvCache {
    /// Positions already cached.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A cache of one sequence copied `n` times along the batch, so that `n` continuations
    /// can run on one shared prefix in a single batch.
    pub fn repeat(&self, n: usize) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let kv = match &l.kv {
                    Some((k, v)) => {
                        let rep = |t: &Tensor| -> Result<Tensor> {
                            let (b, h, s, d) = t.dims4()?;
                            if b != 1 {
                                bail!("only a one-sequence cache can be repeated (it holds {b})");
                            }
                            Ok(t.broadcast_as((n, h, s, d))?.contiguous()?)
                        };
                        Some((rep(k)?, rep(v)?))
                    }
                    None => None,
                };
                Ok(LayerCache { kv })
            })
            .collect::<Result<_>>()?;
        Ok(KvCache { layers })
    }
}

/// The routing of the tokens a rank routed, per MoE layer, as traces store it.
#[derive(Clone, Debug, Default)]
pub struct LayerRouting {
    pub tokens: usize,
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
    pub logits: Vec<f32>,
}

/// Collects routing over forward passes (for `occult profile` and traced evaluation).
#[derive(Clone, Debug, Default)]
pub struct RoutingRecorder {
    pub layers: BTreeMap<usize, LayerRouting>,
}

impl RoutingRecorder {
    /// Appends `other`'s tokens after this recorder's, layer by layer.
    pub fn append(&mut self, other: RoutingRecorder) {
        for (layer, r) in other.layers {
            let mine = self.layers.entry(layer).or_default();
            mine.tokens += r.tokens;
            mine.ids.extend(r.ids);
            mine.weights.extend(r.weights);
            mine.logits.extend(r.logits);
        }
    }

    /// A compact little-endian encoding, to move a recorder between ranks.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut put = |v: u64| out.extend_from_slice(&v.to_le_bytes());
        put(self.layers.len() as u64);
        for (&layer, r) in &self.layers {
            put(layer as u64);
            put(r.tokens as u64);
            put(r.ids.len() as u64);
            put(r.weights.len() as u64);
            put(r.logits.len() as u64);
        }
        for r in self.layers.values() {
            out.extend(r.ids.iter().flat_map(|x| x.to_le_bytes()));
            out.extend(r.weights.iter().flat_map(|x| x.to_le_bytes()));
            out.extend(r.logits.iter().flat_map(|x| x.to_le_bytes()));
        }
        out
    }

    /// Reads [`RoutingRecorder::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bad = || crate::Error::Comm("a routing record that does not decode".into());
        let mut at = 0usize;
        let mut word = || -> Result<u64> {
            let b = bytes.get(at..at.saturating_add(8)).ok_or_else(bad)?;
            at += 8;
            Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
        };
        let n = word()? as usize;
        let mut heads = Vec::new();
        for _ in 0..n.min(bytes.len() / 40) {
            let h: Vec<usize> = (0..5)
                .map(|_| word().map(|w| w as usize))
                .collect::<Result<_>>()?;
            heads.push(h);
        }
        if heads.len() != n {
            return Err(bad());
        }
        let mut rec = RoutingRecorder::default();
        let mut take4 = |len: usize| -> Result<&[u8]> {
            let end = len
                .checked_mul(4)
                .and_then(|n| at.checked_add(n))
                .ok_or_else(bad)?;
            let b = bytes.get(at..end).ok_or_else(bad)?;
            at = end;
            Ok(b)
        };
        for h in heads {
            let ids = take4(h[2])?
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().expect("4")))
                .collect();
            let weights = take4(h[3])?
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4")))
                .collect();
            let logits = take4(h[4])?
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4")))
                .collect();
            rec.layers.insert(
                h[0],
                LayerRouting {
                    tokens: h[1],
                    ids,
                    weights,
                    logits,
                },
            );
        }
        // Every byte read, every layer once, and no more logits than a row per token allows.
        if at != bytes.len() || rec.layers.len() != n {
            return Err(bad());
        }
        Ok(rec)
    }

    fn add(&mut self, layer: usize, routed: &Routed, tokens: usize) -> Result<()> {
        let r = self.layers.entry(layer).or_default();
        r.tokens += tokens;
        r.ids.extend_from_slice(&routed.ids);
        if tokens > 0 {
            r.weights.extend(
                routed
                    .weights
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            );
        }
        r.logits.extend_from_slice(&routed.logits);
        Ok(())
    }
}

/// Which positions get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
}

/// A loaded model (one rank's part under expert parallelism).
pub struct Model {
    pub cfg: ModelConfig,
    pub embed: Tensor,
    pub layers: Vec<Layer>,
    pub norm: Tensor,
    /// `[V, H]`; the embedding itself when tied.
    pub lm_head: Tensor,
    rope: Rope,
    comm: Option<Arc<dyn Communicator>>,
    /// Use candle's fused kernels (no backward); false as soon as a weight is trainable.
    pub fused: bool,
    /// The EP layers' statistics per MoE layer, summed over forwards since the last take.
    ep_stats: Mutex<BTreeMap<usize, StepStats>>,
    /// The routing of each MoE layer on the graph, collected while [`Model::tap_routers`] is on.
    router_taps: Mutex<Option<Vec<RouterTap>>>,
}

/// One MoE layer's routing of one forward, kept on the graph for a loss on the routers.
#[derive(Clone, Debug)]
pub struct RouterTap {
    pub layer: usize,
    /// `[T, E]` f32, on the graph.
    pub logits: Tensor,
    /// The experts each token was sent to, `[T, k]` row-major (after pruning, if on).
    pub ids: Vec<u32>,
}

/// The parts every rank holds in full: everything but the routed experts.
#[derive(Clone)]
pub struct DenseParts {
    pub cfg: ModelConfig,
    pub embed: Tensor,
    pub norm: Tensor,
    pub lm_head: Tensor,
    pub layers: Vec<DenseLayer>,
    pub rope: Rope,
}

/// A layer without its routed experts.
#[derive(Clone)]
pub struct DenseLayer {
    pub input_norm: Tensor,
    pub attn: Attention,
    pub post_norm: Tensor,
    pub dense: Option<DenseMlp>,
    /// `[E, H]` for MoE layers.
    pub router: Option<Tensor>,
    pub shared: Option<SharedExperts>,
}

impl DenseParts {
    /// Reads everything but the routed experts.
    pub fn load(w: &Weights, cfg: &ModelConfig) -> Result<Self> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let names = cfg.family.names;
        let embed = w.get("model.embed_tokens.weight", &[v, h])?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            w.get("lm_head.weight", &[v, h])?
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let mlp3 = |prefix: &str, i: usize| -> Result<DenseMlp> {
                Ok(DenseMlp {
                    gate: w.get(&format!("{prefix}.gate_proj.weight"), &[i, h])?,
                    up: w.get(&format!("{prefix}.up_proj.weight"), &[i, h])?,
                    down: w.get(&format!("{prefix}.down_proj.weight"), &[h, i])?,
                })
            };
            let (dense, router, shared) = if cfg.moe_layers[l] {
                let b = format!("{p}.{}", names.block);
                let router = w.get(
                    &format!("{b}.{}.weight", names.router),
                    &[cfg.moe.num_experts, h],
                )?;
                let shared = match (cfg.moe.shared, names.shared) {
                    (Some(s), Some(sn)) => {
                        let m = mlp3(&format!("{b}.{sn}"), s.intermediate)?;
                        let gate = match (s.gated, names.shared_gate) {
                            (true, Some(g)) => Some(w.get(&format!("{b}.{g}.weight"), &[1, h])?),
                            _ => None,
                        };
                        Some(SharedExperts {
                            gate_proj: m.gate,
                            up_proj: m.up,
                            down_proj: m.down,
                            gate,
                        })
                    }
                    _ => None,
                };
                (None, Some(router), shared)
            } else {
                (
                    Some(mlp3(&format!("{p}.mlp"), cfg.dense_intermediate)?),
                    None,
                    None,
                )
            };
            layers.push(DenseLayer {
                input_norm: w.get(&format!("{p}.input_layernorm.weight"), &[h])?,
                attn: Attention::load(w, cfg, l)?,
                post_norm: w.get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                dense,
                router,
                shared,
            });
        }
        let rope = Rope::new(
            cfg.head_dim,
            cfg.rope_theta,
            cfg.positions(),
            w.dtype(),
            embed.device(),
        )?;
        Ok(DenseParts {
            cfg: cfg.clone(),
            embed,
            norm: w.get("model.norm.weight", &[h])?,
            lm_head,
            layers,
            rope,
        })
    }
}

/// How MoE blocks run: the mode, the placement of each MoE layer's experts, and pruning.
#[derive(Clone, Debug)]
pub struct MoeSetup {
    /// `None`: the single-device reference. Otherwise the EP layer in this dispatch mode.
    pub mode: Option<DispatchMode>,
    /// Per MoE layer, the device of each expert; absent layers use the contiguous map.
    pub maps: BTreeMap<usize, Vec<u32>>,
    /// Devices the maps refer to (the group size under EP).
    pub num_devices: usize,
    /// Pruning per MoE layer (the same rule everywhere, tables per layer).
    pub prune: BTreeMap<usize, PruneSpec>,
}

impl MoeSetup {
    /// The reference mode on one device, no pruning.
    pub fn reference() -> Self {
        MoeSetup {
            mode: None,
            maps: BTreeMap::new(),
            num_devices: 1,
            prune: BTreeMap::new(),
        }
    }

    /// The map of `layer`: the given one, or contiguous blocks.
    pub fn map(&self, layer: usize, num_experts: usize) -> Vec<u32> {
        self.maps.get(&layer).cloned().unwrap_or_else(|| {
            crate::analysis::placement::contiguous(num_experts, self.num_devices)
        })
    }
}

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
        let (e, h, i) = (
            cfg.moe.num_experts,
            cfg.hidden_size,
            cfg.moe.expert_intermediate,
        );
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
            let mlp = match (d.dense, d.router) {
                (Some(m), _) => Mlp::Dense(m),
                (None, Some(router)) => {
                    let prefix = format!("model.layers.{l}.{}", names.block);
                    let map = setup.map(l, e);
                    crate::analysis::placement::validate_map(&map, e, setup.num_devices)
                        .map_err(|err| crate::Error::invalid(format!("layer {l}: {err}")))?;
                    let prune = setup.prune.get(&l).cloned();
                    let exec = match (setup.mode, &comm) {
                        (Some(mode), Some(c)) => {
                            let locs = crate::ep::dispatch::ExpertLocations::new(&map, c.size());
                            let mine = &locs.experts_of[c.rank()];
                            let weights = MoeWeights {
                                router,
                                experts: w.experts(&prefix, names.experts, mine, e, h, i)?,
                                shared: d.shared,
                            };
                            let settings = EpSettings {
                                rule: rule.clone(),
                                device_of_expert: map,
                                mode,
                                prune,
                            };
                            MoeExec::Parallel(EpMoe::new(weights, settings, c.clone())?)
                        }
                        _ => {
                            let all: Vec<u32> = (0..e as u32).collect();
                            let experts = w.experts(&prefix, names.experts, &all, e, h, i)?;
                            MoeExec::Reference {
                                weights: MoeWeights {
                                    router,
                                    experts,
                                    shared: d.shared,
                                },
                                prune: prune.map(|p| (p, map, setup.num_devices)),
                            }
                        }
                    };
                    Mlp::Moe(Box::new(MoeBlock {
                        layer: l,
                        rule: rule.clone(),
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

    /// An empty cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            layers: vec![LayerCache::default(); self.layers.len()],
        }
    }

    /// Every tensor of this rank, named as in the checkpoint, but the routed experts, which
    /// are stacked as `...experts.{gate,up,down}` (this rank's, in slot order).
    pub fn params(&self) -> Vec<(String, Tensor)> {
        self.tagged_params()
            .into_iter()
            .map(|(name, t, _)| (name, t))
            .collect()
    }

    /// This rank's trainable tensors, in the order of [`Model::params`].
    pub fn trainable_params(&self) -> Vec<Tensor> {
        self.params()
            .into_iter()
            .map(|(_, t)| t)
            .filter(|t| t.is_variable())
            .collect()
    }

    /// The tensors every rank holds in full: all but the routed experts.
    pub fn replicated_params(&self) -> Vec<(String, Tensor)> {
        self.tagged_params()
            .into_iter()
            .filter(|(_, _, expert)| !expert)
            .map(|(name, t, _)| (name, t))
            .collect()
    }

    /// This rank's routed experts (its own, under expert parallelism).
    pub fn expert_params(&self) -> Vec<(String, Tensor)> {
        self.tagged_params()
            .into_iter()
            .filter(|(_, _, expert)| *expert)
            .map(|(name, t, _)| (name, t))
            .collect()
    }

    /// [`Model::params`], each marked `true` if it holds routed experts.
    fn tagged_params(&self) -> Vec<(String, Tensor, bool)> {
        let mut out = vec![("model.embed_tokens.weight".to_string(), self.embed.clone())];
        let mut experts_at = Vec::new();
        let names = self.cfg.family.names;
        for (l, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            out.push((
                format!("{p}.input_layernorm.weight"),
                layer.input_norm.clone(),
            ));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                layer.post_norm.clone(),
            ));
            for (n, t) in layer.attn.params() {
                out.push((format!("{p}.self_attn.{n}"), t.clone()));
            }
            match &layer.mlp {
                Mlp::Dense(m) => {
                    for (n, t) in [
                        ("gate_proj", &m.gate),
                        ("up_proj", &m.up),
                        ("down_proj", &m.down),
                    ] {
                        out.push((format!("{p}.mlp.{n}.weight"), t.clone()));
                    }
                }
                Mlp::Moe(b) => {
                    let MoeWeights {
                        router,
                        experts,
                        shared,
                    } = match &b.exec {
                        MoeExec::Reference { weights, .. } => weights,
                        MoeExec::Parallel(ep) => &ep.weights,
                    };
                    let q = format!("{p}.{}", names.block);
                    out.push((format!("{q}.{}.weight", names.router), router.clone()));
                    for (n, t) in [
                        ("gate", &experts.gate),
                        ("up", &experts.up),
                        ("down", &experts.down),
                    ] {
                        experts_at.push(out.len());
                        out.push((format!("{q}.experts.{n}"), t.clone()));
                    }
                    if let (Some(s), Some(sn)) = (shared, names.shared) {
                        for (n, t) in [
                            ("gate_proj", &s.gate_proj),
                            ("up_proj", &s.up_proj),
                            ("down_proj", &s.down_proj),
                        ] {
                            out.push((format!("{q}.{sn}.{n}.weight"), t.clone()));
                        }
                        if let (Some(g), Some(gn)) = (&s.gate, names.shared_gate) {
                            out.push((format!("{q}.{gn}.weight"), g.clone()));
                        }
                    }
                }
            }
        }
        out.push(("model.norm.weight".into(), self.norm.clone()));
        if !self.cfg.tie_word_embeddings {
            out.push(("lm_head.weight".into(), self.lm_head.clone()));
        }
        out.into_iter()
            .enumerate()
            .map(|(i, (name, t))| (name, t, experts_at.contains(&i)))
            .collect()
    }

    /// Logits `[B, T, V]` (or `[B, 1, V]` for [`Logits::Last`]) of token ids `[B, T]`. With a
    /// cache, the ids continue the cached positions and the cache is extended. `rec` collects
    /// this rank's routing. Collective under expert parallelism: each rank brings its own ids
    /// (any batch and length), and a rank without work takes part through
    /// [`Model::finish`] or [`Model::forward_empty`].
    pub fn forward(
        &self,
        ids: &Tensor,
        cache: Option<&mut KvCache>,
        rec: Option<&mut RoutingRecorder>,
        which: Logits,
    ) -> Result<Tensor> {
        // Check before announcing: a rank that fails here must not leave its peers in a step.
        let (b, t) = ids.dims2()?;
        if b == 0 || t == 0 {
            bail!("nothing to run: the batch has {b} sequences of {t} tokens");
        }
        let v = self.cfg.vocab_size;
        let ids_host = ids.flatten_all()?.to_vec1::<u32>()?;
        if let Some(&bad) = ids_host.iter().find(|&&x| x as usize >= v) {
            bail!("token id {bad} is outside the vocabulary of {v}");
        }
        let offset = cache.as_ref().map_or(0, |c| c.len());
        if offset + t > self.cfg.positions() {
            bail!(
                "sequence of {} positions exceeds the model's {} (max_position_embeddings)",
                offset + t,
                self.cfg.positions()
            );
        }
        self.announce(true)?;
        match cache {
            None => self.forward_inner(ids, None, rec, which),
            Some(c) => {
                // A failure part-way would leave some layers' caches extended: restore it.
                let before = c.clone();
                let r = self.forward_inner(ids, Some(c), rec, which);
                if r.is_err() {
                    *c = before;
                }
                r
            }
        }
    }

    fn forward_inner(
        &self,
        ids: &Tensor,
        mut cache: Option<&mut KvCache>,
        mut rec: Option<&mut RoutingRecorder>,
        which: Logits,
    ) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        if let Some(c) = cache.as_deref_mut() {
            if c.layers.len() != self.layers.len() {
                *c = self.new_cache();
            }
        }
        // Token ids may come from the host for a model on a GPU.
        let ids = ids.to_device(self.embed.device())?;
        let mut x = self.embed.index_select(&ids.flatten_all()?, 0)?.reshape((
            b,
            t,
            self.cfg.hidden_size,
        ))?;
        let eps = self.cfg.rms_norm_eps;
        let fused = self.fused;
        for (l, layer) in self.layers.iter().enumerate() {
            let lc = cache.as_deref_mut().map(|c| &mut c.layers[l]);
            let a = layer.attn.forward(
                &rms_norm(&x, &layer.input_norm, eps, fused)?,
                &self.rope,
                lc,
                fused,
            )?;
            x = residual_add(&x, &a)?;
            let hnorm = rms_norm(&x, &layer.post_norm, eps, fused)?;
            let y = match &layer.mlp {
                Mlp::Dense(m) => swiglu_3d(&hnorm, m)?,
                Mlp::Moe(block) => {
                    let flat = hnorm.reshape((b * t, self.cfg.hidden_size))?;
                    let y = self.moe_forward(block, &flat, rec.as_deref_mut())?;
                    y.reshape((b, t, self.cfg.hidden_size))?
                }
            };
            x = residual_add(&x, &y)?;
        }
        let x = match which {
            Logits::All => x,
            Logits::Last => x.narrow(1, t - 1, 1)?,
        };
        let x = rms_norm(&x, &self.norm, eps, fused)?;
        linear(&x, &self.lm_head, None)
    }

    fn moe_forward(
        &self,
        block: &MoeBlock,
        x: &Tensor,
        rec: Option<&mut RoutingRecorder>,
    ) -> Result<Tensor> {
        let n = x.dims2()?.0;
        let (y, routed) = match &block.exec {
            MoeExec::Reference { weights, prune } => {
                let prune = prune.as_ref().map(|(s, m, d)| (s, m.as_slice(), *d));
                reference_forward_routed(weights, &block.rule, x, prune)?
            }
            MoeExec::Parallel(ep) => {
                let (y, stats, routed) = ep.forward_routed(x)?;
                if let Ok(mut all) = self.ep_stats.lock() {
                    all.entry(block.layer).or_default().add(&stats);
                }
                (y, routed)
            }
        };
        if let Some(r) = rec {
            r.add(block.layer, &routed, n)?;
        }
        if let Ok(mut taps) = self.router_taps.lock() {
            if let Some(taps) = taps.as_mut() {
                taps.push(RouterTap {
                    layer: block.layer,
                    logits: routed.router_logits,
                    ids: routed.ids,
                });
            }
        }
        Ok(y)
    }

    /// Starts (or stops) keeping each MoE layer's routing of the following forwards on the
    /// graph, for [`Model::take_router_taps`]. Off by default.
    pub fn tap_routers(&self, on: bool) {
        if let Ok(mut taps) = self.router_taps.lock() {
            *taps = on.then(Vec::new);
        }
    }

    /// The routing kept since the last take, in forward order (one per MoE layer and forward).
    pub fn take_router_taps(&self) -> Vec<RouterTap> {
        self.router_taps
            .lock()
            .ok()
            .and_then(|mut t| t.as_mut().map(std::mem::take))
            .unwrap_or_default()
    }

    /// The EP layers' statistics (rows, pairs, C_T, stage times) summed over every MoE layer
    /// and forward since the last call; resets them.
    pub fn take_ep_stats(&self) -> StepStats {
        let mut sum = StepStats::default();
        for s in self.take_ep_stats_by_layer().values() {
            sum.add(s);
        }
        sum
    }

    /// The EP layers' statistics per MoE layer (by the model's layer index) since the last
    /// take; resets them.
    pub fn take_ep_stats_by_layer(&self) -> BTreeMap<usize, StepStats> {
        self.ep_stats
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default()
    }

    /// The communicator under expert parallelism.
    pub fn comm(&self) -> Option<&Arc<dyn Communicator>> {
        self.comm.as_ref()
    }

    /// Opens one lockstep round: says whether this rank brings a step, and returns whether
    /// any rank does. A no-op `true` on one rank.
    pub(crate) fn announce(&self, active: bool) -> Result<bool> {
        match self.comm() {
            Some(c) if c.size() > 1 => {
                let all = c.all_gather_bytes(&[active as u8])?;
                Ok(all.iter().any(|&b| b != 0))
            }
            _ => Ok(true),
        }
    }
}

fn swiglu_3d(x: &Tensor, m: &DenseMlp) -> Result<Tensor> {
    let (b, t, h) = x.dims3()?;
    let y = swiglu(&x.reshape((b * t, h))?, &m.gate, &m.up, &m.down)?;
    Ok(y.reshape((b, t, h))?)
}

/// A 64-bit FNV-1a digest of bytes (to compare what ranks hold without moving it).
pub fn fingerprint(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What the ranks of a model must agree on, as (what, value) pairs for messages.
fn layout(dense: &DenseParts, setup: &MoeSetup) -> Result<Vec<(String, String)>> {
    let c = &dense.cfg;
    // The replicated weights that decide routing: the routers (small), and the embeddings' first
    // row. Two different checkpoints of one shape differ here.
    let mut weights = Vec::new();
    let first_row = dense.embed.get(0)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    weights.extend(first_row);
    for layer in &dense.layers {
        if let Some(r) = &layer.router {
            weights.extend(r.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
    }
    // The maps in effect (a file's, or the default contiguous ones) of every MoE layer.
    let maps: Vec<u8> = (0..c.num_layers)
        .filter(|&l| c.moe_layers[l])
        .flat_map(|l| std::iter::once(l as u32).chain(setup.map(l, c.moe.num_experts)))
        .flat_map(u32::to_le_bytes)
        .collect();
    let prune: Vec<String> = setup
        .prune
        .iter()
        .map(|(l, p)| {
            let table = p
                .similarity
                .as_ref()
                .map(|t| fingerprint(t.cos.iter().flat_map(|x| x.to_le_bytes())));
            format!(
                "layer {l}: {:?} to {} devices, table {table:x?}",
                p.rule, p.max_devices
            )
        })
        .collect();
    Ok(vec![
        (
            "model".into(),
            format!(
                "{} with hidden size {}, {} layers, {} experts, top-{}, vocabulary {}",
                c.family, c.hidden_size, c.num_layers, c.moe.num_experts, c.moe.top_k, c.vocab_size
            ),
        ),
        ("dtype".into(), format!("{:?}", dense.embed.dtype())),
        (
            "checkpoint weights (digest of the routers and the embeddings' first row)".into(),
            format!(
                "{:016x}",
                fingerprint(weights.iter().flat_map(|x| x.to_le_bytes()))
            ),
        ),
        ("dispatch mode".into(), format!("{:?}", setup.mode)),
        (
            "placement (digest)".into(),
            format!("{} devices, {:016x}", setup.num_devices, fingerprint(maps)),
        ),
        ("pruning".into(), format!("{prune:?}")),
    ])
}

/// Checks that every rank loads the same model under the same setup; the error names the
/// first thing that differs and the ranks that differ from rank 0. Collective.
pub(crate) fn check_same_layout(
    comm: &dyn Communicator,
    dense: &DenseParts,
    setup: &MoeSetup,
) -> Result<()> {
    if comm.size() < 2 {
        return Ok(());
    }
    let mine = layout(dense, setup)?;
    let bytes = serde_json::to_vec(&mine)
        .map_err(|e| Error::invalid(format!("encoding the layout: {e}")))?;
    let all = comm.all_gather_v_bytes(&bytes)?;
    let decoded: Vec<Vec<(String, String)>> = all
        .iter()
        .map(|b| serde_json::from_slice(b))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Error::Comm(format!("a rank's layout does not decode: {e}")))?;
    for (k, (what, value)) in decoded[0].iter().enumerate() {
        let differ: Vec<usize> = (1..decoded.len())
            .filter(|&r| decoded[r].get(k).map(|x| &x.1) != Some(value))
            .collect();
        if let Some(&r) = differ.first() {
            let theirs = decoded[r].get(k).map_or("nothing", |x| x.1.as_str());
            bail!(
                "the ranks run different models or setups: rank(s) {differ:?} differ from rank 0 \
                 in the {what}: rank 0 has {value}, rank {r} has {theirs}"
            );
        }
    }
    Ok(())
}
