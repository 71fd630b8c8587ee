//! [`grouped_linear`]: rows grouped by expert against a stack of expert weights, `y[rows of
//! s] = x[rows of s] · w[s]ᵀ`, as one candle op with its own backward, for training the
//! experts on CPU.
//!
//! One [`super::linear`] per expert on `w.get(s)` computes the same products, but its backward
//! goes through candle's `narrow`, whose gradient is the whole stack zero-padded around the
//! expert's block: every expert of a step allocates, writes and adds a tensor the size of the
//! stack, O(experts x stack) a step (at 16 local experts of OLMoE's shape, 48 passes over
//! 134 MB for the three projections). Here the forward runs each expert's rows on the kernels
//! ([`super::linear_rows`], the kernel `linear` picks for the same rows, so the same bits), and
//! the backward writes the stack's gradient once: `dx = dy · w[s]` per expert (candle's matmul
//! on the stored f32 stack; this op on the transposed stack for bf16 weights) and `dw[s] =
//! dy[rows of s]ᵀ · x[rows of s]` (the kernels, each expert into its block of one buffer).
//! Experts without rows get a zero gradient. A test holds values and gradients to the
//! per-expert products.

use super::linear_op::{operands, output};
use super::{linear_rows, Operand};
use crate::Result;
use candle::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

/// The op: `counts[s]` rows of expert `s`, in expert order.
struct GroupedLinear {
    counts: Vec<usize>,
}

/// `x` `[P, K]` (rows grouped by expert: `counts[s]` rows of expert s, in expert order) against
/// `w` `[n, N, K]`: `[P, N]` in `x`'s dtype. `x` and `w` share a dtype (f32 or bf16), or `x`
/// is f32 and `w` bf16, as for [`super::linear`]; both on the CPU. Differentiable in both.
/// Fails where this CPU has no kernel for the pair (the portable level): callers take the
/// per-expert products there.
pub fn grouped_linear(x: &Tensor, w: &Tensor, counts: &[usize]) -> Result<Tensor> {
    let (p, k) = x.dims2()?;
    let (n, _, kw) = w.dims3()?;
    let total: usize = counts.iter().sum();
    if k != kw || counts.len() != n || total != p {
        crate::bail!(
            "grouped linear: rows {:?} against weights {:?}, with {} experts' row counts \
             (summing to {total})",
            x.dims(),
            w.dims(),
            counts.len()
        );
    }
    let op = GroupedLinear {
        counts: counts.to_vec(),
    };
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, op)?)
}

/// `c` `[P, N]` = each expert's rows of `a` times its block of `w`, in parallel over experts;
/// false where the kernels do not take the pair.
fn products(
    a: Operand<'_>,
    w: Operand<'_>,
    c: &mut [f32],
    counts: &[usize],
    nk: (usize, usize),
) -> bool {
    let (n, k) = nk;
    let mut blocks = Vec::with_capacity(counts.len());
    let (mut rest, mut row) = (c, 0);
    for (s, &m) in counts.iter().enumerate() {
        let (block, tail) = rest.split_at_mut(m * n);
        blocks.push((s, row, m, block));
        rest = tail;
        row += m;
    }
    blocks
        .into_par_iter()
        .filter(|(_, _, m, _)| *m > 0)
        .map(|(s, row, m, block)| {
            linear_rows(
                a.part(row * k, m * k),
                w.part(s * n * k, n * k),
                block,
                (m, n, k),
            )
        })
        .collect::<Vec<bool>>()
        .into_iter()
        .all(|ok| ok)
}

impl CustomOp2 for GroupedLinear {
    fn name(&self) -> &'static str {
        "occult-grouped-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle::Result<(CpuStorage, Shape)> {
        let (p, k) = l1.shape().dims2()?;
        let (_, n, _) = l2.shape().dims3()?;
        let (a, w) = operands("grouped linear", (s1, l1), (s2, l2))?;
        let mut c = vec![0f32; p * n];
        let done = products(a, w, &mut c, &self.counts, (n, k));
        let out = output("grouped linear", s1, s2, c, done)?;
        Ok((out, Shape::from((p, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle::Result<(Option<Tensor>, Option<Tensor>)> {
        let err = |e: crate::Error| candle::Error::Msg(format!("grouped linear backward: {e}"));
        let (x, w, dy) = (x.detach(), w.detach(), dy.detach().contiguous()?);
        let dx = if w.dtype() == DType::F32 {
            // dx [rows of s, K] = dy [rows of s] · w[s], straight from the stored stack.
            let mut parts = Vec::with_capacity(self.counts.len());
            let mut row = 0;
            for (s, &m) in self.counts.iter().enumerate() {
                if m > 0 {
                    parts.push(dy.narrow(0, row, m)?.matmul(&w.get(s)?)?);
                }
                row += m;
            }
            match parts.is_empty() {
                true => x.zeros_like()?,
                false => Tensor::cat(&parts, 0)?.to_dtype(x.dtype())?,
            }
        } else {
            // bf16 weights: this op on the transposed stack (the kernels take bf16 there).
            let wt = w.transpose(1, 2)?.contiguous()?;
            grouped_linear(
                &dy.to_dtype(sum_of(dy.dtype(), w.dtype()))?,
                &wt,
                &self.counts,
            )
            .map_err(err)?
            .to_dtype(x.dtype())?
        };
        let dw = stack_grad(
            &x.to_dtype(dy.dtype())?.contiguous()?,
            &dy,
            &self.counts,
            w.dims3()?,
        )?
        .to_dtype(w.dtype())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// The stack's gradient `[n, N, K]` in f32, written once: `dw[s] = dy[rows of s]ᵀ · x[rows of
/// s]` (`dy` `[P, N]`, `x` `[P, K]`, one dtype, contiguous), zero for experts without rows.
fn stack_grad(
    x: &Tensor,
    dy: &Tensor,
    counts: &[usize],
    (n, rows_w, k): (usize, usize, usize),
) -> candle::Result<Tensor> {
    let (xg, xl) = x.storage_and_layout();
    let (dg, dl) = dy.storage_and_layout();
    let mut out = vec![0f32; n * rows_w * k];
    let ok = match (super::operand_of(&xg, xl), super::operand_of(&dg, dl)) {
        (Some(Operand::F32(x)), Some(Operand::F32(dy))) => {
            per_expert_grads(x, dy, counts, (rows_w, k), &mut out)
        }
        (Some(Operand::Bf16(x)), Some(Operand::Bf16(dy))) => {
            per_expert_grads(x, dy, counts, (rows_w, k), &mut out)
        }
        _ => false,
    };
    if !ok {
        candle::bail!(
            "grouped linear backward: no kernel for the gradient of {:?} rows",
            x.dtype()
        );
    }
    Tensor::from_vec(out, (n, rows_w, k), x.device())
}

/// [`stack_grad`] on slices: each expert's block of `out` from its rows' transposes, in
/// parallel over experts.
fn per_expert_grads<E: super::vmath::Stored>(
    x: &[E],
    dy: &[E],
    counts: &[usize],
    (rows_w, k): (usize, usize),
    out: &mut [f32],
) -> bool {
    let mut starts = Vec::with_capacity(counts.len());
    let mut row = 0;
    for &m in counts {
        starts.push(row);
        row += m;
    }
    out.par_chunks_mut(rows_w * k)
        .zip(counts.par_iter().zip(starts))
        .map(|(block, (&m, row))| {
            if m == 0 {
                return true;
            }
            // dyᵀ [N, m] and xᵀ [K, m] of the expert's rows: dw = dyᵀ · (xᵀ)ᵀ.
            let transposed = |a: &[E], cols: usize| {
                let mut t = vec![E::default(); cols * m];
                super::elem::transpose(&a[row * cols..(row + m) * cols], &mut t, m, cols);
                t
            };
            let (dyt, xt) = (transposed(dy, rows_w), transposed(x, k));
            linear_rows(E::operand(&dyt), E::operand(&xt), block, (rows_w, k, m))
        })
        .collect::<Vec<bool>>()
        .into_iter()
        .all(|ok| ok)
}

/// The dtype `dy` takes against the weights for `dx`: f32 against bf16 weights stays f32 (the
/// mixed pair); otherwise the weights' own.
fn sum_of(dy: DType, w: DType) -> DType {
    if dy == DType::F32 && w == DType::BF16 {
        DType::F32
    } else {
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::linear;
    use crate::test_util::values;
    use candle::{Device, Var};

    /// Values and gradients (of the rows and of the whole stack) equal one `linear` per
    /// expert on its block of the stack, in f32 and with bf16 weights; an expert without rows
    /// gets a zero gradient.
    #[test]
    fn equals_one_linear_per_expert_forward_and_backward() {
        if crate::kernels::process_level() == crate::kernels::Level::Portable {
            eprintln!("portable level: no kernels, callers take the per-expert products");
            return;
        }
        let dev = Device::Cpu;
        let counts = [3usize, 0, 7, 1];
        let (p, n, k) = (11, 24, 40);
        for (xd, wd) in [
            (DType::F32, DType::F32),
            (DType::F32, DType::BF16),
            (DType::BF16, DType::BF16),
        ] {
            let x0 = Tensor::randn(0f32, 1.0, (p, k), &dev)
                .unwrap()
                .to_dtype(xd)
                .unwrap();
            let w0 = Tensor::randn(0f32, 0.3, (4, n, k), &dev)
                .unwrap()
                .to_dtype(wd)
                .unwrap();
            let dy = Tensor::randn(0f32, 1.0, (p, n), &dev)
                .unwrap()
                .to_dtype(xd)
                .unwrap();
            let run = |grouped: bool| {
                let (x, w) = (
                    Var::from_tensor(&x0).unwrap(),
                    Var::from_tensor(&w0).unwrap(),
                );
                let y = if grouped {
                    grouped_linear(x.as_tensor(), w.as_tensor(), &counts).unwrap()
                } else {
                    let mut parts = Vec::new();
                    let mut row = 0;
                    for (s, &m) in counts.iter().enumerate() {
                        let xs = x.as_tensor().narrow(0, row, m).unwrap();
                        parts.push(linear(&xs, &w.as_tensor().get(s).unwrap()).unwrap());
                        row += m;
                    }
                    Tensor::cat(&parts, 0).unwrap()
                };
                let loss = (y.to_dtype(DType::F32).unwrap() * dy.to_dtype(DType::F32).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let g = loss.backward().unwrap();
                let grad = |v: &Var| values(g.get(v.as_tensor()).unwrap());
                (values(&y), grad(&x), grad(&w))
            };
            let (want, got) = (run(false), run(true));
            // f32: the same kernels for the values and dw, candle's matmul for dx (other blocking).
            let tol = if wd == DType::F32 { 1e-5 } else { 1e-2 };
            for (name, a, b) in [
                ("y", &got.0, &want.0),
                ("dx", &got.1, &want.1),
                ("dw", &got.2, &want.2),
            ] {
                assert_eq!(a.len(), b.len(), "{name}");
                for (i, (a, b)) in a.iter().zip(b).enumerate() {
                    assert!(
                        (a - b).abs() <= tol * b.abs().max(1.0),
                        "{xd:?}x{wd:?} {name}[{i}]: {a} vs {b}"
                    );
                }
            }
            // Expert 1 has no rows: its block of dw is zero.
            assert!(got.2[n * k..2 * n * k].iter().all(|&v| v == 0.0));
        }
    }

    #[test]
    fn mismatched_counts_are_refused() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((5, 8), DType::F32, &dev).unwrap();
        let w = Tensor::zeros((2, 4, 8), DType::F32, &dev).unwrap();
        for counts in [&[2usize, 2][..], &[5], &[1, 1, 3]] {
            let e = grouped_linear(&x, &w, counts).unwrap_err().to_string();
            assert!(e.contains("grouped linear"), "{e}");
        }
    }
}
