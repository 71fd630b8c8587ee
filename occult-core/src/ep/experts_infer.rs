//! The inference path of grouped SwiGLU experts on CPU: the sums of the tensor path of
//! [`super::experts`], computed on slices with buffers that are reused from call to call.
//!
//! The tensor path gathers each expert's rows, runs three [`linear`](crate::kernels::linear)s
//! and two element-wise ops, concatenates every expert's outputs and pre-reduces them
//! ([`crate::ep::pre_reduce`]): about ten tensors per expert, most of them large and fresh.
//! Here each expert's rows are gathered into a reused buffer, the projections run on the same
//! kernels ([`linear_rows`]: the same kernel for the same rows, so the same bits), biases are
//! added where the experts have them (gpt-oss), `silu(g) * u` (or gpt-oss's clamped form,
//! [`super::swiglu::Activation::apply_in_place`]) is formed in place a vector at a time ([`crate::kernels::vmath::silu_mul`]: its `exp` is within a few ulp of libm's, the only departure from the tensor
//! path), and the down projection writes straight into one buffer of every pair's output. One
//! parallel pass then weights and sums each row's pairs in the order the tensor path adds them
//! (by expert, from zero) and rounds once to the output dtype (bf16 with `vcvtneps2bf16` on
//! AVX-512 BF16, which flushes f32 subnormals). A test holds the two paths together.
//!
//! It runs only where nothing needs a gradient (no operand is on candle's graph), the tensors
//! are on the CPU, the activations are f32 (the experts' sum dtype) and this CPU has a kernel
//! for the weights; otherwise [`grouped_sum`] returns `None` and the caller takes the tensor
//! path.

use super::swiglu::SwigluStack;
use crate::kernels::scratch::{give, take};
use crate::kernels::vmath::Stored;
use crate::kernels::{linear_rows, operand_of, Operand};
use crate::{bail, Result};
use candle::{DType, Device, Tensor};
use half::bf16;
use rayon::prelude::*;

/// One expert's share of a grouped compute: its slot in the stack, the rows (of `xs`) it
/// computes, and for each row the index of its gate weight (in the flat weights), if weighted.
#[derive(Clone, Copy, Debug)]
pub struct Group<'a> {
    pub slot: usize,
    pub rows: &'a [u32],
    pub weight_at: Option<&'a [u32]>,
}

/// `[rows, hidden]` in `E`, row `r` being `sum_row(r)` rounded once, in parallel over blocks of
/// rows.
fn rows_out<E: Stored>(
    rows: usize,
    hidden: usize,
    sum_row: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<E> {
    let chunk = rows
        .div_ceil(4 * rayon::current_num_threads().max(1))
        .max(1);
    let mut out = vec![E::default(); rows * hidden];
    out.par_chunks_mut(chunk * hidden)
        .enumerate()
        .for_each(|(c, dst)| {
            let mut acc = vec![0f32; hidden];
            for (i, row) in dst.chunks_exact_mut(hidden).enumerate() {
                sum_row(c * chunk + i, &mut acc);
                E::round(&acc, row);
            }
        });
    out
}

/// For every row of `xs` (`[rows, H]`, f32), the sum over the pairs of `groups` that name it
/// of the expert's output on the row, times the pair's gate weight from `weights` (flat f32)
/// if the group has weight indices; rows no pair names are zero. Returns `[rows, H]` in
/// `out_dtype` (f32, or bf16 rounded once), or `None` where this path does not apply (see the
/// module doc). Slots, rows and weight indices out of range are errors.
pub fn grouped_sum(
    stack: &SwigluStack,
    xs: &Tensor,
    weights: Option<&Tensor>,
    groups: &[Group<'_>],
    out_dtype: DType,
) -> Result<Option<Tensor>> {
    let on_graph = xs.track_op()
        || weights.is_some_and(|w| w.track_op())
        || stack.tensors().iter().any(|(_, t)| t.track_op());
    let cpu = |t: &Tensor| matches!(t.device(), Device::Cpu);
    if on_graph
        || !cpu(xs)
        || !cpu(&stack.gate)
        || xs.dtype() != DType::F32
        || !matches!(out_dtype, DType::F32 | DType::BF16)
        || weights.is_some_and(|w| w.dtype() != DType::F32)
    {
        return Ok(None);
    }
    let (num_rows, hidden) = xs.dims2()?;
    let (experts, inter) = (stack.len(), stack.intermediate());
    if stack.hidden() != hidden {
        bail!(
            "expert rows have {hidden} columns, the experts take {}",
            stack.hidden()
        );
    }
    // Read guards on the storages, held to the end.
    let (xg, xl) = xs.storage_and_layout();
    let wg = weights.map(|w| w.storage_and_layout());
    let (gg, gl) = stack.gate.storage_and_layout();
    let (ug, ul) = stack.up.storage_and_layout();
    let (dg, dl) = stack.down.storage_and_layout();
    let elems = (
        operand_of(&xg, xl),
        operand_of(&gg, gl),
        operand_of(&ug, ul),
        operand_of(&dg, dl),
    );
    let (Some(Operand::F32(x)), Some(gate), Some(up), Some(down)) = elems else {
        return Ok(None);
    };
    // Biases in f32, `[n, I]`, `[n, I]`, `[n, H]` (small: read once per call).
    let biases = match &stack.bias {
        Some(b) => Some([
            b.gate
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?,
            b.up.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            b.down
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?,
        ]),
        None => None,
    };
    let add_bias = |ys: &mut [f32], bias: &[f32], slot: usize| {
        let width = bias.len() / experts;
        let b = &bias[slot * width..(slot + 1) * width];
        for row in ys.chunks_exact_mut(width) {
            row.iter_mut().zip(b).for_each(|(y, &b)| *y += b);
        }
    };
    let flat_weights = match wg.as_ref().map(|(g, l)| operand_of(g, l)) {
        Some(Some(Operand::F32(w))) => Some(w),
        Some(_) => return Ok(None),
        None => None,
    };
    // Check every index before any work.
    for g in groups {
        if g.slot >= experts {
            bail!("expert slot {} of a stack of {experts}", g.slot);
        }
        if let Some(&r) = g.rows.iter().find(|&&r| r as usize >= num_rows) {
            bail!("expert {} is sent row {r} of {num_rows}", g.slot);
        }
        match (g.weight_at, flat_weights) {
            (Some(at), Some(w)) => {
                if at.len() != g.rows.len() {
                    bail!(
                        "expert {} has {} rows and {} gate weights",
                        g.slot,
                        g.rows.len(),
                        at.len()
                    );
                }
                if let Some(&i) = at.iter().find(|&&i| i as usize >= w.len()) {
                    bail!("gate weight {i} of {} for expert {}", w.len(), g.slot);
                }
            }
            (Some(_), None) => bail!("expert {} has gate weights but none were given", g.slot),
            (None, _) => {}
        }
    }
    // Pair `p` (in group order) starts at row `starts[p]` of the pair outputs.
    let mut starts = Vec::with_capacity(groups.len() + 1);
    starts.push(0usize);
    for g in groups {
        starts.push(starts.last().copied().unwrap_or(0) + g.rows.len());
    }
    let pairs = starts[groups.len()];
    let mut ys = take(pairs * hidden);
    // Each group's block of pair outputs, disjoint.
    let mut blocks = Vec::with_capacity(groups.len());
    let mut rest = ys.as_mut_slice();
    for g in groups {
        let (block, tail) = rest.split_at_mut(g.rows.len() * hidden);
        blocks.push(block);
        rest = tail;
    }
    let ran: Vec<bool> = groups
        .par_iter()
        .zip(blocks.into_par_iter())
        .map(|(g, y)| {
            let n = g.rows.len();
            if n == 0 {
                return true;
            }
            let mut xe = take(n * hidden);
            for (dst, &r) in xe.chunks_exact_mut(hidden).zip(g.rows) {
                let r = r as usize;
                dst.copy_from_slice(&x[r * hidden..(r + 1) * hidden]);
            }
            let per = inter * hidden;
            let (mut gb, mut ub) = (take(n * inter), take(n * inter));
            let ok = linear_rows(
                Operand::F32(&xe),
                gate.part(g.slot * per, per),
                &mut gb,
                (n, inter, hidden),
            ) && linear_rows(
                Operand::F32(&xe),
                up.part(g.slot * per, per),
                &mut ub,
                (n, inter, hidden),
            );
            if ok {
                let at = g.slot * inter..(g.slot + 1) * inter;
                let bias = biases
                    .as_ref()
                    .map(|[bg, bu, _]| (&bg[at.clone()], &bu[at.clone()]));
                stack.act.apply_in_place(&mut gb, &mut ub, bias);
            }
            let ok = ok
                && linear_rows(
                    Operand::F32(&gb),
                    down.part(g.slot * per, per),
                    y,
                    (n, hidden, inter),
                );
            if let (true, Some([_, _, bd])) = (ok, &biases) {
                add_bias(y, bd, g.slot);
            }
            give(xe);
            give(gb);
            give(ub);
            ok
        })
        .collect();
    if ran.iter().any(|&ok| !ok) {
        give(ys);
        return Ok(None);
    }
    // Each row's pairs in group order: a counting sort of the pairs by row.
    let mut offsets = vec![0usize; num_rows + 1];
    for g in groups {
        for &r in g.rows {
            offsets[r as usize + 1] += 1;
        }
    }
    for r in 0..num_rows {
        offsets[r + 1] += offsets[r];
    }
    let mut fill = offsets.clone();
    // (pair output row, gate weight or 1) of every pair, grouped by row.
    let mut by_row = vec![(0usize, None::<f32>); pairs];
    for (gi, g) in groups.iter().enumerate() {
        for (i, &r) in g.rows.iter().enumerate() {
            let w = g
                .weight_at
                .zip(flat_weights)
                .map(|(at, w)| w[at[i] as usize]);
            by_row[fill[r as usize]] = (starts[gi] + i, w);
            fill[r as usize] += 1;
        }
    }
    let sum_row = |r: usize, acc: &mut [f32]| {
        acc.fill(0.0);
        for &(p, w) in &by_row[offsets[r]..offsets[r + 1]] {
            let y = &ys[p * hidden..(p + 1) * hidden];
            match w {
                Some(w) => acc.iter_mut().zip(y).for_each(|(a, &y)| *a += y * w),
                None => acc.iter_mut().zip(y).for_each(|(a, &y)| *a += y),
            }
        }
    };
    let out = if out_dtype == DType::BF16 {
        Tensor::from_vec(
            rows_out::<bf16>(num_rows, hidden, sum_row),
            (num_rows, hidden),
            xs.device(),
        )?
    } else {
        Tensor::from_vec(
            rows_out::<f32>(num_rows, hidden, sum_row),
            (num_rows, hidden),
            xs.device(),
        )?
    };
    give(ys);
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ep::dispatch::ComputePlan;
    use crate::ep::swiglu::{Activation, ExpertBiases};
    use candle::Var;

    /// Rows, weights and a plan with every case: experts with several rows, one row, none;
    /// rows named by several experts and by none.
    /// With `biased`, biases on every projection and that activation (gpt-oss's clamped one
    /// with a limit low enough that both clamps bite).
    fn setup(
        dtype: DType,
        biased: Option<Activation>,
    ) -> (SwigluStack, Tensor, Tensor, Vec<Vec<u32>>, Vec<Vec<u32>>) {
        let dev = Device::Cpu;
        let (e, i, h, rows) = (5, 48, 40, 9);
        let w = |shape: (usize, usize, usize)| {
            Tensor::randn(0f32, 0.3, shape, &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        let mut stack = SwigluStack::new(w((e, i, h)), w((e, i, h)), w((e, h, i))).unwrap();
        if let Some(act) = biased {
            let b = |n: usize| Tensor::randn(0f32, 0.5, (e, n), &dev).unwrap();
            let bias = ExpertBiases {
                gate: b(i),
                up: b(i),
                down: b(h),
            };
            stack = stack.with_form(act, Some(bias)).unwrap();
        }
        let xs = Tensor::randn(0f32, 1.0, (rows, h), &dev).unwrap();
        let weights = Tensor::rand(0f32, 1.0, 30, &dev).unwrap();
        // Expert 2 has no rows; row 8 is in no group.
        let rows_of = vec![
            vec![0, 1, 2, 3, 4, 5, 6, 7],
            vec![3],
            vec![],
            vec![7, 0, 3],
            vec![1, 2, 5, 6, 4, 0],
        ];
        let mut next = 0u32;
        let weight_at = rows_of
            .iter()
            .map(|r| {
                let at: Vec<u32> = (next..next + r.len() as u32).rev().collect();
                next += r.len() as u32;
                at
            })
            .collect();
        (stack, xs, weights, rows_of, weight_at)
    }

    /// The same sums on the tensor path: the experts as variables, which puts them on candle's
    /// graph.
    fn tensor_path(
        stack: &SwigluStack,
        xs: &Tensor,
        weights: Option<&Tensor>,
        groups: &[Group<'_>],
        out: DType,
    ) -> Tensor {
        let var = |t: &Tensor| Var::from_tensor(t).unwrap().as_tensor().clone();
        let tracked = SwigluStack::new(var(&stack.gate), var(&stack.up), var(&stack.down))
            .unwrap()
            .with_form(stack.act, stack.bias.clone())
            .unwrap();
        assert!(grouped_sum(&tracked, xs, weights, groups, out)
            .unwrap()
            .is_none());
        let mut offsets = vec![0];
        let (mut pair_row, mut pair_weight) = (Vec::new(), Vec::new());
        for slot in 0..stack.len() {
            if let Some(g) = groups.iter().find(|g| g.slot == slot) {
                pair_row.extend_from_slice(g.rows);
                pair_weight.extend_from_slice(g.weight_at.unwrap_or(g.rows));
            }
            offsets.push(pair_row.len());
        }
        let plan = ComputePlan {
            num_local: stack.len(),
            offsets,
            pair_row,
            pair_weight,
        };
        let rows = xs.to_dtype(out).unwrap();
        tracked
            .grouped(&rows, weights, &plan)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    }

    #[test]
    fn inference_sums_match_the_tensor_path() {
        // At the portable level the inference path does not run (it returns None); CI runs this
        // test at every level (OCCULT_KERNELS), natively and emulated.
        let level = crate::kernels::process_level();
        if level == crate::kernels::Level::Portable {
            eprintln!("portable level: the inference path does not run here (it returns None)");
            return;
        }
        eprintln!("inference path at {level}");
        let gpt_oss = Activation::ClampedSwiglu {
            alpha: 1.702,
            limit: 1.0,
        };
        for (wdt, out, biased) in [
            (DType::F32, DType::F32, None),
            (DType::BF16, DType::BF16, None),
            (DType::BF16, DType::F32, None),
            (DType::F32, DType::F32, Some(gpt_oss)),
            (DType::BF16, DType::F32, Some(gpt_oss)),
            (DType::F32, DType::F32, Some(Activation::Silu)),
        ] {
            let (stack, xs, weights, rows_of, weight_at) = setup(wdt, biased);
            for weighted in [true, false] {
                let groups: Vec<Group> = (0..stack.len())
                    .map(|slot| Group {
                        slot,
                        rows: &rows_of[slot],
                        weight_at: weighted.then_some(weight_at[slot].as_slice()),
                    })
                    .collect();
                let w = weighted.then_some(&weights);
                let fast = grouped_sum(&stack, &xs, w, &groups, out)
                    .unwrap()
                    .expect("the inference path applies")
                    .to_dtype(DType::F32)
                    .unwrap();
                let want = tensor_path(&stack, &xs, w, &groups, out);
                let (f, t) = (
                    fast.to_vec2::<f32>().unwrap(),
                    want.to_vec2::<f32>().unwrap(),
                );
                let scale = t.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
                // SiLU's exp differs in the last bits; a bf16 result may round the other way.
                let tol = if out == DType::BF16 {
                    scale / 128.0
                } else {
                    1e-5 * scale
                };
                for (r, (fr, tr)) in f.iter().zip(&t).enumerate() {
                    for (c, (a, b)) in fr.iter().zip(tr).enumerate() {
                        assert!(
                            (a - b).abs() <= tol,
                            "{wdt:?}/{out:?} biased {biased:?} weighted {weighted}: [{r}, {c}] \
                             {a} vs {b}"
                        );
                    }
                }
                assert!(
                    f[8].iter().all(|&v| v == 0.0),
                    "a row no pair names is zero"
                );
            }
        }
    }

    #[test]
    fn indices_out_of_range_are_errors() {
        let (stack, xs, weights, _, _) = setup(DType::F32, None);
        let bad_row = [Group {
            slot: 0,
            rows: &[9],
            weight_at: None,
        }];
        let bad_slot = [Group {
            slot: 5,
            rows: &[0],
            weight_at: None,
        }];
        let bad_weight = [Group {
            slot: 0,
            rows: &[0],
            weight_at: Some(&[30]),
        }];
        for groups in [&bad_row[..], &bad_slot[..], &bad_weight[..]] {
            let r = grouped_sum(&stack, &xs, Some(&weights), groups, DType::F32);
            assert!(r.is_err(), "{groups:?}");
        }
    }
}
