//! `occult reproduce`: the paper's experiments end to end on one model (the built-in one by
//! default): profile routing on calibration text, place experts (contiguous, paper-greedy,
//! ours), the E[C_T] table, speed (prefill, decode and a training step, measured and
//! projected; again over tc-shaped links where the machine allows), fine-tuning from the same
//! start under standard routing and under pruning to fewer devices with each rule, quality on
//! tasks for the start (exact and pruned without fine-tuning), the standard fine-tuned model
//! (served exact and pruned) and each pruned fine-tuned model, and the cluster projection.
//! Writes `report.md`, `results.json` and the plots in the output folder, with every
//! intermediate file (trace, placements, fine-tuned models, task results) beside them.
//!
//! | module | holds |
//! |---|---|
//! | [`recipe`] | the recipe (`configs/reproduce/*.toml`), its sections and checks |
//! | [`ladder`] | the E[C_T] table and the placements of every method |
//! | [`speed`] | the speed stage: prefill, decode and a training step, measured and projected |
//! | [`shaped`] | the speed stage again over tc-shaped links (MPI processes) |
//! | [`results`] | what the stages hand on: routings, rows, and the [`Findings`] of the run |
//! | [`differences`] | the paired differences of quality, with their intervals |
//! | [`report`] | `report.md` |
//! | `report_generative` | its generative section: exact match, differences, verdicts |
//! | [`plots`] | the PNG plots |
//!
//! The pipeline is [`run`]: one function per stage, each taking and returning typed values
//! (the trace, the [`Placements`], the fine-tuned models, the quality rows). Each stage calls
//! the same entry points as the command of its name ([`crate::jobs`] for `profile`, `train`,
//! `eval` and `project`; [`crate::bench`] for the speed), on the recipe's devices: threads of
//! this process, or (backend `mpi`) the processes mpirun started, where rank 0 alone writes
//! files and the report and the others join every collective stage (they read the placement
//! rank 0 wrote after a barrier: a detail of the stages' `Ranks`).

pub mod differences;
pub mod ladder;
pub mod plots;
mod progress;
mod ranks;
pub mod recipe;
pub mod report;
mod report_generative;
pub mod results;
pub mod shaped;
pub mod speed;
mod stages;
mod subject;

use crate::output::{with_provenance, write_json};
use anyhow::{Context, Result};
pub use ladder::Placements;
use progress::{Progress, Stage};
use ranks::Ranks;
use recipe::Recipe;
pub use results::{Findings, FinetuneRow, QualityRow, Routing, StageTime};
use stages::{
    collaboration, collaboration_trace, finetune_stage, placement_stage, profile_stage, project,
    quality_stage, routings, speed_stage,
};
use std::path::Path;
use subject::subject;

/// Runs the recipe into `out`.
pub fn run(recipe: &Recipe, origin: &str, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let ranks = Ranks::new(recipe)?;
    let mut progress = Progress::new(recipe, ranks.root());
    progress.stage(Stage::Model);
    let s = subject(recipe, ranks.mpi())?;
    let cfg = crate::context::spec::model_config(&s.model)?;
    progress.stage(Stage::Profile);
    let trace = std::sync::Arc::new(profile_stage(recipe, &s, &ranks, out)?);
    progress.stage(Stage::Placements);
    let (steps, placements, placed) = placement_stage(recipe, &cfg, &trace, &ranks, out)?;
    let (speed, shaped) = speed_stage(recipe, &s, &placed, &ranks, out, &mut progress)?;
    let routings = routings(recipe);
    let (finetuned, finetunes) = if recipe.finetune.skip {
        (Vec::new(), Vec::new())
    } else {
        progress.stage(Stage::Finetune);
        finetune_stage(recipe, &s, &placed, &routings, &ranks, out, &progress)?
    };
    progress.stage(Stage::Quality);
    let rows = quality_stage(recipe, &s, &placed, &routings, &finetuned, out, &progress)?;
    // Multiple-choice accuracy and generative exact match are compared each on its own.
    let (generative, quality): (Vec<_>, Vec<_>) =
        rows.into_iter().partition(QualityRow::is_generative);
    let differences = differences::quality_differences(&quality)?;
    let generative_differences = differences::quality_differences(&generative)?;
    // The collaboration profile runs on every rank; the rest is rank 0's.
    let collab_trace = collaboration_trace(&finetuned, recipe, &s, out, ranks.mpi())?;
    // Only rank 0 holds the placements; it alone projects and reports.
    let Some(placements) = placements else {
        return Ok(());
    };
    // Rank 0's alone (no collectives), so after the others are done.
    progress.stage(Stage::Replicas);
    let replicas = stages::replica_stage(recipe, &trace, &placed.trace_file)?;
    let projection = if recipe.projection.skip {
        None
    } else {
        progress.stage(Stage::Projection);
        Some(project(&recipe.projection, recipe, &cfg, &trace)?)
    };
    let mut plots = plots::draw_all(out, &steps, &speed, &quality)?;
    let collaboration = match collab_trace {
        Some((routing, after)) => {
            let (shift, plot) = collaboration(
                recipe,
                &cfg,
                &trace,
                &after,
                placements.ours(),
                routing,
                out,
            )?;
            plots.push(plot);
            Some(shift)
        }
        None => None,
    };
    let correlation = results::Correlation {
        measured: speed::ect_time_correlation(&speed, true),
        projected: speed::ect_time_correlation(&speed, false),
    };
    let seconds = progress.clock.elapsed().as_secs_f64();
    let found = Findings {
        steps,
        replicas,
        finetunes,
        quality,
        differences,
        generative,
        generative_differences,
        speed,
        projection,
        shaped,
        collaboration,
        correlation,
        plots,
        stages: progress.finish(),
        builtin_weights: s.provenance.clone(),
    };
    write_outputs(recipe, origin, &s, &cfg, &trace, &found, seconds, out)
}

/// Writes `report.md` and `results.json` into `out`, and prints the report.
#[allow(clippy::too_many_arguments)]
fn write_outputs(
    recipe: &Recipe,
    origin: &str,
    s: &subject::Subject,
    cfg: &occult_core::models::config::ModelConfig,
    trace: &occult_core::analysis::trace::Trace,
    f: &Findings,
    seconds: f64,
    out: &Path,
) -> Result<()> {
    let md = report::full(recipe, origin, cfg, trace, f, seconds);
    let mut results = serde_json::to_value(f)?;
    results["config"] = serde_json::json!({"recipe": recipe, "recipe_source": origin,
        "model": s.model, "builtin": s.builtin});
    results["seconds"] = seconds.into();
    let results = with_provenance(results);
    write_json(&out.join("results.json"), &results)?;
    occult_core::atomic::write_atomic(&out.join("report.md"), |w| {
        std::io::Write::write_all(w, md.as_bytes())
    })?;
    print!("{md}");
    eprintln!(
        "wrote {} and {} in {seconds:.0} s",
        out.join("report.md").display(),
        out.join("results.json").display()
    );
    Ok(())
}
