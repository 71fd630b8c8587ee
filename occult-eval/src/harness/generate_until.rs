//! Greedy generation as lm-evaluation-harness 0.4.13's HF backend runs a `generate_until`
//! request at batch size 1 ([`generate_greedy`], the reference), and continuously batched
//! ([`generate_batched`], what `occult eval` runs; the same tokens): from the context's
//! window of tokens ([`super::gen_task::context_window`]), one argmax token at a time with
//! the key/value cache,
//! until `max_gen_toks` tokens, an EOS token (kept in the output, as transformers keeps it) or
//! a stop string. A stop string is looked for as the harness's `MultiTokenEOSCriteria` looks:
//! in the decoded last `len(encode(stop)) + 2` generated tokens, special tokens kept
//! ([`Stopping`]). The response is the generation decoded without special tokens and cut at the
//! stop strings ([`super::extract::cut_at_stops`]).

use super::extract::{cut_at_stops, stop_sequences};
use anyhow::{bail, Result};
use candle::{DType, Device, Tensor};
use occult_core::models::model::{KvCache, Logits, Model};
use occult_core::models::tokenizer::TextTokenizer;

/// When a request's generation ends: its token budget, the EOS ids, and the stop strings with
/// how many generated tokens each is looked for in.
#[derive(Clone, Debug, PartialEq)]
pub struct Stopping {
    /// The task's `until` and the EOS token's text.
    pub stops: Vec<String>,
    /// `len(encode(stop)) + 2` for each.
    windows: Vec<usize>,
    /// Most new tokens.
    pub max_gen_toks: usize,
    /// The tokenizer's EOS ids (kept in the generation).
    pub eos: Vec<u32>,
}

impl Stopping {
    /// At most `max_gen_toks` tokens, until `tok`'s EOS ids or a stop string of `until` or
    /// `tok`'s EOS text (the first EOS id's).
    pub fn new(tok: &TextTokenizer, until: &[String], max_gen_toks: usize) -> Result<Self> {
        let eos = match tok.eos.first() {
            Some(&id) => Some(tok.decode_with_special(&[id])?),
            None => None,
        };
        let stops = stop_sequences(until, eos.as_deref());
        let windows = stops
            .iter()
            .map(|s| Ok(tok.encode(s, false)?.len() + 2))
            .collect::<Result<Vec<_>>>()?;
        Ok(Stopping {
            stops,
            windows,
            max_gen_toks,
            eos: tok.eos.clone(),
        })
    }

    /// Exactly `max_gen_toks` tokens: no stop string, no EOS (benchmarks).
    pub fn budget(max_gen_toks: usize) -> Self {
        Stopping {
            stops: Vec::new(),
            windows: Vec::new(),
            max_gen_toks,
            eos: Vec::new(),
        }
    }

    /// Whether `generated` ends here: at the budget, an EOS id or a stop string.
    pub fn ends(&self, tok: &TextTokenizer, generated: &[u32]) -> Result<bool> {
        Ok(generated.len() >= self.max_gen_toks
            || generated.last().is_some_and(|t| self.eos.contains(t))
            || self.hit(tok, generated)?)
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
pub(crate) fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Generates after `window` (the context's tokens fed) on `m`, one sequence, until
/// `stopping` ends it (an EOS id is kept).
pub fn generate_greedy(
    m: &Model,
    tok: &TextTokenizer,
    window: &[u32],
    stopping: &Stopping,
) -> Result<Vec<u32>> {
    if window.is_empty() {
        bail!("a generation request with an empty context");
    }
    let mut cache = m.new_cache();
    let ids = Tensor::from_slice(window, (1, window.len()), &Device::Cpu)?;
    let mut logits = m.forward(&ids, Some(&mut cache), None, Logits::Last)?;
    let mut new = Vec::with_capacity(stopping.max_gen_toks);
    loop {
        let row = finite_row(&logits, new.len())?;
        new.push(argmax(&row));
        if stopping.ends(tok, &new)? {
            break;
        }
        let next = new[new.len() - 1];
        let ids = Tensor::from_slice(&[next], (1, 1), &Device::Cpu)?;
        logits = m.forward(&ids, Some(&mut cache), None, Logits::Last)?;
    }
    Ok(new)
}

/// What a batch of generations cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GenCounts {
    /// Context tokens fed (the windows).
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Ragged forward steps run.
    pub steps: u64,
}

/// One request of [`generate_batched`] in flight.
struct Running {
    /// Its index among the requests.
    index: usize,
    cache: KvCache,
    /// What the next step feeds: the window, then the last token.
    feed: Vec<u32>,
    new: Vec<u32>,
}

/// Generates after every window of `windows`, as [`generate_greedy`] does for each alone (until
/// `stopping` ends it), with up to `batch` requests in flight: each step runs the new tokens
/// of every request in flight as one ragged step ([`Model::forward_ragged`]; a request just
/// admitted brings its whole window), and a finished request's place goes to the next waiting
/// one (continuous batching). `done(n)` is told as requests finish. Returns the generations
/// in request order.
pub fn generate_batched(
    m: &Model,
    tok: &TextTokenizer,
    windows: &[Vec<u32>],
    stopping: &Stopping,
    batch: usize,
    done: &dyn Fn(u64),
) -> Result<(Vec<Vec<u32>>, GenCounts)> {
    if batch == 0 {
        bail!("a batch of at least one request is needed");
    }
    if let Some(i) = windows.iter().position(Vec::is_empty) {
        bail!("generation request {i} has an empty context");
    }
    let mut out: Vec<Option<Vec<u32>>> = vec![None; windows.len()];
    let mut counts = GenCounts::default();
    let mut waiting = 0..windows.len();
    let mut running: Vec<Running> = Vec::with_capacity(batch);
    loop {
        while running.len() < batch {
            let Some(index) = waiting.next() else { break };
            counts.prompt_tokens += windows[index].len() as u64;
            running.push(Running {
                index,
                cache: m.new_cache(),
                feed: windows[index].clone(),
                new: Vec::with_capacity(stopping.max_gen_toks),
            });
        }
        if running.is_empty() {
            break;
        }
        let mut caches: Vec<KvCache> = running
            .iter_mut()
            .map(|r| std::mem::take(&mut r.cache))
            .collect();
        let feeds: Vec<&[u32]> = running.iter().map(|r| r.feed.as_slice()).collect();
        let logits = m.forward_ragged(&feeds, &mut caches, None)?;
        counts.steps += 1;
        let mut still = Vec::with_capacity(running.len());
        for (i, (mut r, cache)) in running.into_iter().zip(caches).enumerate() {
            let row = finite_row(&logits.get(i)?, r.new.len())?;
            let next = argmax(&row);
            r.new.push(next);
            counts.generated_tokens += 1;
            if stopping.ends(tok, &r.new)? {
                out[r.index] = Some(r.new);
                done(1);
            } else {
                r.cache = cache;
                r.feed = vec![next];
                still.push(r);
            }
        }
        running = still;
    }
    let out = out
        .into_iter()
        .map(|g| g.expect("every request finished"))
        .collect();
    Ok((out, counts))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::extract::ExactMatch;
    use crate::harness::gen_task::{GenItem, GenTaskSpec};
    use crate::harness::metrics::mean_stderr;
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
        let stopping = Stopping::new(tok, &["hh".into()], 8).unwrap();
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
    /// the generated ids (stopping at the same token), one at a time and batched, the
    /// responses, each filter's answer and exact match, and every run's means and standard
    /// errors.
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
                let stopping =
                    Stopping::new(tok, &spec.generation.until, spec.generation.max_gen_toks)
                        .unwrap();
                let filters: Vec<_> = spec
                    .filters()
                    .iter()
                    .map(|f| f.compile().unwrap())
                    .collect();
                let metric = ExactMatch::new(&spec.exact_match).unwrap();
                let mut scores = vec![Vec::new(); filters.len()];
                let (mut windows, mut wanted) = (Vec::new(), Vec::new());
                for (i, doc) in w["docs"].as_array().unwrap().iter().enumerate() {
                    let fed: Vec<u32> =
                        serde_json::from_value(prompts["runs"][run][i]["input_ids"].clone())
                            .unwrap();
                    let ids = generate_greedy(&m, tok, &fed, &stopping).unwrap();
                    let want_ids: Vec<u32> =
                        serde_json::from_value(doc["gen_ids"].clone()).unwrap();
                    assert_eq!(ids, want_ids, "{model} {run} doc {i}");
                    windows.push(fed);
                    wanted.push(want_ids);
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
                // Batched, three in flight: the same generations.
                let (batched, counts) =
                    generate_batched(&m, tok, &windows, &stopping, 3, &|_| ()).unwrap();
                assert_eq!(batched, wanted, "{model} {run} batched");
                let generated: usize = wanted.iter().map(Vec::len).sum();
                assert_eq!(counts.generated_tokens, generated as u64);
                assert!(counts.steps as usize >= generated.div_ceil(3));
                for (k, f) in filters.iter().enumerate() {
                    let e = mean_stderr(&scores[k]);
                    let (mean, se) = (e.value, e.stderr);
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
