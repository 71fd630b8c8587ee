//! The inference path of attention's core on CPU: scores, scale, causal mask, softmax and the
//! values for every key/value head, on slices with the linear kernels, in one task per head.
//!
//! The tensor path ([`super::attention`]) runs the same steps as candle ops: the scores come
//! out of the kernel, are rounded to the model's dtype, widened to f32, scaled, masked with an
//! additive mask tensor, softmaxed and rounded again, a handful of passes over `[T, S]` per
//! head with a fresh tensor each. Here the scores stay in the kernel's f32 output (one rounding
//! fewer for bf16), the mask is the causal rule itself (masked keys are never exponentiated),
//! and the probabilities are rounded once, to the values' dtype, for the value product, as the
//! tensor path and transformers round them. Results agree with the tensor path within that
//! one rounding; a test holds them together.
//!
//! It runs where nothing needs a gradient, on the CPU, for f32 or bf16 operands of one dtype
//! that the kernels take; otherwise [`core()`] returns `None` and the caller takes the tensor
//! path.

use crate::kernels::elem::transpose;
use crate::kernels::scratch::{give, take};
use crate::kernels::vmath::{scaled_softmax_sink, Stored};
use crate::kernels::weighted_rows::{weighted_rows, RowElem};
use crate::kernels::{linear_rows, operand_of, Operand};
use crate::models::layers::visible_keys;
use crate::Result;
use candle::{CpuStorage, DType, Device, Layout, Storage, Tensor};
use rayon::prelude::*;
use std::ops::Range;

/// The shape of one call: `heads` key/value heads (batch times key/value heads), each with
/// `rows = g * t` query rows (g query heads of `t` positions, stacked), `s` keys and `hd`
/// features; queries at positions `offset..offset + t`, seeing keys at or before their own
/// position and, with `window`, fewer than `window` positions back.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    pub heads: usize,
    pub rows: usize,
    pub t: usize,
    pub s: usize,
    pub hd: usize,
    pub offset: usize,
    pub window: Option<usize>,
    pub scale: f32,
}

impl Dims {
    /// The keys row `r` sees.
    fn visible(&self, r: usize) -> Range<usize> {
        visible_keys(self.offset + r % self.t, self.s, self.window)
    }
}

/// `softmax(scale * scores + mask)` of one row in place: `seen` visible, the rest 0; with a
/// `sink` logit (gpt-oss), the softmax over the visible scores and the sink, the sink's share
/// dropped.
fn softmax_row(row: &mut [f32], seen: Range<usize>, scale: f32, sink: Option<f32>) {
    row[..seen.start].fill(0.0);
    row[seen.end..].fill(0.0);
    scaled_softmax_sink(&mut row[seen], scale, sink);
}

/// Up to this many query rows a head (decode: one a query head sharing the key/value head)
/// take the value product row by row against the values in place
/// ([`weighted_rows`]); more take the linear kernels against the values transposed.
const DIRECT_VALUE_ROWS: usize = 8;

/// One key/value head: `q` `[rows, hd]`, `k` and `v` `[s, hd]`, into `out` `[rows, hd]`;
/// `sinks`: the sink logits of its g query heads. Returns false where the kernels do not take
/// the operands.
pub(super) fn head<E: Stored + RowElem>(
    q: &[E],
    k: &[E],
    v: &[E],
    out: &mut [E],
    d: &Dims,
    sinks: Option<&[f32]>,
) -> bool {
    let (rows, s, hd) = (d.rows, d.s, d.hd);
    let mut scores = take(rows * s);
    let mut ok = linear_rows(E::operand(q), E::operand(k), &mut scores, (rows, s, hd));
    if ok {
        for (r, row) in scores.chunks_exact_mut(s).enumerate() {
            softmax_row(row, d.visible(r), d.scale, sinks.map(|sk| sk[r / d.t]));
        }
        // Probabilities in the values' dtype.
        let mut probs = vec![E::default(); rows * s];
        E::round(&scores, &mut probs);
        let mut y = take(rows * hd);
        if rows <= DIRECT_VALUE_ROWS {
            // Each row's visible probabilities times the cached values, read in place.
            y.fill(0.0);
            for (r, yr) in y.chunks_exact_mut(hd).enumerate() {
                let seen = d.visible(r);
                let mut p = vec![0f32; seen.len()];
                E::widen(&probs[r * s + seen.start..r * s + seen.end], &mut p);
                weighted_rows(&p, &v[seen.start * hd..seen.end * hd], yr);
            }
        } else {
            // The values transposed (`[hd, s]`: the kernels take the second operand as rows
            // of the reduced dimension).
            let mut vt = vec![E::default(); hd * s];
            transpose(v, &mut vt, s, hd);
            ok = linear_rows(E::operand(&probs), E::operand(&vt), &mut y, (rows, hd, s));
        }
        if ok {
            E::round(&y, out);
        }
        give(y);
    }
    give(scores);
    ok
}

/// Every head of `q` (`heads` heads of `rows` rows), `k` and `v` (`heads` heads of `s`
/// positions, head `i` starting at `i * kv_stride` elements), into a new vector, or `None`;
/// `sinks`: every query head's sink logit, `nkv` key/value heads' worth.
fn all_heads<E: Stored + RowElem>(
    q: &[E],
    (k, v, kv_stride): (&[E], &[E], usize),
    d: &Dims,
    sinks: Option<&[f32]>,
) -> Option<Vec<E>> {
    let (qn, kn, on) = (d.rows * d.hd, d.s * d.hd, d.rows * d.hd);
    let g = d.rows / d.t;
    let mut out = vec![E::default(); d.heads * on];
    let ok = out
        .par_chunks_mut(on)
        .enumerate()
        .map(|(i, o)| {
            let at = i * kv_stride..i * kv_stride + kn;
            head(
                &q[i * qn..(i + 1) * qn],
                &k[at.clone()],
                &v[at],
                o,
                d,
                sinks.map(|sk| {
                    let nkv = sk.len() / g;
                    &sk[(i % nkv) * g..(i % nkv + 1) * g]
                }),
            )
        })
        .collect::<Vec<bool>>();
    ok.iter().all(|&ok| ok).then_some(out)
}

/// The elements of `[B, n, S, hd]` keys or values whose `B * n` heads are each `S * hd`
/// contiguous elements, evenly spaced: a contiguous tensor, or a view of a
/// [`LayerCache`](super::layer_cache::LayerCache)'s buffers (heads a buffer's positions apart).
/// Returns the elements from the first head's start to the last one's end and the spacing
/// of the heads in elements, or `None` for any other layout.
pub(super) fn strided_heads<'a>(
    storage: &'a Storage,
    layout: &Layout,
) -> Option<(Operand<'a>, usize)> {
    let &[b, n, s, hd] = layout.dims() else {
        return None;
    };
    let &[sb, sn, ss, sd] = layout.stride() else {
        return None;
    };
    let head = s * hd;
    let rows_ok = (sd == 1 || hd <= 1) && (ss == hd || s <= 1);
    let spacing = if n > 1 { sn } else { sb };
    let heads_ok = (n <= 1 || b <= 1 || sb == n * sn) && (b * n <= 1 || spacing >= head);
    if !rows_ok || !heads_ok {
        return None;
    }
    let spacing = if b * n <= 1 { head } else { spacing };
    let start = layout.start_offset();
    let end = start + (b * n).saturating_sub(1) * spacing + head;
    let op = match storage {
        Storage::Cpu(CpuStorage::F32(x)) => Operand::F32(x.get(start..end)?),
        Storage::Cpu(CpuStorage::BF16(x)) => Operand::Bf16(x.get(start..end)?),
        _ => return None,
    };
    Some((op, spacing))
}

/// Attention's core at inference: queries `q` `[B, nkv, g * t, hd]` (each key/value head's g
/// query heads stacked), keys and values `[B, nkv, S, hd]`, one dtype; the queries at
/// positions `offset..offset + t` (`S = offset + t`), `window` as in the causal mask, scores
/// scaled by `scale`, `sinks` every query head's sink logit (`[nkv * g]`, gpt-oss). Returns
/// `[B, nkv, g * t, hd]` in the operands' dtype, or `None` where this path does not apply (see
/// the module doc). The keys and values may be a [`LayerCache`](super::layer_cache::LayerCache)'s
/// views, read in place ([`strided_heads`]).
#[allow(clippy::too_many_arguments)]
pub fn core(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    t: usize,
    offset: usize,
    window: Option<usize>,
    scale: f64,
    sinks: Option<&[f32]>,
) -> Result<Option<Tensor>> {
    let dtype = q.dtype();
    let applies = [q, k, v]
        .iter()
        .all(|x| !x.track_op() && matches!(x.device(), Device::Cpu) && x.dtype() == dtype)
        && matches!(dtype, DType::F32 | DType::BF16);
    if !applies {
        return Ok(None);
    }
    let (b, nkv, rows, hd) = q.dims4()?;
    let s = k.dim(2)?;
    if t == 0 || rows % t != 0 || k.dims4()? != (b, nkv, s, hd) || v.dims4()? != (b, nkv, s, hd) {
        return Ok(None);
    }
    if sinks.is_some_and(|sk| sk.len() != nkv * (rows / t)) {
        return Ok(None);
    }
    let d = Dims {
        heads: b * nkv,
        rows,
        t,
        s,
        hd,
        offset,
        window,
        scale: scale as f32,
    };
    let (qg, ql) = q.storage_and_layout();
    let (kg, kl) = k.storage_and_layout();
    let (vg, vl) = v.storage_and_layout();
    let (Some((k, ks)), Some((v, vs))) = (strided_heads(&kg, kl), strided_heads(&vg, vl)) else {
        return Ok(None);
    };
    if ks != vs {
        return Ok(None);
    }
    let out = match (operand_of(&qg, ql), k, v) {
        (Some(Operand::F32(q)), Operand::F32(k), Operand::F32(v)) => {
            all_heads(q, (k, v, ks), &d, sinks)
                .map(|o| Tensor::from_vec(o, (b, nkv, rows, hd), &Device::Cpu))
        }
        (Some(Operand::Bf16(q)), Operand::Bf16(k), Operand::Bf16(v)) => {
            all_heads(q, (k, v, ks), &d, sinks)
                .map(|o| Tensor::from_vec(o, (b, nkv, rows, hd), &Device::Cpu))
        }
        _ => None,
    };
    Ok(out.transpose()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::values;

    /// Causal attention in f64 from the operands' values: `[heads][rows][hd]`.
    fn plain(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        d: &Dims,
        sinks: Option<&[f32]>,
    ) -> Vec<Vec<Vec<f64>>> {
        let (q, k, v) = (values(q), values(k), values(v));
        (0..d.heads)
            .map(|h| {
                (0..d.rows)
                    .map(|r| {
                        // The causal rule, written out here rather than taken from `Dims`.
                        let pos = d.offset + r % d.t;
                        let seen: Vec<usize> = (0..d.s)
                            .filter(|&j| j <= pos && d.window.is_none_or(|w| pos - j < w))
                            .collect();
                        let qr = &q[(h * d.rows + r) * d.hd..][..d.hd];
                        let scores: Vec<f64> = seen
                            .iter()
                            .map(|&j| {
                                let kj = &k[(h * d.s + j) * d.hd..][..d.hd];
                                qr.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * d.scale as f64
                            })
                            .collect();
                        // The sink of this row's query head joins the softmax's denominator.
                        let sink = sinks.map(|sk| {
                            let g = d.rows / d.t;
                            sk[(h % (sk.len() / g)) * g + r / d.t] as f64
                        });
                        let max = scores
                            .iter()
                            .cloned()
                            .chain(sink)
                            .fold(f64::NEG_INFINITY, f64::max);
                        let sum: f64 = scores
                            .iter()
                            .chain(sink.as_ref())
                            .map(|s| (s - max).exp())
                            .sum();
                        (0..d.hd)
                            .map(|c| {
                                seen.iter()
                                    .zip(&scores)
                                    .map(|(&j, s)| {
                                        (s - max).exp() / sum * v[(h * d.s + j) * d.hd + c]
                                    })
                                    .sum()
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn core_matches_plain_causal_attention() {
        // At the portable level the inference path does not run (it returns None); CI runs this
        // test at every level (OCCULT_KERNELS), natively and emulated.
        let level = crate::kernels::process_level();
        if level == crate::kernels::Level::Portable {
            eprintln!("portable level: the inference path does not run here (it returns None)");
            return;
        }
        eprintln!("inference path at {level}");
        let dev = Device::Cpu;
        // (batch, kv heads, query heads per kv head, t, offset, hd, window)
        // (.., with gpt-oss's sinks)
        for (case, (b, nkv, g, t, offset, hd, window, sinks)) in [
            (1, 2, 1, 7, 0, 16, None, false),
            (2, 1, 3, 5, 4, 8, None, false),
            (1, 2, 2, 40, 0, 32, Some(6), false),
            (1, 1, 1, 1, 9, 16, None, false),
            (2, 2, 2, 9, 3, 8, Some(4), true),
            (1, 2, 3, 1, 6, 8, None, true),
            (2, 2, 1, 1, 30, 16, None, false),
            (1, 4, 2, 2, 17, 32, Some(8), false),
        ]
        .into_iter()
        .enumerate()
        {
            let sinks: Option<Vec<f32>> =
                sinks.then(|| (0..nkv * g).map(|i| i as f32 * 0.7 - 1.0).collect());
            let sinks = sinks.as_deref();
            let s = offset + t;
            for dtype in [DType::F32, DType::BF16] {
                let r = |shape: (usize, usize, usize, usize)| {
                    Tensor::randn(0f32, 1.0, shape, &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                };
                // Keys and values whole, or as a cache's views: heads a buffer's positions
                // apart (`strided_heads`).
                let strided = case % 2 == 1;
                let room = if strided { 3 } else { 0 };
                let (q, k, v) = (
                    r((b, nkv, g * t, hd)),
                    r((b, nkv, s + room, hd)).narrow(2, 0, s).unwrap(),
                    r((b, nkv, s + room, hd)).narrow(2, 0, s).unwrap(),
                );
                assert_eq!(k.is_contiguous(), !strided || b * nkv == 1);
                let scale = 1.0 / (hd as f64).sqrt();
                let got = values(
                    &core(&q, &k, &v, t, offset, window, scale, sinks)
                        .unwrap()
                        .expect("the inference path applies"),
                );
                let d = Dims {
                    heads: b * nkv,
                    rows: g * t,
                    t,
                    s,
                    hd,
                    offset,
                    window,
                    scale: scale as f32,
                };
                let want: Vec<f64> = plain(&q, &k, &v, &d, sinks)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .collect();
                // bf16: the probabilities and the result are rounded (2^-8 each, relative).
                let tol = if dtype == DType::BF16 { 2e-2 } else { 1e-5 };
                for (i, (&a, &w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (a - w).abs() <= tol * w.abs().max(0.5),
                        "{dtype:?} b{b} nkv{nkv} g{g} t{t} offset{offset} window{window:?} \
                         sinks {sinks:?} [{i}]: {a} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn operands_on_the_graph_take_the_tensor_path() {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1.0, (1, 1, 4, 8), &dev).unwrap();
        let var = candle::Var::from_tensor(&q).unwrap();
        let tracked = var.as_tensor();
        assert!(core(tracked, &q, &q, 4, 0, None, 0.3, None)
            .unwrap()
            .is_none());
        assert!(core(&q, tracked, &q, 4, 0, None, 0.3, None)
            .unwrap()
            .is_none());
    }
}
