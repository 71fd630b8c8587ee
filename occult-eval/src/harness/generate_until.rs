//! Greedy generation as lm-evaluation-harness 0.4.13's HF backend runs a `generate_until`
//! request at batch size 1: from the context's window of tokens
//! ([`super::gen_task::context_window`]), one argmax token at a time with the key/value cache,
//! until `max_gen_toks` tokens, an EOS token (kept in the output, as transformers keeps it) or
//! a stop string. A stop string is looked for as the harness's `MultiTokenEOSCriteria` looks:
//! in the decoded last `len(encode(stop)) + 2` generated tokens, special tokens kept
//! ([`Stopping`]). The response is the generation decoded without special tokens and cut at the
//! stop strings ([`super::extract::cut_at_stops`]).

use super::extract::{cut_at_stops, stop_sequences};
use anyhow::{bail, Result};
use candle::{DType, Device, Tensor};
use occult_core::models::model::{Logits, Model};
use occult_core::models::tokenizer::TextTokenizer;

/// The stop strings of a request and how many generated tokens each is looked for in.
#[derive(Clone, Debug, PartialEq)]
pub struct Stopping {
    /// The task's `until` and the EOS token's text.
    pub stops: Vec<String>,
    /// `len(encode(stop)) + 2` for each.
    windows: Vec<usize>,
}

impl Stopping {
    /// The stop strings of `until` with `tok`'s EOS text appended (the first EOS id's).
    pub fn new(tok: &TextTokenizer, until: &[String]) -> Result<Self> {
        let eos = match tok.eos.first() {
            Some(&id) => Some(tok.decode_with_special(&[id])?),
            None => None,
        };
        let stops = stop_sequences(until, eos.as_deref());
        let windows = stops
            .iter()
            .map(|s| Ok(tok.encode(s, false)?.len() + 2))
            .collect::<Result<Vec<_>>>()?;
        Ok(Stopping { stops, windows })
    }

    /// Whether a stop string shows in the decoded tail of `generated`.
    pub fn hit(&self, tok: &TextTokenizer, generated: &[u32]) -> Result<bool> {
        for (stop, &w) in self.stops.iter().zip(&self.windows) {
            if stop.is_empty() {
                continue;
            }
            let tail = &generated[generated.len().saturating_sub(w)..];
            if tok.decode_with_special(tail)?.contains(stop.as_str()) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The response: `generated` decoded without special tokens, cut at the stop strings.
    pub fn response(&self, tok: &TextTokenizer, generated: &[u32]) -> Result<String> {
        Ok(cut_at_stops(&tok.decode(generated)?, &self.stops))
    }
}

/// The last position's logits as f32, refused if any is not finite (a NaN would silently
/// pick token 0): generation step `step`.
pub(crate) fn finite_row(logits: &Tensor, step: usize) -> Result<Vec<f32>> {
    let row = logits
        .flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?;
    if let Some(i) = row.iter().position(|v| !v.is_finite()) {
        bail!(
            "the model's logits are not finite ({} at token id {i}) at generation step \
             {step}: the weights or the dtype overflow",
            row[i]
        );
    }
    Ok(row)
}

/// The greedy argmax of a row of logits (the first on ties, as torch's).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Generates after `window` (the context's tokens fed) on `m`, one sequence: at most
/// `max_gen_toks` tokens, ending early at an EOS id of `eos` (kept) or a stop string.
pub fn generate_greedy(
    m: &Model,
    tok: &TextTokenizer,
    window: &[u32],
    max_gen_toks: usize,
    eos: &[u32],
    stopping: &Stopping,
) -> Result<Vec<u32>> {
    if window.is_empty() {
        bail!("a generation request with an empty context");
    }
    let mut cache = m.new_cache();
    let ids = Tensor::from_slice(window, (1, window.len()), &Device::Cpu)?;
    let mut logits = m.forward(&ids, Some(&mut cache), None, Logits::Last)?;
    let mut new = Vec::with_capacity(max_gen_toks);
    while new.len() < max_gen_toks {
        let row = finite_row(&logits, new.len())?;
        let next = argmax(&row);
        new.push(next);
        if eos.contains(&next) || new.len() == max_gen_toks || stopping.hit(tok, &new)? {
            break;
        }
        let ids = Tensor::from_slice(&[next], (1, 1), &Device::Cpu)?;
        logits = m.forward(&ids, Some(&mut cache), None, Logits::Last)?;
    }
    Ok(new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::extract::{mean_stderr, ExactMatch};
    use crate::harness::gen_task::{GenItem, GenTaskSpec};
    use crate::harness::pyrandom::PyRandom;
    use occult_core::models::loader::Checkpoint;
    use serde_json::Value;
    use std::path::PathBuf;

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
    }

    fn json(path: PathBuf) -> Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    /// A stop string is looked for in the last `len(encode(stop)) + 2` tokens only: spelt in
    /// byte tokens it is found when it ends the generation, and missed (as the harness misses
    /// it) once more tokens follow; the cut of the response finds it either way.
    #[test]
    fn stop_strings_are_looked_for_in_the_harness_window() {
        let ck = Checkpoint::open(
            root().join("models/qwen3_moe").to_str().unwrap(),
            None,
            DType::F32,
        )
        .unwrap();
        let tok = ck.tokenizer().unwrap();
        let stopping = Stopping::new(tok, &["hh".into()]).unwrap();
        let one = |t: &str| tok.encode(t, false).unwrap()[0];
        let (h, x) = (one("h"), one("x"));
        // "hh" encodes to 2 tokens, so it is looked for in the last 4.
        assert_eq!(tok.encode("hh", false).unwrap().len(), 2);
        assert!(stopping.hit(tok, &[x, x, h, h]).unwrap());
        assert!(stopping.hit(tok, &[h, h, x, x]).unwrap());
        assert!(!stopping.hit(tok, &[h, h, x, x, x]).unwrap());
        assert_eq!(stopping.response(tok, &[x, h, h, x, x, x]).unwrap(), "x");
        assert_eq!(stopping.stops.last().unwrap(), "<|endoftext|>");
    }

    /// What lm-eval 0.4.13's HF backend generated on the fixture models (olmoe.json,
    /// qwen3_moe.json), reproduced token for token from the windows it fed (prompts.json):
    /// the generated ids (stopping at the same token), the responses, each filter's answer
    /// and exact match, and every run's means and standard errors.
    #[test]
    fn generations_and_scores_as_the_harness_made_them() {
        let gen = root().join("generative");
        let prompts = json(gen.join("prompts.json"));
        let test: Vec<Value> = std::fs::read_to_string(gen.join("test.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let mut tokens = 0;
        for model in ["olmoe", "qwen3_moe"] {
            let want = json(gen.join(format!("{model}.json")));
            let dir = root().join("models").join(model);
            let ck = Checkpoint::open(dir.to_str().unwrap(), None, DType::F32).unwrap();
            let tok = ck.tokenizer().unwrap();
            let m = Model::load_reference(&ck.weights, &ck.cfg).unwrap();
            for (run, w) in want["runs"].as_object().unwrap() {
                let task = run.split_once('/').unwrap().0;
                let spec = GenTaskSpec::read(&gen.join(format!("{task}.toml"))).unwrap();
                let stopping = Stopping::new(tok, &spec.generation.until).unwrap();
                let filters: Vec<_> = spec
                    .filters()
                    .iter()
                    .map(|f| f.compile().unwrap())
                    .collect();
                let metric = ExactMatch::new(&spec.exact_match).unwrap();
                let mut scores = vec![Vec::new(); filters.len()];
                for (i, doc) in w["docs"].as_array().unwrap().iter().enumerate() {
                    let fed: Vec<u32> =
                        serde_json::from_value(prompts["runs"][run][i]["input_ids"].clone())
                            .unwrap();
                    let ids = generate_greedy(
                        &m,
                        tok,
                        &fed,
                        spec.generation.max_gen_toks,
                        &tok.eos,
                        &stopping,
                    )
                    .unwrap();
                    let want_ids: Vec<u32> =
                        serde_json::from_value(doc["gen_ids"].clone()).unwrap();
                    assert_eq!(ids, want_ids, "{model} {run} doc {i}");
                    tokens += ids.len();
                    let resp = stopping.response(tok, &ids).unwrap();
                    assert_eq!(
                        resp,
                        doc["resps"].as_str().unwrap(),
                        "{model} {run} doc {i}"
                    );
                    let GenItem { target, .. } =
                        spec.item(&test, i, None, 0, &mut PyRandom::new(0)).unwrap();
                    for (k, f) in filters.iter().enumerate() {
                        let got = f.apply(std::slice::from_ref(&resp));
                        assert_eq!(got, doc["filtered"][&f.name].as_str().unwrap());
                        let em = metric.score(&got, &target);
                        assert_eq!(em, doc["exact_match"][&f.name].as_f64().unwrap());
                        scores[k].push(em);
                    }
                }
                for (k, f) in filters.iter().enumerate() {
                    let (mean, se) = mean_stderr(&scores[k]);
                    let res = &w["results"];
                    let key = |m: &str| format!("{m},{}", f.name);
                    assert!((mean - res[key("exact_match")].as_f64().unwrap()).abs() < 1e-12);
                    assert!(
                        (se.unwrap() - res[key("exact_match_stderr")].as_f64().unwrap()).abs()
                            < 1e-12
                    );
                }
            }
        }
        eprintln!("{tokens} generated tokens held to the harness's");
    }
}
