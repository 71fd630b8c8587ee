//! `occult project`: size a cluster before renting one. Projects the MoE layer and
//! training-step time of standard, dedup-only, Occult and pruned Occult dispatch for D devices
//! on machine profiles, from a real routing trace and modelled expert compute
//! (`occult_core::analysis::cost::projection`). The work is [`crate::jobs::project`].

use super::{load_trace, with_provenance, write_json};
use crate::context::spec::model_config;
use crate::jobs::project::{layer_sizes, load_profiles, project, render};
use anyhow::{bail, Result};
use clap::Args;
use occult_core::analysis::cost::projection::ProjectSettings;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(
    after_help = "Modes: standard = one row per (token, expert), contiguous placement; \
dedup = one row per (token, device), contiguous placement (DeepEP's dispatch); occult = dedup \
under Occult's placement; pruned = occult with each token limited to N devices (router rule); \
node-aware (on machines of several nodes that forward) = dedup under the placement for the \
cluster: fewest nodes per token first. Deduplicated rows cross a node boundary once per remote node and are forwarded inside it when \
the profile's inter-node link is slower than its intra-node link.\n\n\
These are projections from a cost model (bytes over bandwidth plus latency per message, FLOPs \
over throughput), not measurements: check them with `occult bench` over MPI, or measured over \
shaped links with scripts/shaped_links.sh.\n\n\
Examples:\n  \
    occult profile --model allenai/OLMoE-1B-7B-0924 --data calib.jsonl -o olmoe.safetensors\n  \
    occult project --trace olmoe.safetensors --model allenai/OLMoE-1B-7B-0924\n  \
    occult project --trace t.safetensors --hidden 2048 --intermediate 1024 --devices 8,16,32 \\\n      \
    --link ib-ndr --tokens-per-device 128,4096 --json project.json"
)]
pub struct ProjectArgs {
    /// Routing trace (from `occult profile`; router logits are needed for the pruned rows).
    #[arg(long)]
    pub trace: PathBuf,
    /// Read the layer sizes from this model's config (a folder or a cached hub id).
    #[arg(long)]
    pub model: Option<String>,
    /// Hidden size (overrides --model's).
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Intermediate size of one routed expert (overrides --model's).
    #[arg(long)]
    pub intermediate: Option<usize>,
    /// Intermediate size of the shared expert(s) every token runs (overrides --model's).
    #[arg(long)]
    pub shared_intermediate: Option<usize>,
    /// Device counts, comma-separated (more than the experts are skipped with a note).
    #[arg(long, value_delimiter = ',', default_value = "4,8,16,32,64,128,256")]
    pub devices: Vec<usize>,
    /// Tokens each device holds per step, comma-separated (prefill or training batch; a few
    /// for decode).
    #[arg(long, value_delimiter = ',', default_value = "4096")]
    pub tokens_per_device: Vec<usize>,
    /// Machine profiles: pcie4, nvlink-h100, ib-ndr, or TOML files; comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "pcie4,nvlink-h100,ib-ndr"
    )]
    pub link: Vec<String>,
    /// Also project pruning to these device counts per token, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2")]
    pub prune_devices: Vec<usize>,
    /// No pruned rows.
    #[arg(long, conflicts_with = "prune_devices")]
    pub no_prune: bool,
    /// Also search Occult placements whose device loads stay within these factors of the mean;
    /// each machine and size keeps the fastest projected (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1.25,1.1,1.05")]
    pub load_caps: Vec<f64>,
    /// Random starts of Occult's placement search.
    #[arg(long, default_value_t = 2)]
    pub restarts: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(a: ProjectArgs) -> Result<()> {
    super::check_io(&[Some(&a.trace)], &[a.json.as_deref()])?;
    let trace = load_trace(&a.trace)?;
    let from_model = a.model.as_deref().map(model_config).transpose()?;
    let sizes = from_model.as_ref().map(layer_sizes);
    let (Some(hidden), Some(intermediate)) = (
        a.hidden.or(sizes.map(|s| s.0)),
        a.intermediate.or(sizes.map(|s| s.1)),
    ) else {
        bail!("give --model, or --hidden and --intermediate (the layer sizes to project)");
    };
    if let Some(cfg) = &from_model {
        if cfg.moe.num_experts != trace.meta.num_experts || cfg.moe.top_k != trace.meta.top_k {
            bail!(
                "the model routes {} experts top-{}, the trace {} top-{}",
                cfg.moe.num_experts,
                cfg.moe.top_k,
                trace.meta.num_experts,
                trace.meta.top_k
            );
        }
    }
    let profiles = load_profiles(&a.link)?;
    let settings = ProjectSettings {
        devices: a.devices.clone(),
        tokens_per_device: a.tokens_per_device.clone(),
        prune_devices: if a.no_prune {
            Vec::new()
        } else {
            a.prune_devices.clone()
        },
        hidden,
        intermediate,
        shared_intermediate: a.shared_intermediate.or(sizes.map(|s| s.2)).unwrap_or(0),
        load_caps: a.load_caps.clone(),
        restarts: a.restarts,
        seed: a.seed,
    };
    let report = project(&trace, &profiles, &settings)?;
    print!("{}", render(&report));
    if let Some(p) = &a.json {
        let mut v = serde_json::to_value(&report)?;
        v["trace"] = a.trace.display().to_string().into();
        v["profiles"] = serde_json::to_value(&profiles)?;
        v["projection"] = true.into();
        write_json(p, &with_provenance(v))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
