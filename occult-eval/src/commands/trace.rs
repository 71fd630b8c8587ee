//! `occult trace synth` (synthetic routing traces) and `occult trace info` (what a trace holds).

use crate::progress::bar;
use crate::table::{count, Table};
use anyhow::Result;
use clap::{Args, Subcommand};
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
    /// Output trace.
    #[arg(short, long)]
    pub output: PathBuf,
}

pub fn run(cmd: TraceCmd) -> Result<()> {
    match cmd {
        TraceCmd::Synth(a) => synth(a),
        TraceCmd::Info { trace } => info(trace),
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
