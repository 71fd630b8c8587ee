//! Projection: the MoE layer and training-step time of standard, dedup-only, Occult and pruned
//! Occult dispatch for D devices on machine profiles, from a real routing trace and modelled
//! expert compute (`occult_core::analysis::cost::projection`), with the layer sizes read from a model
//! and the report as tables.

use crate::progress::bar;
use crate::table::Table;
use anyhow::Result;
use occult_core::analysis::cost::links::LinkProfile;
use occult_core::analysis::cost::projection::{project_trace, ProjectReport, ProjectSettings};
use occult_core::analysis::trace::Trace;
use occult_core::models::config::ModelConfig;

/// Layer sizes for the projection: (hidden, expert intermediate, shared intermediate).
pub fn layer_sizes(cfg: &ModelConfig) -> (usize, usize, usize) {
    (
        cfg.hidden_size,
        cfg.moe.expert_intermediate,
        cfg.moe.shared.as_ref().map_or(0, |s| s.intermediate),
    )
}

/// Machine profiles by name or file.
pub fn load_profiles(names: &[String]) -> Result<Vec<LinkProfile>> {
    Ok(names
        .iter()
        .map(|l| LinkProfile::load(l))
        .collect::<occult_core::Result<Vec<_>>>()?)
}

/// Runs the projection with a progress bar over device counts.
pub fn project(
    trace: &Trace,
    profiles: &[LinkProfile],
    settings: &ProjectSettings,
) -> Result<ProjectReport> {
    let pb = bar(settings.devices.len() as u64, "device counts");
    let report = project_trace(trace, profiles, settings, &|_| pb.inc(1))?;
    pb.finish_and_clear();
    Ok(report)
}

/// The report as tables: one per machine and tokens per device.
pub fn render(r: &ProjectReport) -> String {
    let s = &r.settings;
    let mut out = format!(
        "PROJECTED (cost model, not measured): one MoE layer of {} experts top-{}, hidden {}, \
         expert intermediate {}{}, from {} traced layers\n",
        r.num_experts,
        r.top_k,
        s.hidden,
        s.intermediate,
        if s.shared_intermediate > 0 {
            format!(", shared intermediate {}", s.shared_intermediate)
        } else {
            String::new()
        },
        r.layers
    );
    // Machines in the order given, then tokens per device.
    let mut groups: Vec<(&str, usize)> = Vec::new();
    for m in &r.rows {
        let g = (m.profile.as_str(), m.tokens_per_device);
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    groups.sort_by_key(|&(p, t)| (r.rows.iter().position(|m| m.profile == p), t));
    let ms = |x: f64| format!("{:.3}", x * 1e3);
    for (profile, tokens) in groups {
        out.push_str(&format!("\n{profile}, {tokens} tokens per device\n\n"));
        let mut t = Table::new(&[
            "D",
            "nodes",
            "mode",
            "load cap",
            "E[C_T]",
            "E[C_N]",
            "intra rows/tok",
            "inter rows/tok",
            "exchange ms",
            "compute ms",
            "layer ms",
            "layer speed-up",
            "train ms",
            "train speed-up",
        ]);
        for m in r
            .rows
            .iter()
            .filter(|m| m.profile == profile && m.tokens_per_device == tokens)
        {
            t.row(vec![
                m.devices.to_string(),
                m.nodes.to_string(),
                if m.mode.ends_with("node-aware") && m.placement != "node-aware" {
                    format!("{} ({})", m.mode, m.placement)
                } else {
                    m.mode.clone()
                },
                m.load_cap.map_or("-".into(), |c| format!("{c:.2}")),
                format!("{:.3}", m.ect),
                format!("{:.3}", m.ecn),
                format!("{:.3}", m.intra_rows_per_token),
                format!("{:.3}", m.inter_rows_per_token),
                ms(m.exchange_s),
                ms(m.compute_s),
                ms(m.layer_s),
                format!("{:.2}x", m.layer_speedup),
                ms(m.train_s),
                format!("{:.2}x", m.train_speedup),
            ]);
        }
        out.push_str(&t.render());
    }
    for sk in &r.skipped {
        out.push_str(&format!(
            "\nD = {}, {} left out: {}",
            sk.devices, sk.mode, sk.reason
        ));
    }
    if !r.skipped.is_empty() {
        out.push('\n');
    }
    if r.rows.iter().any(|m| m.mode.ends_with("node-aware")) {
        out.push_str(
            "\nnode-aware: the placement for the cluster (fewest nodes per token first, then \
             devices; `occult place --link PROFILE`) that projects fastest, among the node-aware \
             ones under each load cap, Occult's flat ones and contiguous (named when one of \
             those won). E[C_N]: distinct nodes per token.\n",
        );
    }
    out
}
