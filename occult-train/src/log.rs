//! The training log, `log.jsonl`: one [`StepRecord`] per optimiser step, written a line at a
//! time as the run goes ([`StepRecord::line`]) and read back typed ([`read_log`]): by a resumed
//! run, which keeps the steps before the one it resumes from, and by whoever reports on a run.

use crate::step::StepReport;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One step of a run, as a line of `log.jsonl` holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    /// Mean cross-entropy per target position over the global batch.
    pub loss: f64,
    pub lr: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens fed over all ranks, and the target positions among them.
    pub tokens: usize,
    #[serde(default)]
    pub targets: usize,
    #[serde(default)]
    pub tokens_per_s: f64,
    /// E[C_T] of each MoE layer, in layer order, and over all of them.
    #[serde(default)]
    pub ect: Vec<f64>,
    #[serde(default)]
    pub mean_ect: f64,
    /// The load-balancing loss, when the run adds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// The held-out loss, at the steps where it was scored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
}

impl StepRecord {
    /// The record of step `step` from its report, with the held-out loss where scored.
    pub fn of(step: u64, r: &StepReport, eval_loss: Option<f64>) -> Self {
        StepRecord {
            step,
            loss: r.loss,
            lr: r.lr,
            grad_norm: r.grad_norm,
            tokens: r.tokens,
            targets: r.targets,
            tokens_per_s: r.tokens as f64 / r.seconds.max(1e-9),
            ect: r.ect_by_layer.clone(),
            mean_ect: r.ect,
            aux_loss: r.aux_loss,
            eval_loss,
        }
    }

    /// The record as one line of `log.jsonl` (keys in name order, no newline).
    pub fn line(&self) -> String {
        serde_json::to_value(self)
            .map(|v| v.to_string())
            .expect("a step record is plain data")
    }
}

/// The records of the log at `path`, in file order. A line that is not a record (the tail of a
/// run killed while writing it) is left out, and said on stderr; a missing log has none.
pub fn read_log(path: &Path) -> Result<Vec<StepRecord>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::Invalid(format!("reading {}: {e}", path.display()))),
    };
    let mut records = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        match serde_json::from_str::<StepRecord>(line) {
            Ok(r) => records.push(r),
            Err(e) => eprintln!(
                "note: {} line {}: not a step record ({e}); left out",
                path.display(),
                i + 1
            ),
        }
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_read_back_from_their_lines() {
        let r = StepRecord {
            step: 3,
            loss: 2.5,
            lr: 1e-4,
            grad_norm: 0.75,
            tokens: 96,
            targets: 80,
            tokens_per_s: 1000.0,
            ect: vec![1.5, 2.0],
            mean_ect: 1.75,
            aux_loss: None,
            eval_loss: Some(2.25),
        };
        let line = r.line();
        assert!(
            !line.contains("aux_loss") && line.contains("\"eval_loss\":2.25"),
            "{line}"
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.jsonl");
        // A torn last line is left out; the records before it read back exactly.
        std::fs::write(&path, format!("{line}\n{line}\n{{\"step\": 4, \"lo")).unwrap();
        assert_eq!(read_log(&path).unwrap(), vec![r.clone(), r]);
        assert!(read_log(&dir.path().join("none.jsonl")).unwrap().is_empty());
    }
}
