//! Whole-trace drivers behind the `occult collab`, `place` and `prune` commands: they apply the
//! per-layer functions of [`crate::analysis::collab`], [`crate::analysis::placement`] and
//! [`crate::analysis::pruning`] to every layer of a trace (layers in parallel) and gather the
//! results.

use crate::analysis::collab::{layer_stats, token_weighted_mean, total_devices, LayerStats};
use crate::analysis::placement::{
    self, LayerPlacement, Method, Placement, PlacementMetrics, SearchConfig,
};
use crate::analysis::pruning::{changed_choices, PruneLimit, PruneRule, Pruner};
use crate::analysis::ranks::RankSplit;
use crate::analysis::routing::{LayerRouters, RouterRule};
use crate::analysis::similarity::{SimilarityAccumulator, SimilarityTable};
use crate::analysis::trace::{LayerTrace, Trace};
use crate::{bail, Error, Result};
use rayon::prelude::*;
use serde::Serialize;

/// The source-rank split of a layer's tokens over `num_devices` devices. A trace that records
/// `num_ranks` must agree with the device count, unless `resplit` asks to split it anew.
pub fn source_split(
    trace: &Trace,
    tokens: usize,
    num_devices: usize,
    resplit: bool,
) -> Result<RankSplit> {
    match trace.meta.num_ranks {
        Some(r) if r != num_devices && !resplit => bail!(
            "the trace was recorded on {r} source rank(s), but the placement has {num_devices} \
             devices; pass --resplit to split its tokens evenly over {num_devices} ranks instead"
        ),
        _ => Ok(RankSplit::new(tokens, num_devices)),
    }
}

/// Checks that a placement covers a trace: same expert count, every traced layer present.
pub fn check_placement_fits(trace: &Trace, p: &Placement) -> Result<()> {
    if p.num_experts != trace.meta.num_experts {
        bail!(
            "the placement is for {} experts, the trace has {}",
            p.num_experts,
            trace.meta.num_experts
        );
    }
    for l in &trace.layers {
        p.covers(l.layer)?;
    }
    Ok(())
}

/// `f(layer, its map, its source split)` for every layer of a trace that `placement` fits, in
/// parallel.
pub(crate) fn per_layer<T: Send>(
    trace: &Trace,
    placement: &Placement,
    resplit: bool,
    f: impl Fn(&LayerTrace, &[u32], RankSplit) -> T + Sync,
) -> Result<Vec<T>> {
    check_placement_fits(trace, placement)?;
    let d = placement.num_devices;
    trace
        .layers
        .par_iter()
        .map(|l| {
            let split = source_split(trace, l.tokens, d, resplit)?;
            Ok(f(l, placement.layer(l.layer)?, split))
        })
        .collect()
}

/// Statistics of every layer of a trace under a placement.
#[derive(Clone, Debug, Serialize)]
pub struct TraceStats {
    pub num_experts: usize,
    pub top_k: usize,
    pub num_devices: usize,
    pub row_bytes: u64,
    /// E[C_T] over all (layer, token) pairs: the token-weighted mean of the layers'.
    pub mean_ect: f64,
    /// E[C_T] that uniform-random routing would give (no locality), for reference.
    pub uniform_ect: f64,
    pub layers: Vec<LayerStats>,
}

/// Computes [`TraceStats`].
pub fn trace_stats(
    trace: &Trace,
    placement: &Placement,
    row_bytes: u64,
    resplit: bool,
) -> Result<TraceStats> {
    let d = placement.num_devices;
    let k = trace.meta.top_k;
    let layers = per_layer(trace, placement, resplit, |l, map, split| {
        layer_stats(l.layer, &l.topk_ids, k, map, d, split, row_bytes)
    })?;
    Ok(TraceStats {
        num_experts: trace.meta.num_experts,
        top_k: k,
        num_devices: d,
        row_bytes,
        mean_ect: token_weighted_mean(layers.iter().map(|s| (s.ect, s.tokens))),
        uniform_ect: crate::analysis::collab::uniform_ect(trace.meta.num_experts, k, d),
        layers,
    })
}

/// What placing one layer found, beyond the map.
#[derive(Clone, Debug, Serialize)]
pub struct PlaceInfo {
    pub layer: usize,
    pub tokens: usize,
    pub ect: f64,
    /// E[C_T] of the paper's greedy map on the same layer (occult method only).
    pub greedy_ect: Option<f64>,
    /// Which start won (occult method only).
    pub start: Option<String>,
    pub swaps: Option<usize>,
    /// E[C_N], distinct nodes per token, when placed for nodes ([`SearchConfig::nodes`]).
    pub ecn: Option<f64>,
}

/// Progress steps [`place_trace`] reports for each layer ([`Method::progress_steps`]).
pub fn place_steps_per_layer(method: Method, cfg: &SearchConfig) -> usize {
    method.progress_steps(cfg)
}

/// Places every layer of a trace with one method, calling `on_step`
/// [`place_steps_per_layer`] times per layer as the work goes.
pub fn place_trace(
    trace: &Trace,
    num_devices: usize,
    method: Method,
    cfg: &SearchConfig,
    on_step: &(dyn Fn() + Sync),
) -> Result<(Placement, Vec<PlaceInfo>)> {
    let (e, k) = (trace.meta.num_experts, trace.meta.top_k);
    placement::check_sizes(e, num_devices)?;
    if cfg.max_load_factor.is_some() && method != Method::Occult {
        bail!(
            "--max-load-factor is honoured by the occult method only, not {}",
            method.name()
        );
    }
    if let Some(level) = &cfg.nodes {
        if method != Method::Occult {
            bail!(
                "placing for nodes (--devices-per-node) is done by the occult method only, not {}",
                method.name()
            );
        }
        level.check(num_devices)?;
    }
    let placed = trace
        .layers
        .par_iter()
        .map(|l| place_layer(l, k, e, num_devices, method, cfg, on_step))
        .collect::<Result<Vec<_>>>()?;
    let (layers, infos): (Vec<_>, Vec<_>) = placed.into_iter().unzip();
    let mut p = Placement {
        format: placement::PLACEMENT_FORMAT.into(),
        num_experts: e,
        num_devices,
        method: method.name().into(),
        source: Default::default(),
        layers,
    };
    let stats = trace_stats(trace, &p, 0, true)?;
    for (lp, s) in p.layers.iter_mut().zip(&stats.layers) {
        lp.metrics = Some(PlacementMetrics {
            ect: s.ect,
            intra_ratio: s.intra_ratio,
            max_load_ratio: s.max_load_ratio,
        });
    }
    Ok((p, infos))
}

/// One map for every layer of `trace`, as an engine that takes a single expert-to-device map
/// needs (vLLM #34811): every layer's tokens searched as one layer, so the map minimises
/// E[C_T] summed over the layers; each layer's figures under it.
pub fn place_trace_shared(
    trace: &Trace,
    num_devices: usize,
    method: Method,
    cfg: &SearchConfig,
    on_step: &(dyn Fn() + Sync),
) -> Result<(Placement, Vec<PlaceInfo>)> {
    let Some(first) = trace.layers.first() else {
        bail!("the trace has no layers");
    };
    let merged = LayerTrace {
        layer: first.layer,
        tokens: trace.layers.iter().map(|l| l.tokens).sum(),
        topk_ids: trace
            .layers
            .iter()
            .flat_map(|l| l.topk_ids.iter().copied())
            .collect(),
        topk_weights: None,
        router_logits: None,
    };
    let one = Trace {
        meta: trace.meta.clone(),
        layers: vec![merged],
    };
    let (shared, _) = place_trace(&one, num_devices, method, cfg, on_step)?;
    let map = shared.layers[0].device_of_expert.clone();
    let mut p = Placement::uniform(&trace.layer_ids(), map.clone(), num_devices, method.name());
    let stats = trace_stats(trace, &p, 0, true)?;
    let mut infos = Vec::with_capacity(stats.layers.len());
    for ((lp, s), l) in p.layers.iter_mut().zip(&stats.layers).zip(&trace.layers) {
        lp.metrics = Some(PlacementMetrics {
            ect: s.ect,
            intra_ratio: s.intra_ratio,
            max_load_ratio: s.max_load_ratio,
        });
        infos.push(PlaceInfo {
            layer: l.layer,
            tokens: l.tokens,
            ect: s.ect,
            greedy_ect: None,
            start: Some("shared".into()),
            swaps: None,
            ecn: cfg.nodes.map(|n| {
                let nodes = placement::devices_and_nodes(
                    &l.topk_ids,
                    trace.meta.top_k,
                    &map,
                    num_devices,
                    n.devices_per_node,
                )
                .1;
                nodes as f64 / l.tokens.max(1) as f64
            }),
        });
    }
    Ok((p, infos))
}

/// Every layer of `trace` placed by the occult method with each of the model's `groups` expert
/// groups kept whole ([`placement::groups`]), for a group-limited model (DeepSeek-V2/V3,
/// Kimi-K2, GLM-4.5): the placement, each layer's figures and the layout the groups took.
pub fn place_trace_groups(
    trace: &Trace,
    num_devices: usize,
    groups: usize,
    cfg: &SearchConfig,
    on_step: &(dyn Fn() + Sync),
) -> Result<(Placement, Vec<PlaceInfo>, placement::groups::GroupLayout)> {
    let (e, k) = (trace.meta.num_experts, trace.meta.top_k);
    let layout = placement::groups::layout_of(e, num_devices, groups)?;
    let placed = trace
        .layers
        .par_iter()
        .map(|l| {
            let out = placement::groups::place_groups_whole(
                &l.topk_ids,
                k,
                e,
                num_devices,
                groups,
                cfg,
                on_step,
            )
            .map_err(|err| Error::invalid(format!("layer {}: {err}", l.layer)))?;
            let per_token = |total: u64| total as f64 / l.tokens.max(1) as f64;
            let map = out.map;
            let info = PlaceInfo {
                layer: l.layer,
                tokens: l.tokens,
                ect: per_token(total_devices(&l.topk_ids, k, &map, num_devices)),
                greedy_ect: None,
                start: Some(
                    out.search
                        .as_ref()
                        .map_or("groups whole".into(), |s| s.start.clone()),
                ),
                swaps: out.search.as_ref().map(|s| s.swaps),
                ecn: cfg.nodes.map(|n| {
                    let nodes = placement::devices_and_nodes(
                        &l.topk_ids,
                        k,
                        &map,
                        num_devices,
                        n.devices_per_node,
                    );
                    per_token(nodes.1)
                }),
            };
            Ok((LayerPlacement::partition(l.layer, map), info))
        })
        .collect::<Result<Vec<_>>>()?;
    let (layers, infos): (Vec<_>, Vec<_>) = placed.into_iter().unzip();
    let mut p = Placement {
        format: placement::PLACEMENT_FORMAT.into(),
        num_experts: e,
        num_devices,
        method: Method::Occult.name().into(),
        source: Default::default(),
        layers,
    };
    p.source.insert("expert_groups".into(), groups.into());
    p.source
        .insert("groups_layout".into(), layout.name().into());
    let stats = trace_stats(trace, &p, 0, true)?;
    for (lp, st) in p.layers.iter_mut().zip(&stats.layers) {
        lp.metrics = Some(PlacementMetrics {
            ect: st.ect,
            intra_ratio: st.intra_ratio,
            max_load_ratio: st.max_load_ratio,
        });
    }
    p.validate()?;
    Ok((p, infos, layout))
}

fn place_layer(
    l: &LayerTrace,
    k: usize,
    e: usize,
    d: usize,
    method: Method,
    cfg: &SearchConfig,
    on_step: &(dyn Fn() + Sync),
) -> Result<(LayerPlacement, PlaceInfo)> {
    let per_token = |total: u64| {
        if l.tokens == 0 {
            0.0
        } else {
            total as f64 / l.tokens as f64
        }
    };
    let (map, search) = method
        .place(&l.topk_ids, k, e, d, cfg, on_step)
        .map_err(|err| Error::invalid(format!("layer {}: {err}", l.layer)))?;
    let greedy_ect = search.as_ref().map(|s| per_token(s.greedy_total_devices));
    let (start, swaps) = search.map(|s| (s.start, s.swaps)).unzip();
    let ect = per_token(total_devices(&l.topk_ids, k, &map, d));
    let ecn = cfg.nodes.map(|n| {
        per_token(placement::devices_and_nodes(&l.topk_ids, k, &map, d, n.devices_per_node).1)
    });
    Ok((
        LayerPlacement::partition(l.layer, map),
        PlaceInfo {
            layer: l.layer,
            tokens: l.tokens,
            ect,
            greedy_ect,
            start,
            swaps,
            ecn,
        },
    ))
}

/// Per-layer outcome of pruning.
#[derive(Clone, Debug, Serialize)]
pub struct PruneLayer {
    pub layer: usize,
    pub ect_before: f64,
    pub ect_after: f64,
    /// Share of (token, expert) choices that changed.
    pub changed_fraction: f64,
}

/// Outcome of pruning a whole trace.
#[derive(Clone, Debug, Serialize)]
pub struct PruneReport {
    pub rule: PruneRule,
    /// The limit: devices, or nodes (and devices in each).
    pub limit: PruneLimit,
    /// The most devices a pruned token spans under it.
    pub max_devices: usize,
    pub num_devices: usize,
    pub ect_before: f64,
    pub ect_after: f64,
    pub changed_fraction: f64,
    pub layers: Vec<PruneLayer>,
}

/// Similarity table of one layer from the router logits of a (calibration) trace.
pub fn layer_similarity(trace: &Trace, layer: usize) -> Result<SimilarityTable> {
    let l = trace
        .layer(layer)
        .ok_or_else(|| Error::invalid(format!("the calibration trace has no layer {layer}")))?;
    let logits = l.router_logits.as_ref().ok_or_else(|| {
        Error::invalid(format!(
            "layer {layer} of the calibration trace has no router logits"
        ))
    })?;
    let mut acc = SimilarityAccumulator::new(trace.meta.num_experts);
    acc.add(logits)?;
    Ok(acc.finish())
}

/// Checks that each layer's router rule reproduces the gate weights a trace recorded, on its
/// first tokens.
pub fn check_router_matches(trace: &Trace, routers: &LayerRouters) -> Result<()> {
    for l in &trace.layers {
        let (Some(logits), Some(w)) = (&l.router_logits, &l.topk_weights) else {
            continue;
        };
        let router = routers.of(l.layer);
        let (e, k) = (trace.meta.num_experts, trace.meta.top_k);
        for t in 0..l.tokens.min(16) {
            let ids = l.ids(t, k);
            let ours = router.gate_weights(&router.scores(&logits[t * e..(t + 1) * e]), ids);
            let theirs = &w[t * k..(t + 1) * k];
            for (a, b) in ours.iter().zip(theirs) {
                // Loose enough for weights that the model applied in bf16 (8 mantissa bits).
                if (a - b).abs() > 1e-2 * b.abs() + 1e-4 {
                    bail!(
                        "the router rule ({}) does not reproduce the trace's gate weights at \
                         layer {} token {t} (trace {b}, rule {a}); check --renormalize, \
                         --scoring and --scaling-factor",
                        describe_rule(&router),
                        l.layer
                    );
                }
            }
        }
    }
    Ok(())
}

fn describe_rule(r: &RouterRule) -> String {
    format!(
        "scoring {:?}, renormalize {}, scaling factor {}",
        r.scoring, r.renormalize, r.scaling_factor
    )
}

/// Checks that a token's traced experts are what its router logits choose, best first: in
/// non-increasing order of selection score, and (without group limits or a selection bias,
/// which a trace does not hold) no unchosen expert scoring above a chosen one. Scores are
/// compared with a tolerance for models that routed in bf16.
fn check_traced_choice(
    router: &RouterRule,
    logits: &[f32],
    ids: &[u32],
) -> std::result::Result<(), String> {
    let choice = router.selection_scores(&router.scores(logits));
    let close = |a: f32, b: f32| a >= b - (1e-3 * a.abs().max(b.abs()) + 1e-6);
    for w in ids.windows(2) {
        if !close(choice[w[0] as usize], choice[w[1] as usize]) {
            return Err(format!(
                "are not best first (expert {} scores {} after expert {} at {})",
                w[1], choice[w[1] as usize], w[0], choice[w[0] as usize]
            ));
        }
    }
    if router.group_limit.is_none() && router.selection_bias.is_none() {
        let worst = ids
            .iter()
            .map(|&i| choice[i as usize])
            .fold(f32::INFINITY, f32::min);
        if let Some((j, &best)) = choice
            .iter()
            .enumerate()
            .filter(|(j, _)| !ids.contains(&(*j as u32)))
            .max_by(|a, b| a.1.total_cmp(b.1))
        {
            if !close(worst, best) {
                return Err(format!(
                    "are not the top-{} of the router logits (expert {j} scores {best}, above \
                     the chosen {worst})",
                    ids.len()
                ));
            }
        }
    }
    Ok(())
}

/// Prunes every layer of a trace to at most `max_devices` devices per token; returns the
/// rewritten trace and the report. The similarity rule takes its tables from `calibration` (or
/// from the trace itself).
pub fn prune_trace(
    trace: &Trace,
    placement: &Placement,
    router: &RouterRule,
    rule: PruneRule,
    max_devices: usize,
    calibration: Option<&Trace>,
    on_layer: &(dyn Fn() + Sync),
) -> Result<(Trace, PruneReport)> {
    let limit = PruneLimit::Devices(max_devices);
    let routers = LayerRouters::same(router.clone());
    prune_trace_to(
        trace,
        placement,
        &routers,
        rule,
        limit,
        calibration,
        on_layer,
    )
}

/// [`prune_trace`] under any [`PruneLimit`] (such as a node limit), each layer under its own
/// router rule.
pub fn prune_trace_to(
    trace: &Trace,
    placement: &Placement,
    routers: &LayerRouters,
    rule: PruneRule,
    limit: PruneLimit,
    calibration: Option<&Trace>,
    on_layer: &(dyn Fn() + Sync),
) -> Result<(Trace, PruneReport)> {
    check_placement_fits(trace, placement)?;
    let (e, k) = (trace.meta.num_experts, trace.meta.top_k);
    let router = &routers.rule;
    if router.num_experts != e || router.top_k != k {
        bail!(
            "the router rule is for {} experts top-{}, the trace has {e} experts top-{k}",
            router.num_experts,
            router.top_k
        );
    }
    let calibration = calibration.unwrap_or(trace);
    if calibration.meta.num_experts != e {
        bail!(
            "the calibration trace has {} experts, the trace {e}",
            calibration.meta.num_experts
        );
    }
    let d = placement.num_devices;
    let results = trace
        .layers
        .par_iter()
        .map(|l| {
            let logits = l.router_logits.as_ref().ok_or_else(|| {
                Error::invalid(format!(
                    "layer {} has no router logits; pruning needs the full router scores \
                     (record them with `occult profile`, or `occult trace synth` without \
                     --no-logits)",
                    l.layer
                ))
            })?;
            let map = placement.layer(l.layer)?;
            let router = routers.of(l.layer);
            let router = router.as_ref();
            let sim = match rule {
                PruneRule::Similarity => Some(layer_similarity(calibration, l.layer)?),
                PruneRule::Router => None,
            };
            let pruner = Pruner::with_limit(rule, router, map, d, limit, sim.as_ref())?;
            let mut ids = Vec::with_capacity(l.topk_ids.len());
            let mut weights = Vec::with_capacity(l.topk_ids.len());
            let mut changed = 0usize;
            for t in 0..l.tokens {
                let before = l.ids(t, k);
                let token_logits = &logits[t * e..(t + 1) * e];
                check_traced_choice(router, token_logits, before).map_err(|why| {
                    Error::invalid(format!(
                        "layer {} token {t}: the traced experts {before:?} {why}; pruning \
                         re-picks from the logits, so they must agree",
                        l.layer
                    ))
                })?;
                let s = pruner.prune_logits(token_logits, before);
                changed += changed_choices(before, &s.ids);
                ids.extend_from_slice(&s.ids);
                weights.extend_from_slice(&s.weights);
            }
            let per_token = |x: u64| x as f64 / l.tokens.max(1) as f64;
            let report = PruneLayer {
                layer: l.layer,
                ect_before: per_token(total_devices(&l.topk_ids, k, map, d)),
                ect_after: per_token(total_devices(&ids, k, map, d)),
                changed_fraction: changed as f64 / (l.tokens * k).max(1) as f64,
            };
            on_layer();
            Ok((
                LayerTrace {
                    layer: l.layer,
                    tokens: l.tokens,
                    topk_ids: ids,
                    topk_weights: Some(weights),
                    router_logits: l.router_logits.clone(),
                },
                report,
                changed,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let total_choices: usize = trace.layers.iter().map(|l| l.tokens * k).sum();
    let total_changed: usize = results.iter().map(|r| r.2).sum();
    let layers: Vec<PruneLayer> = results.iter().map(|r| r.1.clone()).collect();
    let tokens: Vec<usize> = trace.layers.iter().map(|l| l.tokens).collect();
    let weighted = |f: fn(&PruneLayer) -> f64| {
        token_weighted_mean(layers.iter().map(f).zip(tokens.iter().copied()))
    };
    let max_devices = match limit {
        PruneLimit::Devices(n) => n.min(d),
        PruneLimit::Nodes {
            devices_per_node: g,
            max_nodes,
            devices_in_node,
        } => (max_nodes * devices_in_node.unwrap_or(g)).min(d),
    };
    let report = PruneReport {
        rule,
        limit,
        max_devices,
        num_devices: d,
        ect_before: weighted(|l| l.ect_before),
        ect_after: weighted(|l| l.ect_after),
        changed_fraction: total_changed as f64 / total_choices.max(1) as f64,
        layers,
    };
    let mut meta = trace.meta.clone();
    meta.extra.insert(
        "pruned".into(),
        format!("rule={} limit={}", rule.name(), limit.label()),
    );
    let pruned = Trace {
        meta,
        layers: results.into_iter().map(|r| r.0).collect(),
    };
    Ok((pruned, report))
}

#[cfg(test)]
mod shared_tests {
    use super::*;
    use crate::analysis::synth::{synth_trace, SynthConfig};

    /// One map for every layer: the same map in each, its summed E[C_T] no worse than the
    /// contiguous map's (one of the search's starts on the merged layer), and each layer's
    /// figure the one counted under it.
    #[test]
    fn a_shared_map_is_one_map_bounded_by_the_per_layer_search() {
        let cfg = SynthConfig {
            layers: 3,
            num_experts: 16,
            top_k: 4,
            ..SynthConfig::olmoe_like(600, 5)
        };
        let trace = synth_trace(&cfg, &|| ()).unwrap();
        let search = SearchConfig::default();
        let (shared, infos) =
            place_trace_shared(&trace, 4, Method::Occult, &search, &|| ()).unwrap();
        assert!(shared
            .layers
            .iter()
            .all(|l| l.device_of_expert == shared.layers[0].device_of_expert));
        let sum = |p: &Placement| -> f64 {
            trace_stats(&trace, p, 0, true)
                .unwrap()
                .layers
                .iter()
                .map(|l| l.ect)
                .sum()
        };
        let contiguous = Placement::uniform(
            &trace.layer_ids(),
            placement::contiguous(16, 4),
            4,
            "contiguous",
        );
        assert!(sum(&shared) <= sum(&contiguous) + 1e-9);
        let listed: f64 = infos.iter().map(|i| i.ect).sum();
        assert!((listed - sum(&shared)).abs() < 1e-9);
    }
}
