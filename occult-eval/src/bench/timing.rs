//! Timing implementations side by side: something that prefills and decodes with a cache
//! ([`Decoder`]; ours is [`Ours`]), or anything whose prefill and decode can be timed
//! ([`Timed`]; the Python peers), run alternately over paired repeats so that machine noise
//! hits both alike ([`compare`]), with the median paired ratio and the logits' agreement.

use anyhow::Result;
use candle::{DType, Device, Tensor};
use occult_core::models::model::{Logits, Model};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::time::Instant;

/// One implementation's timings.
#[derive(Clone, Debug, Serialize)]
pub struct ModelRun {
    pub implementation: String,
    pub prompt_tokens: usize,
    pub prefill_s: f64,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens: usize,
    pub decode_ms_per_token: f64,
}

/// Something that can prefill and decode with a cache: `step(ids, offset)` returns the last
/// position's logits `[V]`; `reset` clears the cache.
pub trait Decoder {
    fn name(&self) -> String;
    fn reset(&mut self);
    fn step(&mut self, ids: &[u32], offset: usize) -> Result<Vec<f32>>;
}

/// Something whose prefill and greedy decode can be timed: (prefill s, decode s per token,
/// the prompt's last-position logits).
pub trait Timed {
    fn name(&self) -> String;
    fn time(&mut self, prompt: &[u32], steps: usize) -> Result<(f64, f64, Vec<f32>)>;
}

impl<D: Decoder + ?Sized> Timed for D {
    fn name(&self) -> String {
        Decoder::name(self)
    }
    fn time(&mut self, prompt: &[u32], steps: usize) -> Result<(f64, f64, Vec<f32>)> {
        time_one(self, prompt, steps)
    }
}

impl Decoder for Box<dyn Decoder> {
    fn name(&self) -> String {
        self.as_ref().name()
    }
    fn reset(&mut self) {
        self.as_mut().reset()
    }
    fn step(&mut self, ids: &[u32], offset: usize) -> Result<Vec<f32>> {
        self.as_mut().step(ids, offset)
    }
}

/// Our model with its cache.
pub struct Ours<'a> {
    pub model: &'a Model,
    pub cache: occult_core::models::model::KvCache,
    pub label: String,
}

impl Decoder for Ours<'_> {
    fn name(&self) -> String {
        self.label.clone()
    }
    fn reset(&mut self) {
        self.cache = self.model.new_cache();
    }
    fn step(&mut self, ids: &[u32], _offset: usize) -> Result<Vec<f32>> {
        let t = Tensor::from_slice(ids, (1, ids.len()), &Device::Cpu)?;
        let l = self
            .model
            .forward(&t, Some(&mut self.cache), None, Logits::Last)?;
        Ok(l.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?)
    }
}

/// Prefill `prompt`, then decode greedily; returns (prefill s, decode s per token, first
/// logits).
fn time_one<D: Decoder + ?Sized>(
    d: &mut D,
    prompt: &[u32],
    steps: usize,
) -> Result<(f64, f64, Vec<f32>)> {
    d.reset();
    let clock = Instant::now();
    let first = d.step(prompt, 0)?;
    let prefill = clock.elapsed().as_secs_f64();
    let mut logits = first.clone();
    let clock = Instant::now();
    for s in 0..steps {
        let next = logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as u32;
        logits = d.step(&[next], prompt.len() + s)?;
    }
    let per = clock.elapsed().as_secs_f64() / steps.max(1) as f64;
    Ok((prefill, per, first))
}

/// Timings of every decoder over the repeats: `prefill[decoder][repeat]`, likewise `decode`;
/// `probes[repeat]`, what the probe of [`compare`] measured after each round.
pub struct Timings {
    pub runs: Vec<ModelRun>,
    pub logits: Vec<Vec<f32>>,
    pub prefill: Vec<Vec<f64>>,
    pub decode: Vec<Vec<f64>>,
    pub probes: Vec<f64>,
}

/// Runs every decoder `repeats` times, alternating (ours, theirs, ours, theirs...), so that
/// each repeat is a paired comparison under the same machine load; after each round, `probe`
/// if given (the machine's read rate, measured beside the runs it is held against).
pub fn compare(
    decoders: &mut [&mut dyn Timed],
    prompt: &[u32],
    steps: usize,
    repeats: usize,
    mut probe: Option<&mut dyn FnMut() -> f64>,
) -> Result<Timings> {
    let n = decoders.len();
    let mut prefill = vec![Vec::new(); n];
    let mut decode = vec![Vec::new(); n];
    let mut logits = vec![Vec::new(); n];
    let mut probes = Vec::new();
    for _ in 0..repeats.max(1) {
        for (i, d) in decoders.iter_mut().enumerate() {
            let (p, s, l) = d.time(prompt, steps)?;
            prefill[i].push(p);
            decode[i].push(s);
            logits[i] = l;
        }
        if let Some(f) = probe.as_mut() {
            probes.push(f());
        }
    }
    let best = |v: &[f64]| v.iter().cloned().fold(f64::INFINITY, f64::min);
    let runs = decoders
        .iter()
        .enumerate()
        .map(|(i, d)| ModelRun {
            implementation: d.name(),
            prompt_tokens: prompt.len(),
            prefill_s: best(&prefill[i]),
            prefill_tokens_per_s: prompt.len() as f64 / best(&prefill[i]),
            decode_tokens: steps,
            decode_ms_per_token: 1e3 * best(&decode[i]),
        })
        .collect();
    Ok(Timings {
        runs,
        logits,
        prefill,
        decode,
        probes,
    })
}

/// The median over repeats of `a[r] / b[r]`.
pub fn median_ratio(a: &[f64], b: &[f64]) -> f64 {
    median(a.iter().zip(b).map(|(x, y)| x / y).collect())
}

/// The median of `r` (NaN for none).
pub fn median(mut r: Vec<f64>) -> f64 {
    r.sort_by(f64::total_cmp);
    match r.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => r[n / 2],
        n => 0.5 * (r[n / 2 - 1] + r[n / 2]),
    }
}

/// Random prompt ids below `vocab`.
pub fn random_prompt(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| r.random_range(0..vocab as u32)).collect()
}

/// Largest absolute difference, and the largest absolute value of `a`.
pub fn max_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    (d, a.iter().map(|x| x.abs()).fold(0.0, f32::max))
}
