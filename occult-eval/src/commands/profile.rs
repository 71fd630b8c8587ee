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

impl ProfileArgs {
    /// The library's job of these flags.
    pub fn job(&self) -> ProfileJob {
        ProfileJob {
            data: self.data.clone(),
            seq_len: self.seq_len,
            max_tokens: self.max_tokens,
            logits: !self.no_logits,
            add_bos: self.add_bos,
        }
    }
}

pub fn run(a: ProfileArgs) -> Result<()> {
    let spec = a.model.spec()?;
    spec.check_io(&[Some(&a.data)], &[Some(&a.output)])?;
    let job = a.job();
    let Some(p) = profile(&spec, &job)? else {
        return Ok(());
    };
    p.trace.write(&a.output)?;
    eprintln!("{}", p.summary(&a.output));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ProfileArgs,
    }

    /// The flags' defaults are the job's (as `reproduce` and the built-in model fill it from
    /// `ProfileJob::new`).
    #[test]
    fn the_flags_defaults_are_the_jobs() {
        let cli = Cli::try_parse_from(["occult", "--model", "m", "--data", "d", "-o", "t"]);
        let job = cli.unwrap().args.job();
        let new = ProfileJob::new(std::path::Path::new("d"));
        assert_eq!(format!("{job:?}"), format!("{new:?}"));
    }
}
