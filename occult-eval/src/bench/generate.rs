//! `occult bench generate`: what the generative harness's continuous batching costs against a
//! plain batched decode of the same prompts, in one run: (a) `forward`, the B prompts prefilled
//! as one `[B, P]` batch and decoded `[B, 1]` a step at a time with one cache (as `bench
//! model` decodes), and (b) `generate`, the harness's [`generate_batched`] with B requests in
//! flight (ragged steps, a cache per request, the stop checks), each until T tokens. Both
//! pick the greedy token, so they must generate the same ids (checked). Reports tokens per
//! second of each and the median over paired, alternating repeats of (b)'s over (a)'s.

use super::timing::{median_ratio, random_prompt};
use crate::context::ModelSpec;
use crate::harness::generate_until::{argmax, finite_row, generate_batched, Stopping};
use crate::table::Table;
use anyhow::{bail, Result};
use candle::{Device, Tensor};
use occult_core::models::model::{Logits, Model};
use serde_json::json;
use std::path::Path;
use std::time::Instant;

/// The benchmark's settings.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GenBench {
    pub prompt_len: usize,
    pub batch: usize,
    pub decode_tokens: usize,
    pub repeats: usize,
    pub seed: u64,
}

/// (a): the prompts as one batch, `steps` greedy tokens each; the ids per prompt.
fn plain_decode(m: &Model, prompts: &[Vec<u32>], steps: usize) -> Result<Vec<Vec<u32>>> {
    let (b, p) = (prompts.len(), prompts[0].len());
    let flat: Vec<u32> = prompts.concat();
    let mut cache = m.new_cache();
    let ids = Tensor::from_vec(flat, (b, p), &Device::Cpu)?;
    let mut logits = m.forward(&ids, Some(&mut cache), None, Logits::Last)?;
    let mut out = vec![Vec::with_capacity(steps); b];
    for step in 0..steps {
        let mut next = Vec::with_capacity(b);
        for (i, o) in out.iter_mut().enumerate() {
            let t = argmax(&finite_row(&logits.get(i)?, step)?);
            o.push(t);
            next.push(t);
        }
        if step + 1 == steps {
            break;
        }
        let ids = Tensor::from_vec(next, (b, 1), &Device::Cpu)?;
        logits = m.forward(&ids, Some(&mut cache), None, Logits::Last)?;
    }
    Ok(out)
}

/// Runs the benchmark on `spec`'s ranks (each rank its own B prompts), prints the table and
/// writes it as JSON to `json`.
pub fn run(spec: &ModelSpec, b: &GenBench, json_out: Option<&Path>) -> Result<()> {
    if b.batch == 0 || b.prompt_len == 0 || b.decode_tokens == 0 || b.repeats == 0 {
        bail!("--batch, --prompt-len, --decode-tokens and --repeats must be at least 1");
    }
    let ck = spec.open()?;
    let tok = ck.tokenizer()?;
    if b.prompt_len + b.decode_tokens > ck.cfg.positions() {
        bail!(
            "--prompt-len {} + --decode-tokens {} exceed the model's {} positions",
            b.prompt_len,
            b.decode_tokens,
            ck.cfg.positions()
        );
    }
    let work = serde_json::to_vec(b)?;
    let Some(times) = spec.run_same(&ck, "bench settings", work, |m| {
        let rank = m.rank_and_size().0 as u64;
        let prompts: Vec<Vec<u32>> = (0..b.batch as u64)
            .map(|i| random_prompt(b.prompt_len, ck.cfg.vocab_size, b.seed + 1000 * rank + i))
            .collect();
        let stopping = Stopping::budget(b.decode_tokens);
        let (mut plain, mut gen) = (Vec::new(), Vec::new());
        for _ in 0..b.repeats {
            let clock = Instant::now();
            let want = plain_decode(m, &prompts, b.decode_tokens)?;
            plain.push(clock.elapsed().as_secs_f64());
            let clock = Instant::now();
            let (got, _) = generate_batched(m, tok, &prompts, &stopping, b.batch, &|_| ())?;
            gen.push(clock.elapsed().as_secs_f64());
            if got != want {
                bail!("the harness's generation and the plain decode generated different ids");
            }
        }
        m.finish()?;
        Ok((plain, gen))
    })?
    else {
        return Ok(());
    };
    let (plain, gen) = times;
    let tokens = (b.batch * b.decode_tokens) as f64;
    let median = |xs: &[f64]| {
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let ratio = median_ratio(&plain, &gen);
    let mut t = Table::new(&["path", "batch", "prompt", "tokens", "median s", "tokens/s"]);
    for (name, xs) in [
        ("forward (batched decode)", &plain),
        ("generate (harness)", &gen),
    ] {
        t.row(vec![
            name.into(),
            b.batch.to_string(),
            b.prompt_len.to_string(),
            b.decode_tokens.to_string(),
            format!("{:.4}", median(xs)),
            format!("{:.1}", tokens / median(xs)),
        ]);
    }
    println!("{}", t.render());
    println!(
        "generate/forward tokens/s (median of {} paired repeats): {ratio:.3}",
        b.repeats
    );
    if let Some(path) = json_out {
        let report = json!({"settings": b, "model": ck.name, "forward_seconds": plain,
                            "generate_seconds": gen, "ratio": ratio});
        crate::output::write_json(path, &crate::output::with_provenance(report))?;
    }
    Ok(())
}
