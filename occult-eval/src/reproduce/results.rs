//! What the stages of `occult reproduce` produce and hand on: the routings models are
//! fine-tuned and served under, the fine-tuning and quality rows, and everything the report and
//! `results.json` give ([`Findings`]).

use occult_core::analysis::pruning::PruneRule;
use serde::Serialize;

/// A routing a model is fine-tuned or served under: exact, or pruned to `n` devices by a rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routing {
    pub prune: Option<(usize, PruneRule)>,
}

impl Routing {
    pub fn name(self) -> String {
        match self.prune {
            None => "exact".into(),
            Some((n, r)) => format!("pruned-{n}-{}", r.name()),
        }
    }
}

/// One row of the quality table.
#[derive(Clone, Debug, Serialize)]
pub struct QualityRow {
    /// `base`, or the routing the model was fine-tuned under.
    pub variant: String,
    pub fine_tuned: bool,
    /// The routing it is served under.
    pub max_devices: Option<usize>,
    pub rule: Option<String>,
    pub task: String,
    pub acc: f64,
    pub acc_norm: Option<f64>,
}

/// One fine-tuning run.
#[derive(Clone, Debug, Serialize)]
pub struct FinetuneRow {
    pub variant: String,
    pub max_devices: Option<usize>,
    pub rule: Option<String>,
    pub first_loss: f64,
    pub last_loss: f64,
    pub held_out_loss: Option<f64>,
    pub mean_ect: f64,
    pub seconds: f64,
}

/// What the stages found, as the report and `results.json` give it.
pub struct Findings {
    pub steps: Vec<super::ladder::Step>,
    pub speed: Vec<super::speed::SpeedRow>,
    /// Whether the shaped-link run ran, and why not.
    pub shaped: serde_json::Value,
    pub finetunes: Vec<FinetuneRow>,
    pub quality: Vec<QualityRow>,
    pub projection: Option<occult_core::analysis::projection::ProjectReport>,
    /// E[C_T] before and after pruned fine-tuning.
    pub collaboration: serde_json::Value,
    pub plots: Vec<std::path::PathBuf>,
}
