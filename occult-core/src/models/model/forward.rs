//! The forward: token ids to logits through every layer (embeddings, pre-norm attention and
//! MLP blocks, the final norm and the LM head), with an optional cache, routing recorded and
//! tapped on request. Under expert parallelism every forward opens a lockstep round
//! ([`Model::announce`]) and its MoE blocks exchange rows with the other ranks.

use super::cache::KvCache;
use super::decoder::{Layer, Mlp, Model};
use super::dense::DenseMlp;
use super::moe::{MoeBlock, MoeExec};
use super::recorder::{RouterTap, RoutingRecorder};
use crate::ep::swiglu::swiglu;
use crate::ep::{reference_forward_routed, residual_add};
use crate::models::attention::LayerCache;
use crate::models::layers::{linear, rms_norm};
use crate::{bail, Result};
use candle::Tensor;

/// Which positions get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
}

impl Model {
    /// An empty cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            layers: vec![LayerCache::default(); self.layers.len()],
        }
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
        let ids_host = ids.flatten_all()?.to_vec1::<u32>()?;
        self.check_step(&ids_host, cache.as_ref().map_or(0, |c| c.len()), t)?;
        self.announce(true)?;
        match cache {
            None => self.forward_inner(ids, None, rec, which),
            Some(c) => {
                // A failure part-way would leave some layers' caches extended: restore it.
                let before = c.mark();
                let r = self.forward_inner(ids, Some(c), rec, which);
                if r.is_err() {
                    c.restore(before);
                }
                r
            }
        }
    }

    /// Refuses a step of `ids` (`t` per sequence) after `offset` cached positions that leaves
    /// the vocabulary or the model's positions.
    pub(super) fn check_step(&self, ids: &[u32], offset: usize, t: usize) -> Result<()> {
        let v = self.cfg.vocab_size;
        if let Some(&bad) = ids.iter().find(|&&x| x as usize >= v) {
            bail!("token id {bad} is outside the vocabulary of {v}");
        }
        if offset + t > self.cfg.positions() {
            bail!(
                "sequence of {} positions exceeds the model's {} (max_position_embeddings)",
                offset + t,
                self.cfg.positions()
            );
        }
        Ok(())
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
            x = self.mlp_step(layer, &x, rec.as_deref_mut())?;
        }
        let x = match which {
            Logits::All => x,
            Logits::Last => x.narrow(1, t - 1, 1)?,
        };
        let x = rms_norm(&x, &self.norm, eps, fused)?;
        linear(&x, &self.lm_head, None)
    }

    /// A layer's MLP half on `x` `[B, T, H]`: the post-attention norm, the dense or MoE MLP
    /// over every token, and the residual.
    pub(super) fn mlp_step(
        &self,
        layer: &Layer,
        x: &Tensor,
        rec: Option<&mut RoutingRecorder>,
    ) -> Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let hnorm = rms_norm(x, &layer.post_norm, self.cfg.rms_norm_eps, self.fused)?;
        let y = match &layer.mlp {
            Mlp::Dense(m) => swiglu_3d(&hnorm, m)?,
            Mlp::Moe(block) => {
                let flat = hnorm.reshape((b * t, h))?;
                self.moe_forward(block, &flat, rec)?.reshape((b, t, h))?
            }
        };
        residual_add(x, &y)
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
