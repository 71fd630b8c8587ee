//! Generation: continue prompts, greedily or by sampling (temperature, top-p), with the
//! key/value cache. On D ranks the prompts are spread over the ranks (each rank decodes its
//! own, in step with the others), and the results come back in the prompts' order.

use crate::context::ModelSpec;
use anyhow::{bail, Result};
use candle::{Device, Tensor};
use occult_core::models::model::{Logits, Model};
use rand::{Rng, SeedableRng};
use std::time::Instant;

/// How to continue each prompt.
#[derive(Clone, Debug)]
pub struct Sampling {
    /// Most new tokens (generation also stops at an end-of-sequence token).
    pub max_new_tokens: usize,
    /// 0 is greedy decoding; above 0, sample from softmax(logits / temperature).
    pub temperature: f64,
    /// Sample from the smallest set of tokens whose probability reaches this.
    pub top_p: f64,
    /// Seed of the sampler (prompt i uses seed + i).
    pub seed: u64,
    /// Add the tokenizer's special tokens (BOS) to the prompt.
    pub add_bos: bool,
}

/// One prompt and what followed it.
#[derive(Clone, Debug)]
pub struct Continuation {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    /// The prompt as given and the decoded continuation.
    pub text: String,
    pub generated: Generated,
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

/// One prompt's generation.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Generated {
    /// The new token ids.
    pub new: Vec<u32>,
    pub prefill_s: f64,
    pub decode_s: f64,
}

/// Generates at most `limit` tokens after `prompt` (stopping at an EOS token).
fn generate_one(
    m: &Model,
    prompt: &[u32],
    limit: usize,
    eos: &[u32],
    a: &Sampling,
    seed: u64,
) -> Result<Generated> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut cache = m.new_cache();
    let mut new = Vec::new();
    let clock = Instant::now();
    let ids = Tensor::from_slice(prompt, (1, prompt.len()), &Device::Cpu)?;
    let mut logits = m.forward(&ids, Some(&mut cache), None, Logits::Last)?;
    let prefill_s = clock.elapsed().as_secs_f64();
    let clock = Instant::now();
    for step in 0..limit {
        let row = crate::harness::generate_until::finite_row(&logits, step)?;
        let next = pick(&row, a.temperature, a.top_p, &mut rng);
        new.push(next);
        if eos.contains(&next) || step + 1 == limit {
            break;
        }
        let ids = Tensor::from_slice(&[next], (1, 1), &Device::Cpu)?;
        logits = m.forward(&ids, Some(&mut cache), None, Logits::Last)?;
    }
    Ok(Generated {
        new,
        prefill_s,
        decode_s: clock.elapsed().as_secs_f64(),
    })
}

/// Continues every prompt on `spec`'s ranks: rank 0 gets them in order, the other processes
/// of an `mpirun` job `None`.
pub fn generate(
    spec: &ModelSpec,
    texts: &[String],
    a: &Sampling,
) -> Result<Option<Vec<Continuation>>> {
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", a.top_p);
    }
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        bail!("--temperature must be a number >= 0, got {}", a.temperature);
    }
    let ck = spec.open()?;
    let tok = ck.tokenizer()?;
    let eos = tok.eos.clone();
    let max_positions = ck.cfg.positions();
    let mut encoded = Vec::with_capacity(texts.len());
    for (i, text) in texts.iter().enumerate() {
        let prompt = tok.encode(text, a.add_bos)?;
        let which = if texts.len() > 1 {
            format!("prompt {}", i + 1)
        } else {
            "the prompt".into()
        };
        if prompt.is_empty() {
            bail!("{which} encodes to no tokens");
        }
        if prompt.len() >= max_positions {
            bail!(
                "{which} has {} tokens; the model takes {max_positions} positions",
                prompt.len()
            );
        }
        // Stop at the model's last position rather than fail there.
        let limit = a.max_new_tokens.min(max_positions - prompt.len());
        if limit < a.max_new_tokens {
            eprintln!(
                "note: {which}: generating at most {limit} tokens (max_position_embeddings \
                 {max_positions})"
            );
        }
        encoded.push((prompt, limit));
    }
    let work = format!("{encoded:?} {} {} {}", a.seed, a.temperature, a.top_p).into_bytes();
    let Some(results) = spec.run_same(&ck, "prompts or sampling flags", work, |m| {
        let mut mine = Vec::new();
        for i in m.shard(encoded.len()) {
            let (prompt, limit) = &encoded[i];
            mine.push(generate_one(m, prompt, *limit, &eos, a, a.seed + i as u64)?);
        }
        Ok(m.finish_and_gather(mine)?)
    })?
    else {
        return Ok(None);
    };
    let mut outputs = Vec::new();
    for ((text, (prompt, _)), g) in texts.iter().zip(&encoded).zip(&results) {
        // Decode prompt and continuation together (a decoder may drop a leading space of a
        // lone continuation), then print the prompt as given and what follows it.
        let all: Vec<u32> = prompt.iter().chain(&g.new).copied().collect();
        let full = tok.decode(&all)?;
        let head = tok.decode(prompt)?;
        let tail = full.strip_prefix(head.as_str()).map(str::to_string);
        let completion = format!("{text}{}", tail.unwrap_or(tok.decode(&g.new)?));
        outputs.push(Continuation {
            prompt: text.clone(),
            prompt_ids: prompt.clone(),
            text: completion,
            generated: g.clone(),
        });
    }
    Ok(Some(outputs))
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
