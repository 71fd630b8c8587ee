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
//! Each stage runs the same code as the command of its name (`profile`, `place`, `bench`,
//! `train`, `eval`, `project`), on the recipe's devices: threads of this process, or (backend
//! `mpi`) the processes mpirun started, where rank 0 alone writes files and the report and the
//! others join every collective stage, waiting at a barrier wherever they read what rank 0
//! wrote.

pub mod ladder;
pub mod plots;
pub mod recipe;
pub mod report;
pub mod shaped;
pub mod speed;

use crate::builtin::{ensure_cached, BuiltinRecipe};
use crate::commands::eval::EvalArgs;
use crate::commands::model_opts::{ModeArg, ModelOpts, PruneRuleArg};
use crate::commands::profile::ProfileArgs;
use crate::commands::train::{TrainArgs, TrainWhat};
use crate::commands::{with_provenance, write_json, Backend, RowDtype};
use anyhow::{bail, Context, Result};
use ladder::{ect_ladder, LadderSettings};
use occult_core::analysis::projection::{ProjectReport, ProjectSettings};
use occult_core::analysis::pruning::PruneRule;
use occult_core::analysis::trace::Trace;
use recipe::Recipe;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

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

/// Where the model and its data are.
struct Subject {
    model: String,
    calibration: PathBuf,
    instructions: Option<String>,
    held_out: Option<String>,
    tasks: Vec<String>,
    task_data: Vec<String>,
    builtin: Option<BuiltinRecipe>,
}

fn subject(r: &Recipe, mpi: bool) -> Result<Subject> {
    if r.model.builtin {
        let recipe = r.builtin.clone().unwrap_or_default();
        let b = ensure_cached(&recipe, !mpi)?;
        let names = crate::builtin::world::Domain::ALL;
        let tasks = if r.quality.tasks.is_empty() {
            names
                .iter()
                .map(|d| {
                    let name = crate::builtin::data::task_name(*d);
                    b.file(&format!("tasks/{name}.toml")).display().to_string()
                })
                .collect()
        } else {
            r.quality.tasks.clone()
        };
        let mut task_data: Vec<String> = names
            .iter()
            .map(|d| {
                let task = crate::builtin::data::task_name(*d);
                format!(
                    "{task}={}",
                    b.file(&format!("tasks/{}", d.name())).display()
                )
            })
            .collect();
        task_data.extend(r.quality.data.iter().map(|(k, v)| format!("{k}={v}")));
        Ok(Subject {
            model: b.model().display().to_string(),
            calibration: r
                .calibration
                .data
                .clone()
                .unwrap_or_else(|| b.file("calibration.jsonl")),
            instructions: Some(
                r.finetune
                    .data
                    .clone()
                    .unwrap_or_else(|| b.file("instructions/train.jsonl").display().to_string()),
            ),
            held_out: Some(b.file("instructions/held_out.jsonl").display().to_string()),
            tasks,
            task_data,
            builtin: Some(recipe),
        })
    } else {
        Ok(Subject {
            model: r.model.path.clone().expect("checked"),
            calibration: r.calibration.data.clone().expect("checked"),
            instructions: r.finetune.data.clone(),
            held_out: None,
            tasks: r.quality.tasks.clone(),
            task_data: r
                .quality
                .data
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect(),
            builtin: None,
        })
    }
}

/// Where this process stands: the recipe's ranks are threads of this process (local), or this
/// is one of the processes mpirun started (mpi), and then only rank 0 writes and reports.
struct Ranks {
    world: Option<std::sync::Arc<dyn occult_core::ep::comm::Communicator>>,
}

impl Ranks {
    fn new(r: &Recipe) -> Result<Self> {
        Ok(Ranks {
            world: match r.backend {
                Backend::Local => None,
                Backend::Mpi => Some(crate::commands::mpi_world(
                    r.devices,
                    std::time::Duration::from_secs_f64(r.comm_timeout),
                )?),
                Backend::Nccl => bail!(
                    "reproduce runs on the CPU (backend local or mpi); the GPU path runs \
                     through `occult bench`, `eval`, `loss` and `train` with --cuda and \
                     --backend nccl"
                ),
            },
        })
    }

    fn root(&self) -> bool {
        self.world.as_ref().is_none_or(|w| w.rank() == 0)
    }

    /// Waits until every rank is here (after rank 0 wrote files the others read).
    fn sync(&self) -> Result<()> {
        if let Some(w) = &self.world {
            w.barrier()?;
        }
        Ok(())
    }
}

/// The options of the model on the recipe's ranks, without a placement.
fn ranks_opts(model: &str, r: &Recipe) -> ModelOpts {
    let mut o = ModelOpts::local(model);
    o.dtype = r.model.dtype.clone();
    o.devices = r.devices;
    o.backend = r.backend;
    o.comm_timeout = r.comm_timeout;
    o.mode = Some(ModeArg::Occult);
    o
}

fn model_opts(
    model: &str,
    r: &Recipe,
    placement: &Path,
    routing: Routing,
    trace: &Path,
) -> ModelOpts {
    let mut o = ranks_opts(model, r);
    o.placement = Some(placement.to_path_buf());
    if let Some((n, rule)) = routing.prune {
        o.max_devices = Some(n);
        o.prune_rule = match rule {
            PruneRule::Router => PruneRuleArg::Router,
            PruneRule::Similarity => PruneRuleArg::Similarity,
        };
        if rule == PruneRule::Similarity {
            o.calibration = Some(trace.to_path_buf());
        }
    }
    o
}

/// Runs the recipe into `out`.
pub fn run(recipe: &Recipe, origin: &str, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let ranks = Ranks::new(recipe)?;
    let root = ranks.root();
    let mpi = recipe.backend.process_per_rank();
    let clock = Instant::now();
    let stages = 4
        + usize::from(!recipe.finetune.skip)
        + usize::from(!recipe.speed.skip)
        + usize::from(!recipe.projection.skip)
        + usize::from(!recipe.speed.skip && !recipe.shaped.skip);
    let mut done = 0;
    let mut stage = |what: &str| {
        done += 1;
        if !root {
            return;
        }
        eprintln!(
            "[{done}/{stages}] {what} ({:.0} s so far)",
            clock.elapsed().as_secs_f64()
        )
    };
    stage("the model");
    let s = subject(recipe, mpi)?;
    let cfg = crate::commands::project::model_config(&s.model)?;

    stage("routing profile on the calibration text");
    let trace_path = out.join("trace.safetensors");
    crate::commands::profile::run(ProfileArgs {
        model: if mpi {
            ranks_opts(&s.model, recipe)
        } else {
            let mut o = ModelOpts::local(&s.model);
            o.dtype = recipe.model.dtype.clone();
            o
        },
        data: s.calibration.clone(),
        output: trace_path.clone(),
        seq_len: recipe.calibration.seq_len,
        max_tokens: recipe.calibration.max_tokens,
        no_logits: false,
        add_bos: false,
    })?;
    ranks.sync()?;
    let trace = Trace::read(&trace_path)?;

    stage("placements and the E[C_T] table");
    let row = match recipe.analysis.row_dtype.as_str() {
        "f32" => RowDtype::F32,
        "f16" => RowDtype::F16,
        "fp8" => RowDtype::Fp8,
        _ => RowDtype::Bf16,
    };
    let rules: Vec<PruneRule> = recipe
        .analysis
        .prune_rules
        .iter()
        .map(|r| {
            if r == "router" {
                PruneRule::Router
            } else {
                PruneRule::Similarity
            }
        })
        .collect();
    let router = cfg.router_rule();
    let (steps, placements) = if !root {
        (Vec::new(), Vec::new())
    } else {
        ect_ladder(
            &trace,
            &LadderSettings {
                devices: recipe.devices,
                row_bytes: cfg.hidden_size as u64 * row.bytes(),
                restarts: recipe.analysis.restarts,
                seed: 0,
                prune_devices: &recipe.analysis.prune_devices,
                rules: &rules,
                router: &router,
            },
        )?
    };
    for (m, p) in &placements {
        p.write(&out.join(format!("placement-{}.json", m.name())))?;
    }
    ranks.sync()?;
    let placement = out.join("placement-occult.json");

    let mut speed = Vec::new();
    if !recipe.speed.skip {
        stage("speed: prefill, decode and a training step, measured and projected");
        let opts = model_opts(
            &s.model,
            recipe,
            &placement,
            Routing { prune: None },
            &trace_path,
        );
        speed = speed::speed(&opts, &recipe.speed)?;
    }
    let mut shaped = serde_json::Value::Null;
    if !recipe.speed.skip && !recipe.shaped.skip {
        stage("speed over shaped links (measured)");
        let why = if mpi {
            Some("the recipe runs under mpirun, and the shaped run starts its own".to_string())
        } else {
            shaped::unavailable(&shaped::script())
        };
        shaped = match why {
            Some(why) => {
                eprintln!("  skipped: {why}");
                serde_json::json!({"ran": false, "reason": why})
            }
            // A machine that refuses namespaces or shaping costs this stage, not the run.
            None => match shaped::run(&recipe.shaped, &s.model, &placement, recipe.devices, out) {
                Ok(rows) => {
                    speed.extend(rows);
                    serde_json::json!({"ran": true, "rate": recipe.shaped.rate})
                }
                Err(e) => {
                    eprintln!("  failed: {e:#}");
                    serde_json::json!({"ran": false, "reason": format!("{e:#}")})
                }
            },
        };
    }

    let routings: Vec<Routing> = std::iter::once(Routing { prune: None })
        .chain(recipe.analysis.prune_devices.iter().flat_map(|&n| {
            rules.iter().map(move |&r| Routing {
                prune: Some((n, r)),
            })
        }))
        .collect();
    let mut finetunes = Vec::new();
    if !recipe.finetune.skip {
        stage("fine-tuning from the same start, under each routing");
        let data = s.instructions.clone().expect("checked");
        for &routing in &routings {
            let dir = out.join("finetune").join(routing.name());
            if root {
                eprintln!("  {}", routing.name());
            }
            let t = Instant::now();
            crate::commands::train::run(TrainArgs {
                model: model_opts(&s.model, recipe, &placement, routing, &trace_path),
                data: data.clone(),
                out: dir.clone(),
                steps: recipe.finetune.steps,
                seq_len: recipe.finetune.seq_len,
                batch_size: recipe.finetune.batch_size,
                grad_accum: 1,
                lr: recipe.finetune.lr,
                warmup: Some(recipe.finetune.steps / 10),
                min_lr_ratio: 0.0,
                weight_decay: 0.0,
                max_grad_norm: 1.0,
                seed: 0,
                save_every: None,
                resume: false,
                overwrite: true,
                stop_at: None,
                add_bos: false,
                aux_loss: false,
                eval_data: s.held_out.clone(),
                eval_every: None,
                train: TrainWhat::Moe,
            })
            .with_context(|| format!("fine-tuning under {}", routing.name()))?;
            ranks.sync()?;
            if root {
                let _ = std::fs::remove_dir_all(dir.join("state"));
                finetunes.push(finetune_row(&dir, routing, t.elapsed().as_secs_f64())?);
            }
        }
    }

    stage("quality on the tasks");
    let mut quality = Vec::new();
    let mut evaluate =
        |variant: &str, model: &str, fine_tuned: bool, routing: Routing| -> Result<()> {
            let file = out
                .join("quality")
                .join(format!("{variant}--served-{}.json", routing.name()));
            std::fs::create_dir_all(file.parent().expect("a folder"))?;
            if root {
                eprintln!("  {variant}, served {}", routing.name());
            }
            crate::commands::eval::run(EvalArgs {
                model: model_opts(model, recipe, &placement, routing, &trace_path),
                tasks: s.tasks.clone(),
                data: s.task_data.clone(),
                samples: false,
                num_fewshot: recipe.quality.num_fewshot,
                limit: recipe.quality.limit,
                batch_size: 8,
                no_context_reuse: false,
                seed: 1234,
                add_bos: false,
                output: Some(file.clone()),
                log_samples: false,
                quiet: true,
                trace: None,
            })
            .with_context(|| format!("evaluating {variant} served {}", routing.name()))?;
            if root {
                quality.extend(quality_rows(&file, variant, fine_tuned, routing)?);
            }
            Ok(())
        };
    for &routing in &routings {
        evaluate("base", &s.model, false, routing)?;
    }
    if !recipe.finetune.skip {
        let standard = out.join("finetune").join("exact");
        for &routing in &routings {
            evaluate("exact", &standard.display().to_string(), true, routing)?;
        }
        for &routing in routings.iter().skip(1) {
            let dir = out.join("finetune").join(routing.name());
            evaluate(&routing.name(), &dir.display().to_string(), true, routing)?;
        }
    }

    // The collaboration profile runs on every rank; the rest is rank 0's.
    let collab_trace = collaboration_trace(&routings, recipe, &s, out, mpi)?;
    if !root {
        return Ok(());
    }
    // Rank 0's alone (no collectives), so after the others are done.
    let mut projection = None;
    if !recipe.projection.skip {
        stage("the cluster projection (cost model)");
        projection = Some(project(&recipe.projection, recipe, &cfg, &trace)?);
    }
    let mut plots = plots::draw_all(out, &steps, &speed, &quality)?;
    // Collaboration before and after pruned fine-tuning: the routing the fine-tuned model
    // chooses on its own (unpruned), on the calibration text, under the same placement.
    let mut collaboration = serde_json::Value::Null;
    if let Some((routing, after_path)) = collab_trace {
        {
            let after = Trace::read(&after_path)?;
            let best = &placements[2].1;
            let row = cfg.hidden_size as u64 * 2;
            let before_ect = occult_core::analysis::trace_stats(&trace, best, row, true)?.mean_ect;
            let after_ect = occult_core::analysis::trace_stats(&after, best, row, true)?.mean_ect;
            let map = &best.layers[0].device_of_expert;
            let mut order: Vec<usize> = (0..map.len()).collect();
            order.sort_by_key(|&x| (map[x], x));
            let k = cfg.moe.top_k;
            let (b, a) = (
                plots::coactivation(&trace.layers[0], k, &order),
                plots::coactivation(&after.layers[0], k, &order),
            );
            let p = out.join("collaboration.png");
            let t_before = format!(
                "start, layer {} (E[C_T] {before_ect:.3})",
                trace.layers[0].layer
            );
            let t_after = format!("after {} fine-tuning ({after_ect:.3})", routing.name());
            plots::heatmaps(&p, [(&t_before, &b), (&t_after, &a)], recipe.devices)?;
            plots.push(p);
            collaboration = serde_json::json!({"variant": routing.name(),
                "ect_before": before_ect, "ect_after": after_ect});
        }
    }
    let seconds = clock.elapsed().as_secs_f64();
    let mut md = report::render(
        recipe, origin, &cfg, &trace, &steps, &speed, &finetunes, &quality, seconds,
    );
    if let Some(why) = shaped["reason"].as_str() {
        md += &format!(
            "\nThe shaped-link measurement (scripts/shaped_links.sh) did not run: {why}.\n"
        );
    }
    if let Some(p) = &projection {
        md += &report::projection_section(p, &recipe.projection, recipe.devices);
    }
    if let (Some(b), Some(a)) = (
        collaboration["ect_before"].as_f64(),
        collaboration["ect_after"].as_f64(),
    ) {
        md += &format!(
            "\n## Collaboration before and after pruned fine-tuning\n\nThe routing the model \
             chooses on its own (unpruned) on the calibration text, under our placement: E[C_T] \
             {b:.3} at the start, {a:.3} after {} fine-tuning. Co-activation of the first MoE \
             layer's experts, grouped by device:\n\n![Collaboration](collaboration.png)\n",
            collaboration["variant"].as_str().unwrap_or_default()
        );
    }
    let results = with_provenance(serde_json::json!({
        "config": {"recipe": recipe, "recipe_source": origin, "model": s.model,
                   "builtin": s.builtin},
        "ect_table": steps,
        "finetune": finetunes,
        "quality": quality,
        "speed": speed,
        "projection": projection,
        "shaped": shaped,
        "collaboration": collaboration,
        "correlation": {
            "measured": speed::ect_time_correlation(&speed, true),
            "projected": speed::ect_time_correlation(&speed, false),
        },
        "plots": plots.iter().map(|p| p.file_name().map(|n| n.to_string_lossy().to_string())).collect::<Vec<_>>(),
        "seconds": seconds,
    }));
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

/// The projection stage: `occult project` on the profiled trace.
fn project(
    p: &recipe::ProjectionRecipe,
    recipe: &Recipe,
    cfg: &occult_core::models::config::ModelConfig,
    trace: &Trace,
) -> Result<ProjectReport> {
    let own = crate::commands::project::layer_sizes(cfg);
    let profiles = crate::commands::project::load_profiles(&p.links)?;
    let settings = ProjectSettings {
        devices: p.devices.clone(),
        tokens_per_device: p.tokens_per_device.clone(),
        prune_devices: recipe.analysis.prune_devices.clone(),
        hidden: p.hidden.unwrap_or(own.0),
        intermediate: p.intermediate.unwrap_or(own.1),
        shared_intermediate: p.shared_intermediate.unwrap_or(own.2),
        load_caps: p.load_caps.clone(),
        restarts: recipe.analysis.restarts,
        seed: 0,
    };
    crate::commands::project::project(trace, &profiles, &settings)
}

/// The routing the pruned-to-2 fine-tuned model chooses on its own (unpruned) on the
/// calibration text: its trace, profiled on the recipe's ranks; `None` without that model.
fn collaboration_trace(
    routings: &[Routing],
    recipe: &Recipe,
    s: &Subject,
    out: &Path,
    mpi: bool,
) -> Result<Option<(Routing, PathBuf)>> {
    let Some(&routing) = routings.iter().find(|r| r.prune.is_some_and(|p| p.0 == 2)) else {
        return Ok(None);
    };
    let dir = out.join("finetune").join(routing.name());
    if !dir.join("config.json").exists() {
        return Ok(None);
    }
    let model = dir.display().to_string();
    let after = out.join(format!("trace-finetuned-{}.safetensors", routing.name()));
    crate::commands::profile::run(ProfileArgs {
        model: if mpi {
            ranks_opts(&model, recipe)
        } else {
            ModelOpts::local(&model)
        },
        data: s.calibration.clone(),
        output: after.clone(),
        seq_len: recipe.calibration.seq_len,
        max_tokens: recipe.calibration.max_tokens,
        no_logits: true,
        add_bos: false,
    })?;
    Ok(Some((routing, after)))
}

fn finetune_row(dir: &Path, routing: Routing, seconds: f64) -> Result<FinetuneRow> {
    let log = std::fs::read_to_string(dir.join("log.jsonl"))
        .with_context(|| format!("reading {}", dir.join("log.jsonl").display()))?;
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(serde_json::from_str)
        .collect::<std::result::Result<_, _>>()?;
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let first = lines.first().context("an empty training log")?;
    let last = lines.last().context("an empty training log")?;
    let ects: Vec<f64> = lines.iter().map(|v| f(v, "mean_ect")).collect();
    Ok(FinetuneRow {
        variant: routing.name(),
        max_devices: routing.prune.map(|p| p.0),
        rule: routing.prune.map(|p| p.1.name().to_string()),
        first_loss: f(first, "loss"),
        last_loss: f(last, "loss"),
        held_out_loss: last["eval_loss"].as_f64(),
        mean_ect: ects.iter().sum::<f64>() / ects.len().max(1) as f64,
        seconds,
    })
}

fn quality_rows(
    file: &Path,
    variant: &str,
    fine_tuned: bool,
    routing: Routing,
) -> Result<Vec<QualityRow>> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let results = v["results"]
        .as_object()
        .context("no `results` in the eval output")?;
    Ok(results
        .iter()
        .map(|(task, r)| QualityRow {
            variant: variant.to_string(),
            fine_tuned,
            max_devices: routing.prune.map(|p| p.0),
            rule: routing.prune.map(|p| p.1.name().to_string()),
            task: task.clone(),
            acc: r["acc"].as_f64().unwrap_or(f64::NAN),
            acc_norm: r["acc_norm"].as_f64(),
        })
        .collect())
}
