//! The dense building blocks of the decoders: RMSNorm in f32 as transformers computes it,
//! rotate-half RoPE from precomputed tables, softmax, linear projections with optional bias,
//! and the causal mask.
//!
//! Norm, RoPE and softmax come in two forms: differentiable compositions of candle primitives
//! (candle 0.11's fused kernels have no backward), used whenever a weight is
//! trainable, and candle's fused kernels for inference (`fused = true`). Tests hold the two
//! together.

use super::rope_scaling::RopeScaling;
use crate::Result;
use candle::{DType, Device, Tensor, D};

/// `x @ w^T (+ b)` for `x` `[.., in]` and `w` `[out, in]`.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = crate::kernels::linear(x, w)?;
    Ok(match b {
        Some(b) => match add_bias_bf16(&y, b)? {
            Some(sum) => sum,
            None => y.broadcast_add(b)?,
        },
        None => y,
    })
}

/// `y + b` (`b` `[out]` added to every row) for bf16 `y` at inference on the CPU: each element
/// widened, added in f32 and rounded once, as candle's bf16 add computes it (but for
/// subnormal sums, which the vector rounding flushes), on the vector kernels and in parallel
/// over rows (candle's bf16 broadcast add runs on one core, converting each element twice:
/// gpt-oss's four attention biases cost 3% of a 512-token prefill that way). `None` elsewhere.
fn add_bias_bf16(y: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
    use crate::kernels::vmath::{to_bf16, Stored};
    use crate::kernels::{operand_of, Operand};
    use rayon::prelude::*;
    let out = y.dims().last().copied().unwrap_or(0);
    if y.dtype() != DType::BF16
        || !y.device().is_cpu()
        || y.track_op()
        || b.track_op()
        || b.dims() != [out]
        || out == 0
    {
        return Ok(None);
    }
    let bias = b.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let y = y.contiguous()?;
    let sum = {
        let (g, l) = y.storage_and_layout();
        let Some(Operand::Bf16(ys)) = operand_of(&g, l) else {
            return Ok(None);
        };
        let mut sum = vec![half::bf16::ZERO; ys.len()];
        let rows = (ys.len() / out).div_ceil(4 * rayon::current_num_threads().max(1));
        sum.par_chunks_mut(rows.max(1) * out)
            .zip(ys.par_chunks(rows.max(1) * out))
            .for_each(|(dst, src)| {
                let mut row = vec![0f32; out];
                for (d, s) in dst.chunks_exact_mut(out).zip(src.chunks_exact(out)) {
                    half::bf16::widen(s, &mut row);
                    row.iter_mut().zip(&bias).for_each(|(r, &b)| *r += b);
                    to_bf16(&row, d);
                }
            });
        sum
    };
    Ok(Some(Tensor::from_vec(sum, y.shape(), y.device())?))
}

/// RMSNorm over the last dimension: `w * x / sqrt(mean(x^2) + eps)`, normalised in f32 and
/// cast back before the weight, as transformers does. `fused` (inference) runs candle's kernel
/// in f32; for bf16 it rounds once, after the weight (transformers rounds before it too). The
/// q and k norms of a 512-token bf16 prefill measured 5.5 ms through candle's bf16 element-wise
/// ops, 3.6 ms this way.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, fused: bool) -> Result<Tensor> {
    if fused && x.dtype() == DType::F32 {
        return Ok(candle_nn::ops::rms_norm(&x.contiguous()?, w, eps as f32)?);
    }
    if fused && x.dtype() == DType::BF16 && x.device().is_cpu() {
        let y = candle_nn::ops::rms_norm(
            &x.to_dtype(DType::F32)?,
            &w.to_dtype(DType::F32)?,
            eps as f32,
        )?;
        return Ok(y.to_dtype(DType::BF16)?);
    }
    Ok(candle_nn::ops::rms_norm_slow(x, w, eps as f32)?)
}

/// Rotary position tables: `cos` and `sin` `[max_positions, head_dim / 2]`.
#[derive(Clone, Debug)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// Tables for `head_dim` rotated features (all of a head's, or the first ones under partial
    /// rotary) with base `theta`, computed in f64 and stored in `dtype`.
    pub fn new(
        head_dim: usize,
        theta: f64,
        max_positions: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Self> {
        Self::scaled(
            head_dim,
            theta,
            &RopeScaling::Plain,
            max_positions,
            dtype,
            dev,
        )
    }

    /// [`Rope::new`] with the frequencies and the cos/sin factor `scaling` gives (YaRN).
    pub fn scaled(
        head_dim: usize,
        theta: f64,
        scaling: &RopeScaling,
        max_positions: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Self> {
        let half = head_dim / 2;
        // transformers computes the inverse frequencies in f32: match it, then the angles.
        let (inv, factor) = scaling.frequencies(head_dim, theta);
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for &f in &inv {
                let a = p as f32 * f;
                if factor == 1.0 {
                    cos.push(a.cos());
                    sin.push(a.sin());
                } else {
                    cos.push(a.cos() * factor);
                    sin.push(a.sin() * factor);
                }
            }
        }
        let cos = Tensor::from_vec(cos, (max_positions, half), dev)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (max_positions, half), dev)?.to_dtype(dtype)?;
        Ok(Rope { cos, sin })
    }

    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Rotates `x` `[B, heads, T, head_dim]` whose first position is `offset`; `fused` uses
    /// [`super::rope_infer`] on CPU, else candle's kernel (neither has a backward).
    pub fn apply(&self, x: &Tensor, offset: usize, fused: bool) -> Result<Tensor> {
        self.apply_normed(x, offset, fused, None)
    }

    /// [`Rope::apply`] after an RMSNorm of each head's features (`(weight [head_dim], eps)`,
    /// Qwen3's per-head q/k norms), which the fused path computes in the same pass (in f32,
    /// rounded once, after the rotation).
    pub fn apply_normed(
        &self,
        x: &Tensor,
        offset: usize,
        fused: bool,
        norm: Option<(&Tensor, f64)>,
    ) -> Result<Tensor> {
        let t = x.dim(2)?;
        let cos = self.cos.narrow(0, offset, t)?;
        let sin = self.sin.narrow(0, offset, t)?;
        rotate_rows(x, &cos, &sin, fused, norm)
    }

    /// [`Rope::apply_normed`] with each of `x`'s `T` rows at its own position (`positions`,
    /// `T` of them): sequences of their own lengths laid end to end.
    pub fn apply_normed_at(
        &self,
        x: &Tensor,
        positions: &[u32],
        fused: bool,
        norm: Option<(&Tensor, f64)>,
    ) -> Result<Tensor> {
        let at = Tensor::from_slice(positions, positions.len(), self.cos.device())?;
        let cos = self.cos.index_select(&at, 0)?;
        let sin = self.sin.index_select(&at, 0)?;
        rotate_rows(x, &cos, &sin, fused, norm)
    }
}

/// `x` `[B, H, T, D]` rotated row by row by `cos`, `sin` `[T, R]`, after the per-head norm if
/// given (see [`Rope::apply_normed`]).
fn rotate_rows(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    fused: bool,
    norm: Option<(&Tensor, f64)>,
) -> Result<Tensor> {
    {
        if fused {
            if let Some(y) = super::rope_infer::apply(x, cos, sin, norm)? {
                return Ok(y);
            }
        }
        let x = match norm {
            Some((w, eps)) => rms_norm(x, w, eps, fused)?,
            None => x.clone(),
        };
        // Partial rotary (GLM-4.5): the first features rotate, the rest pass through.
        let (d, rot) = (x.dim(3)?, 2 * cos.dim(1)?);
        if rot < d {
            let turned = rotate_all(&x.narrow(3, 0, rot)?, cos, sin, fused)?;
            return Ok(Tensor::cat(&[&turned, &x.narrow(3, rot, d - rot)?], 3)?);
        }
        rotate_all(&x, cos, sin, fused)
    }
}

/// Rotate-half RoPE of all of `x`'s features by `cos`, `sin` (already at its positions): candle's
/// fused kernel, or its differentiable form.
fn rotate_all(x: &Tensor, cos: &Tensor, sin: &Tensor, fused: bool) -> Result<Tensor> {
    if fused {
        return Ok(candle_nn::rotary_emb::rope(
            &x.contiguous()?,
            &cos.contiguous()?,
            &sin.contiguous()?,
        )?);
    }
    Ok(candle_nn::rotary_emb::rope_slow(
        &x.contiguous()?,
        cos,
        sin,
    )?)
}

/// The keys a query at position `pos` attends to, of `keys`: those at or before it, and fewer
/// than `window` positions back if given (the causal rule of [`causal_mask`] and of the
/// inference path's attention).
pub fn visible_keys(pos: usize, keys: usize, window: Option<usize>) -> std::ops::Range<usize> {
    let hi = (pos + 1).min(keys);
    let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
    lo.min(hi)..hi
}

/// The additive attention mask `[T, S]` for `T` queries at positions `offset..offset + T` over
/// `S = offset + T` keys: 0 where a query may attend (key at or before it, and within `window`
/// positions if given), `-inf` elsewhere.
pub fn causal_mask(
    t: usize,
    offset: usize,
    window: Option<usize>,
    dtype: DType,
    dev: &Device,
) -> Result<Tensor> {
    let s = offset + t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            let seen = visible_keys(offset + i, s, window);
            (0..s).map(move |j| {
                if seen.contains(&j) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (t, s), dev)?.to_dtype(dtype)?)
}

/// Softmax over the last dimension in f32, cast back to the input's dtype.
pub fn softmax_f32(x: &Tensor, fused: bool) -> Result<Tensor> {
    let dt = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let y = if fused {
        candle_nn::ops::softmax_last_dim(&x.contiguous()?)?
    } else {
        candle_nn::ops::softmax(&x, D::Minus1)?
    };
    Ok(y.to_dtype(dt)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bf16 bias add on the vector kernels gives candle's bf16 add bit for bit (no
    /// subnormal sums here), rows past a whole chunk included.
    #[test]
    fn bf16_bias_adds_as_candle_adds() {
        let dev = Device::Cpu;
        for (rows, out) in [(1usize, 7usize), (37, 48), (512, 96)] {
            let y = Tensor::randn(0f32, 3.0, (rows, out), &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let b = Tensor::randn(0f32, 1.0, out, &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let fast = add_bias_bf16(&y, &b)
                .unwrap()
                .expect("the fast path applies");
            let want = y.broadcast_add(&b).unwrap();
            let bits = |t: &Tensor| -> Vec<u16> {
                t.flatten_all()
                    .unwrap()
                    .to_vec1::<half::bf16>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(bits(&fast), bits(&want), "{rows}x{out}");
        }
        // f32, or a bias of another width: the tensor path.
        let y = Tensor::zeros((2, 4), DType::F32, &dev).unwrap();
        let b = Tensor::zeros(4, DType::F32, &dev).unwrap();
        assert!(add_bias_bf16(&y, &b).unwrap().is_none());
        let y = y.to_dtype(DType::BF16).unwrap();
        let b = Tensor::zeros(3, DType::BF16, &dev).unwrap();
        assert!(add_bias_bf16(&y, &b).unwrap().is_none());
    }

    #[test]
    fn mask_is_causal_with_offset_and_window() {
        let m = causal_mask(2, 3, None, DType::F32, &Device::Cpu)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(m[0][..4], [0.0; 4]);
        assert!(m[0][4].is_infinite() && m[1][4] == 0.0);
        let w = causal_mask(3, 0, Some(2), DType::F32, &Device::Cpu)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert!(w[2][0].is_infinite() && w[2][1] == 0.0 && w[2][2] == 0.0);
    }

    fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn fused_and_differentiable_forms_agree() {
        let dev = &Device::Cpu;
        let x = Tensor::randn(0f32, 2.0, (2, 3, 5, 8), dev).unwrap();
        let w = Tensor::randn(1f32, 0.1, 8, dev).unwrap();
        let r = Rope::new(8, 10000.0, 16, DType::F32, dev).unwrap();
        for offset in [0, 3] {
            let a = r.apply(&x, offset, true).unwrap();
            let b = r.apply(&x, offset, false).unwrap();
            assert!(max_abs(&a, &b) < 1e-5);
        }
        let a = rms_norm(&x, &w, 1e-6, true).unwrap();
        let b = rms_norm(&x, &w, 1e-6, false).unwrap();
        assert!(max_abs(&a, &b) < 1e-5);
        let m = causal_mask(5, 3, None, DType::F32, dev).unwrap();
        let s = x.broadcast_add(&m).unwrap();
        let a = softmax_f32(&s, true).unwrap();
        let b = softmax_f32(&s, false).unwrap();
        assert!(max_abs(&a, &b) < 1e-6);
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let r = Rope::new(8, 10000.0, 16, DType::F32, &Device::Cpu).unwrap();
        let x = Tensor::randn(0f32, 1.0, (1, 2, 3, 8), &Device::Cpu).unwrap();
        let y = r.apply(&x, 0, false).unwrap();
        let x0 = x.narrow(2, 0, 1).unwrap().flatten_all().unwrap();
        let y0 = y.narrow(2, 0, 1).unwrap().flatten_all().unwrap();
        let diff = (x0 - y0).unwrap().abs().unwrap().max(0).unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-6);
        let nx = x
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let ny = y
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!((nx - ny).abs() < 1e-3 * nx);
        // Rotating with an offset is rotating at those positions of a longer sequence.
        let long = r.apply(&x, 2, false).unwrap();
        let x5 = Tensor::cat(&[&x.narrow(2, 0, 2).unwrap(), &x], 2).unwrap();
        let full = r.apply(&x5, 0, false).unwrap().narrow(2, 2, 3).unwrap();
        let diff = (long - full).unwrap().abs().unwrap().flatten_all().unwrap();
        assert!(diff.max(0).unwrap().to_scalar::<f32>().unwrap() < 1e-6);
    }
}
