//! Profiling: runs calibration text through a model on its ranks and returns its routing
//! trace (`occult.trace.v1`: top-k ids, gate weights and router logits per MoE layer).
//!
//! Data: a `.jsonl` file of objects with a `text` field, or a plain text file with one
//! document per non-empty line. Each document is tokenised on its own (no special tokens
//! unless `add_bos`) and cut into windows of at most `seq_len` tokens.
//!
//! On D ranks each rank runs a contiguous share of the windows, and the trace holds every
//! rank's routing in rank order: the windows' order, the token order of one device. (The
//! trace's `num_ranks` stays unset: the shares are whole windows, not even token splits.)

use crate::context::ModelSpec;
use anyhow::{bail, Context, Result};
use candle::{Device, Tensor};
use occult_core::analysis::trace::{LayerTrace, Trace, TraceMeta};
use occult_core::models::model::{Logits, RoutingRecorder};
use std::path::{Path, PathBuf};

/// What to profile, and how.
#[derive(Clone, Debug)]
pub struct ProfileJob {
    /// Calibration text: JSONL with a `text` field, or plain text (one document per line).
    pub data: PathBuf,
    /// Longest window of tokens run at once; when `None`, 512 or the model's positions,
    /// whichever is fewer.
    pub seq_len: Option<usize>,
    /// Stop after this many tokens.
    pub max_tokens: Option<usize>,
    /// Keep the router logits in the trace (the similarity rule needs them).
    pub logits: bool,
    /// Add the tokenizer's special tokens (BOS) to each document.
    pub add_bos: bool,
}

impl ProfileJob {
    /// `data` at `occult profile`'s defaults: windows of 512 tokens (or the model's positions,
    /// whichever is fewer), every token, with logits, no BOS.
    pub fn new(data: &Path) -> Self {
        ProfileJob {
            data: data.to_path_buf(),
            seq_len: None,
            max_tokens: None,
            logits: true,
            add_bos: false,
        }
    }
}

/// A profiled trace and what it covers.
#[derive(Debug)]
pub struct Profiled {
    pub trace: Trace,
    pub tokens: usize,
    pub windows: usize,
}

impl Profiled {
    /// What was profiled, in words, with where the trace went.
    pub fn summary(&self, written_to: &Path) -> String {
        format!(
            "profiled {} tokens in {} windows over {} MoE layers -> {}",
            self.tokens,
            self.windows,
            self.trace.layers.len(),
            written_to.display()
        )
    }
}

/// The documents of a calibration file.
pub fn read_documents(path: &Path) -> Result<Vec<String>> {
    let text = occult_core::input::read_text(path)?;
    let jsonl = path
        .extension()
        .is_some_and(|e| e == "jsonl" || e == "json");
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if jsonl {
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{} line {}: not valid JSON", path.display(), i + 1))?;
            let t = v.get("text").and_then(|t| t.as_str()).with_context(|| {
                format!("{} line {}: no string field `text`", path.display(), i + 1)
            })?;
            docs.push(t.to_string());
        } else {
            docs.push(line.to_string());
        }
    }
    if docs.is_empty() {
        bail!("{}: no documents", path.display());
    }
    Ok(docs)
}

/// Profiles `job` on `spec`'s ranks: rank 0 gets the trace, the other processes of an
/// `mpirun` job `None`.
pub fn profile(spec: &ModelSpec, job: &ProfileJob) -> Result<Option<Profiled>> {
    let a = job;
    if a.seq_len == Some(0) {
        bail!("--seq-len must be at least 1");
    }
    if a.max_tokens == Some(0) {
        bail!("--max-tokens must be at least 1");
    }
    let ck = spec.open()?;
    // Windows never exceed the model's positions; a longer one asked for is an error.
    let positions = ck.cfg.positions();
    let seq_len = match a.seq_len {
        Some(n) if n > positions => bail!(
            "--seq-len {n} exceeds the model's {positions} positions (max_position_embeddings)"
        ),
        Some(n) => n,
        None => 512.min(positions),
    };
    let tok = ck.tokenizer()?;
    let docs = read_documents(&a.data)?;
    let mut windows: Vec<Vec<u32>> = Vec::new();
    let mut total = 0;
    'docs: for d in &docs {
        let ids = tok.encode(d, a.add_bos)?;
        for w in ids.chunks(seq_len) {
            let take = a.max_tokens.map_or(w.len(), |m| w.len().min(m - total));
            if take == 0 {
                break 'docs;
            }
            windows.push(w[..take].to_vec());
            total += take;
        }
    }
    if total == 0 {
        bail!("{}: the documents hold no tokens", a.data.display());
    }
    let cfg = ck.cfg.clone();
    let work = windows.iter().flatten().flat_map(|x| x.to_le_bytes());
    let Some(rec) = spec.run_same(&ck, "calibration windows", work, |m| {
        let share = &windows[m.shard(windows.len())];
        let mine = share.iter().map(Vec::len).sum::<usize>() as u64;
        let bar = crate::progress::rank_bar(m.rank_and_size().0, mine, "tokens");
        let mut rec = RoutingRecorder::default();
        for w in share {
            let ids = Tensor::from_slice(w, (1, w.len()), &Device::Cpu)?;
            m.forward(&ids, None, Some(&mut rec), Logits::Last)?;
            bar.inc(w.len() as u64);
        }
        bar.finish_and_clear();
        Ok(m.finish_and_gather_routing(rec)?)
    })?
    else {
        return Ok(None);
    };
    let mut trace = trace_of(rec, &cfg, &ck.name, &a.data.display().to_string(), a.logits);
    mark_exported(&mut trace, &ck.files.dir);
    // NaN or infinite routing is the model's fault, not the trace file's: say so.
    for l in &trace.layers {
        let values = l.topk_weights.iter().chain(&l.router_logits).flatten();
        if values.clone().any(|v| !v.is_finite()) {
            bail!(
                "the model's routing at layer {} is not finite (NaN or infinite gate weights or \
                 router logits): its weights hold non-finite values, or the dtype overflows \
                 (try --dtype f32)",
                l.layer
            );
        }
    }
    Ok(Some(Profiled {
        trace,
        tokens: total,
        windows: windows.len(),
    }))
}

/// Marks a trace recorded on an exported (renumbered) checkpoint: its ids are the checkpoint's,
/// and `occult trace remap --to original` maps them back to the original model's.
pub fn mark_exported(trace: &mut Trace, model_dir: &std::path::Path) {
    use occult_core::interop::checkpoint::renumbering::{RENUMBERING_FILE, TRACE_NUMBERING_KEY};
    if model_dir.join(RENUMBERING_FILE).is_file() {
        trace.meta.extra.insert(
            TRACE_NUMBERING_KEY.into(),
            format!("exported ({})", model_dir.join(RENUMBERING_FILE).display()),
        );
    }
}

/// A routing trace of what a recorder saw.
pub fn trace_of(
    rec: RoutingRecorder,
    cfg: &occult_core::models::config::ModelConfig,
    model: &str,
    data: &str,
    logits: bool,
) -> Trace {
    let meta = TraceMeta {
        num_experts: cfg.moe.num_experts,
        top_k: cfg.moe.top_k,
        model: Some(model.to_string()),
        data: Some(data.to_string()),
        num_ranks: None,
        extra: Default::default(),
    };
    let layers = rec
        .layers
        .into_iter()
        .map(|(layer, r)| LayerTrace {
            layer,
            tokens: r.tokens,
            topk_ids: r.ids,
            topk_weights: Some(r.weights),
            router_logits: logits.then_some(r.logits),
        })
        .collect();
    Trace { meta, layers }
}
