//! The expert-parallel MoE layer against the single-device reference: forward and gradients
//! (router, experts, shared experts, input) in the standard and occult modes, with and without
//! pruning, over random configurations, on the local (threads) backend. Row counts agree with
//! the analysis core.

use candle::{Device, Tensor};
use occult_core::analysis::collab::{layer_stats, total_devices};
use occult_core::analysis::placement::replicas::CopyRule;
use occult_core::analysis::placement::{contiguous, random_balanced};
use occult_core::analysis::pruning::{PruneLimit, PruneRule};
use occult_core::analysis::ranks::RankSplit;
use occult_core::analysis::routing::RouterRule;
use occult_core::analysis::run_key::DispatchMode;
use occult_core::ep::comm::local::run_local;
use occult_core::ep::dispatch::{ExpertLocations, SendPlan};
use occult_core::ep::{reference_forward, route, EpMoe, EpSettings, MoeWeights};
use occult_tests::parity::{device_cases, Case, Fixture, BF16_LAYER_BOUNDS, H};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Runs one case on D local ranks and checks it against the reference.
fn check(c: &Case) {
    let f = Fixture::new(c);
    let reference = f.reference();
    let results: Vec<_> = run_local(c.d, |comm| f.run_rank(comm))
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{c:?}: {e}")))
        .collect();
    for (rank, got) in results.iter().enumerate() {
        f.check_rank(&reference, rank, got)
            .unwrap_or_else(|e| panic!("{e} in {c:?}"));
    }
    let summed: Vec<Option<Vec<f32>>> = (0..f.vars.len())
        .map(|i| {
            let present: Vec<&Vec<f32>> = results
                .iter()
                .filter_map(|r| r.gparams[i].as_ref())
                .collect();
            (!present.is_empty()).then(|| {
                let mut s = vec![0.0f32; present[0].len()];
                for g in present {
                    s.iter_mut().zip(g).for_each(|(a, b)| *a += b);
                }
                s
            })
        })
        .collect();
    f.check_params(&reference, &summed)
        .unwrap_or_else(|e| panic!("{e} in {c:?}"));
}

#[test]
fn ep_forward_and_gradients_match_the_reference_on_random_configs() {
    let mut rng = ChaCha8Rng::seed_from_u64(2025);
    for seed in 0..48 {
        check(&Case::random(&mut rng, seed));
    }
}

#[test]
fn edge_cases() {
    let base = Case {
        d: 4,
        e: 16,
        k: 4,
        random_placement: true,
        shared: true,
        renormalize: false,
        tokens: vec![5, 0, 7, 3],
        mode: DispatchMode::Occult,
        prune: None,
        seed: 1,
        frozen_input: false,
        devices_per_node: None,
        replicas: None,
    };
    // A rank with no tokens, in both modes.
    check(&base);
    check(&Case {
        mode: DispatchMode::Standard,
        ..base.clone()
    });
    // Every rank without tokens.
    check(&Case {
        tokens: vec![0; 4],
        ..base.clone()
    });
    // E not divisible by D (devices hold 3 or 2 experts).
    check(&Case {
        d: 3,
        e: 8,
        k: 2,
        tokens: vec![4, 4, 4],
        ..base.clone()
    });
    // One expert per device, and D = 1.
    check(&Case {
        d: 8,
        e: 8,
        k: 8,
        tokens: vec![2; 8],
        ..base.clone()
    });
    check(&Case {
        d: 1,
        tokens: vec![9],
        ..base.clone()
    });
    // A rank that receives nothing (pruned to one device, a rank without tokens), found
    // under mpirun: its backward must still take part in the reverse exchanges.
    check(&Case {
        e: 64,
        k: 2,
        renormalize: true,
        tokens: vec![11, 7, 0, 2],
        prune: Some((PruneRule::Similarity, PruneLimit::Devices(1))),
        seed: 2,
        ..base.clone()
    });
    // A frozen input (only router and experts train), with a rank that has no tokens and a
    // rank that receives nothing, in both modes: every rank must still run the reverse
    // exchanges (found in review: the empty paths used to drop off the graph).
    for mode in [DispatchMode::Standard, DispatchMode::Occult] {
        check(&Case {
            e: 64,
            k: 2,
            tokens: vec![11, 7, 0, 2],
            prune: Some((PruneRule::Similarity, PruneLimit::Devices(1))),
            seed: 2,
            frozen_input: true,
            mode,
            ..base.clone()
        });
    }
    // Pruning to one device with each rule.
    check(&Case {
        prune: Some((PruneRule::Router, PruneLimit::Devices(1))),
        ..base.clone()
    });
    check(&Case {
        prune: Some((PruneRule::Similarity, PruneLimit::Devices(1))),
        ..base.clone()
    });
    // Node-limited, two nodes of 2: to one node, and to one device in it, with each rule.
    for rule in [PruneRule::Router, PruneRule::Similarity] {
        for devices_in_node in [None, Some(1)] {
            let limit = PruneLimit::Nodes {
                devices_per_node: 2,
                max_nodes: 1,
                devices_in_node,
            };
            check(&Case {
                tokens: vec![6, 3, 0, 9],
                prune: Some((rule, limit)),
                ..base.clone()
            });
        }
    }
}

/// The two-level exchange on its edge cases: nodes of 2 with ranks without tokens (every rank
/// too), a short last node, one device per node (every row crosses), one node (no row
/// crosses), a frozen input, and node-limited pruning with a rank that receives nothing.
#[test]
fn two_level_edge_cases() {
    let base = Case {
        d: 4,
        e: 16,
        k: 4,
        random_placement: true,
        shared: true,
        renormalize: false,
        tokens: vec![5, 0, 7, 3],
        mode: DispatchMode::TwoLevel,
        prune: None,
        seed: 3,
        frozen_input: false,
        devices_per_node: Some(2),
        replicas: None,
    };
    check(&base);
    check(&Case {
        tokens: vec![0; 4],
        ..base.clone()
    });
    for (d, g) in [(3, 2), (5, 2), (4, 1), (4, 4)] {
        check(&Case {
            d,
            tokens: (0..d).map(|r| 3 + r % 4).collect(),
            devices_per_node: Some(g),
            ..base.clone()
        });
    }
    check(&Case {
        frozen_input: true,
        ..base.clone()
    });
    for rule in [PruneRule::Router, PruneRule::Similarity] {
        check(&Case {
            e: 64,
            k: 2,
            tokens: vec![11, 7, 0, 2],
            prune: Some((
                rule,
                PruneLimit::Nodes {
                    devices_per_node: 2,
                    max_nodes: 1,
                    devices_in_node: Some(1),
                },
            )),
            frozen_input: true,
            ..base.clone()
        });
    }
    // The flat modes with a node size count their rows by level (checked against the inputs).
    for mode in [DispatchMode::Standard, DispatchMode::Occult] {
        check(&Case {
            mode,
            ..base.clone()
        });
    }
}

/// Placements with replicas on their edge cases, under both copy rules and both flat modes:
/// ranks without tokens (every rank too), two copies on one device, one rank (E + R slots on
/// it), uneven E / D, a frozen input, and rows counted by level. Every case holds outputs and
/// gradients to the reference and the rows to each peer to a count from the rule's choice.
#[test]
fn replica_edge_cases() {
    // Four ranks (one without tokens) in nodes of 2, two more slots per device.
    let replica_case = |rule: CopyRule, mode: DispatchMode| Case {
        d: 4,
        e: 16,
        k: 4,
        random_placement: false,
        shared: true,
        renormalize: false,
        tokens: vec![5, 0, 7, 3],
        mode,
        prune: None,
        seed: 11,
        frozen_input: false,
        devices_per_node: Some(2),
        replicas: Some((2, rule)),
    };
    for rule in [CopyRule::Cover, CopyRule::Sglang] {
        for mode in [DispatchMode::Occult, DispatchMode::Standard] {
            let base = replica_case(rule, mode);
            check(&base);
            check(&Case {
                tokens: vec![0; 4],
                ..base.clone()
            });
            for seed in 0..6 {
                // Seeds whose maps put two copies on one device among them (checked below).
                check(&Case {
                    seed: 100 + seed,
                    replicas: Some((4, rule)),
                    ..base.clone()
                });
            }
            check(&Case {
                d: 1,
                tokens: vec![9],
                devices_per_node: None,
                ..base.clone()
            });
            check(&Case {
                d: 3,
                e: 8,
                k: 2,
                tokens: vec![4, 0, 6],
                devices_per_node: None,
                replicas: Some((1, rule)),
                ..base.clone()
            });
            check(&Case {
                frozen_input: true,
                ..base.clone()
            });
        }
    }
    // Some of those maps hold two copies of an expert on one device.
    let twice = (0..6).any(|seed| {
        let f = Fixture::new(&Case {
            seed: 100 + seed,
            replicas: Some((4, CopyRule::Cover)),
            ..replica_case(CopyRule::Cover, DispatchMode::Occult)
        });
        let map = f.replica.expect("replicas");
        (0..4).any(|d| {
            let mut s = map.device_slots(d).to_vec();
            s.sort_unstable();
            s.windows(2).any(|w| w[0] == w[1])
        })
    });
    assert!(
        twice,
        "no map with two copies on one device among the seeds"
    );
}

/// Replicas with pruning or two-level dispatch are refused, with the reason, on every rank.
#[test]
fn replicas_refuse_what_they_do_not_run() {
    let base = Case {
        devices_per_node: Some(1),
        replicas: Some((1, CopyRule::Cover)),
        ..two_ranks_two_level()
    };
    let pruned = Case {
        mode: DispatchMode::Occult,
        prune: Some((PruneRule::Router, PruneLimit::Devices(1))),
        ..base.clone()
    };
    for (case, says) in [(base, "two-level"), (pruned, "pruning")] {
        let f = Fixture::new(&case);
        for r in run_local(2, |comm| f.run_rank(comm).map(|_| ())) {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("replicas"), "{e}");
        }
    }
}

/// Two ranks of two tokens, 8 experts, top-2, in two-level mode without a node size.
fn two_ranks_two_level() -> Case {
    Case {
        d: 2,
        e: 8,
        k: 2,
        random_placement: false,
        shared: false,
        renormalize: false,
        tokens: vec![2, 2],
        mode: DispatchMode::TwoLevel,
        prune: None,
        seed: 1,
        frozen_input: false,
        devices_per_node: None,
        replicas: None,
    }
}

/// Two-level mode without a node size is refused with the reason, on every rank.
#[test]
fn two_level_without_a_node_size_is_refused() {
    let f = Fixture::new(&two_ranks_two_level());
    for r in run_local(2, |comm| f.run_rank(comm).map(|_| ())) {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("needs the node size"), "{e}");
    }
}

#[test]
fn all_tokens_on_one_expert() {
    // Router row 0 dominates for positive inputs: every token picks expert 0 (k = 1).
    let e = 8;
    let mut router = vec![0.0f32; e * H];
    router[..H].iter_mut().for_each(|v| *v = 10.0);
    let router = Tensor::from_vec(router, (e, H), &Device::Cpu).unwrap();
    let x = Tensor::from_vec(
        (0..6 * H)
            .map(|i| 0.1 + (i % 7) as f32 * 0.1)
            .collect::<Vec<f32>>(),
        (6, H),
        &Device::Cpu,
    )
    .unwrap();
    let rule = RouterRule::softmax_topk(e, 1, false);
    let routed = route(&x, &router, &rule, None).unwrap();
    assert!(routed.ids.iter().all(|&i| i == 0));
    let f = Fixture::new(&Case {
        d: 4,
        e,
        k: 1,
        random_placement: false,
        shared: false,
        renormalize: false,
        tokens: vec![0; 4],
        mode: DispatchMode::Occult,
        prune: None,
        seed: 5,
        frozen_input: false,
        devices_per_node: None,
        replicas: None,
    });
    let w = MoeWeights {
        router,
        ..f.w.clone()
    };
    let map = contiguous(e, 4);
    let reference = reference_forward(&w, &rule, &x, None)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let out = run_local(4, |comm| {
        let settings = EpSettings {
            rule: rule.clone(),
            device_of_expert: map.clone(),
            mode: DispatchMode::Occult,
            prune: None,
            devices_per_node: None,
            replicas: None,
        };
        let layer = EpMoe::from_full(&w, settings, comm.clone())?;
        let mine = if comm.rank() == 2 {
            x.clone()
        } else {
            x.narrow(0, 0, 0)?
        };
        let (y, st) = layer.forward(&mine)?;
        Ok((y.flatten_all()?.to_vec1::<f32>()?, st))
    });
    let (y, st) = out[2].as_ref().unwrap();
    assert_eq!(y, &reference);
    assert_eq!(st.remote_rows_sent, 6);
    let (_, st0) = out[0].as_ref().unwrap();
    assert_eq!(st0.rows_received, 6);
}

#[test]
fn plan_rows_equal_the_analysis_core_per_link() {
    // Tokens split evenly in order over D ranks: each rank's plan sends exactly the analysis
    // core's link rows, in both modes.
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for _ in 0..30 {
        let d = rng.random_range(1..6usize);
        let e = d * rng.random_range(1..6usize) + rng.random_range(0..d);
        let k = rng.random_range(1..=e.min(6));
        let tokens = rng.random_range(0..60usize);
        let mut ids = Vec::new();
        for _ in 0..tokens {
            let mut all: Vec<u32> = (0..e as u32).collect();
            rand::seq::SliceRandom::shuffle(all.as_mut_slice(), &mut rng);
            ids.extend_from_slice(&all[..k]);
        }
        let map = random_balanced(e, d, &mut rng);
        let split = RankSplit::new(tokens, d);
        let s = layer_stats(0, &ids, k, &map, d, split, 1);
        let loc = ExpertLocations::new(&map, d);
        for r in 0..d {
            let mine = &ids[split.range(r).start * k..split.range(r).end * k];
            let occ = SendPlan::new(mine, k, &loc, DispatchMode::Occult).unwrap();
            let std = SendPlan::new(mine, k, &loc, DispatchMode::Standard).unwrap();
            let as_u64 = |v: &[usize]| v.iter().map(|&x| x as u64).collect::<Vec<_>>();
            assert_eq!(as_u64(&occ.send_counts), s.link_rows_occult[r]);
            assert_eq!(as_u64(&std.send_counts), s.link_rows_standard[r]);
            assert_eq!(occ.rows() as u64, total_devices(mine, k, &map, d));
        }
    }
}

/// The stacked-layer case: four ranks, one without tokens.
fn stacked_case() -> Case {
    Case {
        d: 4,
        e: 16,
        k: 4,
        random_placement: true,
        shared: false,
        renormalize: false,
        tokens: vec![5, 0, 7, 3],
        mode: DispatchMode::Occult,
        prune: None,
        seed: 3,
        frozen_input: false,
        devices_per_node: None,
        replicas: None,
    }
}

/// One rank's stacked output, input gradient and parameter gradients.
type Stacked = (Vec<f32>, Option<Vec<f32>>, Vec<Option<Vec<f32>>>);

/// Two EP layers with residual connections, the way models stack them, on ranks that include
/// one without tokens. With a plain `h + moe(h)`, candle's empty-tensor shortcut drops the
/// layers from that rank's backward although its experts served other ranks' rows;
/// `residual_add` keeps them.
fn run_stacked(safe_add: bool, timeout: std::time::Duration) -> Vec<occult_core::Result<Stacked>> {
    use candle::Var;
    use occult_core::ep::comm::local::run_local_with_timeout;
    use occult_core::ep::residual_add;
    let case = stacked_case();
    let a = Fixture::new(&case);
    let b = Fixture::new(&Case {
        seed: 4,
        ..case.clone()
    });
    let starts = case.starts();
    run_local_with_timeout(4, timeout, |comm| {
        let add = |h: &Tensor, y: &Tensor| -> occult_core::Result<Tensor> {
            if safe_add {
                residual_add(h, y)
            } else {
                Ok((h + y)?)
            }
        };
        let r = comm.rank();
        let (at, n) = (starts[r], case.tokens[r]);
        let settings = |p: &Fixture| EpSettings {
            rule: p.rule.clone(),
            device_of_expert: p.map.clone(),
            mode: case.mode,
            prune: None,
            devices_per_node: None,
            replicas: None,
        };
        let l1 = EpMoe::from_full(&a.w, settings(&a), comm.clone())?;
        let l2 = EpMoe::from_full(&b.w, settings(&b), comm.clone())?;
        let x = Var::from_slice(&a.x[at * H..(at + n) * H], (n, H), &Device::Cpu)?;
        let h1 = add(x.as_tensor(), &l1.forward(x.as_tensor())?.0)?;
        let h2 = add(&h1, &l2.forward(&h1)?.0)?;
        let g = Tensor::from_slice(&a.g[at * H..(at + n) * H], (n, H), &Device::Cpu)?;
        let grads = (h2.clone() * g)?.sum_all()?.backward()?;
        let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
        let params = a
            .vars
            .iter()
            .chain(&b.vars)
            .map(|v| grads.get(v.as_tensor()).map(flat).transpose())
            .collect::<candle::Result<Vec<_>>>()?;
        Ok((
            flat(&h2)?,
            grads.get(x.as_tensor()).map(flat).transpose()?,
            params,
        ))
    })
}

#[test]
fn stacked_layers_with_an_empty_rank() {
    use candle::Var;
    use occult_tests::parity::close;
    let results: Vec<_> = run_stacked(true, std::time::Duration::from_secs(120))
        .into_iter()
        .map(|r| r.expect("every rank finishes"))
        .collect();
    // The reference: the same two layers, stacked, on all tokens.
    let case_a = Fixture::new(&stacked_case());
    let case_b = Fixture::new(&Case {
        seed: 4,
        ..case_a.case.clone()
    });
    let x = Var::from_slice(&case_a.x, (15, H), &Device::Cpu).unwrap();
    let h1 = (x.as_tensor()
        + reference_forward(&case_a.w, &case_a.rule, x.as_tensor(), None).unwrap())
    .unwrap();
    let h2 = (&h1 + reference_forward(&case_b.w, &case_b.rule, &h1, None).unwrap()).unwrap();
    let g = Tensor::from_slice(&case_a.g, (15, H), &Device::Cpu).unwrap();
    let grads = (h2.clone() * g)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let out: Vec<f32> = results.iter().flat_map(|r| r.0.clone()).collect();
    close("stacked output", &out, &flat(&h2), 1e-6).unwrap();
    let gx: Vec<f32> = results
        .iter()
        .flat_map(|r| r.1.clone().unwrap_or_default())
        .collect();
    close(
        "stacked input gradient",
        &gx,
        &flat(grads.get(x.as_tensor()).unwrap()),
        1e-6,
    )
    .unwrap();
    for (i, v) in case_a.vars.iter().chain(&case_b.vars).enumerate() {
        let reference = flat(grads.get(v.as_tensor()).unwrap());
        let mut sum = vec![0.0f32; reference.len()];
        for r in &results {
            if let Some(gp) = &r.2[i] {
                sum.iter_mut().zip(gp).for_each(|(s, g)| *s += g);
            }
        }
        close(
            &format!("stacked gradient of parameter {i}"),
            &sum,
            &reference,
            1e-2,
        )
        .unwrap();
    }
    // With a plain `+` the rank without tokens skips the reverse exchanges: its peers fail at
    // the timeout (an error, not a hang, and no wrong numbers).
    let unrecorded = run_stacked(false, std::time::Duration::from_secs(3));
    assert!(unrecorded.iter().any(|r| r.is_err()));
}

/// The layer with its weights and input in f32 and bf16, forward and backward, against the
/// f32 reference: f32 to rounding, bf16 within the bounds the GPU test holds it to as well.
#[test]
fn half_precision_layer_stays_close_to_the_f32_reference() {
    use occult_core::ep::comm::local::local_group;
    use std::sync::Arc;
    for c in device_cases() {
        let f = Fixture::new(&c);
        for (dtype, bounds) in [
            (candle::DType::F32, (1e-5, 1e-6)),
            (candle::DType::BF16, BF16_LAYER_BOUNDS),
        ] {
            let comm = Arc::new(local_group(1).pop().unwrap());
            let run = f.run_on(&Device::Cpu, dtype, comm).unwrap();
            run.check(&f, bounds, &format!("seed {} {dtype:?}", c.seed));
        }
    }
}

#[test]
fn padded_experts_match_one_at_a_time() {
    occult_tests::grouping::padded_experts_match_one_at_a_time(&Device::Cpu);
}

#[test]
fn the_pre_reduction_op_matches_candle_ops() {
    occult_tests::grouping::pre_reduce_matches_candle_ops(&Device::Cpu);
}

/// Plans that name a row or a gate weight out of range are errors, not reads out of bounds.
#[test]
fn the_pre_reduction_op_refuses_indices_out_of_range() {
    use occult_core::ep::pre_reduce::pre_reduce;
    let y = Tensor::zeros((3, 4), candle::DType::F32, &Device::Cpu).unwrap();
    let w = Tensor::zeros(6, candle::DType::F32, &Device::Cpu).unwrap();
    let err = |r: occult_core::Result<Tensor>| r.unwrap_err().to_string();
    assert!(err(pre_reduce(&y, None, &[0, 1, 5], 5 - 3)).contains("row 5"));
    assert!(err(pre_reduce(&y, Some((&w, &[0, 6, 1])), &[0, 1, 1], 2)).contains("weight 6"));
    assert!(err(pre_reduce(&y, None, &[0, 1], 2)).contains("2 pair rows for 3"));
}
