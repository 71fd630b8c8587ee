//! The training log, `log.jsonl`: one [`StepRecord`] per optimiser step, written a line at a
//! time as the run goes ([`StepRecord::line`]) and read back typed ([`read_log`]) by whoever
//! reports on a run; a resumed run keeps the lines before the step it resumes from as they
//! were written ([`read_lines`]).

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

/// One line of a log as written: its text, and its record where it reads as one.
#[derive(Clone, Debug, PartialEq)]
pub struct LogLine {
    pub text: String,
    pub record: Option<StepRecord>,
}

/// The lines of the log at `path`, in file order (a missing log has none). A line that is not
/// a record (the tail of a run killed while writing it) has no `record`.
pub fn read_lines(path: &Path) -> Result<Vec<LogLine>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::Invalid(format!("reading {}: {e}", path.display()))),
    };
    Ok(text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| LogLine {
            text: l.to_string(),
            record: serde_json::from_str(l).ok(),
        })
        .collect())
}

/// The records of the log at `path`, in file order. A line that is not a record is left out,
/// and said on stderr; a missing log has none.
pub fn read_log(path: &Path) -> Result<Vec<StepRecord>> {
    let lines = read_lines(path)?;
    let records: Vec<StepRecord> = lines.iter().filter_map(|l| l.record.clone()).collect();
    if records.len() < lines.len() {
        eprintln!(
            "note: {}: {} line(s) are not step records; left out",
            path.display(),
            lines.len() - records.len()
        );
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
        // A torn last line is left out; the records before it read back exactly, and every
        // line's text is kept as written.
        let torn = "{\"step\": 4, \"lo";
        std::fs::write(&path, format!("{line}\n{line}\n{torn}")).unwrap();
        assert_eq!(read_log(&path).unwrap(), vec![r.clone(), r.clone()]);
        let lines = read_lines(&path).unwrap();
        assert_eq!(lines[0].text, line);
        assert_eq!(lines[0].record, Some(r));
        assert_eq!(
            (lines[2].text.as_str(), lines[2].record.is_none()),
            (torn, true)
        );
        assert!(read_log(&dir.path().join("none.jsonl")).unwrap().is_empty());
    }
}
