//! DeepSeek-V3's multi-head latent attention (MLA), as transformers' `DeepseekV3Attention`
//! computes it: queries from `q_proj`, or from `q_b_proj(norm(q_a_proj(x)))` with a low rank;
//! keys and values from one latent, `kv_a_proj_with_mqa(x)` split into `kv_lora_rank` features
//! (normed, then `kv_b_proj` gives each head its unrotated key and its value) and one key of
//! `qk_rope_head_dim` features, rotated and shared by every head. Each head's query and key are
//! its unrotated part, then its rotated part; the scores are scaled by `qk_head_dim^-1/2`, times
//! YaRN's `mscale^2` where the config's rope scaling has `mscale_all_dim`.
//!
//! Under `rope_interleave` (the default, and the released checkpoints') the rotated features come
//! in pairs `(x0, x1), (x2, x3), ...`; transformers rotates each pair and writes the evens'
//! results, then the odds': the same as taking the evens, then the odds, and rotating halves,
//! which is what this does (one gather of the rotated features).
//!
//! The keys and values are expanded per head and cached so, through the shared core
//! ([`super::attention::attend`]); where the value width differs from the query/key width, the
//! narrower side is padded with zeros, which changes no score and no output.

use super::attention::{attend, first_position, LayerCache};
use super::config::{MlaConfig, ModelConfig};
use super::layers::{linear, rms_norm, Rope};
use crate::models::weights::Weights;
use crate::Result;
use candle::Tensor;

/// How queries are projected.
#[derive(Clone, Debug)]
enum Queries {
    /// `q_proj` `[nh * qk, H]`.
    Direct(Tensor),
    /// `q_a_proj` `[r, H]` (and its bias), `q_a_layernorm` `[r]`, `q_b_proj` `[nh * qk, r]`.
    LowRank {
        a: Tensor,
        a_bias: Option<Tensor>,
        norm: Tensor,
        b: Tensor,
    },
}

/// One layer's latent attention weights.
#[derive(Clone, Debug)]
pub struct LatentAttention {
    queries: Queries,
    /// `kv_a_proj_with_mqa` `[kv_lora + rope, H]` and its bias.
    kv_a: Tensor,
    kv_a_bias: Option<Tensor>,
    /// `kv_a_layernorm` `[kv_lora]`.
    kv_norm: Tensor,
    /// `kv_b_proj` `[nh * (nope + v), kv_lora]`.
    kv_b: Tensor,
    /// `o_proj` `[H, nh * v]` and its bias.
    o: Tensor,
    o_bias: Option<Tensor>,
    num_heads: usize,
    dims: MlaConfig,
    /// The rotated features' order under `rope_interleave`: the evens, then the odds.
    deinterleave: Option<Tensor>,
    scale: f64,
    eps: f64,
}

impl LatentAttention {
    /// Reads layer `l`'s latent attention (`model.layers.{l}.self_attn.*`).
    pub fn load(w: &Weights, cfg: &ModelConfig, m: &MlaConfig, l: usize) -> Result<Self> {
        let p = format!("model.layers.{l}.self_attn");
        let (h, nh) = (cfg.hidden_size, cfg.num_heads);
        let qk = m.qk_head_dim();
        let bias = |name: &str, n: usize| -> Result<Option<Tensor>> {
            cfg.attention_bias
                .then(|| w.get(&format!("{p}.{name}.bias"), &[n]))
                .transpose()
        };
        let queries = match m.q_lora_rank {
            None => Queries::Direct(w.get(&format!("{p}.q_proj.weight"), &[nh * qk, h])?),
            Some(r) => Queries::LowRank {
                a: w.get(&format!("{p}.q_a_proj.weight"), &[r, h])?,
                a_bias: bias("q_a_proj", r)?,
                norm: w.get(&format!("{p}.q_a_layernorm.weight"), &[r])?,
                b: w.get(&format!("{p}.q_b_proj.weight"), &[nh * qk, r])?,
            },
        };
        let rope = m.qk_rope_head_dim;
        let deinterleave = m
            .rope_interleave
            .then(|| {
                let order: Vec<u32> = (0..rope as u32)
                    .step_by(2)
                    .chain((1..rope as u32).step_by(2))
                    .collect();
                Tensor::from_vec(order, rope, w.device())
            })
            .transpose()?;
        Ok(LatentAttention {
            queries,
            kv_a: w.get(
                &format!("{p}.kv_a_proj_with_mqa.weight"),
                &[m.kv_lora_rank + rope, h],
            )?,
            kv_a_bias: bias("kv_a_proj_with_mqa", m.kv_lora_rank + rope)?,
            kv_norm: w.get(&format!("{p}.kv_a_layernorm.weight"), &[m.kv_lora_rank])?,
            kv_b: w.get(
                &format!("{p}.kv_b_proj.weight"),
                &[nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
            )?,
            o: w.get(&format!("{p}.o_proj.weight"), &[h, nh * m.v_head_dim])?,
            o_bias: bias("o_proj", h)?,
            num_heads: nh,
            dims: *m,
            deinterleave,
            scale: (qk as f64).powf(-0.5) * cfg.rope_scaling.softmax_mscale(),
            eps: cfg.rms_norm_eps,
        })
    }

    /// The tensors, named as the checkpoint names them inside `self_attn`.
    pub fn params(&self) -> Vec<(&'static str, &Tensor)> {
        let mut out = match &self.queries {
            Queries::Direct(q) => vec![("q_proj.weight", q)],
            Queries::LowRank { a, a_bias, norm, b } => {
                let mut v = vec![
                    ("q_a_proj.weight", a),
                    ("q_a_layernorm.weight", norm),
                    ("q_b_proj.weight", b),
                ];
                v.extend(a_bias.as_ref().map(|t| ("q_a_proj.bias", t)));
                v
            }
        };
        out.extend([
            ("kv_a_proj_with_mqa.weight", &self.kv_a),
            ("kv_a_layernorm.weight", &self.kv_norm),
            ("kv_b_proj.weight", &self.kv_b),
            ("o_proj.weight", &self.o),
        ]);
        out.extend(
            self.kv_a_bias
                .as_ref()
                .map(|t| ("kv_a_proj_with_mqa.bias", t)),
        );
        out.extend(self.o_bias.as_ref().map(|t| ("o_proj.bias", t)));
        out
    }

    /// Rotates `x` `[B, heads, T, rope]` at positions from `offset`, in the checkpoint's pair
    /// order.
    fn rotate(&self, x: &Tensor, rope: &Rope, offset: usize, fused: bool) -> Result<Tensor> {
        let x = match &self.deinterleave {
            Some(order) => x.contiguous()?.index_select(order, 3)?,
            None => x.clone(),
        };
        rope.apply(&x, offset, fused)
    }

    /// Attention of `x` `[B, T, H]` whose first position is the cache's length; appends this
    /// step's keys and values to `cache` if given.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        cache: Option<&mut LayerCache>,
        fused: bool,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let m = &self.dims;
        let (nh, nope, rot, vd) = (
            self.num_heads,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
        );
        let qk = nope + rot;
        let offset = first_position(cache.as_deref(), t, rope)?;
        let q = match &self.queries {
            Queries::Direct(w) => linear(x, w, None)?,
            Queries::LowRank { a, a_bias, norm, b } => {
                let low = linear(x, a, a_bias.as_ref())?;
                linear(&rms_norm(&low, norm, self.eps, fused)?, b, None)?
            }
        };
        let q = q.reshape((b, t, nh, qk))?.transpose(1, 2)?; // [B, nh, T, qk]
        let q_rot = self.rotate(&q.narrow(3, nope, rot)?, rope, offset, fused)?;
        let latent = linear(x, &self.kv_a, self.kv_a_bias.as_ref())?;
        let kv = rms_norm(
            &latent.narrow(2, 0, m.kv_lora_rank)?,
            &self.kv_norm,
            self.eps,
            fused,
        )?;
        let k_rot = latent
            .narrow(2, m.kv_lora_rank, rot)?
            .reshape((b, t, 1, rot))?
            .transpose(1, 2)?;
        let k_rot = self.rotate(&k_rot, rope, offset, fused)?; // [B, 1, T, rot]
        let kv = linear(&kv, &self.kv_b, None)?
            .reshape((b, t, nh, nope + vd))?
            .transpose(1, 2)?; // [B, nh, T, nope + v]
        let q = Tensor::cat(&[&q.narrow(3, 0, nope)?, &q_rot], 3)?;
        let k = Tensor::cat(
            &[
                &kv.narrow(3, 0, nope)?,
                &k_rot.broadcast_as((b, nh, t, rot))?,
            ],
            3,
        )?;
        let v = kv.narrow(3, nope, vd)?;
        // One width for the core: zeros change no score and no output.
        let width = qk.max(vd);
        let pad = |x: Tensor, from: usize| -> Result<Tensor> {
            Ok(if from < width {
                x.pad_with_zeros(3, 0, width - from)?
            } else {
                x
            })
        };
        let (q, k, v) = (
            pad(q, qk)?.contiguous()?,
            pad(k, qk)?.contiguous()?,
            pad(v, vd)?.contiguous()?,
        );
        let y = attend(q, k, v, cache, offset, None, self.scale, None, fused)?;
        let y = y
            .reshape((b, t, nh, width))?
            .narrow(3, 0, vd)?
            .reshape((b, t, nh * vd))?;
        linear(&y, &self.o, self.o_bias.as_ref())
    }
}
