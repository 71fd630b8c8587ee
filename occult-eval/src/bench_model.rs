//! `occult bench model`: prefill tokens/s and decode ms/token of our model code on a checkpoint,
//! and of another implementation on the same weights and tokens in the same run, with the
//! agreement of their last-position logits: candle-transformers' own model (qwen2_moe,
//! mixtral, qwen3_moe; with the `candle-transformers` feature), or transformers or llama.cpp
//! in a Python process beside this one ([`crate::bench_peer`]). Runs alternate between the two
//! so that machine noise hits both alike; each figure is the best of the repeats. With
//! `--devices D > 1` it compares the expert-parallel modes instead ([`crate::bench_model_ep`]).

use crate::bench_peer::{Peer, PeerKind, PeerOptions};
use crate::commands::model_opts::ModelOpts;
use anyhow::{bail, Result};
use candle::{DType, Device, Tensor};
use occult_core::models::model::{Logits, Model};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::time::Instant;

/// Implementations that can be compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Against {
    /// candle-transformers' model of the same family (build with `--features candle-transformers`).
    CandleTransformers,
    /// Hugging Face transformers (PyTorch) on the same checkpoint, dtype and thread count, in a
    /// Python process beside this one ($OCCULT_PYTHON, default python3, with torch and
    /// transformers installed; scripts/bench_transformers.py), held to our kernels' level.
    Transformers,
    /// llama.cpp (llama-cpp-python) on the checkpoint converted to a GGUF of the same dtype by
    /// llama.cpp's own converter, with the same prompt, threads and decode steps
    /// (scripts/bench_llama_cpp.py; see --gguf).
    #[value(name = "llama.cpp", alias = "llama-cpp")]
    #[serde(rename = "llama.cpp")]
    LlamaCpp,
}

#[derive(clap::Args, Debug)]
pub struct ModelBenchArgs {
    #[command(flatten)]
    pub model: ModelOpts,
    /// Prompt length (random token ids).
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Prompts per rank, prefilled and decoded as one batch (with --devices > 1).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Decode steps after the prompt.
    #[arg(long, default_value_t = 16)]
    pub decode_tokens: usize,
    /// Repeats of each measurement (the best is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Also run another implementation on the same weights.
    #[arg(long, value_enum)]
    pub against: Option<Against>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// With --against llama.cpp: the converted GGUF, used as it is when present and written
    /// there otherwise (without it, the checkpoint is converted again at every run).
    #[arg(long, value_name = "PATH")]
    pub gguf: Option<std::path::PathBuf>,
    /// With --devices D > 1: project the prefill onto this machine (pcie4, nvlink-h100,
    /// ib-ndr, or a TOML file).
    #[arg(long)]
    pub link: Option<String>,
}

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

/// Timings of every decoder over the repeats: `prefill[decoder][repeat]`, likewise `decode`.
pub struct Timings {
    pub runs: Vec<ModelRun>,
    pub logits: Vec<Vec<f32>>,
    pub prefill: Vec<Vec<f64>>,
    pub decode: Vec<Vec<f64>>,
}

/// Runs every decoder `repeats` times, alternating (ours, theirs, ours, theirs...), so that
/// each repeat is a paired comparison under the same machine load.
pub fn compare(
    decoders: &mut [&mut dyn Timed],
    prompt: &[u32],
    steps: usize,
    repeats: usize,
) -> Result<Timings> {
    let n = decoders.len();
    let mut prefill = vec![Vec::new(); n];
    let mut decode = vec![Vec::new(); n];
    let mut logits = vec![Vec::new(); n];
    for _ in 0..repeats.max(1) {
        for (i, d) in decoders.iter_mut().enumerate() {
            let (p, s, l) = d.time(prompt, steps)?;
            prefill[i].push(p);
            decode[i].push(s);
            logits[i] = l;
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
    })
}

/// The median over repeats of `a[r] / b[r]`.
pub fn median_ratio(a: &[f64], b: &[f64]) -> f64 {
    let mut r: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
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

pub fn run(a: ModelBenchArgs) -> Result<()> {
    if a.repeats == 0 {
        bail!("--repeats must be at least 1 (each figure is the best of the repeats)");
    }
    crate::commands::check_model_io(&a.model, &[], &[a.json.as_deref()])?;
    if a.prompt_len == 0 {
        bail!("--prompt-len must be at least 1");
    }
    if a.batch == 0 || (a.batch > 1 && a.model.devices < 2) {
        bail!("--batch takes 1 or more prompts per rank, and more than 1 with --devices 2 or more");
    }
    if a.gguf.is_some() && a.against != Some(Against::LlamaCpp) {
        bail!("--gguf is the converted checkpoint of --against llama.cpp; add that or drop --gguf");
    }
    let ck = a.model.open()?;
    if a.model.devices > 1 {
        return run_parallel(&a, &ck);
    }
    let prompt = random_prompt(a.prompt_len, ck.cfg.vocab_size, a.seed);
    let label = format!("occult ({:?})", a.model.mode()).to_lowercase();
    let against = a.against;
    let level = occult_core::kernels::process_level();
    let Some(timings) = a.model.run(&ck, |m| {
        let mut ours = Ours {
            model: m,
            cache: m.new_cache(),
            label: label.clone(),
        };
        match against {
            None => compare(&mut [&mut ours], &prompt, a.decode_tokens, a.repeats),
            Some(Against::CandleTransformers) => {
                let mut theirs = reference_impl::load(&ck)?;
                compare(
                    &mut [&mut ours, &mut theirs],
                    &prompt,
                    a.decode_tokens,
                    a.repeats,
                )
            }
            Some(peer @ (Against::Transformers | Against::LlamaCpp)) => {
                let kind = match peer {
                    Against::LlamaCpp => PeerKind::LlamaCpp,
                    _ => PeerKind::Transformers,
                };
                let opts = PeerOptions {
                    gguf: a.gguf.clone(),
                    level,
                };
                let threads = rayon::current_num_threads();
                let mut theirs = Peer::start(kind, &ck.files.dir, &a.model.dtype, threads, &opts)?;
                let dtype = &a.model.dtype;
                if let Some(note) =
                    crate::bench_peer::level_mismatch(kind, level, theirs.level, dtype)
                {
                    eprintln!("warning: {note}");
                }
                compare(
                    &mut [&mut ours, &mut theirs],
                    &prompt,
                    a.decode_tokens,
                    a.repeats,
                )
            }
        }
    })?
    else {
        return Ok(());
    };
    let mut table = crate::table::Table::new(&[
        "implementation",
        "prompt",
        "prefill s",
        "prefill tok/s",
        "decode ms/tok",
    ]);
    let runs = &timings.runs;
    for r in runs {
        table.row(vec![
            r.implementation.clone(),
            r.prompt_tokens.to_string(),
            format!("{:.3}", r.prefill_s),
            format!("{:.1}", r.prefill_tokens_per_s),
            format!("{:.2}", r.decode_ms_per_token),
        ]);
    }
    println!("{}", table.render());
    let mut report = serde_json::json!({
        "model": ck.name,
        "dtype": a.model.dtype,
        "threads": rayon::current_num_threads(),
        "kernel_level": level.name(),
        "results": runs,
    });
    if timings.logits.len() == 2 {
        let (d, scale) = max_diff(&timings.logits[0], &timings.logits[1]);
        // Speed of ours relative to theirs (above 1: ours is faster), as the median of the
        // paired repeats.
        let prefill = median_ratio(&timings.prefill[1], &timings.prefill[0]);
        let decode = median_ratio(&timings.decode[1], &timings.decode[0]);
        println!(
            "last-position logits: max |ours - theirs| = {d:.3e} (max |logit| {scale:.3}); \
             speed ours/theirs (median of {} paired repeats): prefill {prefill:.3}, decode \
             {decode:.3}",
            a.repeats
        );
        report["max_abs_logit_diff"] = serde_json::json!(d);
        report["speed_ratio"] = serde_json::json!({"prefill": prefill, "decode": decode});
    }
    if let Some(p) = &a.json {
        crate::commands::write_json(p, &crate::commands::with_provenance(report))?;
    }
    Ok(())
}

/// `bench model --devices D`: the expert-parallel modes side by side.
fn run_parallel(a: &ModelBenchArgs, ck: &occult_core::models::loader::Checkpoint) -> Result<()> {
    use crate::bench_model_ep::{run, EpModelBench};
    if a.against.is_some() {
        bail!("--against compares implementations on one device; drop --devices");
    }
    let link = a
        .link
        .as_deref()
        .map(occult_core::analysis::links::LinkProfile::load)
        .transpose()?;
    let bench = EpModelBench {
        devices: a.model.devices,
        batch: a.batch,
        prompt_len: a.prompt_len,
        decode_tokens: a.decode_tokens,
        repeats: a.repeats,
        max_devices: a.model.max_devices.unwrap_or(2),
        seed: a.seed,
    };
    let Some(results) = run(&a.model, ck, &bench, link.as_ref())? else {
        return Ok(());
    };
    crate::bench_model_ep::print_results(&results, link.is_some(), "prefill");
    println!(
        "({} backend, {} ranks, {} prompt(s) of {} tokens each; stage times are the slowest \
         rank's, summed over MoE layers)",
        a.model.backend.name(),
        bench.devices,
        bench.batch,
        bench.prompt_len
    );
    if let Some(p) = &a.json {
        let v = serde_json::json!({
            "bench": "model",
            "model": ck.name,
            "backend": a.model.backend,
            "config": bench,
            "link": link,
            "projected_with_link_model": link.is_some(),
            "results": results,
        });
        crate::commands::write_json(p, &crate::commands::with_provenance(v))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

#[cfg(not(feature = "candle-transformers"))]
mod reference_impl {
    use super::Decoder;
    use anyhow::{bail, Result};
    use occult_core::models::loader::Checkpoint;

    pub fn load(_: &Checkpoint) -> Result<Box<dyn Decoder>> {
        bail!(
            "this build has no candle-transformers: rebuild with \
             `cargo build --release -p occult-eval --features candle-transformers`"
        )
    }
}

#[cfg(feature = "candle-transformers")]
mod reference_impl {
    //! candle-transformers' qwen2_moe, mixtral and qwen3_moe, built from the same files. Their
    //! configs need fields Hugging Face configs may lack; the defaults given here change
    //! nothing for these checkpoints (no sliding window, SiLU).
    use super::Decoder;
    use anyhow::{bail, Result};
    use candle::{DType, Device, Tensor};
    use candle_transformers::models::{mixtral, qwen2_moe, qwen3_moe};
    use occult_core::models::loader::Checkpoint;
    use serde_json::Value;

    enum Inner {
        Qwen2(qwen2_moe::Model),
        Mixtral(mixtral::Model),
        Qwen3(qwen3_moe::ModelForCausalLM),
    }

    struct Theirs {
        inner: Inner,
        fresh: Box<dyn Fn() -> Result<Inner>>,
    }

    impl Decoder for Theirs {
        fn name(&self) -> String {
            "candle-transformers".into()
        }
        fn reset(&mut self) {
            match &mut self.inner {
                Inner::Qwen2(m) => m.clear_kv_cache(),
                Inner::Qwen3(m) => m.clear_kv_cache(),
                // Mixtral has no cache reset: rebuild it (weights are shared, not copied).
                Inner::Mixtral(_) => {
                    if let Ok(m) = (self.fresh)() {
                        self.inner = m;
                    }
                }
            }
        }
        fn step(&mut self, ids: &[u32], offset: usize) -> Result<Vec<f32>> {
            let t = Tensor::from_slice(ids, (1, ids.len()), &Device::Cpu)?;
            let l = match &mut self.inner {
                Inner::Qwen2(m) => m.forward(&t, offset)?,
                Inner::Mixtral(m) => m.forward(&t, offset)?,
                Inner::Qwen3(m) => m.forward(&t, offset)?,
            };
            Ok(l.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?)
        }
    }

    pub fn load(ck: &Checkpoint) -> Result<Box<dyn Decoder>> {
        let text = std::fs::read_to_string(&ck.files.config)?;
        let mut v: Value = serde_json::from_str(&text)?;
        let c = &ck.cfg;
        let o = v.as_object_mut().expect("config.json is an object");
        let max = c.max_positions.unwrap_or(4096);
        for (k, d) in [
            ("sliding_window", Value::from(max)),
            ("max_window_layers", Value::from(c.num_layers)),
            ("use_sliding_window", Value::from(false)),
            ("hidden_act", Value::from("silu")),
            ("use_flash_attn", Value::from(false)),
            ("attention_bias", Value::from(false)),
            ("head_dim", Value::from(c.head_dim)),
            ("max_position_embeddings", Value::from(max)),
            ("rope_theta", Value::from(c.rope_theta)),
            ("tie_word_embeddings", Value::from(c.tie_word_embeddings)),
        ] {
            if o.get(k).is_none_or(Value::is_null) {
                o.insert(k.to_string(), d);
            }
        }
        let files = ck.files.weights.clone();
        let dtype = ck.weights.dtype();
        // SAFETY: read-only mapping of the checkpoint, as for our own loader.
        let vb =
            unsafe { candle_nn::VarBuilder::from_mmaped_safetensors(&files, dtype, &Device::Cpu)? };
        let (inner, fresh): (Inner, Box<dyn Fn() -> Result<Inner>>) = match c.family.model_type {
            "qwen2_moe" => {
                let cfg: qwen2_moe::Config = serde_json::from_value(v)?;
                (
                    Inner::Qwen2(qwen2_moe::Model::new(&cfg, vb)?),
                    Box::new(|| bail!("unused")),
                )
            }
            "qwen3_moe" => {
                let cfg: qwen3_moe::Config = serde_json::from_value(v)?;
                (
                    Inner::Qwen3(qwen3_moe::ModelForCausalLM::new(&cfg, vb)?),
                    Box::new(|| bail!("unused")),
                )
            }
            "mixtral" => {
                let cfg: mixtral::Config = serde_json::from_value(v)?;
                let m = mixtral::Model::new(&cfg, vb.clone())?;
                (
                    Inner::Mixtral(m),
                    Box::new(move || Ok(Inner::Mixtral(mixtral::Model::new(&cfg, vb.clone())?))),
                )
            }
            other => bail!("candle-transformers has no {other} model to compare with"),
        };
        Ok(Box::new(Theirs { inner, fresh }))
    }
}
