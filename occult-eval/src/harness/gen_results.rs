//! A generative task's results, as lm-evaluation-harness 0.4.13 reports them: each answer
//! decoded and cut at the stop strings, each filter's answer and its `exact_match`, the mean
//! and standard error per filter (`exact_match,FILTER` and `exact_match_stderr,FILTER` in the
//! results JSON), and the samples lines as the harness's `--log_samples` writes them (one line
//! per document and filter, the filters in turn).

use super::extract::ExactMatch;
use super::gen_eval::{GenPrepared, GenScored};
use super::generate_until::Stopping;
use super::metrics::{mean_stderr, Estimate};
use super::results::sha256_hex;
use anyhow::Result;
use occult_core::models::tokenizer::TextTokenizer;
use serde::Serialize;
use serde_json::{json, Map, Value};

/// One item's answer and scores.
#[derive(Clone, Debug, PartialEq)]
pub struct GenSample {
    pub doc_id: usize,
    pub doc: Value,
    pub target: String,
    pub context: String,
    /// The generation decoded and cut at the stop strings.
    pub response: String,
    /// Each filter's answer, in the task's filter order.
    pub filtered: Vec<String>,
    /// Each filter's `exact_match`.
    pub exact_match: Vec<f64>,
}

/// How fast a task's answers were generated.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct GenSpeed {
    pub seconds: f64,
    pub items_per_s: f64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub generated_tokens_per_s: f64,
    /// Ragged forward steps (of the rank with the most).
    pub steps: u64,
}

/// One generative task's results, typed.
#[derive(Clone, Debug)]
pub struct GenResults {
    /// The filters' names, in the task's order (the first is the headline).
    pub filters: Vec<String>,
    /// `exact_match` over the task, per filter.
    pub figures: Vec<Estimate>,
    pub num_fewshot: usize,
    /// The generation's settings, as the harness's `arg_1` records them.
    pub gen_kwargs: Value,
    pub speed: GenSpeed,
    pub samples: Vec<GenSample>,
}

impl GenResults {
    /// The result keys of filter `f`: `exact_match,f` and `exact_match_stderr,f`.
    pub fn keys(f: &str) -> (String, String) {
        (
            format!("exact_match,{f}"),
            format!("exact_match_stderr,{f}"),
        )
    }

    /// The task's entry in the results JSON: each filter's `exact_match` and its standard
    /// error under the harness's keys, `n`, `num_fewshot`, the generation's settings and
    /// `speed`.
    pub fn to_json(&self) -> Value {
        let mut o = Map::new();
        for (f, e) in self.filters.iter().zip(&self.figures) {
            let (value, stderr) = Self::keys(f);
            o.insert(value, json!(e.value));
            o.insert(stderr, json!(e.stderr));
        }
        o.insert("n".into(), json!(self.samples.len()));
        o.insert("num_fewshot".into(), json!(self.num_fewshot));
        o.insert("gen_kwargs".into(), self.gen_kwargs.clone());
        o.insert("speed".into(), json!(self.speed));
        Value::Object(o)
    }

    /// The samples lines as the harness writes them: for each filter in turn, one line per
    /// document with its context and settings (`arguments`), the response (`resps`), the
    /// filter's answer (`filtered_resps`), `exact_match`, and the SHA-256 of the context
    /// (`prompt_hash`) and of the target (`target_hash`).
    pub fn sample_lines(&self) -> Vec<Value> {
        let mut lines = Vec::with_capacity(self.filters.len() * self.samples.len());
        for (k, f) in self.filters.iter().enumerate() {
            for s in &self.samples {
                lines.push(json!({
                    "doc_id": s.doc_id,
                    "doc": s.doc,
                    "target": s.target,
                    "arguments": {"gen_args_0": {"arg_0": s.context, "arg_1": self.gen_kwargs}},
                    "resps": [[s.response]],
                    "filtered_resps": [s.filtered[k]],
                    "filter": f,
                    "metrics": ["exact_match"],
                    "prompt_hash": sha256_hex(&s.context),
                    "target_hash": sha256_hex(&s.target),
                    "exact_match": s.exact_match[k],
                }));
            }
        }
        lines
    }

    /// The headline filter's `exact_match` (the task's first filter).
    pub fn headline(&self) -> Estimate {
        self.figures[0]
    }
}

/// Decodes, filters and scores a task's generations.
pub fn summarise_generative(
    p: &GenPrepared,
    s: &GenScored,
    tok: &TextTokenizer,
    stopping: &Stopping,
) -> Result<GenResults> {
    let filters = p
        .spec
        .filters()
        .iter()
        .map(|f| f.compile())
        .collect::<Result<Vec<_>>>()?;
    let metric = ExactMatch::new(&p.spec.exact_match)?;
    let mut samples = Vec::with_capacity(p.items.len());
    for ((it, doc), ids) in p.items.iter().zip(&p.docs).zip(&s.generated) {
        let response = stopping.response(tok, ids)?;
        let filtered: Vec<String> = filters
            .iter()
            .map(|f| f.apply(std::slice::from_ref(&response)))
            .collect();
        let exact_match = filtered
            .iter()
            .map(|a| metric.score(a, &it.target))
            .collect();
        samples.push(GenSample {
            doc_id: it.doc_id,
            doc: doc.clone(),
            target: it.target.clone(),
            context: it.context.clone(),
            response,
            filtered,
            exact_match,
        });
    }
    let figures = (0..filters.len())
        .map(|k| {
            let xs: Vec<f64> = samples.iter().map(|x| x.exact_match[k]).collect();
            mean_stderr(&xs)
        })
        .collect();
    let g = &p.spec.generation;
    let secs = s.seconds.max(1e-9);
    Ok(GenResults {
        filters: filters.iter().map(|f| f.name.clone()).collect(),
        figures,
        num_fewshot: p.shots,
        gen_kwargs: json!({"until": g.until, "max_gen_toks": g.max_gen_toks,
                           "do_sample": false, "temperature": 0.0}),
        speed: GenSpeed {
            seconds: s.seconds,
            items_per_s: p.items.len() as f64 / secs,
            prompt_tokens: s.counts.prompt_tokens,
            generated_tokens: s.counts.generated_tokens,
            generated_tokens_per_s: s.counts.generated_tokens as f64 / secs,
            steps: s.counts.steps,
        },
        samples,
    })
}
