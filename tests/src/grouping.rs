//! The EP layer's grouped expert compute on candle's graph, held to its references: one expert
//! at a time against every expert padded to the busiest one's rows in three batched products
//! (`ep::experts::Grouping`), and the pre-reduction op (`ep::pre_reduce`) against the same sums
//! in candle ops. The CPU tests and the GPU tests run the same checks on their device.

use crate::parity::close_within;
use candle::{DType, Device, Tensor, Var};
use occult_core::ep::dispatch::ComputePlan;
use occult_core::ep::experts::{Grouping, SwigluStack};

/// A plan over `e` experts with every case: experts with many rows, one, none; rows named
/// by several experts and by none (the last row); weights read out of order.
fn plan(e: usize, rows: usize) -> ComputePlan {
    let mut offsets = vec![0];
    let (mut pair_row, mut pair_weight) = (Vec::new(), Vec::new());
    for slot in 0..e {
        // Slot 1 has one row, slot 2 none; the last row is in no slot.
        let mine: Vec<u32> = match slot {
            1 => vec![3],
            2 => vec![],
            _ => (0..rows as u32 - 1)
                .filter(|r| (r * 7 + slot as u32 * 3).is_multiple_of(slot as u32 + 2))
                .collect(),
        };
        for &r in &mine {
            pair_weight.push((r * 5 + slot as u32) % (rows as u32 * 2));
        }
        pair_row.extend(mine);
        offsets.push(pair_row.len());
    }
    ComputePlan {
        num_local: e,
        offsets,
        pair_row,
        pair_weight,
    }
}

/// Padded and batched against one expert at a time on `dev`: the same outputs and the same
/// gradients (rows, every weight, gate weights), in f32 and with bf16 weights.
pub fn padded_experts_match_one_at_a_time(dev: &Device) {
    let (e, i, h, rows) = (5, 24, 16, 13);
    let p = plan(e, rows);
    assert!(p.range(2).is_empty() && p.range(1).len() == 1 && p.range(0).len() > 3);
    let mut per_row = vec![0; rows];
    p.pair_row.iter().for_each(|&r| per_row[r as usize] += 1);
    assert!(
        per_row.iter().any(|&n| n > 1) && per_row[rows - 1] == 0,
        "{per_row:?}"
    );
    for dtype in [DType::F32, DType::BF16] {
        let var = |shape: &[usize], scale: f32| {
            let t = (Tensor::randn(0f32, 1.0, shape, dev).unwrap() * scale as f64).unwrap();
            Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
        };
        let (gate, up, down) = (
            var(&[e, i, h], 0.3),
            var(&[e, i, h], 0.3),
            var(&[e, h, i], 0.3),
        );
        let stack = SwigluStack::new(
            gate.as_tensor().clone(),
            up.as_tensor().clone(),
            down.as_tensor().clone(),
        )
        .unwrap();
        let x = var(&[rows, h + 2], 1.0);
        let w = var(&[2 * rows], 1.0);
        let loss_weights = Tensor::randn(0f32, 1.0, (rows, h), dev).unwrap();
        let run = |grouping| {
            let y = stack
                .grouped_with(x.as_tensor(), Some(w.as_tensor()), &p, grouping)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let grads = (&y * &loss_weights)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let mut out = vec![y.flatten_all().unwrap().to_vec1::<f32>().unwrap()];
            for v in [&x, &w, &gate, &up, &down] {
                let g = grads.get(v.as_tensor()).expect("a gradient");
                out.push(
                    g.to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap(),
                );
            }
            out
        };
        let (padded, each) = (run(Grouping::Padded), run(Grouping::PerExpert));
        // f32: the same sums, other GEMM blockings. bf16 on the CPU: the padded products
        // round their activations to bf16, the per-expert ones keep them in f32.
        let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
        for (what, (a, b)) in ["output", "rows", "gate weights", "gate", "up", "down"]
            .iter()
            .zip(padded.iter().zip(&each))
        {
            close_within(&format!("{dtype:?} {what}"), a, b, 0.0, tol).unwrap();
        }
        // The row no pair names gets nothing.
        assert!(padded[0][(rows - 1) * h..].iter().all(|&v| v == 0.0));
    }
}

/// The pre-reduction op (`ep::pre_reduce`, a kernel on a GPU) against the same sums in candle
/// ops on `dev`, weighted and not: outputs, the rows' gradients and the gate weights'. Rows
/// with several pairs, one pair and none; weights read out of order.
pub fn pre_reduce_matches_candle_ops(dev: &Device) {
    use occult_core::ep::pre_reduce::{pre_reduce, reference};
    let (rows, hidden, pairs) = (11, 300, 40);
    // Rows 0 to rows - 3 have several pairs each, row rows - 2 has one (the last pair), and
    // the last row none.
    let pair_row: Vec<u32> = (0..pairs as u32)
        .map(|p| match p as usize == pairs - 1 {
            true => rows as u32 - 2,
            false => (p * 7 + p / 3) % (rows as u32 - 2),
        })
        .collect();
    let weight_at: Vec<u32> = (0..pairs as u32).map(|p| (p * 13 + 5) % 64).collect();
    let y = Var::from_tensor(&Tensor::randn(0f32, 1.0, (pairs, hidden), dev).unwrap()).unwrap();
    let w = Var::from_tensor(&Tensor::rand(0f32, 1.0, 64, dev).unwrap()).unwrap();
    let loss_weights = Tensor::randn(0f32, 1.0, (rows, hidden), dev).unwrap();
    for weighted in [true, false] {
        let gate = weighted.then_some((w.as_tensor(), weight_at.as_slice()));
        let run = |out: Tensor| {
            let grads = (&out * &loss_weights)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let mut all = vec![flat(&out), flat(grads.get(y.as_tensor()).unwrap())];
            if weighted {
                all.push(flat(grads.get(w.as_tensor()).unwrap()));
            }
            all
        };
        let ours = run(pre_reduce(y.as_tensor(), gate, &pair_row, rows).unwrap());
        let want = run(reference(y.as_tensor(), gate, &pair_row, rows).unwrap());
        // The same products, summed in another order (and fused on a GPU).
        for (what, (a, b)) in ["output", "rows' gradient", "weights' gradient"]
            .iter()
            .zip(ours.iter().zip(&want))
        {
            close_within(&format!("weighted {weighted} {what}"), a, b, 0.0, 1e-5).unwrap();
        }
        // The last row has no pairs.
        assert!(ours[0][(rows - 1) * hidden..].iter().all(|&v| v == 0.0));
    }
}
