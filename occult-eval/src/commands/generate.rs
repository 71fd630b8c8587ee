//! `occult generate`: continue a prompt, greedily or by sampling (temperature, top-p), with the
//! key/value cache; prints the text on stdout and the speed on stderr.

use super::model_opts::ModelOpts;
use anyhow::{bail, Result};
use candle::{DType, Device, Tensor};
use occult_core::models::model::Logits;
use rand::{Rng, SeedableRng};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelOpts,
    /// The prompt.
    #[arg(long, allow_hyphen_values = true)]
    pub prompt: String,
    /// Most new tokens (generation also stops at an end-of-sequence token).
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// 0 is greedy decoding; above 0, sample from softmax(logits / temperature).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Sample from the smallest set of tokens whose probability reaches this (with temperature).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Add the tokenizer's special tokens (BOS) to the prompt.
    #[arg(long)]
    pub add_bos: bool,
    /// Print the prompt and generated token ids as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Picks the next token from last-position logits.
pub fn pick(logits: &[f32], temperature: f64, top_p: f64, rng: &mut impl Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as u32
    };
    if temperature <= 0.0 {
        return argmax();
    }
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut p: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &v)| (i, ((v as f64 - max) / temperature).exp()))
        .collect();
    let z: f64 = p.iter().map(|x| x.1).sum();
    p.iter_mut().for_each(|x| x.1 /= z);
    p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = 0;
    let mut mass = 0.0;
    for x in &p {
        kept += 1;
        mass += x.1;
        if mass >= top_p {
            break;
        }
    }
    let mut u = rng.random::<f64>() * mass;
    for x in &p[..kept] {
        u -= x.1;
        if u <= 0.0 {
            return x.0 as u32;
        }
    }
    p[kept - 1].0 as u32
}

pub fn run(a: GenerateArgs) -> Result<()> {
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", a.top_p);
    }
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        bail!("--temperature must be a number >= 0, got {}", a.temperature);
    }
    let ck = a.model.open()?;
    let tok = ck.tokenizer()?;
    let prompt = tok.encode(&a.prompt, a.add_bos)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let eos = tok.eos.clone();
    let max_positions = ck.cfg.max_positions.unwrap_or(usize::MAX);
    if prompt.len() >= max_positions {
        bail!(
            "the prompt has {} tokens; the model takes {max_positions} positions",
            prompt.len()
        );
    }
    // Stop at the model's last position rather than fail there.
    let limit = a.max_new_tokens.min(max_positions - prompt.len());
    if limit < a.max_new_tokens {
        eprintln!(
            "note: generating at most {limit} tokens (max_position_embeddings {max_positions})"
        );
    }
    let (new, prefill_s, decode_s) = a.model.run(&ck, |m| {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(a.seed);
        let mut cache = m.new_cache();
        let mut out = Vec::new();
        let clock = Instant::now();
        let ids = Tensor::from_slice(&prompt, (1, prompt.len()), &Device::Cpu)?;
        let mut logits = m.forward(&ids, Some(&mut cache), None, Logits::Last)?;
        let prefill_s = clock.elapsed().as_secs_f64();
        let clock = Instant::now();
        for step in 0..limit {
            let row = logits
                .flatten_all()?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?;
            let next = pick(&row, a.temperature, a.top_p, &mut rng);
            out.push(next);
            if eos.contains(&next) || step + 1 == limit {
                break;
            }
            let ids = Tensor::from_slice(&[next], (1, 1), &Device::Cpu)?;
            logits = m.forward(&ids, Some(&mut cache), None, Logits::Last)?;
        }
        Ok((out, prefill_s, clock.elapsed().as_secs_f64()))
    })?;
    if a.json {
        let v = serde_json::json!({"prompt_ids": prompt, "new_ids": new});
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        // Decode prompt and continuation together (a decoder may drop a leading space of a
        // lone continuation), then print the prompt as given and what follows it.
        let all: Vec<u32> = prompt.iter().chain(&new).copied().collect();
        let text = tok.decode(&all)?;
        let head = tok.decode(&prompt)?;
        let tail = text.strip_prefix(head.as_str()).map(str::to_string);
        println!("{}{}", a.prompt, tail.unwrap_or(tok.decode(&new)?));
    }
    eprintln!(
        "prompt {} tokens: prefill {:.1} tokens/s; {} new tokens: {:.2} ms/token",
        prompt.len(),
        prompt.len() as f64 / prefill_s.max(1e-9),
        new.len(),
        1e3 * decode_s / (new.len().saturating_sub(1).max(1)) as f64
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_sampling_pick_sensibly() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        assert_eq!(pick(&[0.0, 3.0, 1.0], 0.0, 1.0, &mut rng), 1);
        // A tiny top-p keeps only the best token.
        assert_eq!(pick(&[0.0, 3.0, 1.0], 1.0, 1e-6, &mut rng), 1);
        // Sampling hits every token of a flat distribution.
        let mut seen = [false; 3];
        for _ in 0..200 {
            seen[pick(&[0.0, 0.0, 0.0], 1.0, 1.0, &mut rng) as usize] = true;
        }
        assert_eq!(seen, [true; 3]);
    }
}
