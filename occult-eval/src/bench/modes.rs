//! One run's figures over all ranks, for every expert-parallel benchmark (a layer, a model's
//! prefill and decode, a training step): each rank's measurements ([`RankRun`]), the one
//! aggregator ([`summarise`]) that makes them a [`ModeSummary`] under the run's key
//! (traffic and E[C_T] summed, times the slowest rank's, projected onto a link profile), the
//! single-device reference's row, and the table with each run's ratios to standard dispatch.
//! Which runs a benchmark makes is [`occult_core::analysis::run_key::runs`]'s answer.

use occult_core::analysis::cost::links::{project_step, LinkProfile, Projection, RankStep};
use occult_core::analysis::run_key::{DispatchMode, MoeMode, RunKey};
use occult_core::ep::comm::Exchange;
use occult_core::ep::StepStats;
use serde::{Deserialize, Serialize};

/// One rank's measurements of one mode.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RankRun {
    pub rank: usize,
    /// The measured step: the mean forward of a layer, the best prefill of the repeats, or a
    /// training step.
    pub seconds: f64,
    /// The mean decode step time of that repeat's decode (0 when none).
    pub decode_step_s: f64,
    /// The step's EP statistics, summed over MoE layers.
    pub stats: StepStats,
    /// The step's all-to-alls, in order.
    pub exchanges: Vec<Exchange>,
    /// Expert FLOPs of the step on this rank.
    pub flops: f64,
    /// The last decode step's EP statistics, all-to-alls and expert FLOPs (empty without
    /// decode).
    pub decode_stats: StepStats,
    pub decode_exchanges: Vec<Exchange>,
    pub decode_flops: f64,
    /// The measured step's time outside exchanges (its own compute), for profiles of the
    /// machine the bench runs on (`measured_compute`); 0 where not recorded.
    #[serde(default)]
    pub local_s: f64,
}

/// What a [`RankRun`]'s exchanges are, which says which of them carry hidden-state rows (projected
/// in the link profile's activation size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exchanges {
    /// One EP layer's forward: the layer's exchanges, which carry rows where the pattern
    /// ([`DispatchMode::forward_exchanges`]) says so.
    LayerForward(&'static [bool]),
    /// A model's forward: the lockstep announcement, then per MoE layer the layer's exchanges.
    ModelForward(&'static [bool]),
    /// Every exchange projected as measured (f32): a training step.
    Measured,
}

impl Exchanges {
    /// One layer forward of `mode`.
    pub fn layer(mode: DispatchMode) -> Self {
        Exchanges::LayerForward(mode.forward_exchanges())
    }

    /// A model forward in `mode`.
    pub fn model(mode: DispatchMode) -> Self {
        Exchanges::ModelForward(mode.forward_exchanges())
    }

    /// The indices of the exchanges that carry rows, of `n`.
    fn rows(self, n: usize) -> Vec<usize> {
        let carries = |p: &[bool], j: usize| p[j % p.len()];
        match self {
            Exchanges::LayerForward(p) => (0..n).filter(|&j| carries(p, j)).collect(),
            Exchanges::ModelForward(p) => (1..n).filter(|&j| carries(p, j - 1)).collect(),
            Exchanges::Measured => Vec::new(),
        }
    }

    fn is_layer(self) -> bool {
        matches!(self, Exchanges::LayerForward(_))
    }
}

/// The dispatch of an expert-parallel benchmark run (every run of
/// [`occult_core::analysis::run_key::runs`] is one).
pub fn ep_dispatch(key: &RunKey) -> DispatchMode {
    key.dispatch()
        .expect("a benchmark's runs are expert-parallel, never the reference")
}

/// The node size a benchmark of `devices` ranks runs the two-level exchange with: the one
/// given (`--devices-per-node`), else the link profile's ranks per node when its link between
/// nodes is the slower; `None` when that is one node.
pub fn node_size(
    given: Option<usize>,
    link: Option<&LinkProfile>,
    devices: usize,
) -> Option<usize> {
    given
        .or_else(|| link.filter(|p| p.nodes_slower()).map(|p| p.ranks_per_node))
        .filter(|&g| g >= 1 && g < devices)
}

/// A decode step's figures (model benchmarks).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DecodeSummary {
    /// The slowest rank's decode step (one token for each of its sequences).
    pub decode_ms_per_token: f64,
    /// With a link profile: the projected decode step.
    pub decode_projected_s: Option<f64>,
    /// The decode step's traffic and E[C_T] (the last step's).
    pub decode_rows_sent: usize,
    pub decode_bytes_sent: u64,
    pub decode_ect: f64,
}

/// The experts' compute rate (layer benchmark).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExpertRate {
    /// The experts' FLOPs (every rank's pairs).
    pub expert_flops: f64,
    /// The expert compute rate of the rank whose compute stage was slowest (its FLOPs over
    /// that stage), in FLOP per second per device.
    pub expert_flops_per_s: f64,
}

/// One run's figures over all ranks (as a bench's JSON holds it, and reads back).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModeSummary {
    /// What the run is: its mode, pruning and copy rule.
    #[serde(rename = "run")]
    pub key: RunKey,
    /// The key's label (its `Display`), for people and scripts.
    pub mode: String,
    pub devices: usize,
    /// Tokens of the step over all ranks.
    pub tokens: usize,
    pub rows_sent: usize,
    pub remote_rows_sent: usize,
    /// With a node size: the dispatch's rows over links within a node and across nodes, and
    /// E[C_N] (0 without one).
    pub intra_node_rows: usize,
    pub inter_node_rows: usize,
    pub ecn: f64,
    /// Bytes sent to other ranks during the step (dispatch metadata, rows, combine).
    pub bytes_sent: u64,
    pub ect: f64,
    /// The slowest rank's step.
    pub seconds: f64,
    pub tokens_per_s: f64,
    /// Each EP stage's slowest rank (summed over MoE layers); stages include waiting for
    /// peers.
    pub route_s: f64,
    pub plan_s: f64,
    pub dispatch_s: f64,
    pub compute_s: f64,
    pub combine_s: f64,
    /// With a link profile: the projected step and its parts.
    pub projected_seconds: Option<f64>,
    pub projected: Option<Projection>,
    #[serde(flatten)]
    pub decode: Option<DecodeSummary>,
    #[serde(flatten)]
    pub expert: Option<ExpertRate>,
}

/// E[C_T] of ranks' statistics: token-layer pairs on both sides, so the mean over MoE layers.
fn ect<'a>(stats: impl Iterator<Item = &'a StepStats> + Clone) -> f64 {
    let touched: usize = stats.clone().map(|s| s.devices_touched).sum();
    touched as f64 / stats.map(|s| s.tokens).sum::<usize>().max(1) as f64
}

/// The summary of run `key` from every rank's run of `tokens` tokens in all; `exchanges` says
/// what the runs' exchanges are. Decode figures come with [`Exchanges::ModelForward`] and
/// [`Exchanges::Measured`], the experts' rate with [`Exchanges::LayerForward`].
pub fn summarise(
    key: RunKey,
    devices: usize,
    tokens: usize,
    runs: &[RankRun],
    link: Option<&LinkProfile>,
    exchanges: Exchanges,
) -> ModeSummary {
    let max = |f: fn(&RankRun) -> f64| runs.iter().map(f).fold(0.0, f64::max);
    let seconds = max(|r| r.seconds);
    let bytes_sent = runs
        .iter()
        .map(|r| Exchange::remote_bytes(&r.exchanges, r.rank))
        .sum();
    let project = |p: &LinkProfile, part: fn(&RankRun) -> (&[Exchange], f64)| {
        let steps: Vec<RankStep> = runs
            .iter()
            .map(|r| {
                let (exchanges, flops) = part(r);
                RankStep { flops, exchanges }
            })
            .collect();
        let n = steps.iter().map(|r| r.exchanges.len()).min().unwrap_or(0);
        project_step(p, &steps, &exchanges.rows(n))
    };
    let projected = link.map(|p| {
        let mut step = project(p, |r| (&r.exchanges, r.flops));
        // On the machine itself: each rank's measured compute between exchanges, the links
        // modelled (every exchange waits for the slowest rank's compute before it).
        if p.measured_compute && runs.iter().any(|r| r.local_s > 0.0) {
            let exchanges: Vec<&[Exchange]> = runs.iter().map(|r| &r.exchanges[..]).collect();
            let local: Vec<f64> = runs.iter().map(|r| r.local_s).collect();
            step.compute_s = Exchange::critical_compute(&exchanges, &local)
                .unwrap_or_else(|| max(|r| r.local_s));
            step.total_s = step.compute_s + step.comm_s;
        }
        step
    });
    let decode = (!exchanges.is_layer()).then(|| {
        let decoded = runs.iter().all(|r| !r.decode_exchanges.is_empty());
        DecodeSummary {
            decode_ms_per_token: max(|r| r.decode_step_s) * 1e3,
            decode_projected_s: link
                .filter(|_| matches!(exchanges, Exchanges::ModelForward(_)) && decoded)
                .map(|p| project(p, |r| (&r.decode_exchanges, r.decode_flops)).total_s),
            decode_rows_sent: runs.iter().map(|r| r.decode_stats.rows_sent).sum(),
            decode_bytes_sent: runs
                .iter()
                .map(|r| Exchange::remote_bytes(&r.decode_exchanges, r.rank))
                .sum(),
            decode_ect: ect(runs.iter().map(|r| &r.decode_stats)),
        }
    });
    let expert = exchanges.is_layer().then(|| ExpertRate {
        expert_flops: runs.iter().map(|r| r.flops).sum(),
        expert_flops_per_s: runs
            .iter()
            .max_by(|a, b| a.stats.compute_s.total_cmp(&b.stats.compute_s))
            .map_or(0.0, |r| r.flops / r.stats.compute_s.max(1e-12)),
    });
    ModeSummary {
        key,
        mode: key.to_string(),
        devices,
        tokens,
        rows_sent: runs.iter().map(|r| r.stats.rows_sent).sum(),
        remote_rows_sent: runs.iter().map(|r| r.stats.remote_rows_sent).sum(),
        intra_node_rows: runs.iter().map(|r| r.stats.intra_node_rows_sent).sum(),
        inter_node_rows: runs.iter().map(|r| r.stats.inter_node_rows_sent).sum(),
        ecn: runs.iter().map(|r| r.stats.nodes_touched).sum::<usize>() as f64
            / runs.iter().map(|r| r.stats.tokens).sum::<usize>().max(1) as f64,
        bytes_sent,
        ect: ect(runs.iter().map(|r| &r.stats)),
        seconds,
        tokens_per_s: tokens as f64 / seconds.max(1e-12),
        route_s: max(|r| r.stats.route_s),
        plan_s: max(|r| r.stats.plan_s),
        dispatch_s: max(|r| r.stats.dispatch_s),
        compute_s: max(|r| r.stats.compute_s),
        combine_s: max(|r| r.stats.combine_s),
        projected_seconds: projected.as_ref().map(|p| p.total_s),
        projected,
        decode,
        expert,
    }
}

/// The single-device reference's row: `tokens` in `seconds` (all of it compute), with its
/// decode step or its experts' FLOPs where the benchmark has them.
pub fn reference(
    tokens: usize,
    seconds: f64,
    decode_step_s: Option<f64>,
    expert_flops: Option<f64>,
) -> ModeSummary {
    let key = RunKey::exact(MoeMode::Reference);
    ModeSummary {
        key,
        mode: key.to_string(),
        devices: 1,
        tokens,
        rows_sent: 0,
        remote_rows_sent: 0,
        intra_node_rows: 0,
        inter_node_rows: 0,
        ecn: 0.0,
        bytes_sent: 0,
        ect: 1.0,
        seconds,
        tokens_per_s: tokens as f64 / seconds.max(1e-12),
        route_s: 0.0,
        plan_s: 0.0,
        dispatch_s: 0.0,
        compute_s: seconds,
        combine_s: 0.0,
        projected_seconds: None,
        projected: None,
        decode: decode_step_s.map(|s| DecodeSummary {
            decode_ms_per_token: s * 1e3,
            decode_projected_s: None,
            decode_rows_sent: 0,
            decode_bytes_sent: 0,
            decode_ect: 1.0,
        }),
        expert: expert_flops.map(|f| ExpertRate {
            expert_flops: f,
            expert_flops_per_s: f / seconds.max(1e-12),
        }),
    }
}

/// Prints the results as a table, then each mode's ratios to standard dispatch, measured beside
/// projected; `what` names the timed step ("prefill", "training step").
pub fn print(results: &[ModeSummary], projected: bool, what: &str) {
    let ms = |s: f64| format!("{:.1}", s * 1e3);
    let (rate, time) = (format!("{what} tok/s"), format!("{what} ms"));
    let mut header = vec![
        "mode",
        "E[C_T]",
        "rows",
        "remote rows",
        "remote MB",
        rate.as_str(),
        time.as_str(),
        "decode ms/step",
        "route",
        "plan",
        "dispatch",
        "compute",
        "combine",
    ];
    let decode_projected = results.iter().any(|r| {
        r.decode
            .as_ref()
            .is_some_and(|d| d.decode_projected_s.is_some())
    });
    let nodes = results.iter().any(|r| r.inter_node_rows > 0);
    if nodes {
        header.insert(4, "rows across nodes");
        header.insert(2, "E[C_N]");
    }
    if projected {
        header.push("projected ms");
    }
    if decode_projected {
        header.push("decode projected ms");
    }
    let mut table = crate::table::Table::new(&header);
    for r in results {
        let mut row = vec![
            r.mode.clone(),
            format!("{:.3}", r.ect),
            r.rows_sent.to_string(),
            r.remote_rows_sent.to_string(),
            format!("{:.2}", r.bytes_sent as f64 / 1e6),
            format!("{:.1}", r.tokens_per_s),
            ms(r.seconds),
            format!(
                "{:.2}",
                r.decode.as_ref().map_or(0.0, |d| d.decode_ms_per_token)
            ),
            ms(r.route_s),
            ms(r.plan_s),
            ms(r.dispatch_s),
            ms(r.compute_s),
            ms(r.combine_s),
        ];
        if nodes {
            row.insert(4, r.inter_node_rows.to_string());
            row.insert(2, format!("{:.3}", r.ecn));
        }
        if projected {
            row.push(
                r.projected_seconds
                    .map_or("-".into(), |s| format!("{:.3}", s * 1e3)),
            );
        }
        if decode_projected {
            row.push(
                r.decode
                    .as_ref()
                    .and_then(|d| d.decode_projected_s)
                    .map_or("-".into(), |s| format!("{:.3}", s * 1e3)),
            );
        }
        table.row(row);
    }
    println!("{}", table.render());
    // Each run against standard dispatch, measured in this run beside the projection.
    if let Some(s) = results.iter().find(|r| r.key.is_baseline()) {
        for o in results
            .iter()
            .filter(|r| r.devices > 1 && !r.key.is_baseline())
        {
            println!(
                "{} / standard: rows {:.3}, remote bytes {:.3}, {what} time {:.3} (speed-up \
                 {:.2}x){}",
                o.mode,
                o.rows_sent as f64 / s.rows_sent.max(1) as f64,
                o.bytes_sent as f64 / s.bytes_sent.max(1) as f64,
                o.seconds / s.seconds.max(1e-12),
                s.seconds / o.seconds.max(1e-12),
                match (o.projected_seconds, s.projected_seconds) {
                    (Some(x), Some(y)) => format!(", projected time {:.3}", x / y.max(1e-12)),
                    _ => String::new(),
                }
            );
        }
    }
}
