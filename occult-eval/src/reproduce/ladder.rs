//! The E[C_T] table of the paper on a routing trace: standard k-copy dispatch, Occult's
//! deduplicated dispatch, then each placement method of [`Method::ALL`] after the contiguous
//! one (greedy, the paper's, and ours), then pruning to fewer devices with each rule; exact
//! rows, remote rows and bytes per step.

use anyhow::Result;
use occult_core::analysis::cost::cluster::NodeStats;
use occult_core::analysis::placement::{Method, Placement, SearchConfig};
use occult_core::analysis::pruning::PruneRule;
use occult_core::analysis::routing::RouterRule;
use occult_core::analysis::run_key::DispatchMode;
use occult_core::analysis::trace::Trace;
use occult_core::analysis::{place_trace, prune_trace, trace_node_stats, trace_stats, TraceStats};
use serde::Serialize;
use std::time::Instant;

/// One step of the table.
#[derive(Clone, Debug, Serialize)]
pub struct Step {
    pub step: String,
    /// How rows travel: `standard` (k copies) for the first step, `occult` for the others.
    pub dispatch: DispatchMode,
    pub placement: String,
    /// Pruned to this many devices, if pruned.
    pub max_devices: Option<usize>,
    pub rule: Option<String>,
    pub ect: f64,
    pub rows_per_token: f64,
    pub remote_rows_per_token: f64,
    pub remote_bytes: u64,
    /// Remote bytes relative to standard dispatch under the contiguous placement.
    pub remote_bytes_ratio: f64,
    /// Share of (token, expert) choices changed (pruning steps only).
    pub changed_fraction: Option<f64>,
    pub seconds: f64,
    /// With the devices split into two nodes (D even): E[C_N], and rows per token across the
    /// nodes (k copies for standard dispatch, one per remote node under two-level dispatch).
    pub ecn_two_nodes: Option<f64>,
    pub inter_rows_per_token_two_nodes: Option<f64>,
}

/// What the table is computed with.
pub struct LadderSettings<'a> {
    pub devices: usize,
    pub row_bytes: u64,
    pub restarts: usize,
    pub seed: u64,
    pub prune_devices: &'a [usize],
    pub rules: &'a [PruneRule],
    pub router: &'a RouterRule,
}

/// The placements of the table: one per method of [`Method::ALL`], in its order.
#[derive(Clone, Debug)]
pub struct Placements {
    /// Each method's placement, and the seconds it took.
    by_method: Vec<(Method, Placement, f64)>,
}

impl Placements {
    /// Each with its method, in the table's order.
    pub fn iter(&self) -> impl Iterator<Item = (Method, &Placement)> {
        self.by_method.iter().map(|(m, p, _)| (*m, p))
    }

    /// The placement of method `m` (every method of [`Method::ALL`] has one).
    pub fn get(&self, m: Method) -> &Placement {
        self.iter()
            .find(|&(x, _)| x == m)
            .map(|(_, p)| p)
            .expect("every method of Method::ALL is placed")
    }

    /// Ours: the swap search, which every stage after the table serves under.
    pub fn ours(&self) -> &Placement {
        self.get(Method::Occult)
    }
}

/// The step of the table that shows method `m`'s placement under Occult's dispatch.
fn placement_step(m: Method) -> &'static str {
    match m {
        Method::Contiguous => "dedup only (Occult dispatch)",
        Method::Greedy => "+ paper-greedy placement",
        Method::Occult => "+ our placement",
        Method::Eplb => "+ EPLB placement",
        Method::Cooccurrence => "+ TensorRT-LLM's co-occurrence placement",
    }
}

/// The table, and the three placements.
pub fn ect_ladder(trace: &Trace, s: &LadderSettings) -> Result<(Vec<Step>, Placements)> {
    let cfg = SearchConfig {
        restarts: s.restarts,
        seed: s.seed,
        max_load_factor: None,
        nodes: None,
    };
    let mut placements = Placements {
        by_method: Vec::new(),
    };
    for m in Method::ALL {
        let t = Instant::now();
        let (p, _) = place_trace(trace, s.devices, m, &cfg, &|| {})?;
        placements.by_method.push((m, p, t.elapsed().as_secs_f64()));
    }
    let tokens: usize = trace.layers.iter().map(|l| l.tokens).sum();
    let per_tok = |x: u64| x as f64 / tokens.max(1) as f64;
    let sum = |st: &TraceStats, f: fn(&occult_core::analysis::collab::LayerStats) -> u64| {
        st.layers.iter().map(f).sum::<u64>()
    };
    let contiguous = trace_stats(trace, placements.get(Method::Contiguous), s.row_bytes, true)?;
    let base_bytes = sum(&contiguous, |l| l.remote_rows_standard) * s.row_bytes;
    // Two nodes of D / 2: E[C_N] and the rows across them (standard's and two-level's).
    let two_nodes = |t: &Trace, p: &Placement| -> Result<Option<(f64, u64, u64)>> {
        if s.devices < 2 || !s.devices.is_multiple_of(2) {
            return Ok(None);
        }
        let st = trace_node_stats(t, p, s.devices / 2, true)?;
        let inter = |f: fn(&NodeStats) -> u64| st.layers.iter().map(f).sum::<u64>();
        Ok(Some((
            st.mean_ecn,
            inter(|l| l.standard.inter),
            inter(|l| l.two_level.inter),
        )))
    };
    let step = |name: &str,
                placement: &str,
                st: &TraceStats,
                nodes: Option<(f64, u64, u64)>,
                prune: Option<(usize, PruneRule, f64)>,
                seconds| {
        let remote = sum(st, |l| l.remote_rows_occult);
        Step {
            step: name.into(),
            dispatch: DispatchMode::Occult,
            placement: placement.into(),
            max_devices: prune.map(|p| p.0),
            rule: prune.map(|p| p.1.name().to_string()),
            ect: st.mean_ect,
            rows_per_token: per_tok(sum(st, |l| l.rows_occult)),
            remote_rows_per_token: per_tok(remote),
            remote_bytes: remote * s.row_bytes,
            remote_bytes_ratio: (remote * s.row_bytes) as f64 / base_bytes.max(1) as f64,
            changed_fraction: prune.map(|p| p.2),
            seconds,
            ecn_two_nodes: nodes.map(|n| n.0),
            inter_rows_per_token_two_nodes: nodes.map(|n| per_tok(n.2)),
        }
    };
    let contiguous_nodes = two_nodes(trace, placements.get(Method::Contiguous))?;
    let mut steps = vec![Step {
        step: "standard dispatch (k copies)".into(),
        dispatch: DispatchMode::Standard,
        placement: Method::Contiguous.name().into(),
        max_devices: None,
        rule: None,
        ect: contiguous.mean_ect,
        rows_per_token: per_tok(sum(&contiguous, |l| l.rows_standard)),
        remote_rows_per_token: per_tok(sum(&contiguous, |l| l.remote_rows_standard)),
        remote_bytes: base_bytes,
        remote_bytes_ratio: 1.0,
        changed_fraction: None,
        seconds: 0.0,
        ecn_two_nodes: contiguous_nodes.map(|n| n.0),
        inter_rows_per_token_two_nodes: contiguous_nodes.map(|n| per_tok(n.1)),
    }];
    for (m, p, secs) in &placements.by_method {
        let st = trace_stats(trace, p, s.row_bytes, true)?;
        let name = placement_step(*m);
        steps.push(step(name, m.name(), &st, two_nodes(trace, p)?, None, *secs));
    }
    let best = placements.ours();
    for &n in s.prune_devices {
        for &rule in s.rules {
            let t = Instant::now();
            let (pruned, report) = prune_trace(trace, best, s.router, rule, n, None, &|| {})?;
            let st = trace_stats(&pruned, best, s.row_bytes, true)?;
            let name = format!("+ pruning to {n} device(s), {} rule", rule.name());
            let secs = t.elapsed().as_secs_f64();
            steps.push(step(
                &name,
                Method::Occult.name(),
                &st,
                two_nodes(&pruned, best)?,
                Some((n, rule, report.changed_fraction)),
                secs,
            ));
        }
    }
    Ok((steps, placements))
}
