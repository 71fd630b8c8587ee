//! `occult place`: place experts on devices from a routing trace.

use crate::progress::bar;
use crate::table::{fmt_opt, Table};
use anyhow::{Context, Result};
use clap::Args;
use occult_core::analysis::cost::links::LinkProfile;
use occult_core::analysis::drivers::replica_trace::{
    replica_trace_stats, replicate_trace, ReplicaJob,
};
use occult_core::analysis::placement::eplb::EplbGroups;
use occult_core::analysis::placement::replicas::CopyRule;
use occult_core::analysis::placement::{
    Method, NodeLevel, Placement, SearchConfig, DEFAULT_INTER_WEIGHT,
};
use occult_core::analysis::{
    place_steps_per_layer, place_trace, place_trace_groups, place_trace_shared, PlaceInfo,
};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    occult place --trace olmoe-like.safetensors --devices 4 --method occult -o placed.json\n  \
    occult place --trace olmoe-like.safetensors --devices 8 --method occult --max-load-factor 1.2 -o placed.json\n  \
    occult place --trace olmoe-like.safetensors --devices 32 --link ib-ndr -o nodes.json\n  \
    occult place --trace olmoe-like.safetensors --devices 8 --replicas 8 --max-load-factor 1.1 --copy-rule sglang -o for-sglang.json\n\n\
With --replicas, place for the engine that serves the file: --copy-rule sglang (then `occult\n\
export sglang`), trtllm, or cover (Occult's own EP layer). --method eplb and trtllm-cooccurrence\n\
are the rivals, for comparison (`occult bench place --replicas R` runs all of them).\n\n\
With a node size (--devices-per-node G, or --link PROFILE's ranks_per_node), the occult method\n\
places for a cluster of nodes: fewest nodes per token first (a row across nodes costs W rows\n\
inside one: --inter-weight, or the profile's intra- over inter-node bandwidth, else 4), then\n\
fewest devices within them; device d is in node d / G. The result is never costlier on the\n\
trace, by W * E[C_N] + E[C_T], than the flat search's or the contiguous map.")]
pub struct PlaceArgs {
    /// Routing trace (safetensors, format occult.trace.v1); with --from, the trace to count the
    /// engine's placement on (optional).
    #[arg(long, required_unless_present_any = ["from", "loads"])]
    pub trace: Option<PathBuf>,
    /// Devices (EP ranks); with --from, the EP size the file is served with.
    #[arg(long, required_unless_present = "from")]
    pub devices: Option<usize>,
    /// Read an engine's placement file instead of searching: SGLang's --init-expert-location
    /// JSON, TensorRT-LLM's load-balancer YAML, or vLLM's #49572 / #34811 file (told by its
    /// content). SGLang's and vLLM's need --model (which layers are MoE layers) and --devices.
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with_all = ["method", "replicas", "shared_across_layers"]
    )]
    pub from: Option<PathBuf>,
    /// Place from expert loads alone: a TensorRT-LLM expert-statistic dump folder whose
    /// rank*.safetensors hold tokens per expert (its plain dump). Counts say how busy each
    /// expert is but not which experts a token uses together, so the map is DeepSeek's EPLB
    /// (load only), with or without --replicas; record TensorRT-LLM's co-occurrence dump for a
    /// trace Occult can search. Record with TensorRT-LLM's load balancer off: with it on, the
    /// dump counts slots, not experts.
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with_all = [
            "trace", "from", "method", "shared_across_layers", "max_load_factor", "copy_rule",
            "restarts", "seed", "inter_weight",
        ]
    )]
    pub loads: Option<PathBuf>,
    /// With --from: the model the file places (a folder or a hub id in the local cache).
    #[arg(long, requires = "from")]
    pub model: Option<String>,
    /// One map for every layer (what vLLM #34811 takes): the layers' tokens searched as one.
    #[arg(long)]
    pub shared_across_layers: bool,
    #[arg(long, value_enum, default_value_t = Method::Occult)]
    pub method: Method,
    /// occult method: keep each device's (token, expert) load within this factor of the mean.
    #[arg(long)]
    pub max_load_factor: Option<f64>,
    /// occult method: random starts besides the greedy and contiguous ones.
    #[arg(long, default_value_t = 2)]
    pub restarts: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// occult method: place for nodes of this many devices (fewest nodes per token first).
    #[arg(long)]
    pub devices_per_node: Option<usize>,
    /// occult method: the machine to place for (pcie4, nvlink-h100, ib-ndr or a TOML file):
    /// its ranks_per_node is the node size unless --devices-per-node says otherwise, and its
    /// bandwidths give the inter-node row weight.
    #[arg(long)]
    pub link: Option<String>,
    /// occult method with nodes: what a row across nodes costs in rows inside one.
    #[arg(long)]
    pub inter_weight: Option<f64>,
    /// Redundant expert slots (E + R slots, the same number on every device; a multiple of
    /// the devices for the occult method): occult adds copies where they lower E[C_T] most
    /// under --copy-rule, within --max-load-factor; eplb replicates for load alone;
    /// trtllm-cooccurrence replicates for load and groups by co-occurrence. No device ever
    /// holds an expert twice. Writes format occult.placement.v2.
    #[arg(long, default_value_t = 0)]
    pub replicas: usize,
    /// With --replicas: the rule the engine that serves the placement picks a copy by (cover:
    /// Occult's own EP layer; sglang: SGLang's static dispatch table; trtllm: TensorRT-LLM's
    /// uniform choice). Occult's copies are chosen under it, and the figures counted under it.
    /// Default: cover.
    #[arg(long, value_enum)]
    pub copy_rule: Option<CopyRule>,
    /// The model's expert groups (`n_group` of DeepSeek-V2/V3, Kimi-K2, GLM-4.5: group-limited
    /// routing). With the occult method, every group is kept whole: each group fills whole
    /// devices (D a multiple of the groups; with nodes, a token then reaches at most
    /// `topk_group` nodes) or each device holds whole groups (the groups a multiple of D), as
    /// the renumbered checkpoint of such a model needs. With the eplb method and --replicas,
    /// EPLB's hierarchical policy where the groups divide over the nodes (--devices-per-node or
    /// --link); otherwise (the default, one group) its global policy.
    #[arg(long, default_value_t = 1)]
    pub expert_groups: usize,
    /// Output placement (JSON, format occult.placement.v1, or v2 with --replicas).
    #[arg(short, long)]
    pub output: PathBuf,
}

pub fn run(a: PlaceArgs) -> Result<()> {
    if let Some(file) = &a.from {
        return from_engine(&a, file);
    }
    if let Some(dir) = &a.loads {
        return from_loads(&a, dir);
    }
    let (Some(trace_path), Some(devices)) = (a.trace.clone(), a.devices) else {
        anyhow::bail!("give --trace and --devices (or --from FILE)");
    };
    super::check_io(&[Some(&trace_path)], &[Some(&a.output)])?;
    let trace = super::load_trace(&trace_path)?;
    if a.shared_across_layers && a.replicas > 0 {
        anyhow::bail!(
            "--shared-across-layers is for engines that take one expert-to-rank map (vLLM \
             #34811), which holds no replicas: drop --replicas"
        );
    }
    let eplb_replicas = a.method == Method::Eplb && a.replicas > 0;
    if a.copy_rule.is_some() && a.replicas == 0 {
        anyhow::bail!(
            "--copy-rule picks among an expert's copies: give --replicas R (a placement without \
             replicas is served alike under every rule)"
        );
    }
    let rule = a.copy_rule.unwrap_or(CopyRule::Cover);
    let groups_whole = a.expert_groups != 1 && a.method == Method::Occult && a.replicas == 0;
    if a.expert_groups != 1 && !eplb_replicas && !groups_whole {
        anyhow::bail!(
            "--expert-groups keeps the model's expert groups whole with --method occult (without \
             --replicas), or is EPLB's hierarchical policy with --method eplb --replicas R"
        );
    }
    if groups_whole && a.shared_across_layers {
        anyhow::bail!("--expert-groups and --shared-across-layers do not combine yet");
    }
    let cfg = SearchConfig {
        restarts: a.restarts,
        seed: a.seed,
        max_load_factor: a.max_load_factor,
        // Under EPLB with replicas the node size serves its hierarchical policy.
        nodes: node_level(&a)?.filter(|_| !eplb_replicas),
    };
    let steps = place_steps_per_layer(a.method, &cfg) * trace.layers.len();
    let pb = bar(steps as u64, "search steps");
    let start = Instant::now();
    if groups_whole {
        let (mut placement, infos, layout) =
            place_trace_groups(&trace, devices, a.expert_groups, &cfg, &|| pb.inc(1))
                .with_context(|| trace_path.display().to_string())?;
        pb.finish_and_clear();
        record_source(&mut placement, &a, start.elapsed().as_secs_f64());
        placement.write(&a.output)?;
        print!("{}", render(&infos, &placement));
        println!(
            "{} expert groups kept whole: {}",
            a.expert_groups,
            layout.name()
        );
        eprintln!("wrote {}", a.output.display());
        return Ok(());
    }
    // EPLB and TensorRT-LLM's placement with replicas lay out every slot themselves: the
    // partition under them only lists the layers.
    let first = match a.method {
        Method::Eplb | Method::Cooccurrence if a.replicas > 0 => Method::Contiguous,
        m => m,
    };
    let placed = match if a.shared_across_layers {
        place_trace_shared(&trace, devices, first, &cfg, &|| pb.inc(1))
    } else {
        place_trace(&trace, devices, first, &cfg, &|| pb.inc(1))
    } {
        // Copies can balance a partition no balanced search brings within the cap: place
        // without it, and hold the copies to it.
        Err(err) if a.replicas > 0 && first == Method::Occult && cfg.max_load_factor.is_some() => {
            pb.println(format!(
                "no partition within the cap ({err}); placing without it, the copies to bring \
                 it within"
            ));
            let uncapped = SearchConfig {
                max_load_factor: None,
                ..cfg.clone()
            };
            place_trace(&trace, devices, first, &uncapped, &|| ())
        }
        other => other,
    };
    let (mut placement, infos) = placed.with_context(|| trace_path.display().to_string())?;
    let seconds = start.elapsed().as_secs_f64();
    pb.finish_and_clear();
    record_source(&mut placement, &a, seconds);
    if a.replicas > 0 {
        let eplb = EplbGroups {
            groups: a.expert_groups,
            nodes: node_level(&a)?.map_or(1, |l| devices / l.devices_per_node),
        };
        let job = ReplicaJob {
            method: a.method,
            replicas: a.replicas,
            max_load_factor: a.max_load_factor,
            eplb,
            rule,
        };
        let replicated = replicate_trace(&trace, &placement, job)
            .with_context(|| trace_path.display().to_string())?;
        replicated.write(&a.output)?;
        print!("{}", render_replicas(&replicated, rule));
        eprintln!(
            "placed in {:.2} s; wrote {}",
            start.elapsed().as_secs_f64(),
            a.output.display()
        );
        return Ok(());
    }
    placement.write(&a.output)?;
    print!("{}", render(&infos, &placement));
    eprintln!("placed in {seconds:.2} s; wrote {}", a.output.display());
    Ok(())
}

/// `--from FILE`: an engine's placement file read into an Occult placement, counted on the
/// trace where one is given.
fn from_engine(a: &PlaceArgs, file: &std::path::Path) -> Result<()> {
    super::check_io(&[Some(file), a.trace.as_deref()], &[Some(&a.output)])?;
    let layout = match &a.model {
        Some(m) => Some(occult_core::interop::checkpoint::ExpertLayout::read(
            &occult_core::models::checkpoint::resolve(m, None)?.dir,
        )?),
        None => None,
    };
    let (mut p, format) = occult_core::interop::engine_placement::read_engine_placement(
        file,
        layout.as_ref(),
        a.devices,
    )?;
    p.source
        .insert("from".into(), file.display().to_string().into());
    p.source.insert("format".into(), format.name().into());
    if let Some(t) = &a.trace {
        // Copies counted under the rule the file's engine picks them by.
        let route = occult_core::interop::routes::Route::from(format);
        let rule = a
            .copy_rule
            .unwrap_or(route.rule().unwrap_or(CopyRule::Cover));
        let trace = super::load_trace(t)?;
        let st = replica_trace_stats(&trace, &p, rule, false, None)
            .with_context(|| format!("counting {} on {}", file.display(), t.display()))?;
        let mut table = Table::new(&["layer", "E[C_T]", "max/mean load"]);
        for l in &st.layers {
            table.row(vec![
                l.layer.to_string(),
                format!("{:.3}", l.ect),
                format!("{:.3}", l.max_load_ratio),
            ]);
        }
        print!("{}", table.render());
        println!(
            "mean E[C_T] {:.3}, max/mean load {:.3} on {} devices{}",
            st.mean_ect,
            st.mean_max_load_ratio,
            p.num_devices,
            if p.has_replicas() {
                format!(" (copies chosen by the {} rule)", rule.name())
            } else {
                String::new()
            }
        );
    }
    p.write(&a.output)?;
    eprintln!(
        "read {} ({}: {} layers, {} experts on {} ranks{}); wrote {}",
        file.display(),
        format.name(),
        p.layers.len(),
        p.num_experts,
        p.num_devices,
        if p.has_replicas() {
            ", with replicas"
        } else {
            ""
        },
        a.output.display()
    );
    Ok(())
}

/// `--loads DIR`: EPLB over the expert counts of an engine's statistic dump.
fn from_loads(a: &PlaceArgs, dir: &std::path::Path) -> Result<()> {
    use occult_core::analysis::drivers::load_only::{contiguous_balance, place_loads, LayerLoads};
    super::check_io(&[Some(dir)], &[Some(&a.output)])?;
    let devices = a
        .devices
        .context("--loads needs --devices (the EP size to place for)")?;
    let start = Instant::now();
    let (_, counts) = occult_core::interop::trtllm::statistic::read_statistic_counts(dir)
        .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
    let layers: Vec<LayerLoads> = counts
        .into_iter()
        .map(|(layer, loads)| LayerLoads { layer, loads })
        .collect();
    let eplb = EplbGroups {
        groups: a.expert_groups,
        nodes: node_level(a)?.map_or(1, |l| devices / l.devices_per_node),
    };
    let (mut p, balance) = place_loads(&layers, devices, a.replicas, eplb)
        .with_context(|| format!("placing {} by its loads", dir.display()))?;
    let s = &mut p.source;
    s.insert("loads".into(), dir.display().to_string().into());
    s.insert("seconds".into(), start.elapsed().as_secs_f64().into());
    s.insert(
        "occult_version".into(),
        env!("CARGO_PKG_VERSION").to_string().into(),
    );
    let mut t = Table::new(&[
        "layer",
        "tokens x top-k",
        "contiguous max/mean load",
        "eplb max/mean load",
    ]);
    for (l, b) in layers.iter().zip(&balance) {
        t.row(vec![
            l.layer.to_string(),
            format!("{}", l.loads.iter().sum::<f64>()),
            fmt_opt(contiguous_balance(&l.loads, devices), 3),
            format!("{b:.3}"),
        ]);
    }
    print!("{}", t.render());
    println!(
        "EPLB from expert loads alone on {devices} devices with {} replicas (contiguous: one \
         slot per expert): the counts do not say which experts a token uses together, so \
         E[C_T] is neither searched nor known",
        a.replicas
    );
    p.write(&a.output)?;
    eprintln!("wrote {}", a.output.display());
    Ok(())
}

/// The node level the flags ask for, if any.
fn node_level(a: &PlaceArgs) -> Result<Option<NodeLevel>> {
    let profile = a.link.as_deref().map(LinkProfile::load).transpose()?;
    let Some(g) = a
        .devices_per_node
        .or(profile.as_ref().map(|p| p.ranks_per_node))
    else {
        if a.inter_weight.is_some() {
            anyhow::bail!("--inter-weight needs a node size: --devices-per-node or --link");
        }
        return Ok(None);
    };
    let w = a.inter_weight.unwrap_or_else(|| match &profile {
        Some(p) => (p.intra.bandwidth / p.inter.bandwidth).max(1.0),
        None => DEFAULT_INTER_WEIGHT,
    });
    let level = NodeLevel {
        devices_per_node: g,
        inter_weight: w,
    };
    let devices = a.devices.unwrap_or(g);
    level.check(devices)?;
    Ok((g < devices).then_some(level))
}

fn record_source(p: &mut Placement, a: &PlaceArgs, seconds: f64) {
    let s = &mut p.source;
    if let Some(t) = &a.trace {
        s.insert("trace".into(), t.display().to_string().into());
    }
    if a.shared_across_layers {
        s.insert("shared_across_layers".into(), true.into());
    }
    s.insert("seed".into(), a.seed.into());
    s.insert("restarts".into(), a.restarts.into());
    if let Some(f) = a.max_load_factor {
        s.insert("max_load_factor".into(), f.into());
    }
    if let (Method::Occult, Ok(Some(level))) = (a.method, node_level(a)) {
        s.insert(
            "nodes".into(),
            serde_json::json!({
                "devices_per_node": level.devices_per_node,
                "inter_weight": level.inter_weight,
            }),
        );
    }
    s.insert("seconds".into(), seconds.into());
    s.insert(
        "occult_version".into(),
        env!("CARGO_PKG_VERSION").to_string().into(),
    );
}

/// Per layer of a placement with replicas: E[C_T] and the busiest device's load under the
/// copy rule it was placed for; and how to serve it.
fn render_replicas(p: &Placement, rule: CopyRule) -> String {
    let ect = format!("E[C_T] ({} rule)", rule.name());
    let mut t = Table::new(&["layer", "slots", &ect, "max/mean load"]);
    for l in &p.layers {
        let m = l.metrics.as_ref();
        t.row(vec![
            l.layer.to_string(),
            l.slots.as_ref().map_or(0, Vec::len).to_string(),
            fmt_opt(m.map(|m| m.ect), 3),
            fmt_opt(m.map(|m| m.max_load_ratio), 3),
        ]);
    }
    format!(
        "{}\nmethod {} with {} replicas on {} devices\n",
        t.render(),
        p.method,
        p.source
            .get("replicas")
            .and_then(|r| r.as_u64())
            .unwrap_or(0),
        p.num_devices
    )
}

fn render(infos: &[PlaceInfo], p: &Placement) -> String {
    let nodes = infos.iter().any(|i| i.ecn.is_some());
    let mut head = vec!["layer", "E[C_T]"];
    if nodes {
        head.push("E[C_N]");
    }
    head.extend(["greedy E[C_T]", "max/mean load", "start", "swaps"]);
    let mut t = Table::new(&head);
    for (i, l) in infos.iter().zip(&p.layers) {
        let mut row = vec![i.layer.to_string(), format!("{:.3}", i.ect)];
        if nodes {
            row.push(fmt_opt(i.ecn, 3));
        }
        row.extend([
            fmt_opt(i.greedy_ect, 3),
            fmt_opt(l.metrics.as_ref().map(|m| m.max_load_ratio), 3),
            i.start.clone().unwrap_or_else(|| "-".into()),
            i.swaps.map_or("-".into(), |s| s.to_string()),
        ]);
        t.row(row);
    }
    let mean = |f: &dyn Fn(&PlaceInfo) -> f64| {
        occult_core::analysis::collab::token_weighted_mean(infos.iter().map(|i| (f(i), i.tokens)))
    };
    let ecn = match p.source.get("nodes") {
        Some(n) if nodes => format!(
            ", mean E[C_N] {:.3} over nodes of {}",
            mean(&|i| i.ecn.unwrap_or(0.0)),
            n["devices_per_node"]
        ),
        _ => String::new(),
    };
    format!(
        "{}\nmethod {}: mean E[C_T] {:.3} on {} devices{ecn}\n",
        t.render(),
        p.method,
        mean(&|i| i.ect),
        p.num_devices
    )
}
