//! `occult model`: make a synthetic checkpoint, or describe one.

use super::model_opts::ModelOpts;
use anyhow::{bail, Context, Result};
use occult_core::models::family::{family, supported};
use occult_core::models::memory;
use occult_core::models::synth::SynthModel;
use std::path::PathBuf;

#[derive(clap::Subcommand, Debug)]
pub enum ModelCmd {
    /// Write a random checkpoint of a family (config.json, model.safetensors, and a tokenizer
    /// that transformers and llama.cpp read).
    Synth(SynthArgs),
    /// Print a checkpoint's configuration and size.
    Info(InfoArgs),
    /// Load every tensor (and the tokenizer) and check names and shapes.
    Check(InfoArgs),
    /// Build (or find in the cache) the built-in model of `occult reproduce`, with its data;
    /// prints its folder.
    Builtin(BuiltinArgs),
}

#[derive(clap::Args, Debug)]
pub struct BuiltinArgs {
    /// Where to build it [default: $OCCULT_CACHE/builtin, else ~/.cache/occult/builtin].
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Build it again from nothing: generate the data and pre-train (minutes), even where the
    /// cache holds it or the committed weights fit.
    #[arg(long, alias = "force")]
    pub rebuild: bool,
    /// After building, write the weights, log and manifest that occult-eval/builtin/ commits
    /// into DIR (the default recipe, pre-trained from nothing: with --rebuild;
    /// scripts/builtin-weights.sh does both).
    #[arg(long, value_name = "DIR", requires = "rebuild")]
    pub export_weights: Option<std::path::PathBuf>,
    /// A TOML file of recipe fields to change (the `[builtin]` table of a reproduce recipe:
    /// `steps`, `hidden`, `[sizes]`, ...); the default recipe otherwise. A changed recipe is
    /// cached in a folder of its own unless --dir is given.
    #[arg(long)]
    pub recipe: Option<std::path::PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct SynthArgs {
    /// olmoe, qwen2_moe, deepseek, mixtral or qwen3_moe.
    #[arg(long)]
    pub family: String,
    #[arg(long, default_value_t = 1024)]
    pub vocab: usize,
    #[arg(long, default_value_t = 128)]
    pub hidden: usize,
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 8)]
    pub experts: usize,
    #[arg(long, default_value_t = 2)]
    pub top_k: usize,
    /// Expert intermediate size.
    #[arg(long, default_value_t = 64)]
    pub intermediate: usize,
    /// Dense-layer intermediate size (with --dense-layers) [default: 256].
    #[arg(long)]
    pub dense_intermediate: Option<usize>,
    /// Shared-expert intermediate size (qwen2_moe, deepseek) [default: 128].
    #[arg(long)]
    pub shared_intermediate: Option<usize>,
    /// Leading dense layers (deepseek, qwen2_moe, qwen3_moe) [default: 0].
    #[arg(long)]
    pub dense_layers: Option<usize>,
    /// Store experts fused, as transformers v5 saves them.
    #[arg(long)]
    pub fused: bool,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output folder.
    #[arg(short, long)]
    pub output: PathBuf,
}

#[derive(clap::Args, Debug)]
pub struct InfoArgs {
    #[command(flatten)]
    pub model: ModelOpts,
}

pub fn run(c: ModelCmd) -> Result<()> {
    match c {
        ModelCmd::Synth(a) => synth(a),
        ModelCmd::Info(a) => info(a),
        ModelCmd::Check(a) => check(a),
        ModelCmd::Builtin(a) => builtin(a),
    }
}

fn builtin(a: BuiltinArgs) -> Result<()> {
    use crate::builtin::{committed, dir_for, ensure, BuiltinRecipe};
    let recipe = match &a.recipe {
        None => BuiltinRecipe::default(),
        Some(path) => BuiltinRecipe::read(path)?,
    };
    if a.export_weights.is_some() && recipe != BuiltinRecipe::default() {
        bail!("--export-weights: only the default recipe's weights are committed (drop --recipe)");
    }
    let dir = a.dir.unwrap_or_else(|| dir_for(&recipe));
    let clock = std::time::Instant::now();
    let b = ensure(&dir, &recipe, a.rebuild)?;
    let how = match b.provenance() {
        Some(p) if p.weights == "committed" => " (the committed weights)".to_string(),
        Some(p) => format!(" (pre-trained in {:.0} s)", p.pretrain_seconds),
        None => String::new(),
    };
    eprintln!(
        "built-in model ready in {:.1} s{how}",
        clock.elapsed().as_secs_f64()
    );
    if let Some(out) = &a.export_weights {
        let p = b
            .provenance()
            .context("the built folder has no provenance.json")?;
        let built = format!(
            "occult {} from nothing in {:.0} s on {} ({} threads, kernels {})",
            env!("CARGO_PKG_VERSION"),
            p.pretrain_seconds,
            std::env::consts::ARCH,
            rayon::current_num_threads(),
            occult_core::kernels::isa::process_level().name()
        );
        committed::export(&b.dir, &recipe, &p.start_sha256, &built, out)?;
        eprintln!(
            "wrote model.safetensors, log.jsonl and manifest.json into {}",
            out.display()
        );
    }
    println!("{}", b.model().display());
    Ok(())
}

fn synth(a: SynthArgs) -> Result<()> {
    let Some(family) = family(&a.family) else {
        bail!("unknown family {:?} (one of {})", a.family, supported())
    };
    let dtype = match a.dtype.as_str() {
        "f32" => safetensors::Dtype::F32,
        "bf16" => safetensors::Dtype::BF16,
        "f16" => safetensors::Dtype::F16,
        other => bail!("--dtype {other:?} is not one of f32, bf16, f16"),
    };
    let parts = family.synth_parts;
    let lacks = |given: bool, has: bool, flag: &str, part: &str| {
        if given && !has {
            bail!("--{flag}: {} models have no {part}", family.model_type)
        }
        Ok(())
    };
    lacks(
        a.shared_intermediate.is_some(),
        parts.shared_experts,
        "shared-intermediate",
        "shared experts",
    )?;
    lacks(
        a.dense_layers.is_some(),
        parts.dense_layers,
        "dense-layers",
        "dense layers",
    )?;
    lacks(
        a.dense_intermediate.is_some(),
        parts.dense_layers,
        "dense-intermediate",
        "dense layers",
    )?;
    if a.dense_intermediate.is_some() && a.dense_layers.unwrap_or(0) == 0 {
        bail!("--dense-intermediate sizes the leading dense layers, but --dense-layers is 0");
    }
    let s = SynthModel {
        family,
        vocab: a.vocab,
        hidden: a.hidden,
        layers: a.layers,
        heads: a.heads,
        kv_heads: a.kv_heads,
        experts: a.experts,
        top_k: a.top_k,
        expert_intermediate: a.intermediate,
        dense_intermediate: a.dense_intermediate.unwrap_or(256),
        shared_intermediate: a.shared_intermediate.unwrap_or(128),
        dense_layers: a.dense_layers.unwrap_or(0),
        fused: a.fused,
        dtype,
        seed: a.seed,
        std: 0.02,
        rms_norm_eps: family.default_rms_norm_eps,
    };
    let (cfg, bytes) = s.write(&a.output)?;
    eprintln!(
        "{}: {} layers, {} experts (top-{}), {:.1} MB of weights",
        a.output.display(),
        cfg.num_layers,
        cfg.moe.num_experts,
        cfg.moe.top_k,
        bytes as f64 / 1e6
    );
    Ok(())
}

fn info(a: InfoArgs) -> Result<()> {
    let spec = a.model.spec()?;
    let ck = spec.open_header()?;
    let c = &ck.cfg;
    let bytes = weight_bytes(&ck);
    let ranks = a.model.devices.max(1);
    let serve = memory::estimate(&ck.weights, ck.weights.dtype(), 1, false);
    let per_rank = memory::estimate(&ck.weights, ck.weights.dtype(), ranks, false);
    let train = memory::estimate(&ck.weights, ck.weights.dtype(), 1, true);
    let v = serde_json::json!({
        "model": ck.name,
        "folder": ck.files.dir,
        "family": c.family.model_type,
        "layers": c.num_layers,
        "moe_layers": (0..c.num_layers).filter(|&l| c.moe_layers[l]).collect::<Vec<_>>(),
        "hidden_size": c.hidden_size,
        "heads": c.num_heads,
        "kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "num_experts": c.moe.num_experts,
        "top_k": c.moe.top_k,
        "expert_intermediate": c.moe.expert_intermediate,
        "renormalize": c.moe.renormalize,
        "router": {
            "scoring": c.moe.router.scoring,
            "group_limit": c.moe.router.group_limit,
            "scaling_factor": c.moe.router.scaling_factor,
            "selection_bias": c.moe.router.selection_bias,
        },
        "rotary_dim": c.rotary_dim,
        "shared_intermediate": c.moe.shared.map(|s| s.intermediate),
        "weight_files": ck.files.weights.len(),
        "weight_bytes": bytes,
        "tokenizer": ck.files.tokenizer,
        "memory_estimate": {
            "dtype": a.model.dtype,
            "weights_bytes": serve.weights,
            "per_rank_bytes_under_mpirun": {"ranks": ranks, "bytes": per_rank.weights},
            "training_bytes": train.total(),
            "available_bytes": memory::available(),
        },
    });
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

fn check(a: InfoArgs) -> Result<()> {
    let clock = std::time::Instant::now();
    let spec = a.model.spec()?;
    let ck = spec.open()?;
    let bytes = weight_bytes(&ck);
    let Some(params) = spec.run(&ck, |m| {
        Ok(m.params()
            .iter()
            .map(|(_, t)| t.elem_count())
            .sum::<usize>())
    })?
    else {
        return Ok(());
    };
    let peak = peak_rss_bytes();
    println!(
        "{}: ok ({:?}, {params} parameters on rank 0, tokenizer {}, weights {:.1} MB, loaded in \
         {:.2} s, peak RSS {})",
        ck.name,
        ck.cfg.family,
        if ck.tokenizer.is_some() {
            "ok"
        } else {
            "absent"
        },
        bytes as f64 / 1e6,
        clock.elapsed().as_secs_f64(),
        match peak {
            Some(p) => format!(
                "{:.1} MB = {:.2}x the weights",
                p as f64 / 1e6,
                p as f64 / bytes.max(1) as f64
            ),
            None => "unknown".into(),
        }
    );
    Ok(())
}

/// The process's peak resident memory (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The size of a checkpoint's weight files.
fn weight_bytes(ck: &occult_core::models::loader::Checkpoint) -> u64 {
    ck.files
        .weights
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}
