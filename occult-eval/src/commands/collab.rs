//! `occult collab`: collaboration statistics of a trace under a placement.

use super::{resolve_placement, with_provenance, write_json};
use crate::rows::RowDtype;
use crate::table::{count, fmt_opt, Table};
use anyhow::{Context, Result};
use clap::Args;
use occult_core::analysis::cost::links::LinkProfile;
use occult_core::analysis::drivers::replica_trace::replica_trace_stats;
use occult_core::analysis::placement::replicas::CopyRule;
use occult_core::analysis::{trace_node_stats, trace_stats, TraceNodeStats, TraceStats};
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    occult collab --trace olmoe-like.safetensors --devices 4\n  \
    occult collab --trace olmoe-like.safetensors --placement placed.json --json collab.json\n  \
    occult collab --trace olmoe-like.safetensors --placement nodes.json --devices-per-node 8\n\n\
Tokens start on source ranks split evenly and in order over the devices (the first T % D\n\
ranks hold one token more). A trace that records num_ranks must match the device count\n\
unless --resplit is given.")]
pub struct CollabArgs {
    /// Routing trace (safetensors, format occult.trace.v1).
    #[arg(long)]
    pub trace: PathBuf,
    /// Analyse the contiguous placement on D devices.
    #[arg(long)]
    pub devices: Option<usize>,
    /// Analyse this placement file (occult.placement.v1, or v2 with replicas: counted under
    /// --copy-rule).
    #[arg(long)]
    pub placement: Option<PathBuf>,
    /// Hidden size of a row, for byte counts.
    #[arg(long, default_value_t = 2048)]
    pub hidden_size: u64,
    /// Element type of a row, for byte counts.
    #[arg(long, value_enum, default_value_t = RowDtype::Bf16)]
    pub dtype: RowDtype,
    /// Also count at two levels, for nodes of this many devices (device d in node d / G):
    /// E[C_N] and rows within and across nodes for standard, flat and two-level dispatch.
    #[arg(long)]
    pub devices_per_node: Option<usize>,
    /// The node size from this machine profile's ranks_per_node (pcie4, nvlink-h100, ib-ndr
    /// or a TOML file), unless --devices-per-node is given.
    #[arg(long)]
    pub link: Option<String>,
    /// Split tokens evenly over the devices even if the trace records another rank count.
    #[arg(long)]
    pub resplit: bool,
    /// A placement with replicas: which copy each token uses (cover: fewest devices for the
    /// token's experts; sglang: SGLang's static dispatch table, as SGLang builds it from the
    /// file; trtllm: TensorRT-LLM's uniform choice, counted in expectation as its
    /// report_send_ranks_per_token.py counts).
    #[arg(long, value_enum, default_value_t = CopyRule::Cover)]
    pub copy_rule: CopyRule,
    /// Write the statistics as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(a: CollabArgs) -> Result<()> {
    super::check_io(
        &[Some(&a.trace), a.placement.as_deref()],
        &[a.json.as_deref()],
    )?;
    let trace = super::load_trace(&a.trace)?;
    let placement = resolve_placement(&trace, a.devices, a.placement.as_deref())?;
    if a.hidden_size == 0 || a.hidden_size > 1 << 20 {
        anyhow::bail!("--hidden-size {} must be in 1..=1048576", a.hidden_size);
    }
    if placement.has_replicas() {
        return replicated(&a, &trace, &placement);
    }
    let stats = trace_stats(
        &trace,
        &placement,
        a.hidden_size * a.dtype.bytes(),
        a.resplit,
    )
    .with_context(|| a.trace.display().to_string())?;
    print!("{}", render(&stats));
    let per_node = match (a.devices_per_node, &a.link) {
        (Some(g), _) => Some(g),
        (None, Some(l)) => Some(LinkProfile::load(l)?.ranks_per_node),
        (None, None) => None,
    };
    let nodes = per_node
        .map(|g| trace_node_stats(&trace, &placement, g, a.resplit))
        .transpose()
        .with_context(|| a.trace.display().to_string())?;
    if let Some(n) = &nodes {
        print!("\n{}", render_nodes(n));
    }
    if let Some(out) = &a.json {
        let mut v = serde_json::to_value(&stats)?;
        if let Some(n) = &nodes {
            v["nodes"] = serde_json::to_value(n)?;
        }
        v["trace"] = a.trace.display().to_string().into();
        v["placement"] = match &a.placement {
            Some(p) => p.display().to_string().into(),
            None => "contiguous".into(),
        };
        v["placement_method"] = placement.method.clone().into();
        write_json(out, &with_provenance(v))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

/// A placement with replicas: E[C_T] and device loads per layer under the copy rule.
fn replicated(
    a: &CollabArgs,
    trace: &occult_core::analysis::trace::Trace,
    p: &occult_core::analysis::placement::Placement,
) -> Result<()> {
    let per_node = match (a.devices_per_node, &a.link) {
        (Some(g), _) => Some(g),
        (None, Some(l)) => Some(LinkProfile::load(l)?.ranks_per_node),
        (None, None) => None,
    };
    let st = replica_trace_stats(trace, p, a.copy_rule, a.resplit, per_node)
        .with_context(|| a.trace.display().to_string())?;
    let mut head = vec!["layer", "E[C_T]"];
    if per_node.is_some() {
        head.push("E[C_N]");
    }
    head.push("max/mean load");
    let mut t = Table::new(&head);
    for l in &st.layers {
        let mut row = vec![l.layer.to_string(), format!("{:.3}", l.ect)];
        row.extend(l.ecn.map(|x| format!("{x:.3}")));
        row.push(format!("{:.3}", l.max_load_ratio));
        t.row(row);
    }
    let nodes = match (per_node, st.mean_ecn) {
        (Some(g), Some(x)) => format!(", E[C_N] {x:.3} on nodes of {g}"),
        _ => String::new(),
    };
    print!(
        "{}\nmean E[C_T] {:.3}{nodes}, max/mean load {:.3} over {} layers ({} devices of {} \
         slots, copies chosen by the {} rule)\n",
        t.render(),
        st.mean_ect,
        st.mean_max_load_ratio,
        st.layers.len(),
        p.num_devices,
        st.slots_per_device,
        serde_json::to_value(a.copy_rule)?
            .as_str()
            .unwrap_or_default()
    );
    if let Some(out) = &a.json {
        let mut v = serde_json::to_value(&st)?;
        v["trace"] = a.trace.display().to_string().into();
        v["placement_method"] = p.method.clone().into();
        write_json(out, &with_provenance(v))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

/// The per-layer table and the summary line.
pub fn render(s: &TraceStats) -> String {
    let mut t = Table::new(&[
        "layer",
        "E[C_T]",
        "intra",
        "rows std",
        "rows occult",
        "remote std",
        "remote occult",
        "max/mean load",
    ]);
    for l in &s.layers {
        t.row(vec![
            l.layer.to_string(),
            format!("{:.3}", l.ect),
            fmt_opt(l.intra_ratio, 3),
            count(l.rows_standard),
            count(l.rows_occult),
            count(l.remote_rows_standard),
            count(l.remote_rows_occult),
            format!("{:.3}", l.max_load_ratio),
        ]);
    }
    let remote_std: u64 = s.layers.iter().map(|l| l.remote_rows_standard).sum();
    let remote_occ: u64 = s.layers.iter().map(|l| l.remote_rows_occult).sum();
    format!(
        "{}\nmean E[C_T] {:.3} over {} layers ({} experts, top-{}, {} devices; uniform routing \
         would give {:.3})\nremote rows: standard {} vs occult {} ({:.3}x), {} vs {} bytes each \
         direction\n",
        t.render(),
        s.mean_ect,
        s.layers.len(),
        s.num_experts,
        s.top_k,
        s.num_devices,
        s.uniform_ect,
        count(remote_std),
        count(remote_occ),
        remote_occ as f64 / remote_std.max(1) as f64,
        count(remote_std * s.row_bytes),
        count(remote_occ * s.row_bytes),
    )
}

/// The two-level table: nodes per token and rows within / across nodes per dispatch.
pub fn render_nodes(s: &TraceNodeStats) -> String {
    let mut t = Table::new(&[
        "layer",
        "E[C_N]",
        "C_N histogram",
        "standard intra/inter",
        "flat intra/inter",
        "two-level intra/inter",
        "max/mean node rows in",
    ]);
    let pair = |r: &occult_core::analysis::cost::cluster::LevelRows| {
        format!("{} / {}", count(r.intra), count(r.inter))
    };
    for l in &s.layers {
        let hist: Vec<String> = l.ecn_histogram.iter().map(|c| c.to_string()).collect();
        t.row(vec![
            l.layer.to_string(),
            format!("{:.3}", l.ecn),
            hist.join(" "),
            pair(&l.standard),
            pair(&l.dedup),
            pair(&l.two_level),
            format!("{:.3}", l.max_node_inter_ratio),
        ]);
    }
    let sum = |f: &dyn Fn(&occult_core::analysis::cost::cluster::NodeStats) -> u64| -> u64 {
        s.layers.iter().map(f).sum()
    };
    let (flat, two) = (sum(&|l| l.dedup.inter), sum(&|l| l.two_level.inter));
    format!(
        "{}\nmean E[C_N] {:.3} over {} nodes of {} devices; rows across nodes: standard {}, \
         flat {}, two-level {} ({:.3}x flat)\n",
        t.render(),
        s.mean_ecn,
        s.nodes,
        s.devices_per_node,
        count(sum(&|l| l.standard.inter)),
        count(flat),
        count(two),
        two as f64 / flat.max(1) as f64,
    )
}
