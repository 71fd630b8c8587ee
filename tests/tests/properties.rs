//! Property tests over random sizes and routings: the bounds on C_T, row counts, valid balanced
//! placements, our search never worse than greedy, pruning invariants, and file round trips.

use occult_core::analysis::collab::{layer_stats, token_devices, total_devices, CoActivation};
use occult_core::analysis::placement::{
    capacities, contiguous, greedy, random_balanced, search, validate_map, Placement, SearchConfig,
};
use occult_core::analysis::pruning::{devices_of, PruneLimit, PruneRule, Pruner};
use occult_core::analysis::ranks::RankSplit;
use occult_core::analysis::routing::RouterRule;
use occult_core::analysis::similarity::SimilarityTable;
use occult_core::analysis::trace::{LayerTrace, Trace, TraceMeta};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A random problem: sizes, routing (with logits) and a random balanced placement.
#[derive(Debug, Clone)]
struct Case {
    e: usize,
    d: usize,
    k: usize,
    tokens: usize,
    logits: Vec<f32>,
    ids: Vec<u32>,
    map: Vec<u32>,
}

fn case(e: usize, d: usize, k: usize, tokens: usize, seed: u64, clustered: bool) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let rule = RouterRule::softmax_topk(e, k, false);
    let mut logits = Vec::with_capacity(tokens * e);
    let mut ids = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let c = rng.random_range(0..4usize);
        let row: Vec<f32> = (0..e)
            .map(|x| {
                let boost = if clustered && x % 4 == c { 2.0 } else { 0.0 };
                rng.random_range(-1.0f32..1.0) + boost
            })
            .collect();
        ids.extend(rule.route(&row).ids);
        logits.extend(row);
    }
    let map = random_balanced(e, d, &mut rng);
    Case {
        e,
        d,
        k,
        tokens,
        logits,
        ids,
        map,
    }
}

fn arb_case() -> impl Strategy<Value = Case> {
    (2usize..48, any::<u64>(), 0usize..150, any::<bool>()).prop_flat_map(
        |(e, seed, tokens, clustered)| {
            (1..=e, 1..=e.min(8)).prop_map(move |(d, k)| case(e, d, k, tokens, seed, clustered))
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn ct_bounds_and_row_counts(c in arb_case()) {
        let max_per_device = c.e.div_ceil(c.d);
        let lo = c.k.div_ceil(max_per_device);
        let hi = c.k.min(c.d);
        let mut sum = 0u64;
        for row in c.ids.chunks_exact(c.k) {
            let ct = token_devices(row, &c.map, c.d);
            prop_assert!(lo <= ct && ct <= hi, "C_T {} outside [{}, {}]", ct, lo, hi);
            sum += ct as u64;
        }
        let split = RankSplit::new(c.tokens, c.d);
        let s = layer_stats(0, &c.ids, c.k, &c.map, c.d, split, 7);
        prop_assert_eq!(s.rows_occult, sum);
        prop_assert_eq!(s.rows_occult, total_devices(&c.ids, c.k, &c.map, c.d));
        prop_assert_eq!(s.rows_standard, (c.tokens * c.k) as u64);
        prop_assert_eq!(s.ect_histogram.iter().sum::<u64>(), c.tokens as u64);
        prop_assert!(s.remote_rows_occult <= s.remote_rows_standard);
        prop_assert!(s.remote_rows_occult <= s.rows_occult);
        prop_assert_eq!(s.remote_bytes_occult, 7 * s.remote_rows_occult);
        // Each source rank sends exactly k standard rows per token it holds.
        for r in 0..c.d {
            let sent: u64 = s.link_rows_standard[r].iter().sum();
            prop_assert_eq!(sent, (split.len(r) * c.k) as u64);
        }
        prop_assert_eq!(s.device_load.iter().sum::<u64>(), (c.tokens * c.k) as u64);
        prop_assert_eq!(s.device_tokens.iter().sum::<u64>(), s.rows_occult);
    }

    #[test]
    fn placements_are_valid_and_ours_never_worse_than_greedy(c in arb_case(), restarts in 0usize..3) {
        let co = CoActivation::from_ids(&c.ids, c.k, c.e);
        validate_map(&contiguous(c.e, c.d), c.e, c.d).unwrap();
        let g = greedy(&co, c.d);
        validate_map(&g, c.e, c.d).unwrap();
        let cfg = SearchConfig { restarts, seed: 1, ..Default::default() };
        let ours = search(&c.ids, c.k, &co, c.d, &cfg).unwrap();
        validate_map(&ours.map, c.e, c.d).unwrap();
        let greedy_total = total_devices(&c.ids, c.k, &g, c.d);
        prop_assert_eq!(ours.greedy_total_devices, greedy_total);
        prop_assert_eq!(ours.total_devices, total_devices(&c.ids, c.k, &ours.map, c.d));
        prop_assert!(ours.total_devices <= greedy_total);
    }

    /// Node-limited pruning: k distinct experts on at most M nodes (and N devices in each),
    /// the choice kept when on one node, and refused only when the smallest M nodes
    /// (their smallest N devices) cannot hold k.
    #[test]
    fn node_limited_pruning_keeps_k_experts_on_at_most_m_nodes(
        c in arb_case(), g in 1usize..5, m in 1usize..4, n in proptest::option::of(1usize..3),
        similarity in any::<bool>()
    ) {
        prop_assume!(c.d % g == 0);
        let rule = RouterRule::softmax_topk(c.e, c.k, false);
        let sim = SimilarityTable::from_logits(&c.logits, c.e).unwrap();
        let which = if similarity { PruneRule::Similarity } else { PruneRule::Router };
        let limit = PruneLimit::Nodes { devices_per_node: g, max_nodes: m, devices_in_node: n };
        let caps = capacities(c.e, c.d);
        let mut rooms: Vec<usize> = caps
            .chunks(g)
            .map(|node| {
                let mut v = node.to_vec();
                v.sort_unstable();
                v.iter().take(n.unwrap_or(g)).sum()
            })
            .collect();
        rooms.sort_unstable();
        let room: usize = rooms.iter().take(m).sum();
        let pruner = Pruner::with_limit(which, &rule, &c.map, c.d, limit, Some(&sim));
        if room < c.k {
            prop_assert!(pruner.is_err());
            return Ok(());
        }
        let pruner = pruner.unwrap();
        let spread = |ids: &[u32]| {
            let mut per_node = vec![0usize; c.d / g];
            let mut devs: Vec<u32> = ids.iter().map(|&x| c.map[x as usize]).collect();
            devs.sort_unstable();
            devs.dedup();
            devs.iter().for_each(|&d| per_node[d as usize / g] += 1);
            let nodes = per_node.iter().filter(|&&x| x > 0).count();
            (nodes, per_node.into_iter().max().unwrap_or(0))
        };
        for (t, before) in c.ids.chunks_exact(c.k).enumerate() {
            let logits = &c.logits[t * c.e..(t + 1) * c.e];
            let s = pruner.prune_logits(logits, before);
            let mut sorted = s.ids.clone();
            sorted.sort_unstable();
            sorted.dedup();
            prop_assert_eq!(sorted.len(), c.k, "not k distinct experts: {:?}", s.ids);
            let (nodes, most) = spread(&s.ids);
            prop_assert!(nodes <= m, "{} nodes", nodes);
            prop_assert!(n.is_none_or(|n| most <= n), "{} devices in a node", most);
            // A token on one node keeps its choice (its node is the best); one within M nodes
            // may not (DeepSeek-V3 keeps the M best nodes, which need not be its own).
            let (nodes0, most0) = spread(before);
            if nodes0 <= 1 && n.is_none_or(|n| most0 <= n) {
                prop_assert_eq!(&s.ids, &before.to_vec());
            }
        }
    }

    #[test]
    fn pruning_keeps_k_distinct_experts_on_at_most_n_devices(
        c in arb_case(), n in 1usize..6, renormalize in any::<bool>(), similarity in any::<bool>()
    ) {
        let rule = RouterRule::softmax_topk(c.e, c.k, renormalize);
        let sim = SimilarityTable::from_logits(&c.logits, c.e).unwrap();
        let which = if similarity { PruneRule::Similarity } else { PruneRule::Router };
        let mut caps = capacities(c.e, c.d);
        caps.sort_unstable();
        let room: usize = caps.iter().take(n).sum();
        let pruner = Pruner::new(which, &rule, &c.map, c.d, n, Some(&sim));
        if room < c.k {
            prop_assert!(pruner.is_err());
            return Ok(());
        }
        let pruner = pruner.unwrap();
        for (t, before) in c.ids.chunks_exact(c.k).enumerate() {
            let logits = &c.logits[t * c.e..(t + 1) * c.e];
            let s = pruner.prune_logits(logits, before);
            let mut sorted = s.ids.clone();
            sorted.sort_unstable();
            sorted.dedup();
            prop_assert_eq!(sorted.len(), c.k, "not k distinct experts: {:?}", s.ids);
            prop_assert!(devices_of(&s.ids, &c.map) <= n);
            // Each kept expert's own softmax probability, renormalised over the k when asked.
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
            let p: Vec<f64> = s.ids.iter().map(|&x| ((logits[x as usize] - max) as f64).exp() / z).collect();
            let norm: f64 = if renormalize { p.iter().sum() } else { 1.0 };
            for (w, p) in s.weights.iter().zip(&p) {
                prop_assert!((*w as f64 - p / norm).abs() < 1e-5, "weight {} vs {}", w, p / norm);
            }
            if n >= c.d || devices_of(before, &c.map) <= n {
                prop_assert_eq!(&s.ids, &before.to_vec());
            }
            // The kept devices are the first n seen in rank order; experts on them stay chosen.
            let mut kept: Vec<u32> = Vec::new();
            for &x in before {
                let dv = c.map[x as usize];
                if !kept.contains(&dv) && kept.len() < n {
                    kept.push(dv);
                }
            }
            for &x in before.iter().filter(|&&x| kept.contains(&c.map[x as usize])) {
                prop_assert!(s.ids.contains(&x), "expert {} on a kept device was dropped", x);
            }
        }
    }

    #[test]
    fn trace_and_placement_files_round_trip(c in arb_case(), with_logits in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let weights: Vec<f32> = (0..c.tokens * c.k).map(|i| i as f32 * 0.25).collect();
        let trace = Trace {
            meta: TraceMeta {
                num_experts: c.e,
                top_k: c.k,
                model: Some("m".into()),
                data: Some("d".into()),
                num_ranks: Some(c.d),
                extra: [("note".to_string(), "x".to_string())].into_iter().collect(),
            },
            layers: vec![
                LayerTrace {
                    layer: 3,
                    tokens: c.tokens,
                    topk_ids: c.ids.clone(),
                    topk_weights: Some(weights),
                    router_logits: with_logits.then(|| c.logits.clone()),
                },
                LayerTrace {
                    layer: 11,
                    tokens: c.tokens,
                    topk_ids: c.ids.clone(),
                    topk_weights: None,
                    router_logits: None,
                },
            ],
        };
        let p = dir.path().join("t.safetensors");
        if c.tokens == 0 {
            // A layer without tokens is refused, on writing as on reading.
            prop_assert!(trace.write(&p).is_err());
            prop_assert!(!p.exists());
            return Ok(());
        }
        trace.write(&p).unwrap();
        prop_assert_eq!(Trace::read(&p).unwrap(), trace);

        let mut pl = Placement::uniform(&[3, 11], c.map.clone(), c.d, "random");
        pl.source.insert("seed".into(), 5.into());
        let q = dir.path().join("p.json");
        pl.write(&q).unwrap();
        prop_assert_eq!(Placement::read(&q).unwrap(), pl);
    }
}
