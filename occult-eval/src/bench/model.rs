//! `occult bench model`: prefill tokens/s and decode ms/token of our model code on a checkpoint,
//! and of another implementation on the same weights and tokens in the same run, with the
//! agreement of their last-position logits: candle-transformers' own model (qwen2_moe,
//! mixtral, qwen3_moe; with the `candle-transformers` feature), or transformers or llama.cpp
//! in a Python process beside this one ([`super::peers`]). Runs alternate between the two
//! so that machine noise hits both alike; each figure is the best of the repeats. With
//! `--devices D > 1` it compares the expert-parallel modes instead ([`super::model_ep`]).

use super::peers::candle_transformers;
use super::peers::process::{level_mismatch, Peer, PeerKind, PeerOptions};
use super::timing::{compare, max_diff, median, median_ratio, random_prompt, Ours};
use crate::context::ModelSpec;
use anyhow::{bail, Result};
use occult_core::models::loader::Checkpoint;
use serde::Serialize;
use std::path::{Path, PathBuf};

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

/// The model bench's settings.
#[derive(Clone, Debug)]
pub struct ModelBench {
    /// Prompt length (random token ids).
    pub prompt_len: usize,
    /// Prompts per rank, prefilled and decoded as one batch (EP modes).
    pub batch: usize,
    /// Decode steps after the prompt.
    pub decode_tokens: usize,
    /// Repeats of each measurement (the best is reported).
    pub repeats: usize,
    /// Another implementation on the same weights.
    pub against: Option<Against>,
    pub seed: u64,
    /// llama.cpp's converted GGUF (used when present, written otherwise).
    pub gguf: Option<PathBuf>,
    /// EP modes: the link profile to project the prefill onto.
    pub link: Option<String>,
}

/// Runs the bench on `spec` (our model alone or against a peer on one device, the EP modes
/// side by side on more), prints the table and writes it as JSON to `json`.
pub fn run(spec: &ModelSpec, a: &ModelBench, json: Option<&Path>) -> Result<()> {
    if a.repeats == 0 {
        bail!("--repeats must be at least 1 (each figure is the best of the repeats)");
    }
    if a.prompt_len == 0 {
        bail!("--prompt-len must be at least 1");
    }
    if a.batch == 0 || (a.batch > 1 && spec.devices < 2) {
        bail!("--batch takes 1 or more prompts per rank, and more than 1 with --devices 2 or more");
    }
    if a.gguf.is_some() && a.against != Some(Against::LlamaCpp) {
        bail!("--gguf is the converted checkpoint of --against llama.cpp; add that or drop --gguf");
    }
    let ck = spec.open()?;
    if spec.devices > 1 {
        return run_parallel(spec, a, &ck, json);
    }
    let prompt = random_prompt(a.prompt_len, ck.cfg.vocab_size, a.seed);
    let label = format!("occult ({:?})", spec.mode()).to_lowercase();
    let against = a.against;
    let level = occult_core::kernels::process_level();
    let Some(timings) = spec.run(&ck, |m| {
        // The machine's read rate after each round, for the decode's bytes a second to be
        // held against the rate beside them (a shared machine's moves between runs).
        let mut read_rate = || occult_core::kernels::bench::read_bandwidth(READ_RATE_BYTES, 1);
        let probe: Option<&mut dyn FnMut() -> f64> = if a.decode_tokens > 0 {
            Some(&mut read_rate)
        } else {
            None
        };
        let mut ours = Ours {
            model: m,
            cache: m.new_cache(),
            label: label.clone(),
        };
        match against {
            None => compare(&mut [&mut ours], &prompt, a.decode_tokens, a.repeats, probe),
            Some(Against::CandleTransformers) => {
                let mut theirs = candle_transformers::load(&ck)?;
                compare(
                    &mut [&mut ours, &mut theirs],
                    &prompt,
                    a.decode_tokens,
                    a.repeats,
                    probe,
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
                let mut theirs = Peer::start(kind, &ck.files.dir, &spec.dtype, threads, &opts)?;
                let dtype = &spec.dtype;
                if let Some(note) = level_mismatch(kind, level, theirs.level, dtype) {
                    eprintln!("warning: {note}");
                }
                compare(
                    &mut [&mut ours, &mut theirs],
                    &prompt,
                    a.decode_tokens,
                    a.repeats,
                    probe,
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
        "dtype": spec.dtype,
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
    if a.decode_tokens > 0 {
        report["decode_reads"] = decode_read_rates(&ck, &spec.dtype, a, &timings)?;
    }
    if let Some(p) = json {
        super::report::write(p, "model", report)?;
    }
    Ok(())
}

/// Buffer of the read-rate measurement: far past any last-level cache.
const READ_RATE_BYTES: usize = 256 << 20;

/// What each implementation's decode step reads a second (the step's bytes,
/// [`decode_reads`](occult_core::models::decode_reads), at the decode's middle context, over
/// its ms/token), against this machine's read rate measured after each round: the best rate,
/// and the median share of the read rate measured beside it. Printed, and returned for the
/// JSON report.
fn decode_read_rates(
    ck: &Checkpoint,
    dtype: &str,
    a: &ModelBench,
    t: &super::timing::Timings,
) -> Result<serde_json::Value> {
    let dt = occult_core::models::loader::parse_dtype(dtype)?;
    let reads = occult_core::models::decode_reads::decode_reads(&ck.weights, &ck.cfg, dt);
    let bytes = reads.at(a.prompt_len + a.decode_tokens / 2) as f64;
    let rates = &t.probes;
    let (lo, hi) = rates
        .iter()
        .fold((f64::INFINITY, 0f64), |(l, h), &r| (l.min(r), h.max(r)));
    let mut line = format!(
        "decode reads {:.1} MB a token; this machine's read rate {:.1}-{:.1} GB/s (measured \
         after each round):",
        bytes / 1e6,
        lo / 1e9,
        hi / 1e9
    );
    let mut each = Vec::new();
    for (r, secs) in t.runs.iter().zip(&t.decode) {
        let per_s = bytes / (r.decode_ms_per_token / 1e3);
        let share = median(
            secs.iter()
                .zip(rates)
                .map(|(s, rate)| bytes / s / rate)
                .collect(),
        );
        line += &format!(
            " {} {:.1} GB/s at best, a median {:.0}% of the rate beside it;",
            r.implementation,
            per_s / 1e9,
            100.0 * share
        );
        each.push(serde_json::json!({
            "implementation": r.implementation,
            "bytes_per_s": per_s,
            "share_of_read_rate": share,
        }));
    }
    println!("{}", line.trim_end_matches(';'));
    Ok(serde_json::json!({
        "bytes_per_token": bytes,
        "weights_bytes": reads.weights,
        "bytes_per_cached_position": reads.per_position,
        "read_rates_bytes_per_s": rates,
        "implementations": each,
    }))
}

/// `bench model --devices D`: the expert-parallel modes side by side.
fn run_parallel(
    spec: &ModelSpec,
    a: &ModelBench,
    ck: &Checkpoint,
    json: Option<&Path>,
) -> Result<()> {
    use super::model_ep::{run, EpModelBench};
    if a.against.is_some() {
        bail!("--against compares implementations on one device; drop --devices");
    }
    let link = a
        .link
        .as_deref()
        .map(occult_core::analysis::cost::links::LinkProfile::load)
        .transpose()?;
    let bench = EpModelBench {
        devices: spec.devices,
        batch: a.batch,
        prompt_len: a.prompt_len,
        decode_tokens: a.decode_tokens,
        repeats: a.repeats,
        max_devices: spec.max_devices().unwrap_or(2),
        node_limit: spec
            .prune
            .filter(|l| matches!(l, occult_core::analysis::PruneLimit::Nodes { .. })),
        devices_per_node: super::modes::node_size(
            spec.devices_per_node,
            link.as_ref(),
            spec.devices,
        ),
        seed: a.seed,
    };
    let Some(results) = run(spec, ck, &bench, link.as_ref())? else {
        return Ok(());
    };
    super::modes::print(&results, link.is_some(), "prefill");
    println!(
        "({} backend, {} ranks, {} prompt(s) of {} tokens each; stage times are the slowest \
         rank's, summed over MoE layers)",
        spec.backend.name(),
        bench.devices,
        bench.batch,
        bench.prompt_len
    );
    if let Some(p) = json {
        super::report::write_modes(
            p,
            "model",
            Some(&ck.name),
            spec.backend,
            &bench,
            link.as_ref(),
            &results,
        )?;
    }
    Ok(())
}
