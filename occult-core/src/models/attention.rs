//! Causal self-attention of the supported families: [`Attention`] is grouped-query attention
//! ([`GroupedAttention`]) or DeepSeek-V3's latent attention
//! ([`super::attention_latent::LatentAttention`]), both through one core ([`attend`]) with a
//! key/value cache for incremental decoding. Grouped attention has optional q/k/v biases, q/k
//! RMSNorm over the whole projection (OLMoE) or per head (Qwen3, GLM-4.5), optional q/k/v
//! clipping (OLMoE), rotate-half RoPE (on all of each head or its first features), an
//! optional sliding window (on every layer, or on those `layer_types` marks) and gpt-oss's
//! output bias and attention sinks.

use super::attention_infer;
use super::attention_latent::LatentAttention;
use super::attention_ragged;
use super::config::{ModelConfig, QkNorm};
pub use super::layer_cache::LayerCache;
use super::layers::{causal_mask, linear, rms_norm, softmax_f32, Rope};
use crate::ep::experts::par_map;
use crate::models::weights::Weights;
use crate::{bail, Result};
use candle::{DType, Tensor};

/// One layer's attention.
#[derive(Clone, Debug)]
pub enum Attention {
    Grouped(GroupedAttention),
    Latent(Box<LatentAttention>),
}

impl Attention {
    /// Reads layer `l`'s attention (`model.layers.{l}.self_attn.*`): latent where the config
    /// says so (DeepSeek-V3), grouped otherwise.
    pub fn load(w: &Weights, cfg: &ModelConfig, l: usize) -> Result<Self> {
        Ok(match &cfg.mla {
            Some(mla) => Attention::Latent(Box::new(LatentAttention::load(w, cfg, mla, l)?)),
            None => Attention::Grouped(GroupedAttention::load(w, cfg, l)?),
        })
    }

    /// The tensors, named as the checkpoint names them inside `self_attn`.
    pub fn params(&self) -> Vec<(&'static str, &Tensor)> {
        match self {
            Attention::Grouped(a) => a.params(),
            Attention::Latent(a) => a.params(),
        }
    }

    /// Attention of sequences laid end to end in `x` `[1, N, H]`, sequence i the next
    /// `lens[i]` rows continuing `caches[i]`: grouped attention projects all rows at once;
    /// latent attention runs sequence by sequence.
    pub fn forward_ragged(
        &self,
        x: &Tensor,
        lens: &[usize],
        rope: &Rope,
        caches: &mut [&mut LayerCache],
        fused: bool,
    ) -> Result<Tensor> {
        match self {
            Attention::Grouped(a) => a.forward_ragged(x, lens, rope, caches, fused),
            Attention::Latent(a) => {
                let mut parts = Vec::with_capacity(lens.len());
                let mut start = 0;
                for (&t, c) in lens.iter().zip(caches.iter_mut()) {
                    let xs = x.narrow(1, start, t)?;
                    parts.push(a.forward(&xs, rope, Some(&mut **c), fused)?);
                    start += t;
                }
                Ok(Tensor::cat(&parts, 1)?)
            }
        }
    }

    /// Attention of `x` `[B, T, H]` whose first position is the cache's length (see
    /// [`GroupedAttention::forward`]).
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        cache: Option<&mut LayerCache>,
        fused: bool,
    ) -> Result<Tensor> {
        match self {
            Attention::Grouped(a) => a.forward(x, rope, cache, fused),
            Attention::Latent(a) => a.forward(x, rope, cache, fused),
        }
    }
}

/// A per-head RMSNorm: its weight `[head_dim]` and eps.
type HeadNorm<'a> = Option<(&'a Tensor, f64)>;

/// One layer's grouped-query attention weights.
#[derive(Clone, Debug)]
pub struct GroupedAttention {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub o: Tensor,
    /// gpt-oss's `o_proj.bias`.
    pub o_bias: Option<Tensor>,
    /// gpt-oss's per-head sink logits `[num_heads]`.
    pub sinks: Option<Tensor>,
    pub q_bias: Option<Tensor>,
    pub k_bias: Option<Tensor>,
    pub v_bias: Option<Tensor>,
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub qk_norm: QkNorm,
    pub clip: Option<f64>,
    pub eps: f64,
    pub window: Option<usize>,
}

impl GroupedAttention {
    /// Reads layer `l`'s attention (`model.layers.{l}.self_attn.*`).
    pub fn load(w: &Weights, cfg: &ModelConfig, l: usize) -> Result<Self> {
        let p = format!("model.layers.{l}.self_attn");
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let bias = |name: &str, n: usize| -> Result<Option<Tensor>> {
            if cfg.attention_bias {
                Ok(Some(w.get(&format!("{p}.{name}.bias"), &[n])?))
            } else {
                Ok(None)
            }
        };
        let (q_norm, k_norm) = match cfg.qk_norm {
            QkNorm::None => (None, None),
            QkNorm::Full => (
                Some(w.get(&format!("{p}.q_norm.weight"), &[nh * hd])?),
                Some(w.get(&format!("{p}.k_norm.weight"), &[nkv * hd])?),
            ),
            QkNorm::PerHead => (
                Some(w.get(&format!("{p}.q_norm.weight"), &[hd])?),
                Some(w.get(&format!("{p}.k_norm.weight"), &[hd])?),
            ),
        };
        Ok(GroupedAttention {
            q: w.get(&format!("{p}.q_proj.weight"), &[nh * hd, h])?,
            k: w.get(&format!("{p}.k_proj.weight"), &[nkv * hd, h])?,
            v: w.get(&format!("{p}.v_proj.weight"), &[nkv * hd, h])?,
            o: w.get(&format!("{p}.o_proj.weight"), &[h, nh * hd])?,
            o_bias: if cfg.attention.output_bias {
                Some(w.get(&format!("{p}.o_proj.bias"), &[h])?)
            } else {
                None
            },
            sinks: if cfg.attention.sinks {
                Some(w.get(&format!("{p}.sinks"), &[nh])?)
            } else {
                None
            },
            q_bias: bias("q_proj", nh * hd)?,
            k_bias: bias("k_proj", nkv * hd)?,
            v_bias: bias("v_proj", nkv * hd)?,
            q_norm,
            k_norm,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            qk_norm: cfg.qk_norm,
            clip: cfg.clip_qkv,
            eps: cfg.rms_norm_eps,
            window: cfg.window(l),
        })
    }

    /// The tensors, named as the checkpoint names them inside `self_attn` (for gradient
    /// checks, optimisers and saving).
    pub fn params(&self) -> Vec<(&'static str, &Tensor)> {
        let optional = [
            ("q_proj.bias", &self.q_bias),
            ("k_proj.bias", &self.k_bias),
            ("v_proj.bias", &self.v_bias),
            ("o_proj.bias", &self.o_bias),
            ("sinks", &self.sinks),
            ("q_norm.weight", &self.q_norm),
            ("k_norm.weight", &self.k_norm),
        ];
        [
            ("q_proj.weight", &self.q),
            ("k_proj.weight", &self.k),
            ("v_proj.weight", &self.v),
            ("o_proj.weight", &self.o),
        ]
        .into_iter()
        .chain(
            optional
                .into_iter()
                .filter_map(|(n, t)| t.as_ref().map(|t| (n, t))),
        )
        .collect()
    }

    /// Attention of `x` `[B, T, H]` whose first position is the cache's length; appends the new
    /// keys and values to `cache` if given. `fused` picks candle's fused kernels (inference
    /// only: they have no backward).
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        cache: Option<&mut LayerCache>,
        fused: bool,
    ) -> Result<Tensor> {
        let (q, k, v) = self.project(x, fused)?;
        let y = self.attend_positions(q, k, v, rope, cache, fused)?;
        linear(&y, &self.o, self.o_bias.as_ref())
    }

    /// Attention of sequences laid end to end in `x` `[1, N, H]`, sequence i the next
    /// `lens[i]` rows continuing `caches[i]`: the projections and the rotation over all rows
    /// at once (each at its sequence's position), attention against each sequence's cache (all
    /// in one pass at inference on CPU, [`attention_ragged::core`]).
    pub fn forward_ragged(
        &self,
        x: &Tensor,
        lens: &[usize],
        rope: &Rope,
        caches: &mut [&mut LayerCache],
        fused: bool,
    ) -> Result<Tensor> {
        let (q, k, v) = self.project(x, fused)?;
        // Each row at its sequence's next position.
        let mut positions = Vec::with_capacity(q.dim(1)?);
        let mut offsets = Vec::with_capacity(lens.len());
        for (&t, c) in lens.iter().zip(caches.iter()) {
            let offset = first_position(Some(&**c), t, rope)?;
            positions.extend((offset..offset + t).map(|p| p as u32));
            offsets.push(offset);
        }
        let (qn, kn) = self.head_norms();
        let q = rope.apply_normed_at(&q.transpose(1, 2)?, &positions, fused, qn)?;
        let k = rope.apply_normed_at(&k.transpose(1, 2)?, &positions, fused, kn)?;
        let v = v.transpose(1, 2)?;
        let sinks = match &self.sinks {
            Some(sk) if sk.track_op() => None,
            Some(sk) => Some(Some(sk.to_dtype(DType::F32)?.to_vec1::<f32>()?)),
            None => Some(None),
        };
        // Every sequence at once on CPU at inference; the tensor path sequence by sequence.
        if let Some(sinks) = &sinks {
            let (w, scale) = (self.window, self.scale());
            let fast =
                attention_ragged::core(&q, &k, &v, lens, caches, w, scale, sinks.as_deref())?;
            if let Some(y) = fast {
                return linear(&y, &self.o, self.o_bias.as_ref());
            }
        }
        let mut parts = Vec::with_capacity(lens.len());
        let mut start = 0;
        for ((&t, c), &offset) in lens.iter().zip(caches.iter_mut()).zip(&offsets) {
            let part = |a: &Tensor| a.narrow(2, start, t);
            parts.push(attend(
                part(&q)?,
                part(&k)?.contiguous()?,
                part(&v)?.contiguous()?,
                Some(&mut **c),
                offset,
                self.window,
                self.scale(),
                self.sinks.as_ref(),
                fused,
            )?);
            start += t;
        }
        let y = Tensor::cat(&parts, 1)?;
        linear(&y, &self.o, self.o_bias.as_ref())
    }

    /// The per-head q/k norms (Qwen3), which go with the rotation.
    fn head_norms(&self) -> (HeadNorm<'_>, HeadNorm<'_>) {
        match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) if self.qk_norm == QkNorm::PerHead => {
                (Some((qn, self.eps)), Some((kn, self.eps)))
            }
            _ => (None, None),
        }
    }

    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// The queries, keys and values of `x` `[B, T, H]`, `[B, T, heads, head_dim]` each, with
    /// whole-projection norms (OLMoE) and clipping applied.
    fn project(&self, x: &Tensor, fused: bool) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let mut q = linear(x, &self.q, self.q_bias.as_ref())?;
        let mut k = linear(x, &self.k, self.k_bias.as_ref())?;
        let mut v = linear(x, &self.v, self.v_bias.as_ref())?;
        if let (QkNorm::Full, Some(qn), Some(kn)) = (self.qk_norm, &self.q_norm, &self.k_norm) {
            q = rms_norm(&q, qn, self.eps, fused)?;
            k = rms_norm(&k, kn, self.eps, fused)?;
        }
        if let Some(c) = self.clip {
            q = q.clamp(-c, c)?;
            k = k.clamp(-c, c)?;
            v = v.clamp(-c, c)?;
        }
        Ok((
            q.reshape((b, t, nh, hd))?,
            k.reshape((b, t, nkv, hd))?,
            v.reshape((b, t, nkv, hd))?,
        ))
    }

    /// Rotates `q` and `k` `[B, T, heads, head_dim]` at the positions after `cache` (with the
    /// per-head norms, Qwen3), then attends; `[B, T, nh * hd]` before the output projection.
    fn attend_positions(
        &self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        rope: &Rope,
        cache: Option<&mut LayerCache>,
        fused: bool,
    ) -> Result<Tensor> {
        let t = q.dim(1)?;
        let offset = first_position(cache.as_deref(), t, rope)?;
        // Per-head q/k norms (Qwen3) go with the rotation: one pass over each on the fused path.
        let (qn, kn) = self.head_norms();
        let q = rope.apply_normed(&q.transpose(1, 2)?, offset, fused, qn)?;
        let k = rope.apply_normed(&k.transpose(1, 2)?, offset, fused, kn)?;
        let v = v.transpose(1, 2)?.contiguous()?;
        attend(
            q,
            k,
            v,
            cache,
            offset,
            self.window,
            self.scale(),
            self.sinks.as_ref(),
            fused,
        )
    }
}

/// The position of this step's first token: the cache's length, checked with the step's `t`
/// tokens against the positions `rope` covers.
pub fn first_position(cache: Option<&LayerCache>, t: usize, rope: &Rope) -> Result<usize> {
    let offset = cache.map_or(0, |c| c.len());
    if offset + t > rope.max_positions() {
        bail!(
            "sequence of {} positions exceeds the model's {} (max_position_embeddings)",
            offset + t,
            rope.max_positions()
        );
    }
    Ok(offset)
}

/// Causal attention's core: queries `q` `[B, nh, T, hd]` at positions `offset..offset + T`,
/// this step's keys and values `[B, nkv, T, hd]` (appended to `cache` if given, which then
/// holds the earlier ones), scores scaled by `scale`, keys further back than `window` unseen;
/// with `sinks` (`[nh]`, gpt-oss), each head's sink logit joins its softmax and takes its
/// share of the probability to nowhere. Returns `[B, T, nh * hd]`.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: Option<&mut LayerCache>,
    offset: usize,
    window: Option<usize>,
    scale: f64,
    sinks: Option<&Tensor>,
    fused: bool,
) -> Result<Tensor> {
    let (b, nh, t, hd) = q.dims4()?;
    let nkv = k.dim(1)?;
    if nkv == 0 || nh % nkv != 0 {
        bail!("{nh} query heads cannot share {nkv} key/value heads");
    }
    let (k, v) = match cache {
        Some(c) => c.append(&k, &v)?,
        None => (k, v),
    };
    // Grouped-query attention reads each key/value head in place: the g = nh / nkv query
    // heads that share one (consecutive, as transformers' repeat_kv lays them out) are
    // stacked as g * T rows against it, instead of copying the cache g times.
    let g = nh / nkv;
    let s = k.dim(2)?;
    let q = q.contiguous()?.reshape((b, nkv, g * t, hd))?;
    if let Some(sk) = sinks {
        if sk.dims() != [nh] {
            bail!(
                "attention sinks have shape {:?}, expected [{nh}]",
                sk.dims()
            );
        }
    }
    let sinks_f32 = sinks.map(|sk| sk.to_dtype(DType::F32)).transpose()?;
    // The inference path takes the sinks as values; none there while they train.
    let sink_values = match &sinks_f32 {
        Some(sk) if !sk.track_op() => Some(sk.to_vec1::<f32>()?),
        Some(_) => None,
        None => None,
    };
    let infer = match (&sinks_f32, &sink_values) {
        (Some(_), None) => None,
        _ => attention_infer::core(&q, &k, &v, t, offset, window, scale, sink_values.as_deref())?,
    };
    let y = match infer {
        Some(y) => y,
        None => {
            let mask = causal_mask(t, offset, window, DType::F32, q.device())?;
            let vt = v.transpose(2, 3)?.contiguous()?; // [B, nkv, hd, S]
            let (q3, k3) = (
                q.reshape((b * nkv, g * t, hd))?,
                k.reshape((b * nkv, s, hd))?,
            );
            let vt3 = vt.reshape((b * nkv, hd, s))?;
            // Each key/value head (and its g query heads) on its own thread: scores, then scale,
            // mask and softmax in f32 (transformers scales and masks in the model's dtype, then
            // softmaxes in f32: one rounding fewer here), then the values. The element-wise work
            // runs on every core this way, where candle runs it on one.
            let heads: Vec<usize> = (0..b * nkv).collect();
            let ys = par_map(&heads, |&i| {
                let scores =
                    (linear(&q3.get(i)?, &k3.get(i)?, None)?.to_dtype(DType::F32)? * scale)?;
                let scores = scores.reshape((g, t, s))?.broadcast_add(&mask)?;
                let probs = match &sinks_f32 {
                    // The g query heads of key/value head i % nkv, each with its sink as one
                    // more column, dropped after the softmax.
                    Some(sk) => {
                        let sk = sk.narrow(0, (i % nkv) * g, g)?.reshape((g, 1, 1))?;
                        let with = Tensor::cat(&[&scores, &sk.broadcast_as((g, t, 1))?], 2)?;
                        softmax_f32(&with, false)?.narrow(2, 0, s)?
                    }
                    None => softmax_f32(&scores, fused)?,
                };
                let probs = probs.to_dtype(v.dtype())?;
                linear(&probs.reshape((g * t, s))?, &vt3.get(i)?, None)
            })?;
            Tensor::stack(&ys, 0)?.reshape((b, nkv, g * t, hd))?
        }
    };
    let y = y
        .reshape((b, nh, t, hd))?
        .transpose(1, 2)?
        .reshape((b, t, nh * hd))?;
    Ok(y)
}
