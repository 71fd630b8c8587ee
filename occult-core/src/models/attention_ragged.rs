//! The inference path of a ragged step's attention on CPU (continuous batching: sequences of
//! their own lengths laid end to end, each with its own cache): every sequence's new keys and
//! values appended to its cache, and every head of every sequence attended, in one parallel
//! pass over slices. The tensor path runs a handful of candle ops per sequence and layer
//! (narrow, copy, concatenate, attend, concatenate the results), each with its own parallel
//! region, which costs more than the attention itself when the sequences are short and many.
//!
//! Each head is [`attention_infer`](super::attention_infer)'s own (`head`), so every sequence gets exactly what
//! [`attention_infer::core`](super::attention_infer::core) gives it alone; a test holds them together. It applies where that
//! path does (CPU, f32 or bf16 operands and caches of one dtype, nothing on the graph);
//! otherwise [`core()`] returns `None`, leaves the caches as they were, and the caller takes
//! the tensor path.

use super::attention_infer::{head, strided_heads, Dims};
use super::layer_cache::LayerCache;
use crate::kernels::operand_of;
use crate::kernels::vmath::Stored;
use crate::kernels::weighted_rows::RowElem;
use crate::Result;
use candle::{DType, Device, Tensor, WithDType};
use rayon::prelude::*;

/// One sequence of the step: its new rows `start..start + t` of the step's `N`, and all its
/// keys and values after the step, `s` positions of every key/value head, head `j` starting at
/// `j * stride` elements of `k` and `v`.
struct Seq<'a, E> {
    start: usize,
    t: usize,
    s: usize,
    k: &'a [E],
    v: &'a [E],
    stride: usize,
}

/// The shape of the step: `nh` query heads sharing `nkv` key/value heads of `hd` features,
/// `n` new rows in all.
#[derive(Clone, Copy)]
struct Shape {
    nh: usize,
    nkv: usize,
    n: usize,
    hd: usize,
    window: Option<usize>,
    scale: f32,
}

/// The step on slices: `q` `[nh, n, hd]`. Returns the attention `[n, nh * hd]`, or `None`
/// where the kernels do not take the operands.
fn step<E: Stored + RowElem>(
    q: &[E],
    seqs: &[Seq<'_, E>],
    sh: &Shape,
    sinks: Option<&[f32]>,
) -> Option<Vec<E>> {
    let (nh, nkv, n, hd) = (sh.nh, sh.nkv, sh.n, sh.hd);
    let g = nh / nkv;
    // One task per sequence and key/value head: its g query heads' rows stacked, as
    // `attention_infer` lays them out.
    let tasks: Vec<(usize, usize)> = (0..seqs.len())
        .flat_map(|i| (0..nkv).map(move |j| (i, j)))
        .collect();
    let outs: Vec<Option<Vec<E>>> = tasks
        .par_iter()
        .map(|&(i, j)| {
            let sq = &seqs[i];
            let (t, s) = (sq.t, sq.s);
            let mut qs = Vec::with_capacity(g * t * hd);
            for h in j * g..(j + 1) * g {
                let from = (h * n + sq.start) * hd;
                qs.extend_from_slice(&q[from..from + t * hd]);
            }
            let d = Dims {
                heads: 1,
                rows: g * t,
                t,
                s,
                hd,
                offset: s - t,
                window: sh.window,
                scale: sh.scale,
            };
            let mut out = vec![E::default(); g * t * hd];
            let at = j * sq.stride..j * sq.stride + s * hd;
            let sk = sinks.map(|sk| &sk[j * g..(j + 1) * g]);
            head(&qs, &sq.k[at.clone()], &sq.v[at], &mut out, &d, sk).then_some(out)
        })
        .collect();
    // Row `start + r` of the result holds every query head's features in order.
    let mut y = vec![E::default(); n * nh * hd];
    for (&(i, j), out) in tasks.iter().zip(outs) {
        let (sq, out) = (&seqs[i], out?);
        for (a, rows) in out.chunks_exact(sq.t * hd).enumerate() {
            let h = j * g + a;
            for (r, row) in rows.chunks_exact(hd).enumerate() {
                let at = ((sq.start + r) * nh + h) * hd;
                y[at..at + hd].copy_from_slice(row);
            }
        }
    }
    Some(y)
}

/// Attention of a ragged step at inference: queries `q` `[1, nh, N, hd]` and this step's keys
/// and values `[1, nkv, N, hd]` (rotated, in the model's dtype), sequence i the next
/// `lens[i]` rows continuing `caches[i]`, whose positions they take; `window`, `scale` and
/// `sinks` (every query head's sink logit, gpt-oss) as in [`attention_infer::core`](super::attention_infer::core). Returns
/// `[1, N, nh * hd]` and extends every cache (in place: [`LayerCache::append`]), or `None`
/// with the caches as they were where this path does not apply (see the module doc).
#[allow(clippy::too_many_arguments)]
pub fn core(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lens: &[usize],
    caches: &mut [&mut LayerCache],
    window: Option<usize>,
    scale: f64,
    sinks: Option<&[f32]>,
) -> Result<Option<Tensor>> {
    let dtype = q.dtype();
    let (b, nh, n, hd) = q.dims4()?;
    let nkv = k.dim(1)?;
    let cached = caches.iter().map(|c| c.kv()).collect::<Result<Vec<_>>>()?;
    let mut tensors = vec![q, k, v];
    tensors.extend(cached.iter().flatten().flat_map(|(k, v)| [k, v]));
    let applies = tensors
        .iter()
        .all(|x| !x.track_op() && matches!(x.device(), Device::Cpu) && x.dtype() == dtype)
        && matches!(dtype, DType::F32 | DType::BF16)
        && b == 1
        && nkv > 0
        && nh % nkv == 0
        && k.dims4()? == (1, nkv, n, hd)
        && v.dims4()? == (1, nkv, n, hd)
        && lens.len() == caches.len()
        && lens.iter().sum::<usize>() == n
        && !lens.contains(&0)
        && sinks.is_none_or(|sk| sk.len() == nh);
    // The portable level has no kernel for the heads (`head` would refuse after the appends).
    if !applies || crate::kernels::process_level() == crate::kernels::Level::Portable {
        return Ok(None);
    }
    for (kc, vc) in cached.iter().flatten() {
        let s0 = kc.dim(2)?;
        if kc.dims4()? != (1, nkv, s0, hd) || vc.dims4()? != (1, nkv, s0, hd) {
            return Ok(None);
        }
    }
    drop(cached);
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let sh = Shape {
        nh,
        nkv,
        n,
        hd,
        window,
        scale: scale as f32,
    };
    let before: Vec<usize> = caches.iter().map(|c| c.len()).collect();
    let undo = |caches: &mut [&mut LayerCache]| {
        for (c, &len) in caches.iter_mut().zip(&before) {
            c.truncate(len);
        }
    };
    let mut views = Vec::with_capacity(caches.len());
    let mut start = 0;
    for (c, &t) in caches.iter_mut().zip(lens) {
        match c.append(&k.narrow(2, start, t)?, &v.narrow(2, start, t)?) {
            Ok(kv) => views.push(kv),
            Err(e) => {
                undo(caches);
                return Err(e);
            }
        }
        start += t;
    }
    let y = match dtype {
        DType::F32 => typed::<f32>(&q, &views, lens, &sh, sinks),
        _ => typed::<half::bf16>(&q, &views, lens, &sh, sinks),
    };
    drop(views);
    match y {
        Ok(Some(y)) => Ok(Some(y)),
        other => {
            undo(caches);
            other
        }
    }
}

/// [`step`] on `q` and every sequence's keys and values after the step (`views`, as
/// [`LayerCache::append`] returns them) if they are elements of type `E` the heads read in
/// place: the attention `[1, N, nh * hd]`.
fn typed<E: Stored + RowElem + WithDType>(
    q: &Tensor,
    views: &[(Tensor, Tensor)],
    lens: &[usize],
    sh: &Shape,
    sinks: Option<&[f32]>,
) -> Result<Option<Tensor>> {
    let (qg, ql) = q.storage_and_layout();
    let Some(q) = operand_of(&qg, ql).and_then(E::of) else {
        return Ok(None);
    };
    let guards: Vec<_> = views
        .iter()
        .map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout()))
        .collect();
    let mut seqs = Vec::with_capacity(lens.len());
    let mut start = 0;
    for (((kg, kl), (vg, vl)), &t) in guards.iter().zip(lens) {
        let (Some((k, ks)), Some((v, vs))) = (strided_heads(kg, kl), strided_heads(vg, vl)) else {
            return Ok(None);
        };
        let (Some(k), Some(v)) = (E::of(k), E::of(v)) else {
            return Ok(None);
        };
        if ks != vs {
            return Ok(None);
        }
        seqs.push(Seq {
            start,
            t,
            s: kl.dims()[2],
            k,
            v,
            stride: ks,
        });
        start += t;
    }
    let Some(y) = step(q, &seqs, sh, sinks) else {
        return Ok(None);
    };
    Ok(Some(Tensor::from_vec(
        y,
        (1, sh.n, sh.nh * sh.hd),
        &Device::Cpu,
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::attention_infer;
    use crate::test_util::values;

    /// Three sequences (one with nothing cached) stepped together give each the attention
    /// [`attention_infer::core`](super::attention_infer::core) gives it alone and the caches it would leave, in f32 and
    /// bf16, with grouped heads, a window and sinks.
    #[test]
    fn a_ragged_step_equals_each_sequence_alone() {
        if crate::kernels::process_level() == crate::kernels::Level::Portable {
            eprintln!("portable level: the inference path does not run here (it returns None)");
            return;
        }
        let dev = Device::Cpu;
        // (kv heads, query heads per kv head, hd, window, sinks)
        for (nkv, g, hd, window, with_sinks) in [
            (2, 1, 16, None, false),
            (1, 3, 8, Some(4), true),
            (2, 2, 8, None, true),
        ] {
            for dtype in [DType::F32, DType::BF16] {
                let nh = nkv * g;
                let r = |shape: (usize, usize, usize, usize)| {
                    Tensor::randn(0f32, 1.0, shape, &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                };
                // (cached positions, new rows) of each sequence.
                let seqs = [(5, 1), (0, 4), (9, 2)];
                let lens: Vec<usize> = seqs.iter().map(|s| s.1).collect();
                let n: usize = lens.iter().sum();
                let (q, k, v) = (r((1, nh, n, hd)), r((1, nkv, n, hd)), r((1, nkv, n, hd)));
                let mut caches: Vec<LayerCache> = seqs
                    .iter()
                    .map(|&(s0, _)| {
                        let mut c = LayerCache::default();
                        if s0 > 0 {
                            // Appended in two steps, so that the buffers have room left and
                            // the heads are read strided.
                            let (k0, v0) = (r((1, nkv, s0, hd)), r((1, nkv, s0, hd)));
                            c.append(
                                &k0.narrow(2, 0, s0 - 1).unwrap(),
                                &v0.narrow(2, 0, s0 - 1).unwrap(),
                            )
                            .unwrap();
                            c.append(
                                &k0.narrow(2, s0 - 1, 1).unwrap(),
                                &v0.narrow(2, s0 - 1, 1).unwrap(),
                            )
                            .unwrap();
                        }
                        c
                    })
                    .collect();
                let before = caches.clone();
                let sinks: Option<Vec<f32>> =
                    with_sinks.then(|| (0..nh).map(|i| i as f32 * 0.5 - 1.0).collect());
                let scale = 1.0 / (hd as f64).sqrt();
                let mut refs: Vec<&mut LayerCache> = caches.iter_mut().collect();
                let got = core(
                    &q,
                    &k,
                    &v,
                    &lens,
                    &mut refs,
                    window,
                    scale,
                    sinks.as_deref(),
                )
                .unwrap()
                .expect("the inference path applies");
                assert_eq!(got.dims(), [1, n, nh * hd]);
                let mut start = 0;
                for (i, &(s0, t)) in seqs.iter().enumerate() {
                    let part = |x: &Tensor| x.narrow(2, start, t).unwrap();
                    let whole = |x: &Tensor, c: Option<&Tensor>| match c {
                        Some(c) => Tensor::cat(&[c, &part(x)], 2).unwrap(),
                        None => part(x).contiguous().unwrap(),
                    };
                    let old = before[i].kv().unwrap();
                    let old = old.as_ref();
                    let (kw, vw) = (whole(&k, old.map(|c| &c.0)), whole(&v, old.map(|c| &c.1)));
                    // Alone: the g query heads of each kv head stacked, `[1, nkv, g * t, hd]`.
                    let qa = part(&q)
                        .contiguous()
                        .unwrap()
                        .reshape((1, nkv, g * t, hd))
                        .unwrap();
                    let want = attention_infer::core(
                        &qa,
                        &kw,
                        &vw,
                        t,
                        s0,
                        window,
                        scale,
                        sinks.as_deref(),
                    )
                    .unwrap()
                    .unwrap()
                    .reshape((1, nh, t, hd))
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap()
                    .reshape((1, t, nh * hd))
                    .unwrap();
                    assert_eq!(
                        values(&got.narrow(1, start, t).unwrap()),
                        values(&want),
                        "{dtype:?} nkv{nkv} g{g} sequence {i}"
                    );
                    let (kc, vc) = caches[i].kv().unwrap().unwrap();
                    assert_eq!(values(&kc), values(&kw));
                    assert_eq!(values(&vc), values(&vw));
                    assert_eq!(caches[i].len(), s0 + t);
                    start += t;
                }
            }
        }
    }

    /// Operands it does not take (f16, a batch of two) leave the caches untouched.
    #[test]
    fn operands_it_does_not_take_leave_the_caches() {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 2, 3, 8), DType::F16, &dev).unwrap();
        let mut cache = LayerCache::default();
        let got = core(&q, &q, &q, &[3], &mut [&mut cache], None, 0.3, None).unwrap();
        assert!(got.is_none() && cache.is_empty());
        let q = Tensor::zeros((2, 2, 3, 8), DType::F32, &dev).unwrap();
        let got = core(&q, &q, &q, &[3], &mut [&mut cache], None, 0.3, None).unwrap();
        assert!(got.is_none() && cache.is_empty());
    }
}
