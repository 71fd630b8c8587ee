//! `report.md` of `occult reproduce`: the E[C_T] table, the speed table (measured, projected,
//! and over shaped links), the fine-tuning runs, the quality table and the cluster projection,
//! with the paper's claims checked against them in words.

use super::ladder::Step;
use super::recipe::Recipe;
use super::results::{Correlation, Findings, FinetuneRow, QualityRow};
use super::speed::SpeedRow;
use crate::harness::paired::mean_sd;
use crate::table::{count, fmt_opt, Table};
use occult_core::analysis::run_key::{DispatchMode, MoeMode};
use occult_core::analysis::trace::Trace;
use occult_core::models::config::ModelConfig;
use std::collections::BTreeMap;

/// Mean accuracy over tasks of each (variant, served) pair, in first-seen order.
pub fn mean_acc(quality: &[QualityRow]) -> Vec<((String, String), f64)> {
    let mut order: Vec<(String, String)> = Vec::new();
    let mut sums: BTreeMap<(String, String), (f64, usize)> = BTreeMap::new();
    for r in quality {
        let key = (r.variant.clone(), r.served());
        if !order.contains(&key) {
            order.push(key.clone());
        }
        let e = sums.entry(key).or_default();
        e.0 += r.acc;
        e.1 += 1;
    }
    order
        .into_iter()
        .map(|k| {
            let (s, n) = sums[&k];
            (k, s / n.max(1) as f64)
        })
        .collect()
}

/// The report's title line: the recipe, the model, its devices and calibration, and the run's
/// time, stage by stage.
fn header(
    recipe: &Recipe,
    origin: &str,
    cfg: &ModelConfig,
    trace: &Trace,
    f: &Findings,
    seconds: f64,
) -> String {
    let built = match &f.builtin_weights {
        Some(p) if p.weights == "committed" => ", its committed weights".to_string(),
        Some(p) => format!(", pre-trained here in {:.0} s", p.pretrain_seconds),
        None => String::new(),
    };
    let stages: Vec<String> = f
        .stages
        .iter()
        .map(|t| format!("{} {:.0} s", t.stage, t.seconds))
        .collect();
    let stages = if stages.is_empty() {
        String::new()
    } else {
        format!(" ({})", stages.join(", "))
    };
    format!(
        "# occult reproduce: {}\n\nRecipe: {origin}. Model: {}{built} ({} layers, hidden {}, {} \
         experts, top-{}), on {} devices. Calibration: {} tokens per MoE layer. Whole run: \
         {seconds:.0} s{stages}.\n\n",
        recipe.name,
        if recipe.model.builtin {
            "the built-in model".to_string()
        } else {
            recipe.model.path.clone().unwrap_or_default()
        },
        cfg.num_layers,
        cfg.hidden_size,
        cfg.moe.num_experts,
        cfg.moe.top_k,
        recipe.devices,
        trace.layers.first().map_or(0, |l| l.tokens),
    )
}

/// The E[C_T] table: each step's devices per token, rows and bytes, with two nodes' E[C_N],
/// and what the placements cut in words.
fn ect_section(recipe: &Recipe, steps: &[Step]) -> String {
    let mut md = String::from(
        "## E[C_T]: devices each token's experts span, and what crosses links\n\n\
         ![E[C_T] per step](ect.png)\n\n",
    );
    let mut t = Table::new(&[
        "step",
        "placement",
        "E[C_T]",
        "rows/token",
        "remote rows/token",
        "remote bytes",
        "vs standard",
        "changed",
        "E[C_N], 2 nodes",
        "rows/token across 2 nodes",
    ]);
    for s in steps {
        t.row(vec![
            s.step.clone(),
            s.placement.clone(),
            format!("{:.3}", s.ect),
            format!("{:.3}", s.rows_per_token),
            format!("{:.3}", s.remote_rows_per_token),
            count(s.remote_bytes),
            format!("{:.3}", s.remote_bytes_ratio),
            s.changed_fraction
                .map_or("-".into(), |c| format!("{:.1}%", 100.0 * c)),
            fmt_opt(s.ecn_two_nodes, 3),
            fmt_opt(s.inter_rows_per_token_two_nodes, 3),
        ]);
    }
    md += &t.render();
    if steps.iter().any(|s| s.ecn_two_nodes.is_some()) {
        md += &format!(
            "\nThe last two columns split the {} devices into two nodes: distinct nodes per token, \
             and rows per token that cross between them (k copies under standard dispatch; one \
             per remote node under two-level dispatch, forwarded inside it).\n",
            recipe.devices
        );
    }
    if steps.len() >= 4 {
        let (std, dedup, greedy, ours) = (&steps[0], &steps[1], &steps[2], &steps[3]);
        md += &format!(
            "\nDedup alone sends {:.2}x fewer rows than k-copy dispatch. Our placement cuts E[C_T] \
             by {:.1}% against contiguous ({:.3} -> {:.3}); paper-greedy reaches {:.3}.\n",
            std.rows_per_token / dedup.rows_per_token.max(1e-12),
            100.0 * (1.0 - ours.ect / dedup.ect.max(1e-12)),
            dedup.ect,
            ours.ect,
            greedy.ect,
        );
    }
    md
}

/// The speed table, its headlines and the correlation of E[C_T] with time.
fn speed_section(speed: &[SpeedRow], correlation: &Correlation) -> String {
    if speed.is_empty() {
        return String::new();
    }
    let fmt = |c: Option<f64>| c.map_or("-".into(), |c| format!("{c:.2}"));
    speed_table(speed)
        + &speed_headlines(speed)
        + &format!(
            "\nCorrelation of E[C_T] with time over the Occult rows (exact and pruned, each time \
             over its suite's mean): {} measured, {} projected.\n",
            fmt(correlation.measured),
            fmt(correlation.projected),
        )
        + "\n![Prefill speed-up over standard dispatch](speedup_vs_tokens.png)\n"
}

/// Each fine-tuning run: its routing, seed, E[C_T] and losses.
fn finetune_section(finetunes: &[FinetuneRow]) -> String {
    if finetunes.is_empty() {
        return String::new();
    }
    let mut t = Table::new(&[
        "routing",
        "seed",
        "E[C_T]",
        "first loss",
        "last loss",
        "held-out loss",
        "seconds",
    ]);
    for f in finetunes {
        t.row(vec![
            f.variant.clone(),
            f.seed.to_string(),
            format!("{:.3}", f.mean_ect),
            format!("{:.4}", f.first_loss),
            format!("{:.4}", f.last_loss),
            f.held_out_loss.map_or("-".into(), |l| format!("{l:.4}")),
            format!("{:.0}", f.seconds),
        ]);
    }
    "\n## Fine-tuning from the same start\n\n".to_string() + &t.render()
}

/// The quality table (each model and serving: every task's accuracy and the mean with its
/// interval), what its cells are, and the paper's claims checked in words.
fn quality_section(quality: &[QualityRow]) -> String {
    if quality.is_empty() {
        return String::new();
    }
    let mut md = String::from("\n## Quality (accuracy on the tasks)\n\n");
    let mut tasks: Vec<String> = quality.iter().map(|r| r.task.clone()).collect();
    tasks.sort();
    tasks.dedup();
    let mut head = vec![
        "model".to_string(),
        "served".to_string(),
        "seeds".to_string(),
    ];
    head.extend(tasks.iter().cloned());
    head.push("mean".into());
    let head_refs: Vec<&str> = head.iter().map(String::as_str).collect();
    let mut t = Table::new(&head_refs);
    for ((variant, how), _) in mean_acc(quality) {
        let rows: Vec<&QualityRow> = quality
            .iter()
            .filter(|r| r.variant == variant && r.served() == how)
            .collect();
        let seeds = super::results::seeds_of(rows.iter().copied());
        let mut row = vec![
            if variant == "base" {
                "start (no fine-tuning)".to_string()
            } else {
                format!("fine-tuned {variant}")
            },
            how.clone(),
            if variant == "base" {
                "-".into()
            } else {
                seeds.len().to_string()
            },
        ];
        for task in &tasks {
            let of_task: Vec<&QualityRow> =
                rows.iter().copied().filter(|r| &r.task == task).collect();
            row.push(accuracy_cell(&of_task));
        }
        row.push(mean_cell(&rows));
        t.row(row);
    }
    md += &t.render();
    let items: Vec<String> = tasks
        .iter()
        .filter_map(|t| quality.iter().find(|r| &r.task == t))
        .map(|r| format!("{} {}", r.task, r.items))
        .collect();
    md += &format!(
        "\nOne run: accuracy ± its standard error over the items; several seeds \
         (fine-tuning runs with other data orders): the seeds' mean ± their standard \
         deviation. The mean over the tasks carries its 95% interval, drawn as the \
         differences below are (questions asked again drawn together; with seeds, the \
         seeds drawn too and at least Student's t), and the seeds' sd. Items per task: \
         {}.\n",
        items.join(", ")
    );
    md += &quality_summary(quality);
    md + "\n![Mean accuracy against E[C_T]](quality_vs_ect.png)\n"
}

/// A task's accuracy: `acc ± se` for one run; `mean ± sd` over several seeds.
pub(super) fn accuracy_cell(rows: &[&QualityRow]) -> String {
    match rows {
        [] => "-".into(),
        [r] => match r.acc_stderr {
            Some(se) => format!("{:.3} ± {se:.3}", r.acc),
            None => format!("{:.3}", r.acc),
        },
        _ => {
            let accs: Vec<f64> = rows.iter().map(|r| r.acc).collect();
            let (m, sd) = mean_sd(&accs);
            format!("{m:.3} ± {sd:.3}")
        }
    }
}

/// The mean over tasks with its 95% interval (and the seeds' sd with several), as
/// [`mean_interval`] gives them; the plain mean where the rows carry no per-item scores.
fn mean_cell(rows: &[&QualityRow]) -> String {
    match mean_interval(rows) {
        Ok(p) => {
            let interval = format!("{:.3} [{:.3}, {:.3}]", p.diff, p.lo, p.hi);
            match p.seed_sd {
                Some(sd) => format!("{interval}, sd {sd:.3}"),
                None => interval,
            }
        }
        Err(_) => {
            let accs: Vec<f64> = rows.iter().map(|r| r.acc).collect();
            format!("{:.3}", mean_sd(&accs).0)
        }
    }
}

/// The mean accuracy over tasks of `rows` (one model served one way, over its seeds) with its
/// 95% interval: the same pooling as the paired differences
/// ([`crate::harness::paired::pooled_mean`]: questions drawn together, seeds drawn, Student's
/// t with several seeds); `diff` holds the mean.
pub fn mean_interval(rows: &[&QualityRow]) -> anyhow::Result<crate::harness::paired::PairedDiff> {
    use crate::harness::paired::{pooled_mean, TaskScores, RESAMPLES};
    let seeds = super::results::seeds_of(rows.iter().copied());
    let (scores, questions) = super::results::item_scores(rows, &seeds);
    let runs: Vec<&TaskScores> = scores.iter().map(Vec::as_slice).collect();
    pooled_mean(&runs, questions.as_deref(), RESAMPLES, 0)
}

/// The speed table: per suite and size, each mode's measured and projected time, and their
/// ratio to standard dispatch in the same run.
fn speed_table(speed: &[SpeedRow]) -> String {
    let link = speed.first().map_or("", |r| r.link.as_str());
    let md = format!(
        "\n## Speed: measured here, and projected on {link}\n\nSeconds per step (decode: per \
         step, one token per sequence) of the slowest rank; x = standard's time over the \
         mode's, in the same run. `layers` is the prefill's MoE layers alone (route, plan, \
         dispatch, expert compute, combine); projections model those layers. Rows marked \
         `shaped` ran as MPI processes over links shaped with tc, and are projected with that \
         emulated machine's profile.\n\n"
    );
    let mut t = Table::new(&[
        "suite",
        "tokens",
        "mode",
        "E[C_T]",
        "remote bytes",
        "measured s",
        "x",
        "projected s",
        "x",
    ]);
    for r in speed {
        let base = speed
            .iter()
            .find(|b| b.suite == r.suite && b.tokens == r.tokens && b.key.is_baseline());
        t.row(vec![
            r.suite.clone(),
            r.tokens.to_string(),
            r.mode.clone(),
            format!("{:.3}", r.ect),
            count(r.bytes_sent),
            format!("{:.4}", r.seconds),
            ratio(base.map(|b| b.seconds), Some(r.seconds)),
            r.projected_seconds
                .map_or("-".into(), |p| format!("{p:.6}")),
            ratio(base.and_then(|b| b.projected_seconds), r.projected_seconds),
        ]);
    }
    md + &t.render()
}

/// `a / b` to two places, `-` where either is missing or `b` is not positive.
fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    }
}

/// Per suite, at its largest size: how much faster than standard each Occult mode is,
/// measured and projected.
fn speed_headlines(speed: &[SpeedRow]) -> String {
    let mut suites: Vec<&str> = Vec::new();
    for r in speed {
        if !suites.contains(&r.suite.as_str()) {
            suites.push(&r.suite);
        }
    }
    let mut out = String::from(
        "
",
    );
    for suite in suites {
        let rows: Vec<&SpeedRow> = speed.iter().filter(|r| r.suite == suite).collect();
        let tokens = rows.iter().map(|r| r.tokens).max().unwrap_or(0);
        let at: Vec<&&SpeedRow> = rows.iter().filter(|r| r.tokens == tokens).collect();
        let Some(base) = at.iter().find(|r| r.key.is_baseline()) else {
            continue;
        };
        let parts: Vec<String> = at
            .iter()
            .filter(|r| r.key.pre_reduces())
            .map(|r| {
                let projected = match (base.projected_seconds, r.projected_seconds) {
                    (Some(b), Some(x)) if x > 0.0 => format!(", {:.2}x projected", b / x),
                    _ => String::new(),
                };
                format!(
                    "{} {:.2}x measured{projected}",
                    r.mode,
                    base.seconds / r.seconds.max(1e-12)
                )
            })
            .collect();
        out += &format!("- {suite}, {tokens} tokens: {}.\n", parts.join("; "));
    }
    out
}

/// The paper's quality claims, checked in words against the table (mean accuracy over tasks,
/// in points).
fn quality_summary(quality: &[QualityRow]) -> String {
    pruned_lines(quality, |_| true) + "\n"
}

/// For each pruned routing served (of those `keep` takes): what it costs the start, and where
/// fine-tuning under it lands against standard fine-tuning, as list items.
fn pruned_lines(quality: &[QualityRow], keep: impl Fn(&QualityRow) -> bool) -> String {
    let means = mean_acc(quality);
    let get = |variant: &str, how: &str| {
        means
            .iter()
            .find(|((v, h), _)| v == variant && h == how)
            .map(|(_, m)| *m)
    };
    let mut out = String::new();
    let Some(start) = get("base", "exact") else {
        return out;
    };
    // Every pruned routing served, with the model fine-tuned under it.
    let mut pruned: Vec<(String, String)> = Vec::new();
    for r in quality
        .iter()
        .filter(|r| r.fine_tuned && r.variant != "exact" && keep(r))
    {
        let pair = (r.served(), r.variant.clone());
        if !pruned.contains(&pair) {
            pruned.push(pair);
        }
    }
    // A (model, served) difference in points, with its paired 95% interval when there is one
    // (the same figure as the differences table), else the difference of the table's means.
    let diffs = super::differences::quality_differences(quality).unwrap_or_default();
    let points = |model: &str, how: &str, plain: f64| {
        diffs
            .iter()
            .find(|d| d.model == model && d.served == how)
            .map_or(format!("{:+.1} points", 100.0 * plain), |d| {
                let x = &d.difference;
                format!(
                    "{:+.1} points (95% interval [{:+.1}, {:+.1}])",
                    100.0 * x.diff,
                    100.0 * x.lo,
                    100.0 * x.hi
                )
            })
    };
    for (how, variant) in pruned {
        let mut parts = Vec::new();
        if let Some(p) = get("base", &how) {
            parts.push(format!(
                "pruning without fine-tuning changes the start by {}",
                points("base", &how, p - start)
            ));
        }
        if let (Some(f), Some(std)) = (get(&variant, &how), get("exact", "exact")) {
            parts.push(format!(
                "fine-tuning under it lands {} from standard fine-tuning",
                points(&variant, &how, f - std)
            ));
        }
        if !parts.is_empty() {
            out += &format!("\n- {how}: {}.", parts.join("; "));
        }
    }
    out
}

/// The paired differences as a table: each comparison, its models, seeds, difference in
/// points with its standard error and 95% interval, and the items.
pub(super) fn differences_table(diffs: &[super::results::QualityDiff]) -> Table {
    let mut t = Table::new(&[
        "comparison",
        "model",
        "served",
        "against",
        "seeds",
        "difference (points)",
        "stderr",
        "95% interval",
        "items",
    ]);
    for d in diffs {
        let x = &d.difference;
        t.row(vec![
            d.comparison.clone(),
            if d.model == "base" {
                "start".to_string()
            } else {
                format!("fine-tuned {}", d.model)
            },
            d.served.clone(),
            match d.against.0.as_str() {
                "base" => format!("start, {}", d.against.1),
                v => format!("fine-tuned {v}, {}", d.against.1),
            },
            match (d.seeds.len(), x.seed_sd) {
                (0, _) => "-".to_string(),
                (n, None) => n.to_string(),
                (n, Some(sd)) => format!("{n} (sd {:.1})", 100.0 * sd),
            },
            format!("{:+.1}", 100.0 * x.diff),
            format!("{:.1}", 100.0 * x.stderr),
            format!("[{:+.1}, {:+.1}]", 100.0 * x.lo, 100.0 * x.hi),
            format!(
                "{} ({} questions) over {} tasks",
                x.items, x.questions, x.tasks
            ),
        ]);
    }
    t
}

/// The paired differences: each with its standard error and bootstrap 95% interval, in
/// points, and what they allow one to conclude.
fn differences_section(diffs: &[super::results::QualityDiff]) -> String {
    if diffs.is_empty() {
        return String::new();
    }
    let t = differences_table(diffs);
    let resolved: Vec<String> = diffs
        .iter()
        .filter(|d| d.difference.excludes_zero())
        .map(|d| format!("{} ({})", d.served, d.comparison))
        .collect();
    let widest = diffs
        .iter()
        .map(|d| d.difference.stderr)
        .fold(0.0, f64::max);
    let most_seeds = diffs.iter().map(|d| d.seeds.len()).max().unwrap_or(0);
    let seeds_text = if most_seeds > 1 {
        format!(
            "Fine-tuned models ran {most_seeds} seeds (data orders); each seed is paired with \
             standard fine-tuning of the same seed, the difference is the seeds' mean (sd: of \
             the seeds' differences), and the interval carries the spread between fine-tuning \
             runs too: the bootstrap draws the seeds as well as the questions, and since a few \
             seeds understate their spread, the interval is at least Student's t (at the \
             Welch-Satterthwaite degrees of freedom) times the standard error. The start is \
             not fine-tuned: its rows have no seeds."
        )
    } else {
        "One seed: the spread of fine-tuning runs is not in these intervals, so what they \
         say holds for these fine-tuning runs, not for fine-tuning in general (`--seeds N` \
         repeats every fine-tuning)."
            .to_string()
    };
    format!(
        "\n### Differences, paired over the same items\n\nEach difference of mean accuracy \
         over the tasks is paired: both models answer the same items, and a bootstrap resamples \
         those items (2,000 draws, within each task; items that ask the same question again, \
         with other wrong answers, are drawn together as one question) for its 95% interval. \
         An interval that leaves out 0 says the difference is larger than the noise of the \
         items (and of the seeds, with several); one that holds 0 \
         does not say there is none, only that these items cannot tell it from noise (with a \
         standard error up to {:.1} points here, differences under about {:.1} points go \
         unresolved). An interval whose lower end is at or above -1 point says the model is \
         non-inferior by 1 point; one that reaches below does not say it is inferior. \
         {seeds_text}\n\n{}\nIntervals that leave out 0: {}.\n{}",
        100.0 * widest,
        200.0 * widest,
        t.render(),
        if resolved.is_empty() {
            "none".to_string()
        } else {
            resolved.join("; ")
        },
        non_inferiority(diffs)
    )
}

/// Which pruned fine-tunings are non-inferior to standard fine-tuning by 1 point (the lower
/// end of the interval at or above -1 point), and which are not, in words.
fn non_inferiority(diffs: &[super::results::QualityDiff]) -> String {
    let (yes, no): (Vec<_>, Vec<_>) = diffs
        .iter()
        .filter(|d| d.comparison == "pruned fine-tuning")
        .partition(|d| d.difference.lo >= -0.01);
    if yes.is_empty() && no.is_empty() {
        return String::new();
    }
    let list = |v: &[&super::results::QualityDiff]| -> String {
        if v.is_empty() {
            return "none".into();
        }
        v.iter()
            .map(|d| format!("{} (lower end {:+.2})", d.model, 100.0 * d.difference.lo))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let runs = diffs
        .iter()
        .filter(|d| d.comparison == "pruned fine-tuning")
        .map(|d| d.seeds.len())
        .max()
        .unwrap_or(0);
    format!(
        "Non-inferior to standard fine-tuning by 1 point ({}): {}. Not shown non-inferior: \
         {}.\n",
        if runs > 1 {
            format!("over {runs} seeds")
        } else {
            "for this one fine-tuning run of each".to_string()
        },
        list(&yes),
        list(&no)
    )
}

/// The cluster projection: the headline speed-ups on the recipe's device count, then every
/// table of `occult project`.
pub fn projection_section(
    p: &occult_core::analysis::cost::projection::ProjectReport,
    r: &super::recipe::ProjectionRecipe,
    recipe_devices: usize,
) -> String {
    let sizes = r.sizes_from.clone().unwrap_or_else(|| {
        format!(
            "hidden {}, expert intermediate {}",
            p.settings.hidden, p.settings.intermediate
        )
    });
    let mut md = format!(
        "\n## Cluster projection (a cost model, not a measurement)\n\n`occult project` on this \
         run's routing trace at the layer size of {sizes}: each device holds a share of the \
         traced tokens, rows are counted at two levels (within a node, and across nodes once \
         per remote node under deduplication), and time is bytes over bandwidth plus latency \
         per message and FLOPs over throughput, on each machine profile. Speed-ups are \
         standard dispatch's time over the mode's.\n\n"
    );
    // The headline: the recipe's device count where it was projected, else the first.
    let tokens = p.settings.tokens_per_device.first().copied();
    let devices = if p.rows.iter().any(|m| m.devices == recipe_devices) {
        Some(recipe_devices)
    } else {
        p.rows.first().map(|m| m.devices)
    };
    for m in p
        .rows
        .iter()
        .filter(|m| m.dispatch != DispatchMode::Standard)
    {
        if Some(m.tokens_per_device) == tokens && Some(m.devices) == devices {
            md += &format!(
                "- {}, D = {}, {}: layer {:.2}x, training step {:.2}x.\n",
                m.profile, m.devices, m.mode, m.layer_speedup, m.train_speedup
            );
        }
    }
    md + "\n" + &crate::jobs::project::render(p)
}

/// Placements with replicas: each method's E[C_T] and max/mean device load on the recipe's
/// devices.
fn replicas_section(runs: &[crate::bench::place::PlaceRun]) -> String {
    if runs.is_empty() {
        return String::new();
    }
    let profiles: Vec<String> = runs[0]
        .projected
        .iter()
        .map(|p| format!("{} layer ms", p.profile))
        .collect();
    let mut head = vec!["placement", "copy rule", "E[C_T]", "max/mean load"];
    head.extend(profiles.iter().map(String::as_str));
    let mut t = Table::new(&head);
    for r in runs {
        let mut row = vec![
            r.method.clone(),
            r.rule.clone(),
            format!("{:.3}", r.ect),
            format!("{:.3}", r.max_load_ratio),
        ];
        row.extend(
            r.projected
                .iter()
                .map(|p| format!("{:.3}", p.layer_s * 1e3)),
        );
        t.row(row);
    }
    let tokens = runs[0].projected.first().map_or(0, |p| p.tokens_per_device);
    format!(
        "\n## Placements with replicas\n\nOn the calibration trace, {} devices, each token on \
         its rank of an even split: the partitions (every copy rule serves them alike), \
         Occult's under a 1.05 load cap; then, under each copy rule an engine serves with \
         (Occult's cover, SGLang's static table, TensorRT-LLM's uniform choice), like with \
         like: DeepSeek's EPLB and TensorRT-LLM's co-occurrence placement with redundant slots, \
         and Occult's partitions with copies chosen under that rule where they lower E[C_T] \
         most (within the partition's cap; and held to EPLB's balance plus 0.02). The projected \
         columns are one MoE layer of OLMoE-1B-7B's size with {tokens} tokens per device: its \
         one-row-per-device exchange each way under the row's copy rule and its slowest \
         device's expert compute. Every model command runs these placements \
         (`--placement`, `--copy-rule`).\n\n{}",
        runs[0].devices,
        t.render()
    )
}

/// Past one node: the devices as nodes of the recipe's node size. E[C_N] beside E[C_T] for
/// each step of the table, the two-level shaped measurement (the flat and the two-level
/// exchange, pruning to one node in each), and what node-limited pruning costs in quality.
fn nodes_section(
    recipe: &Recipe,
    steps: &[Step],
    speed: &[SpeedRow],
    quality: &[QualityRow],
) -> String {
    let Some(g) = recipe.analysis.node_size(recipe.devices) else {
        return String::new();
    };
    let mut md = format!(
        "\n## Past one node\n\nThe {} devices as nodes of {g} (rank r in node r / {g}); \
         [docs/multinode.md](../../docs/multinode.md) says how to run this on a cluster.\n\n",
        recipe.devices
    );
    if steps.iter().any(|s| s.ecn_two_nodes.is_some()) && g * 2 == recipe.devices {
        let mut t = Table::new(&["step", "E[C_T]", "E[C_N]", "rows across nodes / token"]);
        for s in steps.iter().filter(|s| s.ecn_two_nodes.is_some()) {
            t.row(vec![
                s.step.clone(),
                format!("{:.3}", s.ect),
                fmt_opt(s.ecn_two_nodes, 3),
                fmt_opt(s.inter_rows_per_token_two_nodes, 3),
            ]);
        }
        md += &t.render();
        md += "\nRows across nodes: k copies for standard dispatch, one per remote node under \
               the two-level exchange.\n";
    }
    let shaped: Vec<&SpeedRow> = speed
        .iter()
        .filter(|r| r.suite.contains("nodes of"))
        .collect();
    if !shaped.is_empty() {
        md += &format!(
            "\nMeasured over two-level shaped links ({}): MPI processes, each rank's link to \
             its own node fast and to the other node slow. x = standard's time over the \
             mode's; measured / projected is the cost model's miss.\n\n",
            shaped[0].link
        );
        let mut t = Table::new(&[
            "suite",
            "mode",
            "E[C_T]",
            "remote bytes",
            "measured s",
            "x",
            "projected s",
            "x",
            "measured / projected",
        ]);
        for r in &shaped {
            let base = shaped
                .iter()
                .find(|b| b.suite == r.suite && b.key.is_baseline());
            t.row(vec![
                r.suite.clone(),
                r.mode.clone(),
                format!("{:.3}", r.ect),
                count(r.bytes_sent),
                format!("{:.4}", r.seconds),
                ratio(base.map(|b| b.seconds), Some(r.seconds)),
                r.projected_seconds
                    .map_or("-".into(), |p| format!("{p:.4}")),
                ratio(base.and_then(|b| b.projected_seconds), r.projected_seconds),
                ratio(Some(r.seconds), r.projected_seconds),
            ]);
        }
        md += &t.render();
        for suite in ["prefill", "train"] {
            let find = |mode: MoeMode| {
                shaped
                    .iter()
                    .find(|r| {
                        r.suite.starts_with(suite) && r.key.mode == mode && r.key.prune.is_none()
                    })
                    .map(|r| r.seconds)
            };
            if let (Some(flat), Some(two)) = (find(MoeMode::Occult), find(MoeMode::TwoLevel)) {
                md += &format!(
                    "\n- {suite}: the two-level exchange {:.2}x the flat one, measured.",
                    flat / two.max(1e-12)
                );
            }
        }
        md += "\n";
    }
    let lines = pruned_lines(quality, |r| r.max_nodes.is_some());
    if !lines.is_empty() {
        md += &format!(
            "\nNode-limited pruning (each token's experts on at most M nodes, nodes scored by \
             their two best experts as DeepSeek-V3 scores its groups; rows `pruned to M node` of \
             the quality table), mean accuracy over the tasks:\n{lines}\n"
        );
    }
    md
}

/// The report: the tables, then the shaped run's note, the projection and the collaboration.
pub fn full(
    recipe: &Recipe,
    origin: &str,
    cfg: &ModelConfig,
    trace: &Trace,
    f: &Findings,
    seconds: f64,
) -> String {
    let mut md = header(recipe, origin, cfg, trace, f, seconds);
    md += &ect_section(recipe, &f.steps);
    md += &speed_section(&f.speed, &f.correlation);
    md += &finetune_section(&f.finetunes);
    md += &quality_section(&f.quality);
    md += &differences_section(&f.differences);
    md += &super::report_generative::generative_section(
        &f.generative,
        &f.generative_differences,
        &f.differences,
    );
    if let Some(why) = f.shaped.as_ref().and_then(|s| s.reason.as_deref()) {
        md += &format!(
            "\nThe shaped-link measurement (scripts/shaped_links.sh) did not run: {why}.\n"
        );
    }
    md += &replicas_section(&f.replicas);
    md += &nodes_section(recipe, &f.steps, &f.speed, &f.quality);
    if let Some(p) = &f.projection {
        md += &projection_section(p, &recipe.projection, recipe.devices);
    }
    if let Some(c) = &f.collaboration {
        md += &format!(
            "\n## Collaboration before and after pruned fine-tuning\n\nThe routing the model \
             chooses on its own (unpruned) on the calibration text, under our placement: E[C_T] \
             {:.3} at the start, {:.3} after {} fine-tuning. Co-activation of the first MoE \
             layer's experts, grouped by device:\n\n![Collaboration](collaboration.png)\n",
            c.ect_before, c.ect_after, c.variant
        );
    }
    md
}
