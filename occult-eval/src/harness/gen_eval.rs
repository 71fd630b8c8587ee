//! A generative task's evaluation, as lm-evaluation-harness 0.4.13 runs a `generate_until`
//! task: its documents loaded and its items built with their few-shot contexts, the first
//! `limit` of them ([`prepare_generative`]); each context encoded as the harness's HF backend
//! encodes it and left-truncated to the model's window ([`windows`]); then the answers
//! generated greedily on the model's ranks, each rank its share, batched, and gathered in item
//! order ([`generate_task`]). What the answers score is [`super::gen_results`]'s.

use super::data::{self, Source};
use super::evaluate::{check_fewshot_split, source_name, PrepareOptions};
use super::gen_task::{context_window, GenItem, GenTaskSpec};
use super::generate_until::{generate_batched, GenCounts, Stopping};
use super::pyrandom::PyRandom;
use anyhow::{bail, Context, Result};
use occult_core::models::model::Model;
use occult_core::models::tokenizer::TextTokenizer;
use serde_json::Value;
use std::time::Instant;

/// One generative task's items, ready to generate.
#[derive(Clone, Debug)]
pub struct GenPrepared {
    /// The task file, with the run's `max_gen_toks` in force.
    pub spec: GenTaskSpec,
    /// The requests, in document order.
    pub items: Vec<GenItem>,
    /// Each item's document (for the samples lines).
    pub docs: Vec<Value>,
    /// Few-shot examples per item.
    pub shots: usize,
}

/// A generative task's generations, and what they cost.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct GenScored {
    /// Each item's generated token ids, in the order of [`GenPrepared::items`].
    pub generated: Vec<Vec<u32>>,
    pub counts: GenCounts,
    /// Wall-clock time of the generation (the slowest rank's).
    pub seconds: f64,
}

impl GenScored {
    /// Ranks' generations of consecutive shares of a task, joined in rank order.
    fn join(parts: Vec<GenScored>) -> GenScored {
        let mut all = GenScored {
            generated: Vec::new(),
            counts: GenCounts::default(),
            seconds: 0.0,
        };
        for p in parts {
            all.generated.extend(p.generated);
            all.counts.prompt_tokens += p.counts.prompt_tokens;
            all.counts.generated_tokens += p.counts.generated_tokens;
            all.counts.steps = all.counts.steps.max(p.counts.steps);
            all.seconds = all.seconds.max(p.seconds);
        }
        all
    }
}

/// The few-shot count the harness uses: the task's own when its file says 0 (the harness
/// ignores `--num_fewshot` then), else `asked` or the task's own.
pub fn fewshot_count(spec: &GenTaskSpec, asked: Option<usize>) -> usize {
    match spec.prompt.num_fewshot {
        0 => 0,
        own => asked.unwrap_or(own),
    }
}

/// A generative task's items from `source`: the first `limit` documents of its eval split,
/// each with its few-shot context, drawn with one `random.Random(seed)` advanced document by
/// document as the harness draws.
pub fn prepare_generative(
    mut spec: GenTaskSpec,
    source: &Source,
    o: &PrepareOptions,
) -> Result<GenPrepared> {
    if let Some(n) = o.max_gen_toks {
        if n == 0 {
            bail!("--max-gen-toks must be at least 1");
        }
        spec.generation.max_gen_toks = n;
    }
    let (eval, few) = data::load(&spec.name, &spec.data, source)?;
    let shots = fewshot_count(&spec, o.num_fewshot);
    if spec.prompt.fewshot_samples.is_empty() {
        check_fewshot_split(&spec.name, &spec.data, few.as_ref(), shots)?;
    }
    let n = o.limit.map_or(eval.docs.len(), |l| l.min(eval.docs.len()));
    if n == 0 {
        bail!(
            "no documents to generate for in {} (from {})",
            spec.name,
            source_name(source, &spec.data)
        );
    }
    let mut rng = PyRandom::new(u128::from(o.seed));
    let fewshot = few.as_ref().map(|f| f.docs.as_slice());
    let items = (0..n)
        .map(|i| {
            spec.item(&eval.docs, i, fewshot, shots, &mut rng)
                .with_context(|| eval.origins[i].clone())
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(GenPrepared {
        docs: eval.docs[..n].to_vec(),
        spec,
        items,
        shots,
    })
}

/// Each item's tokens fed, as the harness's HF backend encodes a context (special tokens as
/// [`super::loglik::harness_ids`] adds them) and keeps its last `max_length - max_gen_toks`.
pub fn windows(
    p: &GenPrepared,
    tok: &TextTokenizer,
    max_length: usize,
    add_bos: Option<bool>,
) -> Result<Vec<Vec<u32>>> {
    p.items
        .iter()
        .map(|it| {
            let ids = super::loglik::harness_ids(tok, &it.context, add_bos)?;
            let w = context_window(&ids, max_length, p.spec.generation.max_gen_toks)?;
            if w.is_empty() {
                bail!("document {}: the context encodes to no tokens", it.doc_id);
            }
            Ok(w.to_vec())
        })
        .collect()
}

/// Generates the answers of a task's items with `m` after their `windows`, until `stopping`
/// ends each, `batch` in flight: on D ranks this rank's share (see [`Model::shard`]), then
/// every rank's generations are gathered in item order on rank 0. `done(n)` counts finished
/// items. A generation error is the task's (the other tasks go on); a failure to gather is
/// the run's.
pub fn generate_task(
    m: &Model,
    tok: &TextTokenizer,
    windows: &[Vec<u32>],
    stopping: &Stopping,
    batch: usize,
    done: &dyn Fn(u64),
) -> Result<Result<GenScored, String>> {
    let share = &windows[m.shard(windows.len())];
    let clock = Instant::now();
    let mine = generate_batched(m, tok, share, stopping, batch, done)
        .map(|(generated, counts)| GenScored {
            generated,
            counts,
            seconds: clock.elapsed().as_secs_f64(),
        })
        .map_err(|e| format!("{e:#}"));
    let all = m.finish_and_gather(vec![mine])?;
    Ok(all
        .into_iter()
        .collect::<Result<Vec<_>, String>>()
        .map(GenScored::join))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn options(limit: Option<usize>, num_fewshot: Option<usize>) -> PrepareOptions {
        PrepareOptions {
            data: Default::default(),
            samples: true,
            num_fewshot,
            limit,
            seed: 1234,
            max_gen_toks: None,
        }
    }

    /// The built-in GSM8K task files are the fixture's (held to the harness) with the
    /// harness's default budget of 256 new tokens; the limit takes the first documents, and a
    /// zero-shot task keeps 0 shots whatever is asked, as the harness does.
    #[test]
    fn builtin_generative_tasks_are_the_harness_files() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/generative");
        for name in ["gsm8k", "gsm8k_cot", "gsm8k_cot_zeroshot"] {
            let builtin = match super::super::evaluate::task_file(name).unwrap() {
                super::super::evaluate::TaskFile::Generative(t) => t,
                _ => panic!("{name} is generative"),
            };
            let mut fixture = GenTaskSpec::read(&dir.join(format!("{name}.toml"))).unwrap();
            assert_eq!(builtin.generation.max_gen_toks, 256);
            fixture.generation.max_gen_toks = 256;
            assert_eq!(format!("{builtin:?}"), format!("{fixture:?}"), "{name}");
            let p =
                prepare_generative(builtin, &Source::Samples, &options(Some(3), Some(2))).unwrap();
            assert_eq!(p.items.len(), 3);
            assert_eq!(p.shots, if name.ends_with("zeroshot") { 0 } else { 2 });
        }
        let spec = GenTaskSpec::read(&dir.join("gsm8k.toml")).unwrap();
        let mut o = options(None, None);
        o.max_gen_toks = Some(7);
        let p = prepare_generative(spec.clone(), &Source::Samples, &o).unwrap();
        assert_eq!((p.items.len(), p.shots), (9, 5));
        assert_eq!(p.spec.generation.max_gen_toks, 7);
        o.max_gen_toks = Some(0);
        assert!(prepare_generative(spec, &Source::Samples, &o).is_err());
    }
}
