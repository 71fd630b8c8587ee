//! `occult profile`: runs calibration text through a model and writes its routing trace
//! (`occult.trace.v1`), which `collab`, `place` and `prune` read. The work is
//! [`crate::jobs::profile`].

use super::model_opts::ModelOpts;
use crate::jobs::profile::{profile, ProfileJob};
use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub model: ModelOpts,
    /// Calibration text: JSONL with a `text` field, or plain text (one document per line).
    #[arg(long)]
    pub data: PathBuf,
    /// Where to write the trace.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Longest window of tokens run at once [default: 512, or the model's positions if fewer].
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Stop after this many tokens.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Leave the router logits out of the trace (smaller; the similarity rule needs them).
    #[arg(long)]
    pub no_logits: bool,
    /// Add the tokenizer's special tokens (BOS) to each document.
    #[arg(long)]
    pub add_bos: bool,
}

pub fn run(a: ProfileArgs) -> Result<()> {
    let spec = a.model.spec()?;
    super::check_model_io(&spec, &[Some(&a.data)], &[Some(&a.output)])?;
    let job = ProfileJob {
        data: a.data.clone(),
        seq_len: a.seq_len,
        max_tokens: a.max_tokens,
        logits: !a.no_logits,
        add_bos: a.add_bos,
    };
    let Some(p) = profile(&spec, &job)? else {
        return Ok(());
    };
    p.trace.write(&a.output)?;
    eprintln!(
        "profiled {} tokens in {} windows over {} MoE layers -> {}",
        p.tokens,
        p.windows,
        p.trace.layers.len(),
        a.output.display()
    );
    Ok(())
}
