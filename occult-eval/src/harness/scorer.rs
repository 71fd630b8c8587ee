//! Scoring items' requests with a model, by lm-evaluation-harness's log-likelihood rule
//! ([`super::loglik`]), two ways that give the same scores:
//! - **plain**: every request is its own sequence, context and continuation; requests are
//!   right-padded into batches of `batch` sequences (padding comes after every real token, so
//!   causal attention never sees it);
//! - **context reuse**: an item whose choices share a context runs the context once, keeps
//!   its key/value cache, and runs all continuations as one batch on copies of it.
//!
//! Both count the tokens they feed the model, so the saving is measured, not assumed.

use super::loglik::{encode, input_window, score_from_logits, Encoded};
use super::task::Item;
use anyhow::{Context, Result};
use candle::{DType, Device, Tensor};
use occult_core::models::model::{Logits, Model, RoutingRecorder};
use occult_core::models::tokenizer::TextTokenizer;

/// How to score.
#[derive(Clone, Copy, Debug)]
pub struct ScoreOptions {
    pub reuse_context: bool,
    /// Sequences per forward pass in plain scoring.
    pub batch: usize,
    /// lm-eval's `add_bos_token` (unset: the tokenizer's default; see
    /// [`super::loglik::harness_ids`]).
    pub add_bos: Option<bool>,
}

/// Scores items; counts forward tokens.
pub struct Scorer<'a> {
    pub model: &'a Model,
    pub tok: &'a TextTokenizer,
    pub opts: ScoreOptions,
    /// Real (unpadded) tokens fed to the model.
    pub forward_tokens: u64,
    pub forward_passes: u64,
    /// Records the routing of every token fed (use batch 1 without reuse so that no padding
    /// is recorded).
    pub recorder: Option<RoutingRecorder>,
}

impl<'a> Scorer<'a> {
    pub fn new(model: &'a Model, tok: &'a TextTokenizer, opts: ScoreOptions) -> Self {
        Scorer {
            model,
            tok,
            opts,
            forward_tokens: 0,
            forward_passes: 0,
            recorder: None,
        }
    }

    fn max_len(&self) -> usize {
        self.model.cfg.max_positions.unwrap_or(2048)
    }

    /// Log-likelihoods of every request of every item, in order.
    pub fn score(&mut self, items: &[Item]) -> Result<Vec<Vec<f64>>> {
        let mut enc: Vec<Vec<Encoded>> = Vec::with_capacity(items.len());
        for it in items {
            let e = it
                .contexts
                .iter()
                .zip(&it.continuations)
                .map(|(c, x)| encode(self.tok, c, x, self.opts.add_bos))
                .collect::<Result<Vec<_>>>()
                .with_context(|| format!("document {}", it.doc_id))?;
            enc.push(e);
        }
        let mut out: Vec<Vec<f64>> = enc.iter().map(|e| vec![f64::NAN; e.len()]).collect();
        let mut plain: Vec<(usize, usize)> = Vec::new();
        for (i, (it, e)) in items.iter().zip(&enc).enumerate() {
            let fits = e
                .iter()
                .all(|r| r.context.len() + r.continuation.len() <= self.max_len() + 1);
            let same_ctx = e.windows(2).all(|w| w[0].context == w[1].context);
            let has_tokens = e.iter().all(|r| !r.continuation.is_empty());
            if self.opts.reuse_context && it.shared_context() && same_ctx && fits && has_tokens {
                out[i] = self.reuse(e)?;
            } else {
                plain.extend((0..e.len()).map(|j| (i, j)));
            }
        }
        for chunk in plain.chunks(self.opts.batch.max(1)) {
            let reqs: Vec<&Encoded> = chunk.iter().map(|&(i, j)| &enc[i][j]).collect();
            for (&(i, j), ll) in chunk.iter().zip(self.plain(&reqs)?) {
                out[i][j] = ll;
            }
        }
        Ok(out)
    }

    /// One right-padded batch of whole requests.
    fn plain(&mut self, reqs: &[&Encoded]) -> Result<Vec<f64>> {
        let windows: Vec<(Vec<u32>, usize)> = reqs
            .iter()
            .map(|e| input_window(e, self.max_len()))
            .collect::<Result<_>>()?;
        let width = windows.iter().map(|w| w.0.len()).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(reqs.len() * width);
        for (w, _) in &windows {
            ids.extend(w);
            ids.extend(std::iter::repeat_n(0u32, width - w.len()));
            self.forward_tokens += w.len() as u64;
        }
        let ids = Tensor::from_vec(ids, (reqs.len(), width), &Device::Cpu)?;
        let logits = self
            .model
            .forward(&ids, None, self.recorder.as_mut(), Logits::All)?
            .to_dtype(DType::F32)?;
        self.forward_passes += 1;
        reqs.iter()
            .zip(&windows)
            .enumerate()
            .map(|(b, (e, (_, first)))| {
                Ok(score_from_logits(&logits.get(b)?, e, *first)?.loglikelihood)
            })
            .collect()
    }

    /// Requests sharing one context: the context once, then every continuation on a copy of
    /// its cache.
    fn reuse(&mut self, reqs: &[Encoded]) -> Result<Vec<f64>> {
        let ctx = &reqs[0].context;
        let n = reqs.len();
        let mut cache = self.model.new_cache();
        let ids = Tensor::from_slice(ctx, (1, ctx.len()), &Device::Cpu)?;
        let last = self
            .model
            .forward(&ids, Some(&mut cache), self.recorder.as_mut(), Logits::Last)?
            .to_dtype(DType::F32)?
            .squeeze(0)?; // [1, V]
        self.forward_tokens += ctx.len() as u64;
        self.forward_passes += 1;
        // Every continuation but its last token is input; the first is predicted from the
        // context's last position.
        let width = reqs
            .iter()
            .map(|r| r.continuation.len() - 1)
            .max()
            .unwrap_or(0);
        let rest = if width == 0 {
            None
        } else {
            let mut ids = Vec::with_capacity(n * width);
            for r in reqs {
                let inp = &r.continuation[..r.continuation.len() - 1];
                ids.extend(inp);
                ids.extend(std::iter::repeat_n(0u32, width - inp.len()));
                self.forward_tokens += inp.len() as u64;
            }
            let ids = Tensor::from_vec(ids, (n, width), &Device::Cpu)?;
            let mut batch_cache = cache.repeat(n)?;
            self.forward_passes += 1;
            Some(
                self.model
                    .forward(
                        &ids,
                        Some(&mut batch_cache),
                        self.recorder.as_mut(),
                        Logits::All,
                    )?
                    .to_dtype(DType::F32)?,
            )
        };
        reqs.iter()
            .enumerate()
            .map(|(i, r)| {
                let mut rows = vec![last.clone()];
                if let Some(rest) = &rest {
                    rows.push(rest.get(i)?.narrow(0, 0, r.continuation.len() - 1)?);
                }
                let logits = Tensor::cat(&rows, 0)?;
                Ok(score_from_logits(&logits, r, 0)?.loglikelihood)
            })
            .collect()
    }
}
