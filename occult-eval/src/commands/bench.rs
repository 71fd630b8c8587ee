//! `occult bench`: the benchmarks' flags. Each subcommand turns its flags into values and calls
//! its benchmark in [`crate::bench`], which runs it, prints its table and writes its JSON.

use super::model_opts::ModelOpts;
use crate::bench;
use crate::context::Backend;
use anyhow::Result;
use clap::{Args, Subcommand};
use occult_core::analysis::placement::{Method, SearchConfig};
use occult_core::analysis::pruning::PruneRule;
use std::path::{Path, PathBuf};

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// One OLMoE-shaped MoE layer on D ranks: reference, standard, occult and pruned occult in
    /// one run on the same tokens; per-phase times, exact traffic, E[C_T], projections.
    #[command(after_help = "Examples:\n  \
        occult bench layer                                   # 4 local ranks, 64 experts, top-8\n  \
        occult bench layer --link pcie4 --json layer.json    # + projected time on the paper's box\n  \
        mpirun -np 4 occult bench layer --backend mpi        # one process per rank (feature mpi)\n  \
        occult bench layer --cuda 0 --backend nccl --devices 1 --dtype bf16   # a GPU (feature nccl)")]
    Layer(LayerBenchArgs),
    /// Time contiguous, greedy and occult placement on the same traces; compare E[C_T].
    #[command(after_help = "Example:\n  \
        occult trace synth --tokens 100000 -o clustered.safetensors --no-logits\n  \
        occult trace synth --tokens 100000 --uniform -o uniform.safetensors --no-logits\n  \
        occult bench place --trace clustered.safetensors --trace uniform.safetensors --devices 4,8,16")]
    Place(PlaceBenchArgs),
    /// Prefill and decode speed of a model; with `--against candle-transformers`, against
    /// candle-transformers' own implementation on the same weights in the same run.
    #[command(after_help = "Example:\n  \
        occult model synth --family qwen2_moe --hidden 1024 --layers 8 --experts 32 -o mid\n  \
        occult bench model --model mid --against candle-transformers")]
    Model(ModelBenchArgs),
    /// A fine-tuning step of the MoE blocks on D ranks: standard, Occult, and Occult pruned to 2
    /// and 1 devices, side by side on the same model and data.
    #[command(after_help = "Example:\n  \
        occult model synth --family olmoe --hidden 256 --layers 4 --experts 64 --top-k 8 \\\n      \
        --intermediate 128 -o /tmp/olmoe-256\n  \
        occult bench train --model /tmp/olmoe-256 --devices 4 --link pcie4")]
    Train(TrainBenchArgs),
    /// A benchmark suite from a file (configs/bench/*.toml): a prefill sweep over token counts,
    /// decode over batch sizes, or a training step, every mode side by side at each point.
    #[command(after_help = "Examples:\n  \
        occult bench suite configs/bench/prefill.toml --json prefill.json\n  \
        occult bench suite configs/bench/decode.toml\n  \
        mpirun -np 4 occult bench suite configs/bench/train.toml --backend mpi   # feature mpi\n\n\
        On the built-in model (model = \"builtin\"), Occult's placement is made from its \
        calibration text on first use and kept beside it; give --placement for another model \
        (without one, experts are placed contiguously).")]
    Suite(SuiteArgs),
    /// Generation as the generative tasks run it (continuous batching, a cache per request,
    /// stop checks) against a plain batched decode of the same prompts, in one run.
    #[command(after_help = "Example:\n  \
        occult bench generate --model ~/.cache/occult/builtin/model --batch 8")]
    Generate(GenBenchArgs),
    /// Evaluation speed with and without context reuse, side by side on the same items.
    #[command(after_help = "Example:\n  \
        occult bench eval --model tests/fixtures/models/olmoe --tasks hellaswag,arc_easy,mmlu --samples")]
    Eval(super::eval::EvalArgs),
    /// The linear kernels side by side on the same operands: candle's matmul, the portable path
    /// and Occult's kernels at this CPU's level (AVX2, AVX-512, AMX), in f32 and bf16, with GFLOP/s and each one's largest
    /// difference from the portable path; and the memory read bandwidth that bounds decode.
    #[command(after_help = "Examples:\n  \
        occult bench kernels                                 # OLMoE's expert shapes\n  \
        occult bench kernels --shapes 64x1024x2048,1x2048x1024 --json kernels.json")]
    Kernels(KernelBenchArgs),
}

#[derive(Args, Debug)]
pub struct KernelBenchArgs {
    /// Shapes MxNxK (rows x output features x input features): by default an OLMoE expert's
    /// gate/up (N=1024, K=2048) and down (N=2048, K=1024) projections at 64 rows (512 tokens,
    /// top-8 of 64 experts) and at 1 row (decode), and a 512-row dense projection.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "64x1024x2048,64x2048x1024,1x1024x2048,512x2048x2048"
    )]
    pub shapes: Vec<String>,
    /// Timed calls per candidate (the best is kept).
    #[arg(long, default_value_t = 10)]
    pub repeat: usize,
    /// Buffer for the bandwidth measurement, MiB.
    #[arg(long, default_value_t = 512)]
    pub bandwidth_mib: usize,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct SuiteArgs {
    /// The suite file.
    pub file: PathBuf,
    /// Run the ranks as threads (local), one process each under mpirun (mpi), or one process
    /// per GPU, rank r of a node on GPU r (nccl; feature nccl).
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    pub backend: Backend,
    /// Override the suite's model.
    #[arg(long)]
    pub model: Option<String>,
    /// Occult's placement file (default: made for the built-in model; contiguous otherwise).
    #[arg(long)]
    pub placement: Option<PathBuf>,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct TrainBenchArgs {
    #[command(flatten)]
    pub model: ModelOpts,
    /// Sequences per rank and step.
    #[arg(long, default_value_t = 2)]
    pub batch_size: usize,
    /// Tokens per sequence (random ids).
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    /// Steps run before measuring.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Measured steps (the fastest is reported).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Project the step onto this machine: pcie4, nvlink-h100, ib-ndr, or a TOML file.
    #[arg(long)]
    pub link: Option<String>,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct PlaceBenchArgs {
    /// Routing traces (repeat the flag for several).
    #[arg(long, required = true)]
    pub trace: Vec<PathBuf>,
    /// Device counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
    pub devices: Vec<usize>,
    #[arg(long, default_value_t = 2)]
    pub restarts: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Redundant expert slots: also run Occult under a 1.05 load cap and DeepSeek's EPLB with
    /// this many replicas (E + R must fill the devices evenly), its copies chosen by Occult's
    /// cover rule and by SGLang's static rule.
    #[arg(long, default_value_t = 0)]
    pub replicas: usize,
    /// Link profiles (configs/links/ names or files) to project each placement's MoE layer
    /// onto: its one-row-per-device exchange and its slowest device's expert compute, at
    /// OLMoE-1B-7B's layer size.
    #[arg(long, value_delimiter = ',', default_value = "pcie4,nvlink-h100")]
    pub link: Vec<String>,
    /// Tokens each device holds in the projection.
    #[arg(long, default_value_t = 2048)]
    pub tokens_per_device: usize,
    /// Also the routes table: Occult's partition per layer, one map shared by every layer and
    /// (with --replicas) the partition with copies, each written as every engine's file
    /// (renumbered checkpoint, SGLang, TensorRT-LLM, vLLM #49572 and #34811), read back as the
    /// engine reads it and counted under its copy rule.
    #[arg(long)]
    pub routes: bool,
    /// With --routes: the load cap (max over mean, at least 1) the routes' partitions, shared
    /// map and copies are placed within (default: none).
    #[arg(long, requires = "routes", value_parser = load_cap)]
    pub routes_load_cap: Option<f64>,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct GenBenchArgs {
    #[command(flatten)]
    pub model: ModelOpts,
    /// Prompt length (random token ids).
    #[arg(long, default_value_t = 32)]
    pub prompt_len: usize,
    /// Prompts per rank: one batch, or requests in flight.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens generated after each prompt.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: usize,
    /// Paired, alternating repeats (the median ratio is reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct ModelBenchArgs {
    #[command(flatten)]
    pub model: ModelOpts,
    /// Prompt length (random token ids).
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Prompts per rank, prefilled and decoded as one batch (with --devices > 1).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Decode steps after the prompt.
    #[arg(long, default_value_t = 16)]
    pub decode_tokens: usize,
    /// Repeats of each measurement (the best is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Also run another implementation on the same weights.
    #[arg(long, value_enum)]
    pub against: Option<bench::model::Against>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// With --against llama.cpp: the converted GGUF, used as it is when present and written
    /// there otherwise (without it, the checkpoint is converted again at every run).
    #[arg(long, value_name = "PATH")]
    pub gguf: Option<std::path::PathBuf>,
    /// With --devices D > 1: project the prefill onto this machine (pcie4, nvlink-h100,
    /// ib-ndr, or a TOML file).
    #[arg(long)]
    pub link: Option<String>,
}

#[derive(Args, Debug)]
pub struct LayerBenchArgs {
    #[arg(long, default_value_t = 64)]
    pub experts: usize,
    #[arg(long, default_value_t = 8)]
    pub top_k: usize,
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    #[arg(long, default_value_t = 128)]
    pub intermediate: usize,
    /// Tokens per rank.
    #[arg(long, default_value_t = 512)]
    pub tokens: usize,
    #[arg(long, default_value_t = 4)]
    pub devices: usize,
    /// Measured steps per mode (after --warmup).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Latent clusters of the synthetic router (0 = unstructured).
    #[arg(long, default_value_t = 8)]
    pub clusters: usize,
    /// How experts are placed (from a calibration batch).
    #[arg(long, value_enum, default_value_t = Method::Occult)]
    pub placement: Method,
    /// Devices per token in the pruned run (0 = no pruned run).
    #[arg(long, default_value_t = 2)]
    pub max_devices: usize,
    /// Devices per node: with fewer than --devices, the two-level exchange runs as one more
    /// mode. Default: the link profile's ranks per node, when its link between nodes is the
    /// slower.
    #[arg(long)]
    pub devices_per_node: Option<usize>,
    #[arg(long, value_enum, default_value_t = PruneRule::Similarity)]
    pub prune_rule: PruneRule,
    /// local: ranks as threads; mpi: one process per rank under mpirun (feature mpi); nccl:
    /// one process per GPU (feature nccl; more than one under mpirun).
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    pub backend: Backend,
    /// Run on CUDA device N (feature cuda); under mpirun with `--backend nccl`, the rank
    /// mpirun numbers r on its node runs on device N + r.
    #[arg(long, value_name = "N")]
    pub cuda: Option<usize>,
    /// The layer's dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Project times onto this machine: pcie4, nvlink-h100, ib-ndr, or a TOML file.
    #[arg(long)]
    pub link: Option<String>,
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Renormalise the top-k gate weights over the chosen experts (DeepSpeed-MoE's TopKGate,
    /// Qwen3-MoE, Mixtral); OLMoE's plain softmax by default.
    #[arg(long)]
    pub renormalize: bool,
    /// Write the layer (router, experts), every rank's tokens and the layer's output on them
    /// here, f32 safetensors, for another engine to run (scripts/bench_deepspeed_moe.py
    /// --layer FILE).
    #[arg(long, value_name = "FILE")]
    pub layer_out: Option<PathBuf>,
    /// Time a training step instead of a forward: the forward, then the backward of the sum of
    /// the outputs (gradients for the tokens, the router and every expert; the reverse
    /// exchanges included), as DeepSpeed-MoE's peer script times it.
    #[arg(long)]
    pub train: bool,
}

pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Place(a) => place(a),
        BenchCmd::Layer(a) => layer(a),
        BenchCmd::Model(a) => model(a),
        BenchCmd::Eval(a) => eval(a),
        BenchCmd::Generate(a) => generate(a),
        BenchCmd::Train(a) => train(a),
        BenchCmd::Suite(a) => suite(a),
        BenchCmd::Kernels(a) => kernels(a),
    }
}

fn kernels(a: KernelBenchArgs) -> Result<()> {
    super::check_io(&[], &[a.json.as_deref()])?;
    let shapes = bench::kernels::parse_shapes(&a.shapes)?;
    bench::kernels::run(&shapes, a.repeat, a.bandwidth_mib, a.json.as_deref())
}

fn suite(a: SuiteArgs) -> Result<()> {
    super::check_io(
        &[Some(&a.file), a.placement.as_deref()],
        &[a.json.as_deref()],
    )?;
    bench::suite::bench(
        &a.file,
        a.model.as_deref(),
        a.placement.as_deref(),
        a.backend,
        a.json.as_deref(),
    )
}

fn train(a: TrainBenchArgs) -> Result<()> {
    let spec = a.model.spec()?;
    spec.check_io(&[], &[a.json.as_deref()])?;
    let link = a
        .link
        .as_deref()
        .map(occult_core::analysis::cost::links::LinkProfile::load)
        .transpose()?;
    let b = bench::train::TrainBench {
        devices: spec.devices,
        batch_per_rank: a.batch_size,
        seq_len: a.seq_len,
        warmup: a.warmup,
        steps: a.steps,
        seed: a.seed,
    };
    bench::train::bench(&spec, &b, link.as_ref(), a.json.as_deref())
}

fn place(a: PlaceBenchArgs) -> Result<()> {
    let traces: Vec<Option<&Path>> = a.trace.iter().map(|t| Some(t.as_path())).collect();
    super::check_io(&traces, &[a.json.as_deref()])?;
    let cfg = SearchConfig {
        restarts: a.restarts,
        seed: a.seed,
        max_load_factor: None,
        nodes: None,
    };
    let links: Vec<&str> = a.link.iter().map(String::as_str).collect();
    let proj = bench::place::PlaceProjection::olmoe_on(&links, a.tokens_per_device)?;
    let routes = a.routes.then(|| SearchConfig {
        max_load_factor: a.routes_load_cap,
        ..cfg.clone()
    });
    bench::place::run(
        &a.trace,
        &a.devices,
        &cfg,
        a.replicas,
        &proj,
        routes.as_ref(),
        a.json.as_deref(),
    )
}

fn eval(a: super::eval::EvalArgs) -> Result<()> {
    bench::eval::run(&a.model.spec()?, &a.job(), a.output.as_deref())
}

fn generate(a: GenBenchArgs) -> Result<()> {
    let spec = a.model.spec()?;
    spec.check_io(&[], &[a.json.as_deref()])?;
    let b = bench::generate::GenBench {
        prompt_len: a.prompt_len,
        batch: a.batch,
        decode_tokens: a.decode_tokens,
        repeats: a.repeats,
        seed: a.seed,
    };
    bench::generate::run(&spec, &b, a.json.as_deref())
}

fn model(a: ModelBenchArgs) -> Result<()> {
    let spec = a.model.spec()?;
    spec.check_io(&[], &[a.json.as_deref()])?;
    let b = bench::model::ModelBench {
        prompt_len: a.prompt_len,
        batch: a.batch,
        decode_tokens: a.decode_tokens,
        repeats: a.repeats,
        against: a.against,
        seed: a.seed,
        gguf: a.gguf,
        link: a.link,
    };
    bench::model::run(&spec, &b, a.json.as_deref())
}

fn layer(a: LayerBenchArgs) -> Result<()> {
    super::check_io(&[], &[a.json.as_deref(), a.layer_out.as_deref()])?;
    let device = crate::context::device::pick_device(a.cuda, a.backend)?;
    let link = a
        .link
        .as_deref()
        .map(occult_core::analysis::cost::links::LinkProfile::load)
        .transpose()?;
    let devices_per_node = bench::modes::node_size(a.devices_per_node, link.as_ref(), a.devices);
    let b = bench::layer::LayerBench {
        experts: a.experts,
        top_k: a.top_k,
        hidden: a.hidden,
        intermediate: a.intermediate,
        tokens: a.tokens,
        devices: a.devices,
        steps: a.steps,
        warmup: a.warmup,
        seed: a.seed,
        clusters: a.clusters,
        placement: a.placement,
        max_devices: a.max_devices,
        devices_per_node,
        prune_rule: a.prune_rule,
        renormalize: a.renormalize,
        layer_out: a.layer_out.clone(),
        train: a.train,
        device_name: crate::context::device::device_name(&device),
        dtype: a.dtype.clone(),
        device,
    };
    bench::layer::run(&b, a.backend, link.as_ref(), a.json.as_deref())
}

/// A load cap: a finite factor of at least 1 (the mean itself).
fn load_cap(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(c) if c.is_finite() && c >= 1.0 => Ok(c),
        _ => Err(format!(
            "{s:?} is not a load cap: a number of at least 1 (the busiest device over the mean)"
        )),
    }
}
