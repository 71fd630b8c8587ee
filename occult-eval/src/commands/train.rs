//! `occult train`: fine-tunes the MoE blocks (or every tensor with `--train all`) on
//! instruction data (Alpaca) or plain text, on D ranks, with exact or pruned routing. Writes
//! the model in the source's layout, `log.jsonl` (a line per step) and the state `--resume`
//! continues from, in `--out`. The work is [`crate::jobs::fine_tune`].

use super::model_opts::ModelOpts;
use crate::jobs::fine_tune::{fine_tune, FineTune, TrainWhat};
use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    occult train --model M --data alpaca.jsonl --out tuned --steps 1000 --batch-size 8\n  \
    occult train --model M --data tatsu-lab/alpaca --out pruned2 --devices 4 \\\n      \
    --placement p.json --max-devices 2 --prune-rule similarity --calibration trace.safetensors\n  \
    occult train --model M --data alpaca.jsonl --out tuned --steps 1000 --resume")]
pub struct TrainArgs {
    #[command(flatten)]
    pub model: ModelOpts,
    /// Training data: a JSON/JSONL/Parquet file, a folder with a train split, or a dataset id
    /// in the Hugging Face cache; Alpaca records (`instruction`, `input`, `output`) or `text`.
    #[arg(long)]
    pub data: String,
    /// Output folder: the fine-tuned model, log.jsonl and the resumable state.
    #[arg(long)]
    pub out: PathBuf,
    /// Optimiser steps (the learning-rate schedule runs over them).
    #[arg(long, default_value_t = 1000)]
    pub steps: u64,
    /// Longest sequence in tokens [default: 512, or the model's positions if fewer].
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Examples per step over all ranks.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Micro-batches per step on each rank (gradient accumulation: the same step in less
    /// memory).
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 2e-5)]
    pub lr: f64,
    /// Linear warm-up steps (default: 3% of the steps).
    #[arg(long)]
    pub warmup: Option<u64>,
    /// The final learning rate as a fraction of the peak (cosine decay).
    #[arg(long, default_value_t = 0.0)]
    pub min_lr_ratio: f64,
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Clip gradients to this global norm.
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Seed of the data order.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Save the model and state every this many steps (and at the end).
    #[arg(long)]
    pub save_every: Option<u64>,
    /// Continue the run saved in --out.
    #[arg(long, conflicts_with = "overwrite")]
    pub resume: bool,
    /// Start afresh in an --out that holds another run.
    #[arg(long)]
    pub overwrite: bool,
    /// Stop after this many steps (saving first) and continue later with --resume, as a job
    /// with a time limit does; the schedule still runs over --steps.
    #[arg(long)]
    pub stop_at: Option<u64>,
    /// Add the tokenizer's special tokens (BOS) when encoding.
    #[arg(long)]
    pub add_bos: bool,
    /// Add the model's load-balancing auxiliary loss, in its family's form and with its own
    /// coefficient (`router_aux_loss_coef`, or DeepSeek's `aux_loss_alpha` and `seq_aux`).
    #[arg(long)]
    pub aux_loss: bool,
    /// Held-out data, scored (`eval_loss` in log.jsonl) at the end and every --eval-every
    /// steps, under the run's routing.
    #[arg(long)]
    pub eval_data: Option<String>,
    /// Score --eval-data every this many steps (besides the end).
    #[arg(long, requires = "eval_data")]
    pub eval_every: Option<u64>,
    /// What trains: the MoE blocks (routers, experts, shared experts), as in the paper.
    #[arg(long, value_enum, default_value_t = TrainWhat::Moe)]
    pub train: TrainWhat,
}

impl TrainArgs {
    /// The library's job of these flags.
    pub fn job(&self) -> FineTune {
        let a = self;
        FineTune {
            data: a.data.clone(),
            out: a.out.clone(),
            steps: a.steps,
            seq_len: a.seq_len,
            batch_size: a.batch_size,
            grad_accum: a.grad_accum,
            lr: a.lr,
            warmup: a.warmup,
            min_lr_ratio: a.min_lr_ratio,
            weight_decay: a.weight_decay,
            max_grad_norm: a.max_grad_norm,
            seed: a.seed,
            save_every: a.save_every,
            resume: a.resume,
            overwrite: a.overwrite,
            stop_at: a.stop_at,
            add_bos: a.add_bos,
            aux_loss: a.aux_loss,
            eval_data: a.eval_data.clone(),
            eval_every: a.eval_every,
            train: a.train,
        }
    }
}

pub fn run(a: TrainArgs) -> Result<()> {
    fine_tune(&a.model.spec()?, &a.job())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TrainArgs,
    }

    /// The flags' defaults are the job's: the pipelines that fill a `FineTune` from `new`
    /// train as `occult train` does by default.
    #[test]
    fn the_flags_defaults_are_the_jobs() {
        let cli = Cli::try_parse_from(["occult", "--model", "m", "--data", "d", "--out", "o"]);
        let job = cli.unwrap().args.job();
        let new = FineTune::new("d", std::path::Path::new("o"));
        assert_eq!(format!("{job:?}"), format!("{new:?}"));
    }
}
