//! Generative task files (`output_type = "generate_until"`, lm-evaluation-harness's GSM8K and
//! its chain-of-thought variants) and the requests they make of documents: the prompt, the
//! generation's stop strings and token budget, the filters and `exact_match`'s settings.
//!
//! A request's context is built as the harness's `fewshot_context` builds it: the description,
//! then each few-shot example as `text + target_delimiter + target + fewshot_delimiter` (the
//! target delimiter only before a non-empty target), then the document's text with nothing
//! after it. Examples come from the few-shot split, the task's own inline samples (the
//! harness's `fewshot_config.samples`), or the eval split, drawn as the multiple-choice tasks
//! draw them ([`super::task::draw_fewshot`]). The tokens fed are the context's last
//! `max_length - max_gen_toks` ([`context_window`]: the harness truncates on the left).
//!
//! What becomes of the generated text is [`super::extract`]'s.

use super::extract::{ExactMatchSpec, Filter, Step};
use super::pyrandom::PyRandom;
use super::task::{
    blank_line, check_task_name, draw_fewshot, parse_task_file, space, DataSpec, Sampler,
};
use super::template::render;
use anyhow::{bail, Result};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// The one output type a generative task file declares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputType {
    GenerateUntil,
}

/// How documents become prompts and targets.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenPromptSpec {
    /// Printed once before the few-shot examples (a template).
    #[serde(default)]
    pub description: String,
    /// The document's text (a template; `doc_to_text`).
    pub text: String,
    /// The reference answer (a template; `doc_to_target`), also what follows an example's text.
    pub target: String,
    #[serde(default = "space")]
    pub target_delimiter: String,
    #[serde(default = "blank_line")]
    pub fewshot_delimiter: String,
    #[serde(default)]
    pub num_fewshot: usize,
    #[serde(default)]
    pub fewshot_sampler: Sampler,
    /// Draw n + 1 and drop the eval document (default: when the examples come from the eval
    /// split itself).
    #[serde(default)]
    pub fewshot_exclude_doc: Option<bool>,
    /// Few-shot documents written in the task file (the harness's `fewshot_config.samples`),
    /// used instead of a split.
    #[serde(default)]
    pub fewshot_samples: Vec<Value>,
}

/// The generation of each request.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GenerationSpec {
    /// Stop strings (the EOS token's text is added, [`super::extract::stop_sequences`]).
    pub until: Vec<String>,
    /// Most new tokens (the harness's default 256).
    #[serde(default = "default_max_gen_toks")]
    pub max_gen_toks: usize,
}

fn default_max_gen_toks() -> usize {
    256
}

/// A generative task file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenTaskSpec {
    pub name: String,
    #[serde(default)]
    pub about: String,
    pub output_type: OutputType,
    pub data: DataSpec,
    pub prompt: GenPromptSpec,
    pub generation: GenerationSpec,
    /// Named pipelines over each response (none: the response itself, as `take_first`).
    #[serde(default)]
    pub filters: Vec<Filter>,
    #[serde(default)]
    pub exact_match: ExactMatchSpec,
}

/// One generation request: the context, and the reference its answer is scored against.
#[derive(Clone, Debug, PartialEq)]
pub struct GenItem {
    pub doc_id: usize,
    pub context: String,
    pub target: String,
}

impl GenTaskSpec {
    /// Parses a task file; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self> {
        parse_task_file(text, origin, Self::check)
    }

    /// Reads a task file.
    pub fn read(path: &Path) -> Result<Self> {
        let text = occult_core::input::read_text(path)?;
        Self::parse(&text, &path.display().to_string())
    }

    fn check(&self) -> Result<()> {
        check_task_name(&self.name)?;
        if self.generation.max_gen_toks == 0 {
            bail!("generation.max_gen_toks must be at least 1");
        }
        for f in self.filters() {
            f.compile()?;
        }
        super::extract::ExactMatch::new(&self.exact_match)?;
        Ok(())
    }

    /// The filters, or the harness's `none` (the first response) when the file gives none.
    pub fn filters(&self) -> Vec<Filter> {
        if self.filters.is_empty() {
            return vec![Filter {
                name: "none".into(),
                steps: vec![Step::TakeFirst],
            }];
        }
        self.filters.clone()
    }

    /// The request of eval document `i` of `docs`, with `shots` few-shot examples from
    /// `fewshot` (the few-shot split), else the task's inline samples, else `docs` itself (the
    /// document never its own example); random draws from `rng`, advanced document by
    /// document as the harness does.
    pub fn item(
        &self,
        docs: &[Value],
        i: usize,
        fewshot: Option<&[Value]>,
        shots: usize,
        rng: &mut PyRandom,
    ) -> Result<GenItem> {
        let doc = &docs[i];
        let p = &self.prompt;
        let (pool, from_eval): (&[Value], bool) = match fewshot {
            Some(f) => (f, false),
            None if !p.fewshot_samples.is_empty() => (&p.fewshot_samples, false),
            None => (docs, true),
        };
        let exclude_doc = p.fewshot_exclude_doc.unwrap_or(from_eval);
        let picked = draw_fewshot(
            rng,
            pool.len(),
            shots,
            p.fewshot_sampler,
            exclude_doc,
            &|j| &pool[j] == doc,
        )?;
        let mut context = render(&p.description, doc)?;
        for j in picked {
            let ex = &pool[j];
            context.push_str(&render(&p.text, ex)?);
            let target = render(&p.target, ex)?;
            if !target.is_empty() {
                context.push_str(&p.target_delimiter);
                context.push_str(&target);
            }
            context.push_str(&p.fewshot_delimiter);
        }
        context.push_str(&render(&p.text, doc)?);
        Ok(GenItem {
            doc_id: i,
            context,
            target: render(&p.target, doc)?,
        })
    }
}

/// The tokens of a context the harness feeds: the last `max_length - max_gen_toks` (it
/// truncates on the left, so that the generation fits the model's `max_length`). Fails where
/// the budget leaves no room for a context, as the harness does.
pub fn context_window(ids: &[u32], max_length: usize, max_gen_toks: usize) -> Result<&[u32]> {
    let room = max_length.saturating_sub(max_gen_toks);
    if room == 0 {
        bail!(
            "max_gen_toks {max_gen_toks} leaves no room for a prompt in the model's \
             {max_length} positions (give a smaller --max-gen-toks)"
        );
    }
    Ok(&ids[ids.len().saturating_sub(room)..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use occult_core::models::tokenizer::TextTokenizer;
    use std::path::PathBuf;

    fn dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/generative")
    }

    fn jsonl(name: &str) -> Vec<Value> {
        std::fs::read_to_string(dir().join(name))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Every context of `prompts.json` (lm-eval 0.4.13's own, for gsm8k at 0, 1 and 5 shots,
    /// gsm8k_cot at 0, 1 and 8, gsm8k_cot_zeroshot and the stop-string variant), built from
    /// this repository's translations of the harness's task files: the same string, the same
    /// stop strings and budget, and the same tokens fed after the left truncation.
    #[test]
    fn contexts_and_windows_as_the_harness_built_them() {
        let f: Value =
            serde_json::from_str(&std::fs::read_to_string(dir().join("prompts.json")).unwrap())
                .unwrap();
        let tok = TextTokenizer::read(
            &PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/fixtures/models/tokenizer.json"),
            304,
        )
        .unwrap();
        let (test, train) = (jsonl("test.jsonl"), jsonl("train.jsonl"));
        let seed = f["seed"].as_u64().unwrap();
        let mut checked = 0;
        for (run, docs) in f["runs"].as_object().unwrap() {
            let (task, shots) = run.split_once('/').unwrap();
            let spec = GenTaskSpec::read(&dir().join(format!("{task}.toml"))).unwrap();
            let shots: usize = shots.parse().unwrap();
            let fewshot = spec.data.fewshot_split.as_ref().map(|_| train.as_slice());
            let mut rng = PyRandom::new(u128::from(seed));
            for (i, want) in docs.as_array().unwrap().iter().enumerate() {
                let item = spec.item(&test, i, fewshot, shots, &mut rng).unwrap();
                assert_eq!(
                    item.context,
                    want["context"].as_str().unwrap(),
                    "{run} doc {i}"
                );
                let g = &want["gen_kwargs"];
                let until: Vec<String> = serde_json::from_value(g["until"].clone()).unwrap();
                assert_eq!(spec.generation.until, until, "{run}");
                assert_eq!(
                    spec.generation.max_gen_toks as u64,
                    g["max_gen_toks"].as_u64().unwrap()
                );
                let ids = tok.encode(&item.context, false).unwrap();
                assert_eq!(ids.len() as u64, want["context_len"].as_u64().unwrap());
                let window = context_window(&ids, 128, spec.generation.max_gen_toks).unwrap();
                let fed: Vec<u32> = serde_json::from_value(want["input_ids"].clone()).unwrap();
                assert_eq!(window, fed.as_slice(), "{run} doc {i}");
                checked += 1;
            }
        }
        assert_eq!(checked, 8 * 9);
    }

    /// The targets are the harness's `doc_to_target`: GSM8K's whole answer, or the chain-of-
    /// thought tasks' final number (as `scripted.json` recorded them).
    #[test]
    fn targets_as_the_harness_rendered_them() {
        let f: Value =
            serde_json::from_str(&std::fs::read_to_string(dir().join("scripted.json")).unwrap())
                .unwrap();
        let test = jsonl("test.jsonl");
        for (task, t) in f["tasks"].as_object().unwrap() {
            let spec = GenTaskSpec::read(&dir().join(format!("{task}.toml"))).unwrap();
            let mut rng = PyRandom::new(1234);
            for (i, want) in t["targets"].as_array().unwrap().iter().enumerate() {
                let item = spec.item(&test, i, None, 0, &mut rng).unwrap();
                assert_eq!(item.target, want.as_str().unwrap(), "{task} doc {i}");
            }
        }
    }

    #[test]
    fn bad_task_files_are_named() {
        let base = std::fs::read_to_string(dir().join("gsm8k.toml")).unwrap();
        for (from, to, says) in [
            ("max_gen_toks = 32", "max_gen_toks = 0", "max_gen_toks"),
            (
                "regex_pattern = \"#### (",
                "regex_pattern = \"#### ((",
                "strict-match",
            ),
            (
                r#"output_type = "generate_until""#,
                r#"output_type = "loglikelihood""#,
                "not a valid task file",
            ),
            (
                "[generation]",
                "[generation]\nstop = 1",
                "not a valid task file",
            ),
        ] {
            assert!(base.contains(from), "{from}");
            let err = GenTaskSpec::parse(&base.replacen(from, to, 1), "t.toml").unwrap_err();
            assert!(format!("{err:#}").contains(says), "{to}: {err:#}");
        }
        let few = GenTaskSpec::parse(&base, "t.toml").unwrap();
        let mut rng = PyRandom::new(1);
        let docs = jsonl("test.jsonl");
        let err = few
            .item(&docs, 0, Some(&docs[..2]), 5, &mut rng)
            .unwrap_err();
        assert!(err.to_string().contains("5 few-shot examples"), "{err}");
        assert!(context_window(&[1, 2, 3], 32, 32).is_err());
        assert_eq!(context_window(&[1, 2, 3], 34, 32).unwrap(), &[2, 3]);
    }
}
