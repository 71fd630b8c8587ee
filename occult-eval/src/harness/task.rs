//! Task files (`tasks/NAME.toml`) and the multiple-choice items they make of documents, as
//! lm-evaluation-harness builds them: the context is the description, the few-shot examples
//! (`text + target_delimiter + answer + fewshot_delimiter` each) and the document's text; one
//! request per choice, `(context, target_delimiter + choice)`. Multiple-input tasks
//! (WinoGrande) instead have one context per choice and a shared continuation.

use super::preprocess::{apply, Preprocess};
use super::pyrandom::PyRandom;
use super::template::{as_text, lookup, render};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// Where a task's data lives.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    /// The Hugging Face dataset id.
    pub hub: String,
    /// The dataset configuration, if any.
    #[serde(default)]
    pub config: Option<String>,
    /// The split scored.
    pub eval_split: String,
    /// Where few-shot examples come from (default: the eval split, without the item itself).
    #[serde(default)]
    pub fewshot_split: Option<String>,
    /// A field whose value groups items into subtasks (MMLU's `subject`); few-shot examples
    /// come from the same group, and results are reported per group and pooled.
    #[serde(default)]
    pub group_field: Option<String>,
    /// Groups of groups (MMLU's four categories of subjects): each is reported, and the
    /// task's figure pools the categories.
    #[serde(default)]
    pub categories: std::collections::BTreeMap<String, Vec<String>>,
}

/// How the gold answer is found.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Gold {
    /// A field holding the index (an integer or a string of digits).
    Field(String),
    /// The position of a field's value in a list: a literal one, or another field's.
    Among { field: String, among: Among },
    /// A fixed index.
    Fixed { index: usize },
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Among {
    List(Vec<String>),
    Field(String),
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Sampler {
    /// A seeded random draw (the harness's default).
    #[default]
    Random,
    /// The first N documents of the few-shot split (MMLU).
    FirstN,
}

/// The metrics a task reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    Acc,
    AccNorm,
}

impl Metric {
    /// Every metric, in the order the samples lines list them.
    pub const ALL: [Metric; 2] = [Metric::Acc, Metric::AccNorm];

    /// The metric's name: as task files spell it, and its key in the results JSON, the
    /// samples lines and the table.
    pub fn key(self) -> &'static str {
        match self {
            Metric::Acc => "acc",
            Metric::AccNorm => "acc_norm",
        }
    }

    /// The key of the metric's standard error in the results JSON (`KEY_stderr`).
    pub fn stderr_key(self) -> String {
        format!("{}_stderr", self.key())
    }
}

pub(crate) fn space() -> String {
    " ".into()
}

pub(crate) fn blank_line() -> String {
    "\n\n".into()
}

/// How documents become prompts.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptSpec {
    /// Printed once before the few-shot examples (a template).
    #[serde(default)]
    pub description: String,
    #[serde(default = "preprocess_none")]
    pub preprocess: Preprocess,
    /// The document's text (a template): one context for all choices.
    #[serde(default)]
    pub text: Option<String>,
    /// Or: a list field of contexts, one per choice (multiple-input tasks).
    #[serde(default)]
    pub contexts: Option<String>,
    /// With `contexts`: the continuation scored under each (a template).
    #[serde(default)]
    pub continuation: Option<String>,
    /// Choice templates.
    #[serde(default)]
    pub choices: Option<Vec<String>>,
    /// Or: a list field of choices.
    #[serde(default)]
    pub choices_field: Option<String>,
    pub gold: Gold,
    #[serde(default = "space")]
    pub target_delimiter: String,
    #[serde(default = "blank_line")]
    pub fewshot_delimiter: String,
    #[serde(default)]
    pub num_fewshot: usize,
    #[serde(default)]
    pub fewshot_sampler: Sampler,
    /// Draw n + 1 examples and drop the eval document, as the harness does when its few-shot
    /// split equals its test split. Both may be unset there, so tasks scored on a validation
    /// split with examples from train do it too; RACE, whose examples come from the test split
    /// itself, does not (the document may be its own example). Default: the few-shot split is
    /// the eval split.
    #[serde(default)]
    pub fewshot_exclude_doc: Option<bool>,
}

fn preprocess_none() -> Preprocess {
    Preprocess::None
}

/// A task file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSpec {
    pub name: String,
    #[serde(default)]
    pub about: String,
    pub data: DataSpec,
    pub prompt: PromptSpec,
    pub metrics: Vec<Metric>,
}

/// One scored item: its requests' contexts and continuations, the gold index, and the
/// choices' lengths in characters (for `acc_norm`).
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    pub doc_id: usize,
    pub group: Option<String>,
    /// One per request (all equal when the choices share a context).
    pub contexts: Vec<String>,
    pub continuations: Vec<String>,
    pub gold: usize,
    pub choice_chars: Vec<usize>,
}

impl Item {
    /// Whether every request shares one context (so its encoding can be reused).
    pub fn shared_context(&self) -> bool {
        self.contexts.windows(2).all(|w| w[0] == w[1])
    }
}

/// Parses a task file of either kind (`origin` names it in errors), then checks it.
pub(crate) fn parse_task_file<T: serde::de::DeserializeOwned>(
    text: &str,
    origin: &str,
    check: fn(&T) -> Result<()>,
) -> Result<T> {
    let t: T = toml::from_str(text).with_context(|| format!("{origin}: not a valid task file"))?;
    check(&t).with_context(|| origin.to_string())?;
    Ok(t)
}

/// A task's name becomes part of file names (samples_NAME.jsonl): one plain name.
pub(crate) fn check_task_name(n: &str) -> Result<()> {
    let plain = !n.is_empty()
        && n.len() <= 128
        && !n.starts_with('.')
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
    if !plain {
        bail!(
            "task name {n:?} must be 1 to 128 letters, digits, '_', '-' or '.', not starting \
             with '.' (it names output files)"
        );
    }
    Ok(())
}

impl TaskSpec {
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
        let p = &self.prompt;
        match (&p.text, &p.contexts) {
            (Some(_), None) => {
                if p.choices.is_some() == p.choices_field.is_some() {
                    bail!("give exactly one of prompt.choices and prompt.choices_field");
                }
            }
            (None, Some(_)) => {
                if p.continuation.is_none() {
                    bail!("prompt.contexts needs prompt.continuation");
                }
            }
            _ => bail!("give exactly one of prompt.text and prompt.contexts"),
        }
        if self.metrics.is_empty() {
            bail!("no metrics");
        }
        Ok(())
    }

    /// The document's text (single-context tasks) or its contexts.
    fn contexts_of(&self, doc: &Value) -> Result<Vec<String>> {
        let p = &self.prompt;
        if let Some(t) = &p.text {
            return Ok(vec![render(t, doc)?]);
        }
        let path = p.contexts.as_deref().unwrap_or_default();
        list_of_text(doc, path)
    }

    /// The choices (single-context tasks).
    fn choices_of(&self, doc: &Value) -> Result<Vec<String>> {
        let p = &self.prompt;
        match (&p.choices, &p.choices_field) {
            (Some(ts), _) => ts.iter().map(|t| render(t, doc)).collect(),
            (None, Some(f)) => list_of_text(doc, f),
            (None, None) => bail!("no choices"),
        }
    }

    fn gold_of(&self, doc: &Value, n: usize) -> Result<usize> {
        let index = match &self.prompt.gold {
            Gold::Fixed { index } => *index,
            Gold::Field(f) => {
                let v = lookup(doc, f).with_context(|| format!("no gold field `{f}`"))?;
                match v {
                    Value::Number(x) => x
                        .as_u64()
                        .with_context(|| format!("gold `{f}` = {x} is not an index"))?
                        as usize,
                    Value::String(s) => s
                        .trim()
                        .parse()
                        .with_context(|| format!("gold `{f}` = {s:?} is not an index"))?,
                    other => bail!("gold `{f}` = {other} is not an index"),
                }
            }
            Gold::Among { field, among } => {
                let v = lookup(doc, field)
                    .and_then(as_text)
                    .with_context(|| format!("no gold field `{field}`"))?;
                let list = match among {
                    Among::List(l) => l.clone(),
                    Among::Field(f) => list_of_text(doc, f)?,
                };
                if list.len() != n {
                    bail!(
                        "the gold labels {list:?} are {} for {n} choices: each choice needs \
                         one label",
                        list.len()
                    );
                }
                list.iter()
                    .position(|x| x.trim() == v.trim())
                    .with_context(|| format!("gold `{field}` = {v:?} is not one of {list:?}"))?
            }
        };
        if index >= n {
            bail!("the gold index {index} is out of range for {n} choices");
        }
        Ok(index)
    }

    /// The text a document contributes as a few-shot example.
    fn example(&self, doc: &Value) -> Result<String> {
        let p = &self.prompt;
        let n = self.contexts_of(doc)?.len();
        if p.contexts.is_some() {
            let gold = self.gold_of(doc, n)?;
            let ctx = &self.contexts_of(doc)?[gold];
            let cont = render(p.continuation.as_deref().unwrap_or_default(), doc)?;
            return Ok(format!("{ctx}{}{cont}", p.target_delimiter));
        }
        let choices = self.choices_of(doc)?;
        let gold = self.gold_of(doc, choices.len())?;
        Ok(format!(
            "{}{}{}",
            self.contexts_of(doc)?[0],
            p.target_delimiter,
            choices[gold]
        ))
    }

    /// Preprocesses documents; `origins` name each one's file and row in errors.
    pub fn prepare(&self, docs: &[Value], origins: &[String]) -> Result<Vec<Value>> {
        docs.iter()
            .zip(origins)
            .map(|(d, o)| apply(self.prompt.preprocess, d).with_context(|| o.clone()))
            .collect()
    }

    /// The item of eval document `i` of `docs`, with `shots` few-shot examples drawn from
    /// `fewshot` (the same list as `docs` when the task has no few-shot split: the item itself
    /// is then never drawn). Random draws come from `rng`, as lm-evaluation-harness draws them:
    /// one `random.Random(seed)` per task (per group here: each MMLU subject is a task there),
    /// advanced document by document in order.
    pub fn item(
        &self,
        docs: &[Value],
        i: usize,
        fewshot: Option<&[Value]>,
        shots: usize,
        rng: &mut PyRandom,
    ) -> Result<Item> {
        let doc = &docs[i];
        let p = &self.prompt;
        let group = match &self.data.group_field {
            Some(f) => Some(
                lookup(doc, f)
                    .and_then(as_text)
                    .with_context(|| format!("no group field `{f}`"))?,
            ),
            None => None,
        };
        let same_group = |d: &Value| match (&self.data.group_field, &group) {
            (Some(f), Some(g)) => lookup(d, f).and_then(as_text).as_deref() == Some(g.as_str()),
            _ => true,
        };
        // Few-shot pool: the few-shot split, else the eval split (the document itself is then
        // drawn around); in the same group. As the harness does: from the same split, draw
        // n + 1, drop every copy of the document, keep n (and if copies left fewer than n,
        // draw n again from the pool without them).
        let exclude_doc = p.fewshot_exclude_doc.unwrap_or(fewshot.is_none());
        let pool: Vec<&Value> = fewshot
            .unwrap_or(docs)
            .iter()
            .filter(|d| same_group(d))
            .collect();
        let picked: Vec<&Value> = draw_fewshot(
            rng,
            pool.len(),
            shots,
            p.fewshot_sampler,
            exclude_doc,
            &|j| pool[j] == doc,
        )?
        .into_iter()
        .map(|j| pool[j])
        .collect();
        let mut prefix = render(&p.description, doc)?;
        for ex in picked {
            prefix.push_str(&self.example(ex)?);
            prefix.push_str(&p.fewshot_delimiter);
        }
        let (contexts, continuations, chars, n) = if p.contexts.is_some() {
            let ctxs = self.contexts_of(doc)?;
            let cont = render(p.continuation.as_deref().unwrap_or_default(), doc)?;
            let n = ctxs.len();
            let chars = ctxs.iter().map(|c| c.chars().count()).collect();
            let contexts = ctxs.iter().map(|c| format!("{prefix}{c}")).collect();
            let conts = vec![format!("{}{cont}", p.target_delimiter); n];
            (contexts, conts, chars, n)
        } else {
            let text = &self.contexts_of(doc)?[0];
            let choices = self.choices_of(doc)?;
            let n = choices.len();
            let chars = choices.iter().map(|c| c.chars().count()).collect();
            let conts = choices
                .iter()
                .map(|c| format!("{}{c}", p.target_delimiter))
                .collect();
            (vec![format!("{prefix}{text}"); n], conts, chars, n)
        };
        if n == 0 {
            bail!("the document has no choices");
        }
        Ok(Item {
            doc_id: i,
            group,
            gold: self.gold_of(doc, n)?,
            contexts,
            continuations,
            choice_chars: chars,
        })
    }
}

/// A list field of strings.
fn list_of_text(doc: &Value, path: &str) -> Result<Vec<String>> {
    let v = lookup(doc, path).with_context(|| format!("no list field `{path}`"))?;
    let a = v
        .as_array()
        .with_context(|| format!("field `{path}` is not a list"))?;
    a.iter()
        .map(|x| as_text(x).with_context(|| format!("field `{path}` holds a non-text value {x}")))
        .collect()
}

/// Indices into a pool of `pool_len` documents of the `shots` few-shot examples, drawn as
/// lm-evaluation-harness 0.4.13 draws them (`ContextSampler.sample`, `FirstNSampler.sample`).
/// With `exclude_doc`, where `is_doc(j)` says that pool document `j` equals the eval document:
/// draw n + 1, drop every copy of the document, keep the first n; if copies left fewer than n,
/// draw n again from the pool without them. Otherwise draw n. `first_n` takes the pool in
/// order (without the document under `exclude_doc`).
pub fn draw_fewshot(
    rng: &mut PyRandom,
    pool_len: usize,
    shots: usize,
    sampler: Sampler,
    exclude_doc: bool,
    is_doc: &dyn Fn(usize) -> bool,
) -> Result<Vec<usize>> {
    if shots == 0 {
        return Ok(Vec::new());
    }
    let keep = |j: &usize| !exclude_doc || !is_doc(*j);
    let rest: Vec<usize> = (0..pool_len).filter(keep).collect();
    if rest.len() < shots {
        bail!(
            "{shots} few-shot examples asked for, the pool has {}{}",
            rest.len(),
            if exclude_doc {
                " besides this document"
            } else {
                ""
            }
        );
    }
    Ok(match sampler {
        Sampler::FirstN => rest[..shots].to_vec(),
        Sampler::Random => {
            let draw = shots + usize::from(exclude_doc);
            if draw > pool_len {
                bail!("{shots} few-shot examples asked for, the pool has {pool_len} with this document");
            }
            let got: Vec<usize> = rng
                .sample(pool_len, draw)
                .into_iter()
                .filter(keep)
                .take(shots)
                .collect();
            if got.len() == shots {
                got
            } else {
                rng.sample(rest.len(), shots)
                    .into_iter()
                    .map(|j| rest[j])
                    .collect()
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn few_shot_draws_are_lm_eval_0_4_13s() {
        // What lm-evaluation-harness 0.4.13's own samplers picked, document after document
        // (scripts/make_fewshot_fixtures.py), with copies of eval documents in the pool.
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/lmeval_fewshot.json"
        );
        let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let ids = |x: &Value| -> Vec<u64> {
            x.as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_u64().unwrap())
                .collect()
        };
        let cases = v["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 40);
        for c in cases {
            let pool = ids(&c["pool"]);
            let sampler = match c["sampler"].as_str().unwrap() {
                "default" => Sampler::Random,
                _ => Sampler::FirstN,
            };
            let same = c["same_split"].as_bool().unwrap();
            let shots = c["shots"].as_u64().unwrap() as usize;
            let mut rng = PyRandom::new(u128::from(c["seed"].as_u64().unwrap()));
            for (doc, want) in ids(&c["eval"])
                .into_iter()
                .zip(c["picks"].as_array().unwrap())
            {
                let got = draw_fewshot(&mut rng, pool.len(), shots, sampler, same, &|j| {
                    pool[j] == doc
                })
                .unwrap();
                let got: Vec<u64> = got.into_iter().map(|j| j as u64).collect();
                assert_eq!(got, ids(want), "case {c}, document {doc}");
            }
        }
    }

    const ARC: &str = r#"
name = "arc_easy"
metrics = ["acc", "acc_norm"]
[data]
hub = "allenai/ai2_arc"
config = "ARC-Easy"
eval_split = "test"
fewshot_split = "train"
[prompt]
text = "Question: {question}\nAnswer:"
choices_field = "choices.text"
gold = { field = "answerKey", among = "choices.label" }
"#;

    fn arc_doc(q: &str, key: &str) -> Value {
        json!({"question": q, "choices": {"text": ["red", "blue"], "label": ["A", "B"]},
               "answerKey": key})
    }

    #[test]
    fn requests_follow_the_harness_rules() {
        let t = TaskSpec::parse(ARC, "arc_easy.toml").unwrap();
        let docs = vec![arc_doc("Sky?", "B"), arc_doc("Rose?", "A")];
        let it = t.item(&docs, 0, None, 0, &mut PyRandom::new(0)).unwrap();
        assert_eq!(it.contexts, vec!["Question: Sky?\nAnswer:"; 2]);
        assert_eq!(it.continuations, vec![" red", " blue"]);
        assert_eq!((it.gold, it.choice_chars.clone()), (1, vec![3, 4]));
        assert!(it.shared_context());
        // One shot from the eval split is never the item itself.
        let it = t.item(&docs, 0, None, 1, &mut PyRandom::new(7)).unwrap();
        assert_eq!(
            it.contexts[0],
            "Question: Rose?\nAnswer: red\n\nQuestion: Sky?\nAnswer:"
        );
        assert!(t.item(&docs, 0, None, 2, &mut PyRandom::new(7)).is_err());
    }

    #[test]
    fn multiple_input_items_share_the_continuation() {
        let t = TaskSpec::parse(
            r#"
name = "winogrande"
metrics = ["acc"]
[data]
hub = "allenai/winogrande"
eval_split = "validation"
[prompt]
preprocess = "winogrande"
contexts = "contexts"
continuation = "{target}"
gold = { field = "answer", among = ["1", "2"] }
"#,
            "w",
        )
        .unwrap();
        let docs = t
            .prepare(
                &[json!({"sentence": "Tom gave Al a pen because _ had two.",
                    "option1": "Tom", "option2": "Al", "answer": "1"})],
                &["w row 0".to_string()],
            )
            .unwrap();
        let it = t.item(&docs, 0, None, 0, &mut PyRandom::new(0)).unwrap();
        assert_eq!(
            it.contexts,
            vec![
                "Tom gave Al a pen because Tom",
                "Tom gave Al a pen because Al"
            ]
        );
        assert_eq!(it.continuations, vec![" had two."; 2]);
        assert_eq!((it.gold, it.choice_chars.clone()), (0, vec![29, 28]));
        assert!(!it.shared_context());
    }

    #[test]
    fn metric_keys_are_the_task_file_names() {
        for m in Metric::ALL {
            assert_eq!(serde_json::to_value(m).unwrap(), json!(m.key()));
        }
        assert_eq!(Metric::AccNorm.stderr_key(), "acc_norm_stderr");
    }

    #[test]
    fn bad_task_files_and_documents_are_named() {
        let e = TaskSpec::parse("name = 3", "x.toml").unwrap_err();
        assert!(format!("{e:#}").contains("x.toml"), "{e:#}");
        let both = ARC.replace("choices_field", "choices = [\"a\"]\nchoices_field");
        let e = TaskSpec::parse(&both, "y.toml").unwrap_err();
        assert!(
            format!("{e:#}").contains("exactly one of prompt.choices"),
            "{e:#}"
        );
        let t = TaskSpec::parse(ARC, "arc").unwrap();
        let e = t
            .item(&[arc_doc("Q", "C")], 0, None, 0, &mut PyRandom::new(0))
            .unwrap_err();
        assert!(e.to_string().contains("\"C\" is not one of"), "{e}");
        let e = t
            .item(
                &[
                    json!({"question": "Q", "choices": {"text": [], "label": []},
                "answerKey": "A"}),
                ],
                0,
                None,
                0,
                &mut PyRandom::new(0),
            )
            .unwrap_err();
        assert!(
            e.to_string().contains("no choices") || e.to_string().contains("not one of"),
            "{e}"
        );
    }
}
