//! One task's results, aggregated as lm-evaluation-harness aggregates them: each item's
//! metrics ([`ItemScores`]), their mean with its standard error over the task, or per group
//! (MMLU's subjects) pooled into categories and the task; as the task's entry in the results
//! JSON, with the per-item lines of `samples_TASK.jsonl`.

use super::evaluate::{Prepared, Scored};
use super::metrics::{mean_stderr, pooled, Estimate, ItemScores};
use super::task::Metric;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// One task's results.
#[derive(Clone, Debug)]
pub struct TaskResults {
    /// The task's entry in the results JSON: for each of the task's metrics its value (`KEY`,
    /// see [`Metric::key`]) and standard error (`KEY_stderr`, `null` for a single item), `n`,
    /// `subtasks` (each group and category as `TASK_NAME`, with the same figures; grouped
    /// tasks only), `num_fewshot` and `speed`.
    pub results: Value,
    /// One line per item: `doc_id`, `target` (the gold index), `loglikelihoods` (one per
    /// choice), `prompt_hash` (lm-eval's: the SHA-256 of the first request's context, the same
    /// for items that ask the same question) and the item's value of every metric.
    pub samples: Vec<Value>,
}

/// Every metric's estimate over a task, group or category, and its size.
struct Figures {
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

    fn get(&self, m: Metric) -> Estimate {
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
    use sha2::{Digest, Sha256};
    let context = it.contexts.first().map_or("", String::as_str);
    Sha256::digest(context.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Aggregates one task's scores into its results entry and its samples lines.
pub fn summarise(p: &Prepared, s: &Scored) -> TaskResults {
    let metrics = &p.spec.metrics;
    let mut all = Vec::with_capacity(p.items.len());
    let mut by_group: BTreeMap<String, Vec<ItemScores>> = BTreeMap::new();
    let mut samples = Vec::with_capacity(p.items.len());
    for (it, lls) in p.items.iter().zip(&s.lls) {
        let scores = ItemScores::of(lls, &it.choice_chars, it.gold);
        all.push(scores);
        if let Some(g) = &it.group {
            by_group.entry(g.clone()).or_default().push(scores);
        }
        let mut line = json!({"doc_id": it.doc_id, "target": it.gold, "loglikelihoods": lls,
                              "prompt_hash": prompt_hash(it)});
        for m in Metric::ALL {
            line[m.key()] = json!(scores.get(m));
        }
        samples.push(line);
    }
    let mut o = if by_group.is_empty() {
        Figures::mean(&all).to_json(metrics)
    } else {
        // Groups: each subtask's mean, then the size-weighted pool.
        let mut subs = Map::new();
        let groups: Vec<(&String, Figures)> = by_group
            .iter()
            .map(|(g, items)| (g, Figures::mean(items)))
            .collect();
        for (g, f) in &groups {
            subs.insert(
                format!("{}_{g}", p.spec.name),
                Value::Object(f.to_json(metrics)),
            );
        }
        // Categories pool their groups; the task pools the categories and any group in no
        // category, as the harness's nested groups do.
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
            subs.insert(
                format!("{}_{cat}", p.spec.name),
                Value::Object(f.to_json(metrics)),
            );
            parts.push(f);
        }
        let mut parts: Vec<&Figures> = parts.iter().collect();
        parts.extend(
            groups
                .iter()
                .filter(|(g, _)| !cats.values().any(|m| m.contains(g)))
                .map(|(_, f)| f),
        );
        let mut o = Figures::pool(&parts).to_json(metrics);
        o.insert("subtasks".into(), Value::Object(subs));
        o
    };
    o.insert("num_fewshot".into(), json!(p.shots));
    o.insert(
        "speed".into(),
        json!({
            "seconds": s.seconds,
            "items_per_s": p.items.len() as f64 / s.seconds.max(1e-9),
            "forward_tokens": s.forward_tokens,
            "forward_tokens_per_item": s.forward_tokens as f64 / p.items.len() as f64,
            "forward_passes": s.forward_passes,
        }),
    );
    TaskResults {
        results: Value::Object(o),
        samples,
    }
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
        let r = summarise(&p, &s);
        let subs = r.results["subtasks"].as_object().unwrap();
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
        assert!(r.results.get("acc_norm").is_none());
        assert_eq!(r.results["acc"], json!(0.6));
        assert_eq!(r.results["n"], json!(5));
        assert_eq!(r.samples.len(), 5);
        assert_eq!(r.samples[1]["acc"], json!(0.0));
        assert_eq!(r.samples[1]["acc_norm"], json!(0.0));
        assert_eq!(r.results["speed"]["forward_tokens_per_item"], json!(2.0));
    }
}
