//! The `occult` command line: parses arguments and hands them to `occult_eval::commands`.

use clap::{Parser, Subcommand};
use occult_eval::commands::{
    bench, collab, eval, export, generate, loglik, loss, model, place, profile, project, prune,
    reproduce, trace, train,
};

/// Runs candle's element-wise ops on the calling thread unless `CANDLE_NUM_THREADS` says
/// otherwise. Our kernels and the expert loop run on rayon's pool; candle 0.11 keeps a second
/// pool of spinning workers for element-wise ops, and on the same cores the two pools compete
/// (measured: prefill 1.1x faster without the second pool, 512 tokens of an OLMoE-shaped layer
/// on 2 threads). Candle reads the variable once, when it first starts that pool, so this runs
/// first, while the process has one thread.
fn one_thread_pool() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}

/// Keeps buffers up to 32 MiB in the heap when they are freed, for the next allocation to reuse.
/// glibc's default hands buffers from 128 KiB (rising as buffers are freed) back to the kernel,
/// and every new one is then faulted in and zeroed page by page: each expert's activations and
/// the kernels' packed operands are such buffers, allocated anew for every layer and token
/// batch. Measured on a 512-token prefill of an OLMoE-shaped layer: 37,000 page faults (146 MB
/// zeroed) a prefill by default, none with this.
fn reuse_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "occult",
    version,
    about = "Cut the all-to-all traffic of expert-parallel MoE models: profile expert \
             collaboration, place experts, prune collaboration, measure.",
    after_help = "Start with `occult reproduce`, or:\n  \
        occult trace synth -o t.safetensors\n  \
        occult collab --trace t.safetensors --devices 4\n  \
        occult place --trace t.safetensors --devices 4 --method occult -o p.json\n  \
        occult collab --trace t.safetensors --placement p.json\n  \
        occult prune --trace t.safetensors --placement p.json --max-devices 2 --rule similarity"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Routing traces: generate synthetic ones, inspect any.
    #[command(subcommand)]
    Trace(trace::TraceCmd),
    /// Collaboration statistics of a trace under a placement (E[C_T], rows, loads).
    Collab(collab::CollabArgs),
    /// Place experts on devices from a trace.
    Place(place::PlaceArgs),
    /// Apply collaboration pruning to a trace.
    Prune(prune::PruneArgs),
    /// Benchmarks, each comparing methods in one run.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Project layer and training-step times of each dispatch onto clusters of D devices.
    Project(project::ProjectArgs),
    /// Run the end-to-end recipe and write a report.
    Reproduce(reproduce::ReproduceArgs),
    /// Continue a prompt with a model (greedy or sampled).
    Generate(generate::GenerateArgs),
    /// Log-likelihood of a continuation, scored as lm-evaluation-harness does (JSON).
    Loglik(loglik::LoglikArgs),
    /// Held-out loss and perplexity of instruction or text data under the model's routing.
    Loss(loss::LossArgs),
    /// Score multiple-choice and generative tasks as lm-evaluation-harness does (MMLU,
    /// HellaSwag, GSM8K, ...).
    Eval(eval::EvalArgs),
    /// Run calibration text through a model and write its routing trace.
    Profile(profile::ProfileArgs),
    /// Fine-tune the MoE blocks (standard, Occult or pruned routing) and save the model.
    Train(train::TrainArgs),
    /// Take a placement to other engines: a renumbered checkpoint, SGLang's location file.
    #[command(subcommand)]
    Export(export::ExportCmd),
    /// Checkpoints: make a synthetic one, describe one.
    #[command(subcommand)]
    Model(model::ModelCmd),
}

fn main() {
    one_thread_pool();
    reuse_freed_memory();
    let cli = Cli::parse();
    // The command runs on one of rayon's workers, so that the kernels' parallel loops start
    // there (work stealing) rather than being handed to the pool from outside and waited for:
    // two context switches per loop, which on a small model cost more than the loop (measured:
    // 146,000 futex calls to score 1,000 items).
    let result = rayon::scope(|_| match cli.cmd {
        Cmd::Trace(c) => trace::run(c),
        Cmd::Collab(a) => collab::run(a),
        Cmd::Place(a) => place::run(a),
        Cmd::Prune(a) => prune::run(a),
        Cmd::Bench(c) => bench::run(c),
        Cmd::Project(a) => project::run(a),
        Cmd::Reproduce(a) => reproduce::run(a),
        Cmd::Generate(a) => generate::run(a),
        Cmd::Loglik(a) => loglik::run(a),
        Cmd::Loss(a) => loss::run(a),
        Cmd::Profile(a) => profile::run(a),
        Cmd::Eval(a) => eval::run(a),
        Cmd::Train(a) => train::run(a),
        Cmd::Model(c) => model::run(c),
        Cmd::Export(c) => export::run(c),
    });
    match result {
        Ok(()) => occult_eval::context::backend::finalize_mpi(),
        Err(e) => {
            eprintln!("error: {e:#}");
            // Without finalising MPI: finalising waits for every peer, while exiting at once
            // lets mpirun end the whole job now.
            std::process::exit(1);
        }
    }
}
