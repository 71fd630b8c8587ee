//! The generative section of `report.md`: each model's exact match on the generative tasks
//! (the built-in model's arithmetic questions answered in writing), the paired differences
//! with their intervals, and whether the multiple-choice verdict (each pruned fine-tuning
//! non-inferior to standard fine-tuning by 1 point, or not) also holds on generation.

use super::report::{accuracy_cell, differences_table};
use super::results::{seeds_of, QualityDiff, QualityRow};
use crate::table::Table;

/// Non-inferior by 1 point: the interval's lower end at or above -1 point.
fn non_inferior(d: &QualityDiff) -> bool {
    d.difference.lo >= -0.01
}

/// The section; empty without generative rows.
pub fn generative_section(
    rows: &[QualityRow],
    diffs: &[QualityDiff],
    choice_diffs: &[QualityDiff],
) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let mut tasks: Vec<String> = rows.iter().map(|r| r.task.clone()).collect();
    tasks.sort();
    tasks.dedup();
    let mut head = vec!["model", "served", "seeds"];
    head.extend(tasks.iter().map(String::as_str));
    let mut t = Table::new(&head);
    let mut seen: Vec<(String, String)> = Vec::new();
    for r in rows {
        let key = (r.variant.clone(), r.served());
        if seen.contains(&key) {
            continue;
        }
        seen.push(key.clone());
        let of: Vec<&QualityRow> = rows
            .iter()
            .filter(|x| x.variant == key.0 && x.served() == key.1)
            .collect();
        let mut row = vec![
            if key.0 == "base" {
                "start (no fine-tuning)".to_string()
            } else {
                format!("fine-tuned {}", key.0)
            },
            key.1.clone(),
            if key.0 == "base" {
                "-".into()
            } else {
                seeds_of(of.iter().copied()).len().to_string()
            },
        ];
        for task in &tasks {
            let cell: Vec<&QualityRow> = of.iter().copied().filter(|x| &x.task == task).collect();
            row.push(accuracy_cell(&cell));
        }
        t.row(row);
    }
    let metric = rows[0].metric.clone();
    let items: Vec<String> = tasks
        .iter()
        .filter_map(|t| rows.iter().find(|r| &r.task == t))
        .map(|r| format!("{} {}", r.task, r.items))
        .collect();
    let mut md = format!(
        "\n## Generation (exact match on the written answer)\n\nThe same models asked to write \
         the answer, generated greedily and scored by exact match ({metric}), as \
         lm-evaluation-harness scores GSM8K: a model that still ranks the right choice first \
         can fail to write it. Cells as in the quality table. Items: {}.\n\n{}",
        items.join(", "),
        t.render()
    );
    if !diffs.is_empty() {
        md += &format!(
            "\nPaired differences of exact match, drawn as the multiple-choice ones are:\n\n{}",
            differences_table(diffs).render()
        );
    }
    md + &verdicts(diffs, choice_diffs)
}

/// Per pruned fine-tuning: its multiple-choice verdict, and whether generation agrees.
fn verdicts(diffs: &[QualityDiff], choice_diffs: &[QualityDiff]) -> String {
    let mut lines = Vec::new();
    for g in diffs
        .iter()
        .filter(|d| d.comparison == "pruned fine-tuning")
    {
        let gen = if non_inferior(g) {
            "non-inferior"
        } else {
            "not shown non-inferior"
        };
        let lo = format!("lower end {:+.2}", 100.0 * g.difference.lo);
        let line = match choice_diffs
            .iter()
            .find(|c| c.comparison == g.comparison && c.model == g.model && c.served == g.served)
        {
            Some(c) => {
                let holds = match (non_inferior(c), non_inferior(g)) {
                    (true, true) => "the multiple-choice verdict holds on generation",
                    (true, false) => {
                        "the multiple-choice verdict is not confirmed on generation (its \
                         interval reaches below -1 point)"
                    }
                    (false, true) => {
                        "generation is non-inferior where multiple choice is not shown"
                    }
                    (false, false) => "neither is shown non-inferior",
                };
                let mc = if non_inferior(c) {
                    "non-inferior"
                } else {
                    "not shown non-inferior"
                };
                format!(
                    "- {}: multiple choice {mc} (lower end {:+.2}), generation {gen} ({lo}): \
                     {holds}.",
                    g.model,
                    100.0 * c.difference.lo
                )
            }
            None => format!("- {}: generation {gen} ({lo}).", g.model),
        };
        lines.push(line);
    }
    if lines.is_empty() {
        return String::new();
    }
    format!(
        "\nPruned fine-tuning against standard fine-tuning, non-inferior by 1 point (the \
         interval's lower end at or above -1 point):\n\n{}\n",
        lines.join("\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::paired::PairedDiff;

    fn row(variant: &str, acc: f64) -> QualityRow {
        QualityRow {
            variant: variant.into(),
            fine_tuned: variant != "base",
            seed: (variant != "base").then_some(0),
            max_devices: (variant.starts_with("pruned")).then_some(1),
            max_nodes: None,
            rule: variant.starts_with("pruned").then(|| "router".into()),
            task: "builtin_arithmetic_gen".into(),
            metric: "exact_match,none".into(),
            acc,
            acc_stderr: Some(0.02),
            acc_norm: None,
            items: 100,
            item_acc: Vec::new(),
            item_question: Vec::new(),
        }
    }

    fn diff(comparison: &str, lo: f64) -> QualityDiff {
        QualityDiff {
            comparison: comparison.into(),
            model: "pruned-1-router".into(),
            served: "pruned to 1, router".into(),
            against: ("exact".into(), "exact".into()),
            seeds: vec![0],
            difference: PairedDiff {
                diff: lo + 0.02,
                stderr: 0.01,
                lo,
                hi: lo + 0.04,
                bootstrap: (lo, lo + 0.04),
                items: 100,
                questions: 100,
                tasks: 1,
                per_seed: vec![lo + 0.02],
                seed_sd: None,
                df: None,
            },
        }
    }

    /// The verdicts say whether generation agrees with multiple choice, both ways.
    #[test]
    fn the_multiple_choice_verdict_is_checked_on_generation() {
        let rows = [
            row("base", 0.7),
            row("exact", 0.8),
            row("pruned-1-router", 0.75),
        ];
        let same = generative_section(
            &rows,
            &[diff("pruned fine-tuning", -0.005)],
            &[diff("pruned fine-tuning", 0.0)],
        );
        assert!(same.contains("exact_match,none"), "{same}");
        assert!(same.contains("0.750 ± 0.020"), "{same}");
        assert!(
            same.contains("the multiple-choice verdict holds on generation"),
            "{same}"
        );
        let differ = generative_section(
            &rows,
            &[diff("pruned fine-tuning", -0.05)],
            &[diff("pruned fine-tuning", 0.0)],
        );
        assert!(differ.contains("not confirmed on generation"), "{differ}");
        assert!(differ.contains("generation not shown non-inferior (lower end -5.00)"));
        assert!(generative_section(&[], &[], &[]).is_empty());
    }
}
