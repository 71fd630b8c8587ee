//! `occult prune`: apply a collaboration-pruning rule to a trace and report E[C_T] before and
//! after and the share of (token, expert) choices that changed.

use super::model_opts::PruneLimitOpts;
use super::{load_trace, resolve_placement, with_provenance, write_json};
use crate::progress::bar;
use crate::table::Table;
use anyhow::{Context, Result};
use clap::Args;
use occult_core::analysis::pruning::PruneRule;
use occult_core::analysis::routing::{GroupLimit, GroupScore, LayerRouters, RouterRule, Scoring};
use occult_core::analysis::trace::Trace;
use occult_core::analysis::{check_router_matches, prune_trace_to, PruneReport};
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::layer_routers;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "Rules:\n  \
    router      walk the token's experts best first, keep the first N devices seen, re-pick\n              \
                the top-k among their experts by router score\n  \
    similarity  keep the chosen experts on those devices, replace each other one by the most\n              \
                similar unselected expert on them (cosine of router-logit columns)\n\n\
The trace must hold router logits. Gate weights follow the model's rule: --model reads it\n\
from the checkpoint, each layer's selection bias included (DeepSeek-V3, GLM-4.5: a trace does\n\
not hold it); otherwise --scoring, --renormalize and --scaling-factor (and --num-groups/\n\
--topk-groups for group-limited routing) give it. If the trace holds gate weights, the rule is\n\
checked against them.\n\n\
Examples:\n  \
    occult prune --trace olmoe-like.safetensors --placement placed.json --max-devices 2 --rule similarity\n  \
    occult prune --trace t.safetensors --devices 4 --max-devices 1 --rule router --json prune.json -o pruned.safetensors\n  \
    occult prune --trace v3.safetensors --model deepseek-ai/DeepSeek-V3 --devices 32 --max-devices 4 --rule router")]
pub struct PruneArgs {
    /// Routing trace with router logits.
    #[arg(long)]
    pub trace: PathBuf,
    /// Placement file (occult.placement.v1; pruning runs on placements without replicas).
    #[arg(long)]
    pub placement: Option<PathBuf>,
    /// Use the contiguous placement on D devices instead of a placement file.
    #[arg(long)]
    pub devices: Option<usize>,
    #[command(flatten)]
    pub limit: PruneLimitOpts,
    #[arg(long, value_enum)]
    pub rule: PruneRule,
    /// Build similarity tables from this trace's router logits instead of --trace's.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// The model whose routing the trace recorded (a folder or an id in the Hugging Face cache):
    /// its router rule, with each layer's selection bias, instead of the flags below.
    #[arg(long, conflicts_with_all = ["scoring", "renormalize", "scaling_factor", "num_groups"])]
    pub model: Option<String>,
    /// How router logits become scores.
    #[arg(long, value_enum, default_value_t = Scoring::Softmax)]
    pub scoring: Scoring,
    /// The model renormalises its top-k weights (Mixtral, Qwen3-MoE).
    #[arg(long)]
    pub renormalize: bool,
    /// Multiplies the gate weights (DeepSeek's routed_scaling_factor).
    #[arg(long, default_value_t = 1.0)]
    pub scaling_factor: f32,
    /// Group-limited routing (DeepSeek-V2/V3): number of expert groups.
    #[arg(long, requires = "topk_groups")]
    pub num_groups: Option<usize>,
    /// Group-limited routing: groups each token may use.
    #[arg(long, requires = "num_groups")]
    pub topk_groups: Option<usize>,
    /// Group-limited routing: how a group is scored.
    #[arg(long, value_enum, default_value_t = GroupScore::Max)]
    pub group_score: GroupScore,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the pruned trace here.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Accept a trace recorded on another number of source ranks than the placement's devices.
    #[arg(long)]
    pub resplit: bool,
}

pub fn run(a: PruneArgs) -> Result<()> {
    super::check_io(
        &[
            Some(&a.trace),
            a.placement.as_deref(),
            a.calibration.as_deref(),
        ],
        &[a.output.as_deref(), a.json.as_deref()],
    )?;
    let trace = load_trace(&a.trace)?;
    let placement = resolve_placement(&trace, a.devices, a.placement.as_deref())?;
    // As `collab`: a trace recorded on other ranks is pruned only when asked to.
    occult_core::analysis::source_split(&trace, 0, placement.num_devices, a.resplit)
        .with_context(|| a.trace.display().to_string())?;
    let calibration = a.calibration.as_deref().map(load_trace).transpose()?;
    let routers = routers_of(&a, &trace)?;
    routers.rule.validate()?;
    check_router_matches(&trace, &routers).with_context(|| a.trace.display().to_string())?;
    let rule = a.rule;
    let pb = bar(trace.layers.len() as u64, "layers");
    let Some(limit) = a.limit.limit() else {
        anyhow::bail!("give --max-devices N, or --max-nodes M with --devices-per-node G");
    };
    let (pruned, report) = prune_trace_to(
        &trace,
        &placement,
        &routers,
        rule,
        limit,
        calibration.as_ref(),
        &|| pb.inc(1),
    )
    .with_context(|| a.trace.display().to_string())?;
    pb.finish_and_clear();
    print!("{}", render(&report));
    if let Some(out) = &a.output {
        pruned.write(out)?;
        eprintln!("wrote {}", out.display());
    }
    if let Some(out) = &a.json {
        let mut v = serde_json::to_value(&report)?;
        v["trace"] = a.trace.display().to_string().into();
        v["placement_method"] = placement.method.clone().into();
        write_json(out, &with_provenance(v))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

/// The router rule of each layer: the model's (with each layer's selection bias) or the flags'.
fn routers_of(a: &PruneArgs, trace: &Trace) -> Result<LayerRouters> {
    let (e, k) = (trace.meta.num_experts, trace.meta.top_k);
    if let Some(m) = &a.model {
        let ck = Checkpoint::open(m, None, candle::DType::F32)
            .with_context(|| format!("--model {m}"))?;
        let routers = layer_routers(&ck.weights, &ck.cfg)?;
        if (routers.rule.num_experts, routers.rule.top_k) != (e, k) {
            anyhow::bail!(
                "--model {m} routes top-{} of {} experts, the trace top-{k} of {e}",
                routers.rule.top_k,
                routers.rule.num_experts
            );
        }
        return Ok(routers);
    }
    let mut router = RouterRule::softmax_topk(e, k, a.renormalize);
    router.scoring = a.scoring;
    router.scaling_factor = a.scaling_factor;
    if let (Some(num_groups), Some(topk_groups)) = (a.num_groups, a.topk_groups) {
        router.group_limit = Some(GroupLimit {
            num_groups,
            topk_groups,
            score: a.group_score,
        });
    }
    Ok(LayerRouters::same(router))
}

pub fn render(r: &PruneReport) -> String {
    let mut t = Table::new(&["layer", "E[C_T] before", "E[C_T] after", "changed"]);
    for l in &r.layers {
        t.row(vec![
            l.layer.to_string(),
            format!("{:.3}", l.ect_before),
            format!("{:.3}", l.ect_after),
            format!("{:.1}%", 100.0 * l.changed_fraction),
        ]);
    }
    format!(
        "{}\n{} rule, at most {} ({} devices): E[C_T] {:.3} -> {:.3}, {:.1}% of choices changed\n",
        t.render(),
        r.rule.name(),
        r.limit.label(),
        r.num_devices,
        r.ect_before,
        r.ect_after,
        100.0 * r.changed_fraction
    )
}
