//! The two ways the EP layer's grouped expert compute runs on candle's graph, held to each
//! other: one expert at a time, and every expert padded to the busiest one's rows in three
//! batched products (`ep::experts::Grouping`). The CPU tests and the GPU tests run the same
//! check on their device.

use candle::{DType, Device, Tensor, Var};
use occult_core::ep::dispatch::ComputePlan;
use occult_core::ep::experts::{Grouping, SwigluStack};

/// A plan over `e` experts with every case: experts with many rows, one, none; rows named
/// by several experts and by none (the last row); weights read out of order.
fn plan(e: usize, rows: usize) -> ComputePlan {
    let mut offsets = vec![0];
    let (mut pair_row, mut pair_weight) = (Vec::new(), Vec::new());
    for slot in 0..e {
        let mine: Vec<u32> = (0..rows as u32 - 1)
            .filter(|r| (r * 7 + slot as u32 * 3).is_multiple_of(slot as u32 + 2) && slot != 2)
            .collect();
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
    assert!(p.range(2).is_empty() && p.range(0).len() > 3 && p.pairs() > rows);
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
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = a.iter().zip(b).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(diff <= tol * scale, "{dtype:?} {what}: {diff} of {scale}");
        }
        // The row no pair names gets nothing.
        assert!(padded[0][(rows - 1) * h..].iter().all(|&v| v == 0.0));
    }
}
