//! `occult generate`: continue a prompt, or every line of a prompts file, greedily or by
//! sampling (temperature, top-p), with the key/value cache; prints the text on stdout and the
//! speed on stderr. The work is [`crate::jobs::generate`].

use super::model_opts::ModelOpts;
use crate::jobs::generate::{generate, Sampling};
use anyhow::{bail, Result};

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelOpts,
    /// The prompt.
    #[arg(
        long,
        allow_hyphen_values = true,
        required_unless_present = "prompts",
        conflicts_with = "prompts"
    )]
    pub prompt: Option<String>,
    /// A file of prompts, one per non-empty line, spread over the ranks.
    #[arg(long)]
    pub prompts: Option<std::path::PathBuf>,
    /// Most new tokens (generation also stops at an end-of-sequence token).
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// 0 is greedy decoding; above 0, sample from softmax(logits / temperature).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Sample from the smallest set of tokens whose probability reaches this (with temperature).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Seed of the sampler (prompt i of a file uses seed + i).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Add the tokenizer's special tokens (BOS) to the prompt.
    #[arg(long)]
    pub add_bos: bool,
    /// Print the prompt and generated token ids as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The prompts: `--prompt`, or the non-empty lines of `--prompts`.
fn prompts(a: &GenerateArgs) -> Result<Vec<String>> {
    match (&a.prompt, &a.prompts) {
        (Some(p), _) => Ok(vec![p.clone()]),
        (None, Some(path)) => {
            let text = occult_core::input::read_text(path)?;
            let lines: Vec<String> = text
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(String::from)
                .collect();
            if lines.is_empty() {
                bail!("{}: no prompts", path.display());
            }
            Ok(lines)
        }
        (None, None) => bail!("give --prompt TEXT or --prompts FILE"),
    }
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let sampling = Sampling {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
        add_bos: a.add_bos,
    };
    let texts = prompts(&a)?;
    let spec = a.model.spec()?;
    let Some(outputs) = generate(&spec, &texts, &sampling)? else {
        return Ok(());
    };
    let json = |o: &crate::jobs::generate::Continuation| {
        serde_json::json!({"prompt": o.prompt, "prompt_ids": o.prompt_ids,
            "new_ids": o.generated.new, "text": o.text})
    };
    match (a.json, a.prompts.is_some()) {
        (true, false) => {
            let o = &outputs[0];
            let v = serde_json::json!({"prompt_ids": o.prompt_ids, "new_ids": o.generated.new});
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        (true, true) => {
            let all: Vec<serde_json::Value> = outputs.iter().map(json).collect();
            println!("{}", serde_json::to_string_pretty(&all)?)
        }
        (false, _) => {
            let texts: Vec<&str> = outputs.iter().map(|o| o.text.as_str()).collect();
            println!("{}", texts.join("\n\n"));
        }
    }
    let prompt_tokens: usize = outputs.iter().map(|o| o.prompt_ids.len()).sum();
    let results: Vec<_> = outputs.iter().map(|o| &o.generated).collect();
    let new_tokens: usize = results.iter().map(|g| g.new.len()).sum();
    let prefill_s: f64 = results.iter().map(|g| g.prefill_s).sum();
    let decode_s: f64 = results.iter().map(|g| g.decode_s).sum();
    let steps: usize = results.iter().map(|g| g.new.len().saturating_sub(1)).sum();
    eprintln!(
        "{} prompt(s), {prompt_tokens} tokens: prefill {:.1} tokens/s; {new_tokens} new tokens: \
         {:.2} ms/token",
        outputs.len(),
        prompt_tokens as f64 / prefill_s.max(1e-9),
        1e3 * decode_s / steps.max(1) as f64
    );
    Ok(())
}
