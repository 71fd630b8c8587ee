//! `occult eval`: multiple-choice and generative tasks scored as lm-evaluation-harness scores
//! them, with the
//! model options of every model command (so pruned routing can be scored without fine-tuning).
//! Writes results as JSON (per task and metric with standard errors, the configuration, the
//! version and the seed), prints a Markdown table, and with `--log-samples` writes
//! `samples_TASK.jsonl` beside the results. A task that fails is reported and the others go on.
//! The work is [`crate::jobs::eval`].

use super::model_opts::ModelOpts;
use crate::jobs::eval::{evaluate, EvalJob};
use anyhow::Result;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    occult eval --model M --tasks piqa,arc_easy --samples          # the built-in sample data\n  \
    occult eval --model M --tasks gsm8k --data gsm8k=gsm8k/ --limit 100 --batch-size 16\n  \
    occult eval --model M --tasks hellaswag --data hellaswag=hellaswag_val.jsonl --limit 200\n  \
    occult eval --model M --tasks mmlu --data mmlu=mmlu_dir/ --devices 4 --max-devices 2 \\\n      \
    --placement p.json --output results.json --log-samples")]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelOpts,
    /// Tasks, comma-separated: built-in names or paths to task files.
    #[arg(long, value_delimiter = ',', required = true)]
    pub tasks: Vec<String>,
    /// A task's data: TASK=PATH, a Parquet/JSONL/JSON file (the eval split) or a folder of
    /// split files. Without it, the task's dataset is read from the Hugging Face cache.
    #[arg(long)]
    pub data: Vec<String>,
    /// Use the built-in sample data for tasks without --data.
    #[arg(long)]
    pub samples: bool,
    /// Few-shot examples per item (default: each task's own).
    #[arg(long)]
    pub num_fewshot: Option<usize>,
    /// Score at most this many items per task.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Requests per forward pass when contexts are not reused; generative tasks: requests in
    /// flight.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Run each request whole instead of running a shared context once.
    #[arg(long)]
    pub no_context_reuse: bool,
    /// Seed of the few-shot draw.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// lm-eval's add_bos_token: by default the tokenizer's special tokens are added as the
    /// harness adds them (a BOS where the tokenizer's post-processor adds one, as Llama's,
    /// Mixtral's and DeepSeek's do); `--add-bos false` encodes without them.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub add_bos: Option<bool>,
    /// Generative tasks: most new tokens per answer (default: each task's own; GSM8K's is the
    /// harness's 256).
    #[arg(long)]
    pub max_gen_toks: Option<usize>,
    /// Write the results JSON here.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Also write per-item log-likelihoods (samples_TASK.jsonl beside --output).
    #[arg(long, requires = "output")]
    pub log_samples: bool,
    /// Print no table on stdout (the results go to --output).
    #[arg(long, requires = "output")]
    pub quiet: bool,
    /// Record the routing of every evaluated token into this trace (one device; requests run
    /// one at a time, whole, so that no padding is recorded).
    #[arg(long)]
    pub trace: Option<PathBuf>,
}

impl EvalArgs {
    /// The library's job of these flags.
    pub fn job(&self) -> EvalJob {
        EvalJob {
            tasks: self.tasks.clone(),
            data: self.data.clone(),
            samples: self.samples,
            num_fewshot: self.num_fewshot,
            limit: self.limit,
            batch_size: self.batch_size,
            context_reuse: !self.no_context_reuse,
            seed: self.seed,
            add_bos: self.add_bos,
            record_routing: self.trace.is_some(),
            max_gen_toks: self.max_gen_toks,
        }
    }
}

/// `occult eval`: prepares, scores and reports every task; fails if any task failed.
pub fn run(a: EvalArgs) -> Result<()> {
    let job = a.job();
    let spec = a.model.spec()?;
    // Task files and data are inputs too: no output may replace them.
    let inputs = job.inputs()?;
    let more: Vec<Option<&Path>> = inputs.iter().map(|p| Some(p.as_path())).collect();
    spec.check_io(&more, &[a.output.as_deref(), a.trace.as_deref()])?;
    let Some(done) = evaluate(&spec, &job)? else {
        return Ok(());
    };
    if let (Some(path), Some(trace)) = (&a.trace, &done.routing) {
        trace.write(path)?;
        eprintln!("routing of the evaluated text -> {}", path.display());
    }
    if !a.quiet {
        println!("{}", done.table().render());
    }
    if let Some(out) = &a.output {
        done.write(out, a.log_samples)?;
    }
    done.check(a.tasks.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: EvalArgs,
    }

    /// The flags' defaults are the job's (as `reproduce` fills it from `EvalJob::new`).
    #[test]
    fn the_flags_defaults_are_the_jobs() {
        let cli = Cli::try_parse_from(["occult", "--model", "m", "--tasks", "a,b"]);
        let job = cli.unwrap().args.job();
        let new = EvalJob::new(vec!["a".into(), "b".into()]);
        assert_eq!(format!("{job:?}"), format!("{new:?}"));
    }
}
