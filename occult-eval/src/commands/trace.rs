//! `occult trace synth` (synthetic routing traces), `occult trace info` (what a trace holds) and
//! `occult trace remap` (between an exported checkpoint's expert ids and the original's) and
//! `occult trace import` (routing arrays from other frameworks).

use crate::progress::bar;
use crate::table::{count, Table};
use anyhow::Result;
use clap::{Args, Subcommand};
use occult_core::analysis::routing::{GroupLimit, GroupScore};
use occult_core::analysis::synth::{synth_trace, SynthConfig};
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum TraceCmd {
    /// Generate a synthetic routing trace with latent expert clusters (or uniform routing).
    #[command(after_help = "Examples:\n  \
        occult trace synth --experts 64 --top-k 8 --layers 16 --tokens 100000 --seed 0 -o olmoe-like.safetensors\n  \
        occult trace synth --experts 64 --top-k 8 --tokens 20000 --uniform -o uniform.safetensors")]
    Synth(SynthArgs),
    /// Print what a routing trace holds.
    Info {
        /// The trace (safetensors, format occult.trace.v1).
        trace: PathBuf,
    },
    /// Map a trace between an exported (renumbered) checkpoint's expert ids and the original
    /// model's (`occult export checkpoint` wrote the renumbering).
    #[command(after_help = "Example:\n  \
        occult profile --model olmoe-placed --data calib.txt -o placed.safetensors\n  \
        occult trace remap --trace placed.safetensors --model olmoe-placed -o original-ids.safetensors")]
    Remap(RemapArgs),
    /// Read routing recorded by another framework (.npz, .npy or safetensors arrays of top-k
    /// ids per layer, SGLang's per_token expert-distribution dumps, or Megatron-Core's router
    /// trace JSONL; see docs/formats.md) into an occult trace.
    #[command(after_help = "Examples:\n  \
        occult trace import routing.npz --experts 64 -o t.safetensors\n  \
        occult trace import routing.safetensors --model allenai/OLMoE-1B-7B-0924 -o t.safetensors\n  \
        occult trace import /tmp/expert_distribution_recorder_*.pt --model Qwen/Qwen3-30B-A3B -o t.safetensors\n  \
        occult trace import traces/router_trace_rank*.jsonl --experts 64 -o t.safetensors   # Megatron-Core\n  \
        occult trace import responses.json --model Qwen/Qwen3-30B-A3B -o t.safetensors   # vLLM / SGLang routed experts\n  \
        occult trace import expert_statistic/ --experts 256 -o t.safetensors   # TensorRT-LLM's dump\n\n\
        In Python: np.savez('routing.npz', **{f'layers.{l}.topk_ids': ids[l] for l in layers}), \
        or one stacked array np.savez('routing.npz', topk_ids=ids, layer_ids=layers). \
        scripts/record_routing.py records a transformers model's routing straight into a trace.")]
    Import(ImportArgs),
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// The routing files (.npz, .npy, .safetensors, SGLang's per_token .pt dumps,
    /// Megatron-Core's router_trace_rank*.jsonl, vLLM's / SGLang's routed-expert responses as
    /// .json with --model, or TensorRT-LLM's expert-statistic folder): their tokens are
    /// concatenated in order.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Experts per layer.
    #[arg(long, required_unless_present = "model")]
    pub experts: Option<usize>,
    /// A model whose config.json gives the experts per layer (a folder or a cached hub id).
    #[arg(long, conflicts_with = "experts")]
    pub model: Option<String>,
    /// The model layer of a single [tokens, k] array.
    #[arg(long)]
    pub layer: Option<usize>,
    /// What text was routed (recorded in the trace).
    #[arg(long)]
    pub data: Option<String>,
    /// Output trace.
    #[arg(short, long)]
    pub output: PathBuf,
}

/// Which numbering `occult trace remap` writes.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Numbering {
    /// The original model's expert ids.
    Original,
    /// The exported checkpoint's expert ids.
    Exported,
}

#[derive(Args, Debug)]
pub struct RemapArgs {
    /// The trace to map.
    #[arg(long)]
    pub trace: PathBuf,
    /// The exported checkpoint's folder (its occult.renumbering.json is used).
    #[arg(long, conflicts_with = "renumbering")]
    pub model: Option<PathBuf>,
    /// The renumbering file itself.
    #[arg(long)]
    pub renumbering: Option<PathBuf>,
    /// The numbering to write.
    #[arg(long, value_enum, default_value_t = Numbering::Original)]
    pub to: Numbering,
    /// Output trace.
    #[arg(short, long)]
    pub output: PathBuf,
}

#[derive(Args, Debug)]
pub struct SynthArgs {
    #[arg(long, default_value_t = 64)]
    pub experts: usize,
    #[arg(long, default_value_t = 8)]
    pub top_k: usize,
    #[arg(long, default_value_t = 16)]
    pub layers: usize,
    #[arg(long, default_value_t = 20000)]
    pub tokens: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Latent expert clusters per layer.
    #[arg(long, default_value_t = 8)]
    pub clusters: usize,
    /// Logit boost of a token's own cluster (0 = no structure).
    #[arg(long, default_value_t = 2.0)]
    pub strength: f32,
    /// Spread of per-expert popularity (0 = equal popularity).
    #[arg(long, default_value_t = 0.3)]
    pub skew: f32,
    /// Uniform-random routing (the null case): sets --strength 0 --skew 0.
    #[arg(long)]
    pub uniform: bool,
    /// Renormalise the top-k gate weights (Mixtral/Qwen3 style).
    #[arg(long)]
    pub renormalize: bool,
    /// Do not store router logits (smaller file; pruning then cannot run on it).
    #[arg(long)]
    pub no_logits: bool,
    /// Record that tokens came from this many source ranks.
    #[arg(long)]
    pub num_ranks: Option<usize>,
    /// Route group-limited as DeepSeek-V3 does: experts in this many groups of consecutive
    /// ids, each token's experts from its best --topk-groups groups (a group scored by its two
    /// best experts).
    #[arg(long, requires = "topk_groups")]
    pub groups: Option<usize>,
    /// With --groups: the groups each token's experts come from.
    #[arg(long, requires = "groups")]
    pub topk_groups: Option<usize>,
    /// Output trace.
    #[arg(short, long)]
    pub output: PathBuf,
}

pub fn run(cmd: TraceCmd) -> Result<()> {
    match cmd {
        TraceCmd::Synth(a) => synth(a),
        TraceCmd::Info { trace } => info(trace),
        TraceCmd::Remap(a) => remap(a),
        TraceCmd::Import(a) => import(a),
    }
}

fn synth(a: SynthArgs) -> Result<()> {
    super::check_io(&[], &[Some(&a.output)])?;
    let mut cfg = SynthConfig {
        num_experts: a.experts,
        top_k: a.top_k,
        layers: a.layers,
        tokens: a.tokens,
        seed: a.seed,
        clusters: a.clusters,
        strength: a.strength,
        skew: a.skew,
        renormalize: a.renormalize,
        with_logits: !a.no_logits,
        group_limit: a.groups.zip(a.topk_groups).map(|(g, m)| GroupLimit {
            num_groups: g,
            topk_groups: m,
            score: GroupScore::Top2Sum,
        }),
    };
    if a.uniform {
        cfg = cfg.uniform();
    }
    if a.num_ranks == Some(0) {
        anyhow::bail!("--num-ranks must be at least 1");
    }
    let pb = bar(cfg.layers as u64, "layers");
    let mut trace = synth_trace(&cfg, &|| pb.inc(1))?;
    pb.finish_and_clear();
    trace.meta.num_ranks = a.num_ranks;
    trace.write(&a.output)?;
    eprintln!(
        "wrote {} ({} layers x {} tokens, {} experts, top-{})",
        a.output.display(),
        cfg.layers,
        cfg.tokens,
        cfg.num_experts,
        cfg.top_k
    );
    Ok(())
}

fn import(a: ImportArgs) -> Result<()> {
    use occult_core::interop::routing_import::{import_all, ImportOptions};
    let inputs: Vec<Option<&std::path::Path>> = a.files.iter().map(|f| Some(f.as_path())).collect();
    super::check_io(&inputs, &[Some(&a.output)])?;
    let num_experts = match (a.experts, &a.model) {
        (Some(e), _) => e,
        (None, Some(m)) => {
            let dir = occult_core::models::checkpoint::resolve(m, None)?.dir;
            occult_core::interop::checkpoint::ExpertLayout::read(&dir)?.num_experts
        }
        (None, None) => anyhow::bail!("give --experts E or --model M"),
    };
    occult_core::analysis::placement::check_sizes(num_experts, 1)?;
    // Routed-expert responses lay out every hidden layer: the model says which are MoE layers.
    let layers = match &a.model {
        Some(m) => {
            let dir = occult_core::models::checkpoint::resolve(m, None)?.dir;
            let layout = occult_core::interop::checkpoint::ExpertLayout::read(&dir)?;
            let config: serde_json::Value =
                serde_json::from_str(&occult_core::input::read_text(&dir.join("config.json"))?)?;
            config["num_experts_per_tok"]
                .as_u64()
                .map(|k| occult_core::interop::r3::ModelLayers {
                    num_layers: layout.num_layers,
                    moe_layers: layout.moe_layers.clone(),
                    top_k: k as usize,
                })
        }
        None => None,
    };
    let opts = ImportOptions {
        num_experts,
        layer: a.layer,
        model: a.model.clone(),
        data: a.data.clone(),
        layers,
    };
    let mut t = import_all(&a.files, &opts)?;
    if let Some(m) = &a.model {
        // Routing recorded on an exported checkpoint is in its numbering: say so, as profile does.
        let dir = occult_core::models::checkpoint::resolve(m, None)?.dir;
        crate::jobs::profile::mark_exported(&mut t, &dir);
    }
    t.write(&a.output)?;
    eprintln!(
        "wrote {} ({} layers, {} tokens in the first, {} experts, top-{})",
        a.output.display(),
        t.layers.len(),
        t.layers[0].tokens,
        t.meta.num_experts,
        t.meta.top_k
    );
    Ok(())
}

fn remap(a: RemapArgs) -> Result<()> {
    use occult_core::interop::checkpoint::renumbering::{
        Renumbering, RENUMBERING_FILE, TRACE_NUMBERING_KEY,
    };
    let file = match (&a.model, &a.renumbering) {
        (Some(m), None) => m.join(RENUMBERING_FILE),
        (None, Some(r)) => r.clone(),
        _ => anyhow::bail!("give --model EXPORTED_FOLDER or --renumbering FILE"),
    };
    super::check_io(&[Some(&a.trace), Some(&file)], &[Some(&a.output)])?;
    let ren = Renumbering::read(&file)?;
    let t = super::load_trace(&a.trace)?;
    let marked = t.meta.extra.contains_key(TRACE_NUMBERING_KEY);
    let mut out = match (a.to, marked) {
        (Numbering::Original, true) => ren.to_original(&t)?,
        (Numbering::Exported, false) => ren.to_exported(&t)?,
        (Numbering::Original, false) => anyhow::bail!(
            "{} is already in the original numbering (no {TRACE_NUMBERING_KEY} metadata, which \
             `occult profile` writes for an exported checkpoint)",
            a.trace.display()
        ),
        (Numbering::Exported, true) => anyhow::bail!(
            "{} is already in an exported numbering ({TRACE_NUMBERING_KEY} = {})",
            a.trace.display(),
            t.meta.extra[TRACE_NUMBERING_KEY]
        ),
    };
    match a.to {
        Numbering::Original => {
            out.meta.extra.remove(TRACE_NUMBERING_KEY);
        }
        Numbering::Exported => {
            out.meta.extra.insert(
                TRACE_NUMBERING_KEY.into(),
                format!("exported ({})", file.display()),
            );
        }
    }
    out.write(&a.output)?;
    eprintln!(
        "wrote {} ({} layers, {} numbering)",
        a.output.display(),
        out.layers.len(),
        match a.to {
            Numbering::Original => "original",
            Numbering::Exported => "exported",
        }
    );
    Ok(())
}

fn info(path: PathBuf) -> Result<()> {
    let t = super::load_trace(&path)?;
    let m = &t.meta;
    println!("trace {}", path.display());
    println!("  experts {}, top-{}", m.num_experts, m.top_k);
    for (k, v) in [("model", &m.model), ("data", &m.data)] {
        if let Some(v) = v {
            println!("  {k}: {v}");
        }
    }
    if let Some(r) = m.num_ranks {
        println!("  source ranks: {r}");
    }
    for (k, v) in &m.extra {
        println!("  {k}: {v}");
    }
    let mut tab = Table::new(&["layer", "tokens", "weights", "router logits"]);
    for l in &t.layers {
        tab.row(vec![
            l.layer.to_string(),
            count(l.tokens as u64),
            if l.topk_weights.is_some() {
                "yes"
            } else {
                "no"
            }
            .into(),
            if l.router_logits.is_some() {
                "yes"
            } else {
                "no"
            }
            .into(),
        ]);
    }
    print!("{}", tab.render());
    Ok(())
}
