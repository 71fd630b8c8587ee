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

use crate::kernels::scratch::{give, take};
use crate::kernels::vmath::{scaled_softmax_sink, Stored};
use crate::kernels::{linear_rows, operand_of, Operand};
use crate::models::layers::visible_keys;
use crate::Result;
use candle::{DType, Device, Tensor};
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

/// `dst` `[cols, rows]` = `src` `[rows, cols]` transposed, in blocks of 16 rows (each column of
/// a block is written as one run).
fn transpose<E: Copy>(src: &[E], dst: &mut [E], rows: usize, cols: usize) {
    for r0 in (0..rows).step_by(16) {
        let r1 = (r0 + 16).min(rows);
        for c in 0..cols {
            let run = &mut dst[c * rows + r0..c * rows + r1];
            for (i, d) in run.iter_mut().enumerate() {
                *d = src[(r0 + i) * cols + c];
            }
        }
    }
}

/// One key/value head: `q` `[rows, hd]`, `k` and `v` `[s, hd]`, into `out` `[rows, hd]`;
/// `sinks`: the sink logits of its g query heads. Returns false where the kernels do not take
/// the operands.
pub(super) fn head<E: Stored>(
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
        // Probabilities in the values' dtype, and the values transposed (`[hd, s]`: the
        // kernels take the second operand as rows of the reduced dimension).
        let mut probs = vec![E::default(); rows * s];
        E::round(&scores, &mut probs);
        let mut vt = vec![E::default(); hd * s];
        transpose(v, &mut vt, s, hd);
        let mut y = take(rows * hd);
        ok = linear_rows(E::operand(&probs), E::operand(&vt), &mut y, (rows, hd, s));
        if ok {
            E::round(&y, out);
        }
        give(y);
    }
    give(scores);
    ok
}

/// Every head of `q`, `k`, `v` (slices of `heads` heads each), into a new vector, or `None`;
/// `sinks`: every query head's sink logit, `nkv` key/value heads' worth.
fn all_heads<E: Stored>(
    q: &[E],
    k: &[E],
    v: &[E],
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
            head(
                &q[i * qn..(i + 1) * qn],
                &k[i * kn..(i + 1) * kn],
                &v[i * kn..(i + 1) * kn],
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

/// Attention's core at inference: queries `q` `[B, nkv, g * t, hd]` (each key/value head's g
/// query heads stacked), keys and values `[B, nkv, S, hd]`, one dtype; the queries at
/// positions `offset..offset + t` (`S = offset + t`), `window` as in the causal mask, scores
/// scaled by `scale`, `sinks` every query head's sink logit (`[nkv * g]`, gpt-oss). Returns
/// `[B, nkv, g * t, hd]` in the operands' dtype, or `None` where this path does not apply (see
/// the module doc).
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
    let out = match (
        operand_of(&qg, ql),
        operand_of(&kg, kl),
        operand_of(&vg, vl),
    ) {
        (Some(Operand::F32(q)), Some(Operand::F32(k)), Some(Operand::F32(v))) => {
            all_heads(q, k, v, &d, sinks)
                .map(|o| Tensor::from_vec(o, (b, nkv, rows, hd), &Device::Cpu))
        }
        (Some(Operand::Bf16(q)), Some(Operand::Bf16(k)), Some(Operand::Bf16(v))) => {
            all_heads(q, k, v, &d, sinks)
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
        for (b, nkv, g, t, offset, hd, window, sinks) in [
            (1, 2, 1, 7, 0, 16, None, false),
            (2, 1, 3, 5, 4, 8, None, false),
            (1, 2, 2, 40, 0, 32, Some(6), false),
            (1, 1, 1, 1, 9, 16, None, false),
            (2, 2, 2, 9, 3, 8, Some(4), true),
            (1, 2, 3, 1, 6, 8, None, true),
        ] {
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
                let (q, k, v) = (
                    r((b, nkv, g * t, hd)),
                    r((b, nkv, s, hd)),
                    r((b, nkv, s, hd)),
                );
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
