//! `occult loss`: the held-out loss and perplexity of instruction or text data under the
//! model's routing (the reference, exact expert parallelism, or pruning), on D ranks; JSON on
//! stdout. The loss counts what fine-tuning trains on: the response and EOS of Alpaca records,
//! every token of packed text.

use super::model_opts::ModelOpts;
use crate::jobs::fine_tune::{load_examples, seq_len};
use anyhow::Result;
use occult_train::heldout::heldout_loss;

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    occult loss --model tuned --data held_out.jsonl\n  \
    occult loss --model pruned2 --data held_out.jsonl --devices 4 --max-devices 2")]
pub struct LossArgs {
    #[command(flatten)]
    pub model: ModelOpts,
    /// Held-out data: a JSON/JSONL/Parquet file, a folder (its test, validation or train
    /// split), or a dataset id in the Hugging Face cache; Alpaca records or `text`.
    #[arg(long)]
    pub data: String,
    /// Longest sequence in tokens [default: 512, or the model's positions if fewer].
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Examples per forward over all ranks.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Add the tokenizer's special tokens (BOS) when encoding.
    #[arg(long)]
    pub add_bos: bool,
}

pub fn run(a: LossArgs) -> Result<()> {
    let spec = a.model.spec()?;
    let ck = spec.open()?;
    let data = load_examples(&ck, &a.data, seq_len(&ck, a.seq_len), a.add_bos)?;
    let ids: Vec<&Vec<u32>> = data.examples.iter().map(|e| &e.ids).collect();
    let work = format!("{ids:?}").into_bytes();
    let scored = spec.run_same(&ck, "held-out data", work, |m| {
        Ok(heldout_loss(m, &data.examples, a.batch_size)?)
    })?;
    if let Some(h) = scored {
        let v = serde_json::json!({
            "model": ck.name,
            "data": a.data,
            "examples": h.examples,
            "targets": h.targets,
            "loss": h.loss,
            "perplexity": h.perplexity(),
            "mean_ect": h.ect,
            "mode": spec.mode(),
            "devices": a.model.devices,
            "max_devices": a.model.limit.max_devices,
            "prune_limit": a.model.limit.limit().map(|l| l.label()),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    }
    Ok(())
}
