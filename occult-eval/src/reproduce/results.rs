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
    /// The routing it is served under: a device or a node limit, and the rule.
    pub max_devices: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_nodes: Option<usize>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_nodes: Option<usize>,
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
    /// The placements section: partitions, EPLB and ours with replicas, on the recipe's
    /// devices.
    pub replicas: Vec<crate::bench::place::PlaceRun>,
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
