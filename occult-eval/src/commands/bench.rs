//! `occult bench`: benchmarks as commands. `bench place` times each placement method on the same
//! traces and device counts in one run and reports E[C_T] side by side.

use super::Backend;
use super::{load_trace, with_provenance, write_json};
use crate::table::Table;
use anyhow::Result;
use clap::{Args, Subcommand};
use occult_core::analysis::place_trace;
use occult_core::analysis::placement::{Method, SearchConfig};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

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
    Model(crate::bench_model::ModelBenchArgs),
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
    pub model: super::model_opts::ModelOpts,
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
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One timed placement run.
#[derive(Clone, Debug, Serialize)]
pub struct PlaceRun {
    pub trace: String,
    pub method: &'static str,
    pub devices: usize,
    pub layers: usize,
    pub tokens: usize,
    pub seconds: f64,
    pub ect: f64,
}

pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Place(a) => place(a),
        BenchCmd::Layer(a) => layer(a),
        BenchCmd::Model(a) => crate::bench_model::run(a),
        BenchCmd::Eval(a) => super::eval::bench(a),
        BenchCmd::Train(a) => train(a),
        BenchCmd::Suite(a) => suite(a),
        BenchCmd::Kernels(a) => kernels(a),
    }
}

fn kernels(a: KernelBenchArgs) -> Result<()> {
    use occult_core::kernels::{bench, describe, isa, process_level, Simd};
    super::check_io(&[], &[a.json.as_deref()])?;
    let mut shapes = Vec::new();
    for s in &a.shapes {
        let dims: Vec<usize> = s
            .split('x')
            .map(|d| d.trim().parse::<usize>())
            .collect::<Result<_, _>>()
            .map_err(|_| anyhow::anyhow!("--shapes: {s:?} is not MxNxK (three whole numbers)"))?;
        let [m, n, k] = dims[..] else {
            anyhow::bail!("--shapes: {s:?} is not MxNxK (three whole numbers)");
        };
        if m * n * k > 1 << 34 {
            anyhow::bail!("--shapes: {s} is over 2^34 multiply-adds; give a smaller shape");
        }
        shapes.push((m, n, k));
    }
    let threads = rayon::current_num_threads();
    eprintln!(
        "{threads} threads; level {} (AVX2 {}, AVX-512 F {}, BF16 {}, AMX {}); f32: {}; bf16: {}",
        process_level(),
        isa().avx2,
        isa().avx512f,
        isa().avx512bf16,
        isa().amx,
        describe(candle::DType::F32),
        describe(candle::DType::BF16)
    );
    let mut rows = Vec::new();
    let mut t = Table::new(&[
        "shape",
        "dtype",
        "candidate",
        "ms",
        "GFLOP/s",
        "vs candle",
        "max |diff|",
    ]);
    for &(m, n, k) in &shapes {
        for dtype in [candle::DType::F32, candle::DType::BF16] {
            let r = bench::time_linear(m, n, k, dtype, a.repeat)?;
            let candle_s = r[0].seconds;
            for c in &r {
                t.row(vec![
                    format!("{m}x{n}x{k}"),
                    c.dtype.clone(),
                    c.candidate.clone(),
                    format!("{:.3}", c.seconds * 1e3),
                    format!("{:.1}", c.gflops),
                    format!("{:.2}x", candle_s / c.seconds),
                    format!("{:.2e}", c.max_abs_diff),
                ]);
            }
            rows.extend(r);
        }
    }
    println!("{}", t.render());
    let bw = bench::read_bandwidth(a.bandwidth_mib << 20, 5);
    println!(
        "memory read bandwidth: {:.1} GB/s ({} MiB buffer, best of 5)",
        bw / 1e9,
        a.bandwidth_mib
    );
    // The FMA peak at each vector width this process's kernels may use.
    let mut peaks = serde_json::Map::new();
    for (simd, name, has) in [
        (Simd::Avx2, "avx2", isa().avx2),
        (Simd::Avx512, "avx512", isa().avx512f),
    ] {
        if let Some(peak) = has.then(|| bench::fma_peak(simd, 5)).flatten() {
            println!(
                "f32 FMA peak at {name} ({threads} threads, register-only loop, best of 5): \
                 {:.1} GFLOP/s",
                peak / 1e9
            );
            peaks.insert(name.into(), serde_json::json!(peak));
        }
    }
    if let Some(p) = &a.json {
        let v = serde_json::json!({
            "threads": threads,
            "level": process_level().name(),
            "fma_peak_flops": peaks,
            "isa": {"avx2": isa().avx2, "avx512f": isa().avx512f, "avx512bf16": isa().avx512bf16, "amx": isa().amx},
            "timings": rows,
            "read_bandwidth_bytes_per_s": bw,
        });
        write_json(p, &with_provenance(v))?;
    }
    Ok(())
}

fn suite(a: SuiteArgs) -> Result<()> {
    super::check_io(
        &[Some(&a.file), a.placement.as_deref()],
        &[a.json.as_deref()],
    )?;
    use crate::bench_suite::{render, run, Suite};
    let mut s = Suite::read(&a.file)?;
    if let Some(m) = &a.model {
        s.model = m.clone();
    }
    let mut opts = super::model_opts::ModelOpts::local(&s.model);
    opts.placement = a.placement.clone();
    if s.model == "builtin" {
        let recipe = crate::builtin::BuiltinRecipe::default();
        let b = crate::builtin::ensure_cached(&recipe, a.backend == Backend::Local)?;
        opts.model = b.model().display().to_string();
        if opts.placement.is_none() {
            opts.placement = Some(b.placement(s.devices)?);
        }
    }
    opts.devices = s.devices;
    opts.backend = a.backend;
    opts.dtype = s.dtype.clone();
    let points = run(&s, &opts)?;
    if points.is_empty() {
        return Ok(());
    }
    println!("{}", render(&s, &points));
    if let Some(p) = &a.json {
        let v = serde_json::json!({
            "bench": "suite",
            "file": a.file.display().to_string(),
            "config": s,
            "model": opts.model,
            "placement": opts.placement,
            "backend": a.backend,
            "projected_with": s.link,
            "points": points,
        });
        write_json(p, &with_provenance(v))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

fn train(a: TrainBenchArgs) -> Result<()> {
    super::check_model_io(&a.model, &[], &[a.json.as_deref()])?;
    let link = a
        .link
        .as_deref()
        .map(occult_core::analysis::links::LinkProfile::load)
        .transpose()?;
    let bench = crate::bench_train::TrainBench {
        devices: a.model.devices,
        batch_per_rank: a.batch_size,
        seq_len: a.seq_len,
        warmup: a.warmup,
        steps: a.steps,
        seed: a.seed,
    };
    let mut ck = a.model.open()?;
    let Some(results) = crate::bench_train::run(&a.model, &mut ck, &bench, link.as_ref())? else {
        return Ok(());
    };
    crate::bench_model_ep::print_results(&results, link.is_some(), "training step");
    println!(
        "({} ranks, {} sequences of {} tokens each per step; training the MoE blocks; stage \
         times are the slowest rank's forward stages, summed over MoE layers)",
        bench.devices, bench.batch_per_rank, bench.seq_len
    );
    if let Some(p) = &a.json {
        let v = serde_json::json!({
            "bench": "train",
            "model": ck.name,
            "backend": a.model.backend,
            "config": bench,
            "link": link,
            "projected_with_link_model": link.is_some(),
            "results": results,
        });
        write_json(p, &with_provenance(v))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

fn place(a: PlaceBenchArgs) -> Result<()> {
    let traces: Vec<Option<&std::path::Path>> = a.trace.iter().map(|t| Some(t.as_path())).collect();
    super::check_io(&traces, &[a.json.as_deref()])?;
    let cfg = SearchConfig {
        restarts: a.restarts,
        seed: a.seed,
        max_load_factor: None,
    };
    let mut runs = Vec::new();
    for path in &a.trace {
        let trace = load_trace(path)?;
        for &d in &a.devices {
            for m in [Method::Contiguous, Method::Greedy, Method::Occult] {
                let start = Instant::now();
                let (_, infos) = place_trace(&trace, d, m, &cfg, &|| {})?;
                let seconds = start.elapsed().as_secs_f64();
                let run = PlaceRun {
                    trace: path.display().to_string(),
                    method: m.name(),
                    devices: d,
                    layers: infos.len(),
                    tokens: trace.layers.first().map_or(0, |l| l.tokens),
                    seconds,
                    ect: occult_core::analysis::collab::token_weighted_mean(
                        infos.iter().map(|i| (i.ect, i.tokens)),
                    ),
                };
                eprintln!(
                    "{} D={d} {}: {:.2} s, E[C_T] {:.3}",
                    run.trace, run.method, run.seconds, run.ect
                );
                runs.push(run);
            }
        }
    }
    print!("{}", render(&runs));
    if let Some(out) = &a.json {
        let v = serde_json::json!({ "bench": "place", "results": runs });
        write_json(out, &with_provenance(v))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

fn render(runs: &[PlaceRun]) -> String {
    let mut t = Table::new(&[
        "trace",
        "D",
        "method",
        "seconds",
        "mean E[C_T]",
        "vs contiguous",
        "vs greedy",
    ]);
    for r in runs {
        let find = |m: &str| {
            runs.iter()
                .find(|x| x.trace == r.trace && x.devices == r.devices && x.method == m)
                .map(|x| x.ect)
        };
        let ratio = |b: Option<f64>| b.map_or("-".into(), |b| format!("{:.3}", r.ect / b));
        t.row(vec![
            r.trace.clone(),
            r.devices.to_string(),
            r.method.into(),
            format!("{:.2}", r.seconds),
            format!("{:.3}", r.ect),
            ratio(find("contiguous")),
            ratio(find("greedy")),
        ]);
    }
    t.render()
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
    #[arg(long, value_enum, default_value_t = super::place::MethodArg::Occult)]
    pub placement: super::place::MethodArg,
    /// Devices per token in the pruned run (0 = no pruned run).
    #[arg(long, default_value_t = 2)]
    pub max_devices: usize,
    #[arg(long, value_enum, default_value_t = super::prune::RuleArg::Similarity)]
    pub prune_rule: super::prune::RuleArg,
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
}

fn layer(a: LayerBenchArgs) -> Result<()> {
    super::check_io(&[], &[a.json.as_deref()])?;
    use crate::bench_layer::{LayerBench, ModeResult};
    use occult_core::analysis::links::{swiglu_flops, LinkProfile};
    let device = super::model_opts::pick_device(a.cuda, a.backend)?;
    let bench = LayerBench {
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
        placement: a.placement.into(),
        max_devices: a.max_devices,
        prune_rule: match a.prune_rule {
            super::prune::RuleArg::Router => occult_core::analysis::pruning::PruneRule::Router,
            super::prune::RuleArg::Similarity => {
                occult_core::analysis::pruning::PruneRule::Similarity
            }
        },
        device_name: super::model_opts::ModelOpts::device_name(&device),
        dtype: a.dtype.clone(),
        device,
    };
    let link = a.link.as_deref().map(LinkProfile::load).transpose()?;
    let (records, is_root) = match a.backend {
        Backend::Local => {
            bench.validate()?;
            let setup = bench.setup()?;
            eprintln!("running {} local ranks", bench.devices);
            let per_rank = occult_core::ep::comm::local::run_local(bench.devices, |comm| {
                bench
                    .run_rank(&setup, comm)
                    .map_err(|e| occult_core::Error::invalid(e.to_string()))
            });
            let mut records = Vec::new();
            for r in per_rank {
                records.extend(r?);
            }
            (Some((records, bench.run_reference(&setup)?)), true)
        }
        Backend::Mpi | Backend::Nccl => process_layer(&bench, a.backend)?,
    };
    if !is_root {
        return Ok(());
    }
    let (records, reference_s) = records.expect("root has the records");
    let mut results: Vec<ModeResult> = bench.combine(&records, link.as_ref());
    let total = bench.tokens * bench.devices;
    let reference_flops = swiglu_flops(total * bench.top_k, bench.hidden, bench.intermediate);
    let reference = ModeResult {
        mode: "reference (1 device)".into(),
        devices: 1,
        tokens: total,
        rows_sent: 0,
        remote_rows_sent: 0,
        bytes_sent: 0,
        ect: 1.0,
        seconds: reference_s,
        route_s: 0.0,
        plan_s: 0.0,
        dispatch_s: 0.0,
        compute_s: reference_s,
        combine_s: 0.0,
        tokens_per_s: total as f64 / reference_s.max(1e-12),
        expert_flops: reference_flops,
        expert_flops_per_s: reference_flops / reference_s.max(1e-12),
        projected_seconds: None,
        projected: None,
    };
    results.insert(0, reference);
    print!(
        "{}",
        render_layer(&bench, &results, link.as_ref(), a.backend)
    );
    if let Some(out) = &a.json {
        let v = serde_json::json!({
            "bench": "layer",
            "backend": a.backend,
            "config": bench,
            "link": link,
            "projected_with_link_model": link.is_some(),
            "results": results,
        });
        write_json(out, &with_provenance(v))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

type LayerRecords = (Option<(Vec<crate::bench_layer::RankRecord>, f64)>, bool);

/// The bench on this process's rank of `backend`'s group (one process per rank); rank 0
/// gathers the records.
fn process_layer(bench: &crate::bench_layer::LayerBench, backend: Backend) -> Result<LayerRecords> {
    let timeout = occult_core::ep::comm::DEFAULT_TIMEOUT;
    let comm = backend.world(bench.devices, &bench.device, timeout)?;
    bench.validate()?;
    let setup = bench.setup()?;
    let mine = bench.run_rank(&setup, &comm)?;
    // Every rank sends its records to rank 0.
    let bytes = serde_json::to_vec(&mine)?;
    let mut counts = vec![0; comm.size()];
    counts[0] = bytes.len();
    let (all, from) = comm.all_to_all_v_bytes(&bytes, &counts, 1)?;
    if comm.rank() != 0 {
        return Ok((None, false));
    }
    let mut records = Vec::new();
    let mut at = 0;
    for n in from {
        let part: Vec<crate::bench_layer::RankRecord> = serde_json::from_slice(&all[at..at + n])?;
        records.extend(part);
        at += n;
    }
    Ok((Some((records, bench.run_reference(&setup)?)), true))
}

fn render_layer(
    bench: &crate::bench_layer::LayerBench,
    results: &[crate::bench_layer::ModeResult],
    link: Option<&occult_core::analysis::links::LinkProfile>,
    backend: Backend,
) -> String {
    let ms = |s: f64| format!("{:.2}", s * 1e3);
    let mut header = vec![
        "mode",
        "E[C_T]",
        "rows sent",
        "remote rows",
        "remote MB",
        "step ms",
        "route",
        "plan",
        "dispatch",
        "compute",
        "combine",
        "tokens/s",
        "expert TFLOP/s",
    ];
    if link.is_some() {
        header.extend(["proj. ms", "proj. compute", "proj. comm"]);
    }
    let mut t = Table::new(&header);
    for r in results {
        let mut row = vec![
            r.mode.clone(),
            format!("{:.3}", r.ect),
            crate::table::count(r.rows_sent as u64),
            crate::table::count(r.remote_rows_sent as u64),
            format!("{:.2}", r.bytes_sent as f64 / 1e6),
            ms(r.seconds),
            ms(r.route_s),
            ms(r.plan_s),
            ms(r.dispatch_s),
            ms(r.compute_s),
            ms(r.combine_s),
            format!("{:.0}", r.tokens_per_s),
            format!("{:.3}", r.expert_flops_per_s / 1e12),
        ];
        if link.is_some() {
            match &r.projected {
                Some(p) => row.extend([
                    format!("{:.4}", p.total_s * 1e3),
                    format!("{:.4}", p.compute_s * 1e3),
                    format!("{:.4}", p.comm_s * 1e3),
                ]),
                None => row.extend(["-".into(), "-".into(), "-".into()]),
            }
        }
        t.row(row);
    }
    let mut out = format!(
        "layer: {} experts, top-{}, hidden {}, intermediate {}, {} on {}; {} ranks x {} tokens ({} backend);\n  placement {}.\n  expert TFLOP/s: the slowest rank's expert FLOPs over its compute stage.\n  step ms: the slowest rank's mean forward time; phase columns: each phase's slowest rank \
         (phases include waiting for peers, so they need not add up to step ms)\n\n{}",
        bench.experts,
        bench.top_k,
        bench.hidden,
        bench.intermediate,
        bench.dtype,
        bench.device_name,
        bench.devices,
        bench.tokens,
        backend.name(),
        bench.placement.name(),
        t.render()
    );
    if let Some(l) = link {
        out.push_str(&format!(
            "\nprojected on link profile {} ({}): expert FLOPs / {:.2e} FLOP/s + bytes / bandwidth \
             + latency per message, slowest rank\n",
            l.name, l.description, l.device_flops
        ));
    }
    let find = |m: &str| results.iter().find(|r| r.mode == m);
    if let (Some(s), Some(o)) = (find("standard"), find("occult")) {
        let ratio = |a: f64, b: f64| {
            if b > 0.0 {
                format!("{:.3}", a / b)
            } else {
                "-".into()
            }
        };
        out.push_str(&format!(
            "\noccult / standard: rows {}, remote rows {}, remote bytes {}, measured time {}{}\n",
            ratio(o.rows_sent as f64, s.rows_sent as f64),
            ratio(o.remote_rows_sent as f64, s.remote_rows_sent as f64),
            ratio(o.bytes_sent as f64, s.bytes_sent as f64),
            ratio(o.seconds, s.seconds),
            match (o.projected_seconds, s.projected_seconds) {
                (Some(a), Some(b)) => format!(", projected time {}", ratio(a, b)),
                _ => String::new(),
            }
        ));
    }
    out
}
