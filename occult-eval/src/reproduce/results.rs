//! What the stages of `occult reproduce` produce and hand on: the routings models are
//! fine-tuned and served under, the fine-tuning and quality rows, and everything the report and
//! `results.json` give ([`Findings`]).

use occult_core::analysis::pruning::{PruneLimit, PruneRule};
use serde::Serialize;

/// A routing a model is fine-tuned or served under: exact, or pruned by a rule to a number of
/// devices or of nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routing {
    pub prune: Option<(PruneLimit, PruneRule)>,
}

impl Routing {
    pub fn name(self) -> String {
        match self.prune {
            None => "exact".into(),
            Some((PruneLimit::Devices(n), r)) => format!("pruned-{n}-{}", r.name()),
            Some((PruneLimit::Nodes { max_nodes, .. }, r)) => {
                format!("pruned-{max_nodes}node-{}", r.name())
            }
        }
    }

    /// The device limit (`None` when exact or limited by nodes).
    pub fn max_devices(self) -> Option<usize> {
        match self.prune {
            Some((PruneLimit::Devices(n), _)) => Some(n),
            _ => None,
        }
    }

    /// The node limit (`None` when exact or limited by devices).
    pub fn max_nodes(self) -> Option<usize> {
        match self.prune {
            Some((PruneLimit::Nodes { max_nodes, .. }, _)) => Some(max_nodes),
            _ => None,
        }
    }

    pub fn rule(self) -> Option<String> {
        self.prune.map(|p| p.1.name().to_string())
    }
}

/// One row of the quality table.
#[derive(Clone, Debug, Serialize)]
pub struct QualityRow {
    /// `base`, or the routing the model was fine-tuned under.
    pub variant: String,
    pub fine_tuned: bool,
    /// The fine-tuning seed (fine-tuned models only; `reproduce --seeds N` runs 0..N).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// The routing it is served under: a device or a node limit, and the rule.
    pub max_devices: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_nodes: Option<usize>,
    pub rule: Option<String>,
    pub task: String,
    /// The headline metric `acc` holds: `acc`, or a generative task's `exact_match,FILTER`
    /// (its first filter).
    pub metric: String,
    /// The headline score: accuracy, or a generative task's exact match.
    pub acc: f64,
    /// The standard error of `acc` (the eval's `acc_stderr`).
    pub acc_stderr: Option<f64>,
    pub acc_norm: Option<f64>,
    /// Items scored.
    pub items: usize,
    /// Each item's `acc` (0 or 1), in `doc_id` order: what paired differences resample.
    #[serde(skip)]
    pub item_acc: Vec<f64>,
    /// Each item's question (a hash of its prompt), in the same order: items asking the same
    /// question again are one cluster of the paired bootstrap.
    #[serde(skip)]
    pub item_question: Vec<u64>,
}

impl QualityRow {
    /// Whether the row is a generative task's (its score an exact match).
    pub fn is_generative(&self) -> bool {
        self.metric.starts_with("exact_match")
    }

    /// How the model was served, in words: `exact`, `pruned to N, RULE` or `pruned to M
    /// node(s), RULE`.
    pub fn served(&self) -> String {
        match (self.max_devices, self.max_nodes, &self.rule) {
            (Some(n), _, Some(rule)) => format!("pruned to {n}, {rule}"),
            (_, Some(m), Some(rule)) => {
                format!(
                    "pruned to {m} node{}, {rule}",
                    if m == 1 { "" } else { "s" }
                )
            }
            _ => "exact".into(),
        }
    }
}

/// The distinct seeds of `rows`, in order (`None`, a model not fine-tuned, first).
pub fn seeds_of<'a>(rows: impl IntoIterator<Item = &'a QualityRow>) -> Vec<Option<u64>> {
    let mut seeds: Vec<Option<u64>> = rows.into_iter().map(|r| r.seed).collect();
    seeds.sort();
    seeds.dedup();
    seeds
}

/// Per task, each item's question key.
pub type QuestionKeys = Vec<Vec<u64>>;

/// The rows' question keys by task, where every item has one (the evaluation gives them);
/// `None` otherwise (every item its own question).
pub fn question_keys(rows: &[&QualityRow]) -> Option<QuestionKeys> {
    rows.iter()
        .all(|r| r.item_question.len() == r.item_acc.len())
        .then(|| rows.iter().map(|r| r.item_question.clone()).collect())
}

/// Per seed (of `seeds`), the rows' per-item scores by task (in name order), and the first
/// seed's question keys: what [`crate::harness::paired::pooled_mean`] takes.
pub fn item_scores(
    rows: &[&QualityRow],
    seeds: &[Option<u64>],
) -> (Vec<Vec<Vec<f64>>>, Option<QuestionKeys>) {
    let of_seed = |seed: Option<u64>| -> Vec<&QualityRow> {
        let mut r: Vec<&QualityRow> = rows.iter().copied().filter(|r| r.seed == seed).collect();
        r.sort_by(|a, b| a.task.cmp(&b.task));
        r
    };
    let scores = seeds
        .iter()
        .map(|&s| of_seed(s).iter().map(|r| r.item_acc.clone()).collect())
        .collect();
    let questions = seeds.first().and_then(|&s| question_keys(&of_seed(s)));
    (scores, questions)
}

/// One paired difference of mean accuracy over the tasks, on the same items.
#[derive(Clone, Debug, Serialize)]
pub struct QualityDiff {
    /// `pruned serving` (the start served pruned, against the start served exact) or
    /// `pruned fine-tuning` (fine-tuned and served under a pruned routing, against standard
    /// fine-tuning served exact).
    pub comparison: String,
    /// The variant and how it is served.
    pub model: String,
    pub served: String,
    /// What it is compared with: (variant, served).
    pub against: (String, String),
    /// The fine-tuning seeds pooled (empty for the start, which is not fine-tuned).
    pub seeds: Vec<u64>,
    #[serde(flatten)]
    pub difference: crate::harness::paired::PairedDiff,
}

/// One fine-tuning run.
#[derive(Clone, Debug, Serialize)]
pub struct FinetuneRow {
    pub variant: String,
    /// The fine-tuning seed: the order of the data.
    pub seed: u64,
    pub max_devices: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_nodes: Option<usize>,
    pub rule: Option<String>,
    pub first_loss: f64,
    pub last_loss: f64,
    pub held_out_loss: Option<f64>,
    pub mean_ect: f64,
    pub seconds: f64,
}

/// Whether the shaped-link run ran: at which rate, or why not.
#[derive(Clone, Debug, Serialize)]
pub struct ShapedOutcome {
    pub ran: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl ShapedOutcome {
    pub fn ran(rate: &str) -> Self {
        ShapedOutcome {
            ran: true,
            rate: Some(rate.to_string()),
            reason: None,
        }
    }

    pub fn skipped(reason: String) -> Self {
        ShapedOutcome {
            ran: false,
            rate: None,
            reason: Some(reason),
        }
    }
}

/// E[C_T] before and after pruned fine-tuning: the routing the fine-tuned model chooses on its
/// own (unpruned) on the calibration text, under our placement.
#[derive(Clone, Debug, Serialize)]
pub struct CollaborationShift {
    /// The routing the model was fine-tuned under.
    pub variant: String,
    pub ect_before: f64,
    pub ect_after: f64,
}

/// Pearson's correlation of E[C_T] with time over the Occult rows of the speed table.
#[derive(Clone, Debug, Serialize)]
pub struct Correlation {
    pub measured: Option<f64>,
    pub projected: Option<f64>,
}

/// How long a stage of the run took.
#[derive(Clone, Debug, Serialize)]
pub struct StageTime {
    pub stage: String,
    pub seconds: f64,
}

/// What the stages found, as the report gives it and as `results.json` holds it (its keys are
/// the serde names here).
#[derive(Serialize)]
pub struct Findings {
    #[serde(rename = "ect_table")]
    pub steps: Vec<super::ladder::Step>,
    /// The placements section: partitions, EPLB and ours with replicas, on the recipe's
    /// devices.
    #[serde(rename = "placements_with_replicas")]
    pub replicas: Vec<crate::bench::place::PlaceRun>,
    #[serde(rename = "finetune")]
    pub finetunes: Vec<FinetuneRow>,
    pub quality: Vec<QualityRow>,
    /// Paired differences with bootstrap intervals (pruned servings and pruned fine-tunings).
    #[serde(rename = "quality_differences")]
    pub differences: Vec<QualityDiff>,
    /// The generative tasks' rows (`acc` is the exact match), apart from the multiple-choice
    /// ones.
    pub generative: Vec<QualityRow>,
    /// Their paired differences, as `quality_differences` over the generative tasks.
    pub generative_differences: Vec<QualityDiff>,
    pub speed: Vec<super::speed::SpeedRow>,
    pub projection: Option<occult_core::analysis::cost::projection::ProjectReport>,
    /// Whether the shaped-link run ran, and why not (`None`: the speed stage or the shaped
    /// run is skipped by the recipe).
    pub shaped: Option<ShapedOutcome>,
    /// E[C_T] before and after pruned fine-tuning.
    pub collaboration: Option<CollaborationShift>,
    pub correlation: Correlation,
    /// The plots written, as file names.
    #[serde(serialize_with = "file_names")]
    pub plots: Vec<std::path::PathBuf>,
    /// Each stage's seconds, in order.
    pub stages: Vec<StageTime>,
    /// How the built-in model's weights came about (`None` for another model).
    pub builtin_weights: Option<crate::builtin::Provenance>,
}

fn file_names<S: serde::Serializer>(paths: &[std::path::PathBuf], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(
        paths
            .iter()
            .map(|p| p.file_name().map(|n| n.to_string_lossy().to_string())),
    )
}
