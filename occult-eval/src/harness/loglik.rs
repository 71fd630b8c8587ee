//! Log-likelihood requests scored as lm-evaluation-harness scores them for Hugging Face causal
//! LMs (`HFLM.loglikelihood`):
//! 1. trailing whitespace of the context moves to the front of the continuation;
//! 2. `whole = encode(context + continuation)`, `ctx = encode(context)`, and the continuation's
//!    tokens are `whole[len(ctx)..]` (the tail of the joint encoding);
//! 3. an empty context becomes the prefix token (BOS, else EOS);
//! 4. the input is `(ctx + cont)[-(max_len + 1)..][..-1]`, and the score is the sum of the
//!    continuation tokens' log-probabilities; `is_greedy` says every one is the argmax.
//!
//! `encode` adds the tokenizer's special tokens (its post-processor's BOS, as Llama's and
//! Mixtral's tokenizers add) as the harness does by default ([`harness_ids`]): unless
//! `add_bos` is `Some(false)` (lm-eval's `add_bos_token=False`), and never to a text that
//! already starts with the BOS text. An empty context's continuation is encoded without
//! them, and a continuation that starts with the prefix token gives it up as the context.

use anyhow::{bail, Result};
use candle::{Device, Tensor, D};
use occult_core::models::model::{Logits, Model};
use occult_core::models::tokenizer::TextTokenizer;
use serde::{Deserialize, Serialize};

/// A request's tokens: the context and the continuation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encoded {
    pub context: Vec<u32>,
    pub continuation: Vec<u32>,
}

/// The score of one request (`occult loglik`'s JSON).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Score {
    pub loglikelihood: f64,
    pub is_greedy: bool,
    pub tokens: usize,
}

/// Splits trailing whitespace off the context onto the continuation.
pub fn move_trailing_space(context: &str, continuation: &str) -> (String, String) {
    let kept = context.trim_end();
    let moved = &context[kept.len()..];
    (kept.to_string(), format!("{moved}{continuation}"))
}

/// Encodes `text` as the harness's HF backend does: with the tokenizer's special tokens
/// (its post-processor's BOS) unless `add_bos` is `Some(false)` (lm-eval's `add_bos_token`;
/// unset, the tokenizer's default, which adds them), and never when the text already starts
/// with the prefix token's text.
pub fn harness_ids(tok: &TextTokenizer, text: &str, add_bos: Option<bool>) -> Result<Vec<u32>> {
    let prefixed = match tok.prefix_token() {
        Some(p) => {
            let bos = tok.decode_with_special(&[p])?;
            !bos.is_empty() && text.starts_with(&bos)
        }
        None => false,
    };
    Ok(tok.encode(text, add_bos.unwrap_or(true) && !prefixed)?)
}

/// Tokenises a request by the harness's rule (special tokens as [`harness_ids`] adds them).
pub fn encode(
    tok: &TextTokenizer,
    context: &str,
    continuation: &str,
    add_bos: Option<bool>,
) -> Result<Encoded> {
    if context.is_empty() {
        let prefix = match tok.prefix_token() {
            Some(p) => p,
            None => bail!("an empty context needs a BOS or EOS token, and the model has neither"),
        };
        // The harness encodes it without special tokens here, whatever add_bos_token says.
        let mut cont = tok.encode(continuation, false)?;
        // A continuation that already starts with the prefix token uses it as the context.
        let context = if cont.first() == Some(&prefix) {
            vec![cont.remove(0)]
        } else {
            vec![prefix]
        };
        return Ok(Encoded {
            context,
            continuation: cont,
        });
    }
    let (context, continuation) = move_trailing_space(context, continuation);
    let whole = harness_ids(tok, &format!("{context}{continuation}"), add_bos)?;
    let ctx = harness_ids(tok, &context, add_bos)?;
    if ctx.is_empty() {
        // lm-eval asserts here too: only a truly empty context gets the prefix token.
        bail!("the context {context:?} encodes to no tokens (a whitespace-only context?)");
    }
    let cut = ctx.len().min(whole.len());
    Ok(Encoded {
        continuation: whole[cut..].to_vec(),
        context: ctx,
    })
}

/// The model input and the positions scored: `(input, first scored position)`.
pub fn input_window(e: &Encoded, max_len: usize) -> Result<(Vec<u32>, usize)> {
    if e.continuation.is_empty() {
        bail!("the continuation has no tokens of its own");
    }
    if e.continuation.len() > max_len {
        bail!(
            "the continuation has {} tokens, more than the model's {max_len} positions",
            e.continuation.len()
        );
    }
    if e.context.is_empty() {
        bail!("the context has no tokens (an empty context takes the prefix token)");
    }
    let all: Vec<u32> = e.context.iter().chain(&e.continuation).copied().collect();
    let start = all.len().saturating_sub(max_len + 1);
    let input = all[start..all.len() - 1].to_vec();
    // The continuation's first token is predicted at the position just before it.
    let first = input.len() - (e.continuation.len() - 1) - 1;
    Ok((input, first))
}

/// Scores one request from the logits `[T, V]` of its input window.
pub fn score_from_logits(logits: &Tensor, e: &Encoded, first: usize) -> Result<Score> {
    let n = e.continuation.len();
    let logp = candle_nn::ops::log_softmax(&logits.narrow(0, first, n)?, D::Minus1)?;
    let rows = logp.to_vec2::<f32>()?;
    let mut total = 0f64;
    let mut greedy = true;
    for (row, &tok) in rows.iter().zip(&e.continuation) {
        total += row[tok as usize] as f64;
        // Ties count as greedy only if the token is the first maximum (torch's argmax).
        let best =
            row.iter().enumerate().fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            );
        greedy &= best.0 == tok as usize;
    }
    if !total.is_finite() {
        bail!("the log-likelihood is {total}: the model's outputs are not finite");
    }
    Ok(Score {
        loglikelihood: total,
        is_greedy: greedy,
        tokens: n,
    })
}

/// Scores one request with `model` (one forward pass).
pub fn score(model: &Model, e: &Encoded) -> Result<Score> {
    let max_len = model.cfg.max_positions.unwrap_or(2048);
    let (input, first) = input_window(e, max_len)?;
    let ids = Tensor::from_slice(&input, (1, input.len()), &Device::Cpu)?;
    let logits = model
        .forward(&ids, None, None, Logits::All)?
        .squeeze(0)?
        .to_dtype(candle::DType::F32)?;
    score_from_logits(&logits, e, first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailing_space_moves_to_the_continuation() {
        assert_eq!(
            move_trailing_space("The cake was ", "baked"),
            ("The cake was".into(), " baked".into())
        );
        assert_eq!(
            move_trailing_space("Q:\n\n", "A"),
            ("Q:".into(), "\n\nA".into())
        );
        assert_eq!(move_trailing_space("a", " b"), ("a".into(), " b".into()));
    }

    #[test]
    fn the_window_scores_the_continuation_tail() {
        let e = Encoded {
            context: vec![1, 2, 3],
            continuation: vec![4, 5],
        };
        // Input 1 2 3 4: token 4 is predicted at position 2, token 5 at 3.
        assert_eq!(input_window(&e, 100).unwrap(), (vec![1, 2, 3, 4], 2));
        // Truncated to the last max_len + 1 tokens, minus the last.
        assert_eq!(input_window(&e, 3).unwrap(), (vec![2, 3, 4], 1));
        assert!(input_window(&e, 1).is_err());
    }

    #[test]
    fn hand_checked_scores() {
        // Two positions over a vocabulary of 3.
        let logits = Tensor::new(&[[0f32, 0.0, 0.0], [2.0, 1.0, 0.0]], &Device::Cpu).unwrap();
        let e = Encoded {
            context: vec![0],
            continuation: vec![1, 0],
        };
        let s = score_from_logits(&logits, &e, 0).unwrap();
        let lse = (2f64.exp() + 1f64.exp() + 1.0).ln();
        let want = -(3f64.ln()) + (2.0 - lse);
        assert!((s.loglikelihood - want).abs() < 1e-6, "{s:?}");
        // Token 1 at a uniform position is not the first maximum.
        assert!(!s.is_greedy);
        assert_eq!(s.tokens, 2);
    }
}
