//! The inference path of rotary position embedding on CPU: rotate-half RoPE read straight from
//! the strided view the attention hands over (`[B, heads, T, hd]` as a transpose of
//! `[B, T, heads, hd]`), computed in f32 and written contiguous, one task per (batch, head).
//!
//! candle's fused `rope` wants a contiguous input (a copy first) and computes bf16 in bf16, each
//! product and sum rounded; here the arithmetic is f32 with one rounding at the end (without a
//! norm, the same products and differences as candle's in f32, in the same order). It runs where
//! nothing needs a gradient, on the CPU, for f32 or bf16; otherwise [`apply`] returns `None`.

use crate::kernels::vmath::Stored;
use crate::Result;
use candle::{CpuStorage, DType, Device, Storage, Tensor};
use rayon::prelude::*;

/// The per-row RMSNorm of [`apply`]: weight `[D]` in f32, and eps.
type Norm<'a> = Option<(&'a [f32], f32)>;

/// `x` (elements from `start` with strides `st` over `[B, H, T, D]`, the last 1), normalised by
/// `norm` if given, then its first `2 * R` features rotated by `cos`, `sin` (`[T, R]`, f32) and
/// the rest passed through, into a new contiguous `[B, H, T, D]`.
fn rotate<E: Stored>(
    x: &[E],
    start: usize,
    st: &[usize],
    (b, h, t, d): (usize, usize, usize, usize),
    (cos, sin): (&[f32], &[f32]),
    norm: Norm<'_>,
) -> Vec<E> {
    let half = cos.len() / t.max(1);
    let mut out = vec![E::default(); b * h * t * d];
    out.par_chunks_mut(t * d).enumerate().for_each(|(bh, dst)| {
        let base = start + (bh / h) * st[0] + (bh % h) * st[1];
        let (mut xs, mut ys) = (vec![0f32; d], vec![0f32; d]);
        for (p, row) in dst.chunks_exact_mut(d).enumerate() {
            E::widen(&x[base + p * st[2]..base + p * st[2] + d], &mut xs);
            if let Some((w, eps)) = norm {
                let ms = xs.iter().map(|v| v * v).sum::<f32>() / d as f32;
                let r = 1.0 / (ms + eps).sqrt();
                xs.iter_mut().zip(w).for_each(|(v, &w)| *v = *v * r * w);
            }
            let (c, s) = (
                &cos[p * half..(p + 1) * half],
                &sin[p * half..(p + 1) * half],
            );
            for i in 0..half {
                let (x1, x2) = (xs[i], xs[i + half]);
                ys[i] = x1 * c[i] - x2 * s[i];
                ys[i + half] = x1 * s[i] + x2 * c[i];
            }
            ys[2 * half..].copy_from_slice(&xs[2 * half..]);
            E::round(&ys, row);
        }
    });
    out
}

/// Rotate-half RoPE of `x` `[B, H, T, D]` (any strides, the last 1) by `cos`, `sin` `[T, R]`,
/// as candle's `rope`, on the first `2 * R <= D` features (partial rotary; the others pass
/// through), after an RMSNorm over `D` if `norm` (`(weight [D], eps)`) is given; `None` where
/// this path does not apply (see the module doc).
pub fn apply(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    norm: Option<(&Tensor, f64)>,
) -> Result<Option<Tensor>> {
    let dims = x.dims4()?;
    let (_, _, t, d) = dims;
    let operands = [Some(x), Some(cos), Some(sin), norm.map(|(w, _)| w)];
    let on_cpu = operands
        .iter()
        .flatten()
        .all(|v| !v.track_op() && matches!(v.device(), Device::Cpu));
    if !on_cpu || !matches!(x.dtype(), DType::F32 | DType::BF16) || d % 2 != 0 {
        return Ok(None);
    }
    let (ct, half) = cos.dims2()?;
    if ct != t || half == 0 || 2 * half > d || sin.dims2()? != (t, half) {
        return Ok(None);
    }
    if norm.is_some_and(|(w, _)| w.dims() != [d]) {
        return Ok(None);
    }
    let f32s = |v: &Tensor| -> Result<Vec<f32>> {
        Ok(v.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let (cos, sin) = (f32s(cos)?, f32s(sin)?);
    let norm = norm
        .map(|(w, eps)| Ok::<_, crate::Error>((f32s(w)?, eps as f32)))
        .transpose()?;
    let norm = norm.as_ref().map(|(w, eps)| (w.as_slice(), *eps));
    let (guard, layout) = x.storage_and_layout();
    let st = layout.stride().to_vec();
    if st[3] != 1 {
        return Ok(None);
    }
    let start = layout.start_offset();
    let tables = (cos.as_slice(), sin.as_slice());
    let out = match &*guard {
        Storage::Cpu(CpuStorage::F32(v)) => Tensor::from_vec(
            rotate(v, start, &st, dims, tables, norm),
            dims,
            &Device::Cpu,
        )?,
        Storage::Cpu(CpuStorage::BF16(v)) => Tensor::from_vec(
            rotate(v, start, &st, dims, tables, norm),
            dims,
            &Device::Cpu,
        )?,
        _ => return Ok(None),
    };
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::values;

    #[test]
    fn rotation_of_a_strided_view_matches_plain_loops() {
        let dev = Device::Cpu;
        let (b, t, h, d) = (2, 5, 3, 8);
        for (dtype, rot) in [(DType::F32, d), (DType::BF16, d), (DType::F32, d / 2)] {
            for normed in [false, true] {
                // [B, T, H, D] seen as [B, H, T, D], as attention hands it over.
                let x = Tensor::randn(0f32, 2.0, (b, t, h, d), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let view = x.transpose(1, 2).unwrap();
                let cos = Tensor::randn(0f32, 1.0, (t, rot / 2), &dev).unwrap();
                let sin = Tensor::randn(0f32, 1.0, (t, rot / 2), &dev).unwrap();
                let w = Tensor::randn(0f32, 1.0, d, &dev).unwrap();
                let norm = normed.then_some((&w, 1e-6));
                let got = values(
                    &apply(&view, &cos, &sin, norm)
                        .unwrap()
                        .expect("the inference path applies"),
                );
                let (xs, c, s, wv) = (values(&x), values(&cos), values(&sin), values(&w));
                let half = rot / 2;
                for bi in 0..b {
                    for hi in 0..h {
                        for p in 0..t {
                            let mut row: Vec<f64> = (0..d)
                                .map(|i| xs[((bi * t + p) * h + hi) * d + i])
                                .collect();
                            if normed {
                                let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
                                let r = 1.0 / (ms + 1e-6).sqrt();
                                for (v, &w) in row.iter_mut().zip(&wv) {
                                    *v *= r * w;
                                }
                            }
                            for i in 0..d {
                                let (ci, si) = (c[p * half + i % half], s[p * half + i % half]);
                                let want = if i >= rot {
                                    row[i]
                                } else if i < half {
                                    row[i] * ci - row[i + half] * si
                                } else {
                                    row[i - half] * si + row[i] * ci
                                };
                                let at = ((bi * h + hi) * t + p) * d + i;
                                let tol = if dtype == DType::BF16 { 1e-2 } else { 1e-5 };
                                assert!(
                                    (got[at] - want).abs() <= tol * want.abs().max(1.0),
                                    "{dtype:?} rot {rot} normed {normed} [{bi} {hi} {p} {i}]: {} vs {want}",
                                    got[at]
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
