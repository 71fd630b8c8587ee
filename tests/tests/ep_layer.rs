//! The expert-parallel MoE layer against the single-device reference: forward and gradients
//! (router, experts, shared experts, input) in the standard and occult modes, with and without
//! pruning, over random configurations, on the local (threads) backend. Row counts agree with
//! the analysis core.

use candle::{Device, Tensor, Var};
use occult_core::collab::{layer_stats, total_devices};
use occult_core::comm::local::run_local;
use occult_core::dispatch::{DispatchMode, ExpertLocations, SendPlan};
use occult_core::experts::{SharedExperts, SwigluStack};
use occult_core::moe::{reference_forward, route, EpMoe, MoeWeights, PruneSpec};
use occult_core::placement::{contiguous, random_balanced};
use occult_core::pruning::PruneRule;
use occult_core::ranks::RankSplit;
use occult_core::routing::RouterRule;
use occult_core::similarity::SimilarityTable;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const H: usize = 32;
const I: usize = 16;

struct Model {
    vars: Vec<Var>,
    w: MoeWeights,
}

fn randn(rng: &mut ChaCha8Rng, shape: &[usize], scale: f32) -> Var {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect();
    Var::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn model(e: usize, shared: bool, gated: bool, rng: &mut ChaCha8Rng) -> Model {
    let router = randn(rng, &[e, H], 0.5);
    let gate = randn(rng, &[e, I, H], 0.3);
    let up = randn(rng, &[e, I, H], 0.3);
    let down = randn(rng, &[e, H, I], 0.3);
    let mut vars = vec![router.clone(), gate.clone(), up.clone(), down.clone()];
    let shared = shared.then(|| {
        let s = [
            randn(rng, &[2 * I, H], 0.3),
            randn(rng, &[2 * I, H], 0.3),
            randn(rng, &[H, 2 * I], 0.3),
        ];
        let g = gated.then(|| randn(rng, &[1, H], 0.5));
        vars.extend(s.iter().cloned());
        vars.extend(g.iter().cloned());
        SharedExperts {
            gate_proj: s[0].as_tensor().clone(),
            up_proj: s[1].as_tensor().clone(),
            down_proj: s[2].as_tensor().clone(),
            gate: g.map(|g| g.as_tensor().clone()),
        }
    });
    let experts = SwigluStack::new(
        gate.as_tensor().clone(),
        up.as_tensor().clone(),
        down.as_tensor().clone(),
    )
    .unwrap();
    Model {
        w: MoeWeights {
            router: router.as_tensor().clone(),
            experts,
            shared,
        },
        vars,
    }
}

#[derive(Clone, Debug)]
struct Config {
    d: usize,
    e: usize,
    k: usize,
    random_placement: bool,
    shared: bool,
    renormalize: bool,
    tokens: Vec<usize>,
    mode: DispatchMode,
    prune: Option<(PruneRule, usize)>,
    seed: u64,
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// Max abs error within 1e-5 of the reference's scale. `floor` bounds the scale from below:
/// a gradient that vanishes mathematically (the router's under k = 1 with renormalisation) is
/// float noise on both sides.
fn assert_close_floor(name: &str, ours: &[f32], reference: &[f32], c: &Config, floor: f32) {
    assert_eq!(ours.len(), reference.len(), "{name}: lengths differ, {c:?}");
    let scale = max_abs(reference).max(floor);
    let err = ours
        .iter()
        .zip(reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        err / scale <= 1e-5,
        "{name}: max error {err} (scale {scale}) in {c:?}"
    );
}

fn assert_close(name: &str, ours: &[f32], reference: &[f32], c: &Config) {
    assert_close_floor(name, ours, reference, c, 1e-6)
}

/// Runs one configuration: forward and backward on D local ranks and on the reference, and
/// compares outputs, input gradients and parameter gradients (summed over ranks).
fn check(c: &Config) {
    let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
    let m = model(c.e, c.shared, c.shared && c.seed.is_multiple_of(2), &mut rng);
    let total: usize = c.tokens.iter().sum();
    let x_all: Vec<f32> = (0..total * H)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let g_all: Vec<f32> = (0..total * H)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let map = if c.random_placement {
        random_balanced(c.e, c.d, &mut rng)
    } else {
        contiguous(c.e, c.d)
    };
    let mut rule = RouterRule::softmax_topk(c.e, c.k, c.renormalize);
    rule.scaling_factor = if c.seed.is_multiple_of(3) { 2.5 } else { 1.0 };
    // The similarity table comes from the router logits of the batch itself.
    let similarity = {
        let x = Tensor::from_slice(&x_all, (total, H), &Device::Cpu).unwrap();
        let l = x.matmul(&m.w.router.t().unwrap()).unwrap();
        SimilarityTable::from_logits(&l.flatten_all().unwrap().to_vec1::<f32>().unwrap(), c.e)
            .unwrap()
    };
    let prune = c.prune.map(|(rule, max_devices)| PruneSpec {
        rule,
        max_devices,
        similarity: Some(similarity.clone()),
    });

    // Reference on all tokens.
    let x_ref = Var::from_slice(&x_all, (total, H), &Device::Cpu).unwrap();
    let out_ref = reference_forward(
        &m.w,
        &rule,
        x_ref.as_tensor(),
        prune.as_ref().map(|p| (p, map.as_slice(), c.d)),
    )
    .unwrap();
    let g = Tensor::from_slice(&g_all, (total, H), &Device::Cpu).unwrap();
    let grads_ref = (out_ref.clone() * &g)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();

    // EP on D ranks; rank r takes the next tokens[r] tokens.
    let starts: Vec<usize> = c
        .tokens
        .iter()
        .scan(0, |s, &n| {
            let at = *s;
            *s += n;
            Some(at)
        })
        .collect();
    let results = run_local(c.d, |comm| {
        let r = comm.rank();
        let (at, n) = (starts[r], c.tokens[r]);
        let layer = EpMoe::from_full(
            &m.w,
            rule.clone(),
            &map,
            comm.clone(),
            c.mode,
            prune.clone(),
        )?;
        let x = Var::from_slice(&x_all[at * H..(at + n) * H], (n, H), &Device::Cpu)?;
        let (out, stats) = layer.forward(x.as_tensor())?;
        let gr = Tensor::from_slice(&g_all[at * H..(at + n) * H], (n, H), &Device::Cpu)?;
        let grads = (out.clone() * gr)?.sum_all()?.backward()?;
        let gx = grads
            .get(x.as_tensor())
            .map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let gp: Vec<Option<Vec<f32>>> = m
            .vars
            .iter()
            .map(|v| {
                grads
                    .get(v.as_tensor())
                    .map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            })
            .collect();
        Ok((
            out.flatten_all()?.to_vec1::<f32>()?,
            gx,
            gp,
            stats,
            comm.stats(),
        ))
    });
    let results: Vec<_> = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{c:?}: {e}")))
        .collect();

    let out_ep: Vec<f32> = results.iter().flat_map(|r| r.0.clone()).collect();
    assert_close(
        "output",
        &out_ep,
        &out_ref.flatten_all().unwrap().to_vec1().unwrap(),
        c,
    );
    let gx_ref = grads_ref.get(x_ref.as_tensor()).map_or(vec![], |g| {
        g.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    });
    let gx_ep: Vec<f32> = results
        .iter()
        .zip(&c.tokens)
        .flat_map(|(r, &n)| r.1.clone().unwrap_or_else(|| vec![0.0; n * H]))
        .collect();
    assert_close("input gradient", &gx_ep, &gx_ref, c);
    for (i, v) in m.vars.iter().enumerate() {
        let reference = grads_ref
            .get(v.as_tensor())
            .map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let mut sum = vec![0.0f32; v.as_tensor().elem_count()];
        let mut any = false;
        for r in &results {
            if let Some(gp) = &r.2[i] {
                any = true;
                sum.iter_mut().zip(gp).for_each(|(s, g)| *s += g);
            }
        }
        match reference {
            Some(reference) => {
                assert!(
                    any || total == 0,
                    "parameter {i} got no gradient on any rank, {c:?}"
                );
                assert_close_floor(
                    &format!("gradient of parameter {i}"),
                    &sum,
                    &reference,
                    c,
                    1e-2,
                );
            }
            None => assert!(!any, "parameter {i}: gradient only under EP, {c:?}"),
        }
    }

    // Row counts: the layer's rows are the analysis core's (standard: k per token; occult:
    // C_T per token), and what the communicator counted.
    for (r, res) in results.iter().enumerate() {
        let stats = &res.3;
        let rows_expected = match c.mode {
            DispatchMode::Standard => stats.tokens * c.k,
            DispatchMode::Occult => stats.devices_touched,
        };
        assert_eq!(stats.rows_sent, rows_expected, "rank {r}, {c:?}");
        let comm = &res.4;
        // Exchanges: slot metadata, payload, combine (forward), then the backward ones.
        let row_bytes = (H + if c.mode == DispatchMode::Standard {
            1
        } else {
            c.k.min(c.e.div_ceil(c.d))
        }) * 4;
        let sent: u64 = comm.exchanges[1].bytes_to.iter().sum();
        assert_eq!(
            sent,
            (stats.rows_sent * row_bytes) as u64,
            "rank {r}, {c:?}"
        );
        let remote: u64 = comm.exchanges[1]
            .bytes_to
            .iter()
            .enumerate()
            .filter(|(p, _)| *p != r)
            .map(|(_, b)| b)
            .sum();
        assert_eq!(remote, (stats.remote_rows_sent * row_bytes) as u64);
    }
}

fn random_config(rng: &mut ChaCha8Rng, seed: u64) -> Config {
    let d = [1, 2, 3, 4, 8][rng.random_range(0..5)];
    let e = [8, 16, 64][rng.random_range(0..3)];
    let k = [1, 2, 4, 8][rng.random_range(0..4)];
    let mut tokens: Vec<usize> = (0..d).map(|_| rng.random_range(0..12)).collect();
    if d > 1 && rng.random_bool(0.3) {
        tokens[rng.random_range(0..d)] = 0;
    }
    let mode = if rng.random_bool(0.5) {
        DispatchMode::Occult
    } else {
        DispatchMode::Standard
    };
    let epd = e / d;
    let prune = (d > 1 && rng.random_bool(0.3)).then(|| {
        let n = (1..=d).find(|n| n * epd >= k).unwrap();
        let rule = if rng.random_bool(0.5) {
            PruneRule::Router
        } else {
            PruneRule::Similarity
        };
        (rule, n)
    });
    Config {
        d,
        e,
        k,
        random_placement: rng.random_bool(0.5),
        shared: rng.random_bool(0.5),
        renormalize: rng.random_bool(0.5),
        tokens,
        mode,
        prune,
        seed,
    }
}

#[test]
fn ep_forward_and_gradients_match_the_reference_on_random_configs() {
    let mut rng = ChaCha8Rng::seed_from_u64(2025);
    for seed in 0..48 {
        let c = random_config(&mut rng, seed);
        check(&c);
    }
}

#[test]
fn edge_cases() {
    let base = Config {
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
    };
    // A rank with no tokens, in both modes.
    check(&base);
    check(&Config {
        mode: DispatchMode::Standard,
        ..base.clone()
    });
    // Every rank without tokens.
    check(&Config {
        tokens: vec![0; 4],
        ..base.clone()
    });
    // E not divisible by D (devices hold 3 or 2 experts).
    check(&Config {
        d: 3,
        e: 8,
        k: 2,
        tokens: vec![4, 4, 4],
        ..base.clone()
    });
    // One expert per device, and D = 1.
    check(&Config {
        d: 8,
        e: 8,
        k: 8,
        tokens: vec![2; 8],
        ..base.clone()
    });
    check(&Config {
        d: 1,
        tokens: vec![9],
        ..base.clone()
    });
    // Pruning to one device with each rule.
    check(&Config {
        prune: Some((PruneRule::Router, 1)),
        ..base.clone()
    });
    check(&Config {
        prune: Some((PruneRule::Similarity, 1)),
        ..base.clone()
    });
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
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let m = model(e, false, false, &mut rng);
    let w = MoeWeights { router, ..m.w };
    let map = contiguous(e, 4);
    let reference = reference_forward(&w, &rule, &x, None)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let out = run_local(4, |comm| {
        let layer = EpMoe::from_full(
            &w,
            rule.clone(),
            &map,
            comm.clone(),
            DispatchMode::Occult,
            None,
        )?;
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
