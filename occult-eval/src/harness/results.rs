//! One task's results, aggregated as lm-evaluation-harness aggregates them: each item's
//! metrics ([`ItemScores`]), their mean with its standard error over the task, or per group
//! (MMLU's subjects) pooled into categories and the task; as the task's entry in the results
//! JSON, with the per-item lines of `samples_TASK.jsonl`.

use super::evaluate::{Prepared, Scored};
use super::gen_results::GenResults;
use super::metrics::{mean_stderr, pooled, Estimate, ItemScores};
use super::task::Metric;
use serde::Serialize;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// One item's scores: what its line of `samples_TASK.jsonl` holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub doc_id: usize,
    /// The gold choice's index.
    pub target: usize,
    /// One per choice, in choice order.
    pub loglikelihoods: Vec<f64>,
    /// lm-eval's: the SHA-256 of the first request's context, the same for items that ask the
    /// same question.
    pub prompt_hash: String,
    /// The item's value of every metric.
    pub scores: ItemScores,
}

impl Sample {
    /// The samples line: `doc_id`, `target`, `loglikelihoods`, `prompt_hash` and each metric's
    /// value by its key.
    pub fn to_json(&self) -> Value {
        let mut line = json!({"doc_id": self.doc_id, "target": self.target,
                              "loglikelihoods": self.loglikelihoods,
                              "prompt_hash": self.prompt_hash});
        for m in Metric::ALL {
            line[m.key()] = json!(self.scores.get(m));
        }
        line
    }

    /// The question key of the paired bootstrap: the hash's first 64 bits.
    pub fn question(&self) -> Option<u64> {
        u64::from_str_radix(self.prompt_hash.get(..16)?, 16).ok()
    }
}

/// How fast a task was scored.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Speed {
    pub seconds: f64,
    pub items_per_s: f64,
    pub forward_tokens: u64,
    pub forward_tokens_per_item: f64,
    pub forward_passes: u64,
}

/// One task's results, typed: its figures (each metric's value and standard error over the
/// task, pooled over its groups when it has them), its groups' and categories' figures, the
/// few-shot count and speed, and every item's sample. [`TaskResults::to_json`] gives the task's
/// entry in the results JSON.
#[derive(Clone, Debug)]
pub struct TaskResults {
    /// The metrics the task reports (the samples carry every metric).
    pub metrics: Vec<Metric>,
    pub figures: Figures,
    /// Each group and category as `TASK_NAME`, in name order (grouped tasks only).
    pub subtasks: BTreeMap<String, Figures>,
    pub num_fewshot: usize,
    pub speed: Speed,
    pub samples: Vec<Sample>,
}

impl TaskResults {
    /// Metric `m`'s estimate over the task.
    pub fn get(&self, m: Metric) -> Estimate {
        self.figures.get(m)
    }

    /// The task's entry in the results JSON: for each of the task's metrics its value (`KEY`,
    /// see [`Metric::key`]) and standard error (`KEY_stderr`, `null` for a single item), `n`,
    /// `subtasks` (grouped tasks only, with the same figures), `num_fewshot` and `speed`.
    pub fn to_json(&self) -> Value {
        let mut o = self.figures.to_json(&self.metrics);
        if !self.subtasks.is_empty() {
            let subs: Map<String, Value> = self
                .subtasks
                .iter()
                .map(|(name, f)| (name.clone(), Value::Object(f.to_json(&self.metrics))))
                .collect();
            o.insert("subtasks".into(), Value::Object(subs));
        }
        o.insert("num_fewshot".into(), json!(self.num_fewshot));
        o.insert("speed".into(), json!(self.speed));
        Value::Object(o)
    }
}

/// Every metric's estimate over a task, group or category, and its size.
#[derive(Clone, Debug, PartialEq)]
pub struct Figures {
    estimates: Vec<(Metric, Estimate)>,
    n: usize,
}

impl Figures {
    /// The mean and standard error of each metric over items.
    fn mean(items: &[ItemScores]) -> Self {
        let estimates = Metric::ALL
            .iter()
            .map(|&m| {
                let xs: Vec<f64> = items.iter().map(|s| s.get(m)).collect();
                (m, mean_stderr(&xs))
            })
            .collect();
        Figures {
            estimates,
            n: items.len(),
        }
    }

    /// The size-weighted pool of parts (groups or categories), metric by metric.
    fn pool(parts: &[&Figures]) -> Self {
        let estimates = Metric::ALL
            .iter()
            .map(|&m| {
                let es: Vec<Estimate> = parts.iter().map(|f| f.get(m)).collect();
                (m, pooled(&es))
            })
            .collect();
        Figures {
            estimates,
            n: parts.iter().map(|f| f.n).sum(),
        }
    }

    /// Metric `m`'s estimate (every metric is estimated).
    pub fn get(&self, m: Metric) -> Estimate {
        self.estimates
            .iter()
            .find(|(k, _)| *k == m)
            .map(|&(_, e)| e)
            .expect("every metric is estimated")
    }

    /// The JSON figures of `metrics`: each value and standard error, and the size.
    fn to_json(&self, metrics: &[Metric]) -> Map<String, Value> {
        let mut o = Map::new();
        for &m in metrics {
            let e = self.get(m);
            o.insert(m.key().into(), json!(e.value));
            o.insert(m.stderr_key(), json!(e.stderr));
        }
        o.insert("n".into(), json!(self.n));
        o
    }
}

/// lm-eval's `prompt_hash` of an item: the hex SHA-256 of its first request's context.
pub fn prompt_hash(it: &super::task::Item) -> String {
    sha256_hex(it.contexts.first().map_or("", String::as_str))
}

/// The lower-case hex SHA-256 of `text` (the harness's `hash_string`).
pub fn sha256_hex(text: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A task's results of either kind.
#[derive(Clone, Debug)]
pub enum TaskOutcome {
    Choice(TaskResults),
    Generative(GenResults),
}

/// One item's headline score (`acc`, or the first filter's `exact_match`), by document, with
/// its question key ([`Sample::question`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ItemScore {
    pub doc_id: usize,
    pub score: f64,
    pub question: u64,
}

impl TaskOutcome {
    /// The task's entry in the results JSON.
    pub fn to_json(&self) -> Value {
        match self {
            TaskOutcome::Choice(t) => t.to_json(),
            TaskOutcome::Generative(g) => g.to_json(),
        }
    }

    /// The lines of `samples_TASK.jsonl`.
    pub fn sample_lines(&self) -> Vec<Value> {
        match self {
            TaskOutcome::Choice(t) => t.samples.iter().map(Sample::to_json).collect(),
            TaskOutcome::Generative(g) => g.sample_lines(),
        }
    }

    /// Items scored.
    pub fn n(&self) -> usize {
        match self {
            TaskOutcome::Choice(t) => t.samples.len(),
            TaskOutcome::Generative(g) => g.samples.len(),
        }
    }

    pub fn num_fewshot(&self) -> usize {
        match self {
            TaskOutcome::Choice(t) => t.num_fewshot,
            TaskOutcome::Generative(g) => g.num_fewshot,
        }
    }

    pub fn items_per_s(&self) -> f64 {
        match self {
            TaskOutcome::Choice(t) => t.speed.items_per_s,
            TaskOutcome::Generative(g) => g.speed.items_per_s,
        }
    }

    /// The reported figures by key (`acc`, `exact_match,strict-match`), in the task's order.
    pub fn figures(&self) -> Vec<(String, Estimate)> {
        match self {
            TaskOutcome::Choice(t) => t
                .metrics
                .iter()
                .map(|&m| (m.key().into(), t.get(m)))
                .collect(),
            TaskOutcome::Generative(g) => g
                .filters
                .iter()
                .zip(&g.figures)
                .map(|(f, &e)| (GenResults::keys(f).0, e))
                .collect(),
        }
    }

    /// The headline metric's name and figure: `acc`, or the first filter's `exact_match`.
    pub fn headline(&self) -> (String, Estimate) {
        match self {
            TaskOutcome::Choice(t) => (Metric::Acc.key().into(), t.get(Metric::Acc)),
            TaskOutcome::Generative(g) => (GenResults::keys(&g.filters[0]).0, g.headline()),
        }
    }

    /// `acc_norm` where the task reports it.
    pub fn acc_norm(&self) -> Option<f64> {
        match self {
            TaskOutcome::Choice(t) => t
                .metrics
                .contains(&Metric::AccNorm)
                .then(|| t.get(Metric::AccNorm).value),
            TaskOutcome::Generative(_) => None,
        }
    }

    /// Every item's headline score in `doc_id` order; `None` if an item lacks its question.
    pub fn item_scores(&self) -> Option<Vec<ItemScore>> {
        let mut items: Vec<ItemScore> = match self {
            TaskOutcome::Choice(t) => t
                .samples
                .iter()
                .map(|s| {
                    Some(ItemScore {
                        doc_id: s.doc_id,
                        score: s.scores.acc,
                        question: s.question()?,
                    })
                })
                .collect::<Option<_>>()?,
            TaskOutcome::Generative(g) => g
                .samples
                .iter()
                .map(|s| {
                    let hash = sha256_hex(&s.context);
                    Some(ItemScore {
                        doc_id: s.doc_id,
                        score: s.exact_match[0],
                        question: u64::from_str_radix(hash.get(..16)?, 16).ok()?,
                    })
                })
                .collect::<Option<_>>()?,
        };
        items.sort_by_key(|i| i.doc_id);
        Some(items)
    }
}

/// Aggregates one task's scores into its results.
pub fn summarise(p: &Prepared, s: &Scored) -> TaskResults {
    let samples: Vec<Sample> = p
        .items
        .iter()
        .zip(&s.lls)
        .map(|(it, lls)| Sample {
            doc_id: it.doc_id,
            target: it.gold,
            loglikelihoods: lls.clone(),
            prompt_hash: prompt_hash(it),
            scores: ItemScores::of(lls, &it.choice_chars, it.gold),
        })
        .collect();
    let mut by_group: BTreeMap<String, Vec<ItemScores>> = BTreeMap::new();
    for (it, sample) in p.items.iter().zip(&samples) {
        if let Some(g) = &it.group {
            by_group.entry(g.clone()).or_default().push(sample.scores);
        }
    }
    let (figures, subtasks) = if by_group.is_empty() {
        let all: Vec<ItemScores> = samples.iter().map(|x| x.scores).collect();
        (Figures::mean(&all), BTreeMap::new())
    } else {
        pool_groups(p, &by_group)
    };
    TaskResults {
        metrics: p.spec.metrics.clone(),
        figures,
        subtasks,
        num_fewshot: p.shots,
        speed: Speed {
            seconds: s.seconds,
            items_per_s: p.items.len() as f64 / s.seconds.max(1e-9),
            forward_tokens: s.forward_tokens,
            forward_tokens_per_item: s.forward_tokens as f64 / p.items.len() as f64,
            forward_passes: s.forward_passes,
        },
        samples,
    }
}

/// A grouped task's figures: each group's mean, each category pooling its groups, and the task
/// pooling the categories and any group in no category, as the harness's nested groups do;
/// with every group and category as a subtask `TASK_NAME`.
fn pool_groups(
    p: &Prepared,
    by_group: &BTreeMap<String, Vec<ItemScores>>,
) -> (Figures, BTreeMap<String, Figures>) {
    let mut subtasks = BTreeMap::new();
    let groups: Vec<(&String, Figures)> = by_group
        .iter()
        .map(|(g, items)| (g, Figures::mean(items)))
        .collect();
    for (g, f) in &groups {
        subtasks.insert(format!("{}_{g}", p.spec.name), f.clone());
    }
    let cats = &p.spec.data.categories;
    let mut parts: Vec<Figures> = Vec::new();
    for (cat, members) in cats {
        let inside: Vec<&Figures> = groups
            .iter()
            .filter(|(g, _)| members.contains(g))
            .map(|(_, f)| f)
            .collect();
        if inside.is_empty() {
            continue;
        }
        let f = Figures::pool(&inside);
        subtasks.insert(format!("{}_{cat}", p.spec.name), f.clone());
        parts.push(f);
    }
    let mut parts: Vec<&Figures> = parts.iter().collect();
    parts.extend(
        groups
            .iter()
            .filter(|(g, _)| !cats.values().any(|m| m.contains(g)))
            .map(|(_, f)| f),
    );
    (Figures::pool(&parts), subtasks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::task::{Item, TaskSpec};

    const GROUPED: &str = r#"
name = "quiz"
metrics = ["acc"]
[data]
hub = "x/quiz"
eval_split = "test"
group_field = "subject"
[data.categories]
science = ["physics", "biology"]
[prompt]
text = "{question}"
choices = ["A", "B"]
gold = "answer"
"#;

    fn item(doc_id: usize, group: &str, gold: usize) -> Item {
        Item {
            doc_id,
            group: Some(group.into()),
            contexts: vec!["q".into(); 2],
            continuations: vec![" A".into(), " B".into()],
            gold,
            choice_chars: vec![1, 1],
        }
    }

    #[test]
    fn groups_pool_into_categories_and_the_task() {
        let spec = TaskSpec::parse(GROUPED, "quiz.toml").unwrap();
        // Choice 0 always wins: physics 1/2, biology 2/2, history 0/1.
        let items = vec![
            item(0, "physics", 0),
            item(1, "physics", 1),
            item(2, "biology", 0),
            item(3, "biology", 0),
            item(4, "history", 1),
        ];
        let lls = vec![vec![-1.0, -2.0]; items.len()];
        let p = Prepared {
            spec,
            items,
            shots: 0,
        };
        let s = Scored {
            lls,
            forward_tokens: 10,
            forward_passes: 2,
            seconds: 1.0,
        };
        let typed = summarise(&p, &s);
        let r = typed.to_json();
        let subs = r["subtasks"].as_object().unwrap();
        let keys: Vec<&str> = subs.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "quiz_biology",
                "quiz_history",
                "quiz_physics",
                "quiz_science"
            ]
        );
        assert_eq!(subs["quiz_science"]["acc"], json!(0.75));
        assert_eq!(subs["quiz_science"]["n"], json!(4));
        assert_eq!(subs["quiz_history"]["acc_stderr"], Value::Null);
        // Only the task's metrics are reported; the samples carry every metric.
        assert!(r.get("acc_norm").is_none());
        assert_eq!(r["acc"], json!(0.6));
        assert_eq!(typed.get(Metric::Acc).value, 0.6);
        assert_eq!(r["n"], json!(5));
        assert_eq!(typed.samples.len(), 5);
        let line = typed.samples[1].to_json();
        assert_eq!(line["acc"], json!(0.0));
        assert_eq!(line["acc_norm"], json!(0.0));
        assert_eq!(line["doc_id"], json!(1));
        assert_eq!(r["speed"]["forward_tokens_per_item"], json!(2.0));
    }
}
