//! The EP layer's grouped expert compute on candle's graph, held to its references: one expert
//! at a time against every expert padded to the busiest one's rows in three batched products,
//! and against three grouped products over the stacked weights (`ep::experts::Grouping`), and the pre-reduction op (`ep::pre_reduce`) against the same sums
//! in candle ops. The CPU tests and the GPU tests run the same checks on their device.

use crate::parity::close_within;
use candle::{DType, Device, Tensor, Var};
use occult_core::ep::dispatch::ComputePlan;
use occult_core::ep::experts::{Grouping, SwigluStack};
use occult_core::ep::swiglu::{Activation, ExpertBiases};

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

/// Padded and batched, and stacked (on the CPU; elsewhere it runs one expert at a time),
/// against one expert at a time on `dev`: the same outputs and the same gradients (rows, every
/// weight, gate weights, biases), in f32 and with bf16 weights, without biases and with
/// gpt-oss's biases and clamped activation.
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
    for (dtype, biased) in [
        (DType::F32, false),
        (DType::BF16, false),
        (DType::F32, true),
        (DType::BF16, true),
    ] {
        let var = |shape: &[usize], scale: f32| {
            let t = (Tensor::randn(0f32, 1.0, shape, dev).unwrap() * scale as f64).unwrap();
            Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
        };
        let (gate, up, down) = (
            var(&[e, i, h], 0.3),
            var(&[e, i, h], 0.3),
            var(&[e, h, i], 0.3),
        );
        let mut stack = SwigluStack::new(
            gate.as_tensor().clone(),
            up.as_tensor().clone(),
            down.as_tensor().clone(),
        )
        .unwrap();
        let biases = [var(&[e, i], 0.5), var(&[e, i], 0.5), var(&[e, h], 0.5)];
        if biased {
            let bias = ExpertBiases {
                gate: biases[0].as_tensor().clone(),
                up: biases[1].as_tensor().clone(),
                down: biases[2].as_tensor().clone(),
            };
            // gpt-oss's limit: a clamp that bites near bf16's rounding would tip gradients
            // between the padded products (bf16 activations) and the others.
            let act = Activation::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0,
            };
            stack = stack.with_form(act, Some(bias)).unwrap();
        }
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
            let trained = [&x, &w, &gate, &up, &down];
            let with_biases = biases.iter().filter(|_| biased);
            for v in trained.into_iter().chain(with_biases) {
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
        let each = run(Grouping::PerExpert);
        let names = [
            "output",
            "rows",
            "gate weights",
            "gate",
            "up",
            "down",
            "gate bias",
            "up bias",
            "down bias",
        ];
        for grouping in [Grouping::Padded, Grouping::Stacked] {
            let other = run(grouping);
            assert_eq!(other.len(), each.len());
            // f32: the same sums, other GEMM blockings. bf16 on the CPU: the padded products
            // round their activations to bf16, the per-expert ones keep them in f32.
            let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
            for (what, (a, b)) in names.iter().zip(other.iter().zip(&each)) {
                let what = format!("{grouping:?} {dtype:?} biased {biased} {what}");
                close_within(&what, a, b, 0.0, tol).unwrap();
            }
            // The row no pair names gets nothing.
            assert!(other[0][(rows - 1) * h..].iter().all(|&v| v == 0.0));
        }
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
