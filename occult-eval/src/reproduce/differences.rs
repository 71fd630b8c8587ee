//! The quality differences `reproduce` reports, each paired over the same items with a
//! bootstrap 95% interval ([`crate::harness::paired`]): every pruned serving of the start
//! against its exact serving (what pruning costs without fine-tuning), and every model
//! fine-tuned under a pruned routing, served under it, against standard fine-tuning served
//! exact (what fine-tuning under pruning keeps).

use super::results::{QualityDiff, QualityRow};
use crate::harness::paired::{paired_difference, RESAMPLES};
use anyhow::{Context, Result};

/// The rows of (variant, served), by task name.
fn scores<'a>(quality: &'a [QualityRow], variant: &str, served: &str) -> Vec<&'a QualityRow> {
    let mut rows: Vec<&QualityRow> = quality
        .iter()
        .filter(|r| r.variant == variant && r.served() == served)
        .collect();
    rows.sort_by(|a, b| a.task.cmp(&b.task));
    rows
}

/// (variant, served) against (base variant, base served), over the tasks both have.
fn compare(
    quality: &[QualityRow],
    comparison: &str,
    (variant, served): (&str, &str),
    (base_variant, base_served): (&str, &str),
) -> Result<Option<QualityDiff>> {
    let a = scores(quality, variant, served);
    let b = scores(quality, base_variant, base_served);
    let tasks: Vec<&str> = a
        .iter()
        .map(|r| r.task.as_str())
        .filter(|t| b.iter().any(|r| r.task == *t))
        .collect();
    if tasks.is_empty() {
        return Ok(None);
    }
    let pick = |rows: &[&QualityRow]| -> Vec<Vec<f64>> {
        tasks
            .iter()
            .map(|t| {
                rows.iter()
                    .find(|r| r.task == *t)
                    .map_or(Vec::new(), |r| r.item_acc.clone())
            })
            .collect()
    };
    let difference = paired_difference(&pick(&a), &pick(&b), RESAMPLES, 0)
        .with_context(|| format!("{variant} served {served} against {base_variant}"))?;
    Ok(Some(QualityDiff {
        comparison: comparison.into(),
        model: variant.into(),
        served: served.into(),
        against: (base_variant.into(), base_served.into()),
        difference,
    }))
}

/// Every pruned serving of the start against its exact serving, then every pruned
/// fine-tuning (served under its routing) against standard fine-tuning served exact.
pub fn quality_differences(quality: &[QualityRow]) -> Result<Vec<QualityDiff>> {
    let mut pairs: Vec<(&str, String, String, (&str, &str))> = Vec::new();
    let mut seen: Vec<(String, String)> = Vec::new();
    for r in quality {
        let key = (r.variant.clone(), r.served());
        if seen.contains(&key) {
            continue;
        }
        seen.push(key.clone());
        if r.variant == "base" && key.1 != "exact" {
            pairs.push(("pruned serving", key.0, key.1, ("base", "exact")));
        } else if r.fine_tuned && r.variant != "exact" {
            pairs.push(("pruned fine-tuning", key.0, key.1, ("exact", "exact")));
        }
    }
    let mut out = Vec::new();
    for (comparison, variant, served, base) in pairs {
        out.extend(compare(quality, comparison, (&variant, &served), base)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(
        variant: &str,
        fine_tuned: bool,
        devices: Option<usize>,
        task: &str,
        acc: &[f64],
    ) -> QualityRow {
        QualityRow {
            variant: variant.into(),
            fine_tuned,
            max_devices: devices,
            max_nodes: None,
            rule: devices.map(|_| "router".to_string()),
            task: task.into(),
            acc: acc.iter().sum::<f64>() / acc.len() as f64,
            acc_stderr: None,
            acc_norm: None,
            items: acc.len(),
            item_acc: acc.to_vec(),
        }
    }

    /// The start served pruned against served exact, and the model fine-tuned pruned against
    /// standard fine-tuning; standard fine-tuning served pruned is not compared.
    #[test]
    fn differences_pair_the_right_rows() {
        let q = vec![
            row("base", false, None, "a", &[1.0, 1.0, 0.0, 0.0]),
            row("base", false, Some(1), "a", &[1.0, 0.0, 0.0, 0.0]),
            row("exact", true, None, "a", &[1.0, 1.0, 1.0, 0.0]),
            row("exact", true, Some(1), "a", &[0.0, 0.0, 0.0, 0.0]),
            row("pruned-1-router", true, Some(1), "a", &[1.0, 1.0, 0.0, 0.0]),
        ];
        let d = quality_differences(&q).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(
            (d[0].comparison.as_str(), d[0].served.as_str()),
            ("pruned serving", "pruned to 1, router")
        );
        assert!((d[0].difference.diff + 0.25).abs() < 1e-12);
        assert_eq!(d[1].model, "pruned-1-router");
        assert_eq!(d[1].against, ("exact".to_string(), "exact".to_string()));
        assert!((d[1].difference.diff + 0.25).abs() < 1e-12);
    }
}
