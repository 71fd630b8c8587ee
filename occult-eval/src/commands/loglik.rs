//! `occult loglik`: the log-likelihood of a continuation given a context, scored as
//! lm-evaluation-harness scores it; JSON on stdout.

use super::model_opts::ModelOpts;
use crate::harness::loglik::{encode, score};
use anyhow::Result;

#[derive(clap::Args, Debug)]
pub struct LoglikArgs {
    #[command(flatten)]
    pub model: ModelOpts,
    /// The context (may be empty).
    #[arg(long, allow_hyphen_values = true)]
    pub context: String,
    /// The continuation to score.
    #[arg(long, allow_hyphen_values = true)]
    pub continuation: String,
    /// lm-eval's add_bos_token: by default the tokenizer's special tokens (its BOS) are added
    /// as the harness adds them; `--add-bos false` encodes without them.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub add_bos: Option<bool>,
}

pub fn run(a: LoglikArgs) -> Result<()> {
    let spec = a.model.spec()?;
    let ck = spec.open()?;
    let enc = encode(ck.tokenizer()?, &a.context, &a.continuation, a.add_bos)?;
    // One request: the first rank scores it, the others take part in its exchanges.
    let work = format!("{enc:?}").into_bytes();
    let scores = spec.run_same(&ck, "request", work, |m| {
        let mine = m
            .shard(1)
            .map(|_| score(m, &enc))
            .collect::<Result<Vec<_>>>()?;
        Ok(m.finish_and_gather(mine)?)
    })?;
    if let Some(s) = scores.and_then(|s| s.into_iter().next()) {
        println!("{}", serde_json::to_string_pretty(&s)?);
    }
    Ok(())
}
