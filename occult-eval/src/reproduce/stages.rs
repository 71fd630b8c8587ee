//! The stages of [`super::run`], one function each, passing typed values on: the trace, the
//! [`Placements`] and our [`Placed`] placement, the speed rows, the fine-tuned models and the
//! quality rows; and the model specs each stage runs under.

use super::ladder::{ect_ladder, LadderSettings, Placements, Step};
use super::plots;
use super::progress::{Progress, Stage};
use super::ranks::Ranks;
use super::recipe::{self, Recipe};
use super::results::{CollaborationShift, FinetuneRow, QualityRow, Routing, ShapedOutcome};
use super::shaped;
use super::speed::{self, SpeedRow};
use super::subject::Subject;
use crate::context::ModelSpec;
use crate::harness::results::TaskOutcome;
use crate::jobs::eval::{evaluate, EvalJob, Evaluated};
use crate::jobs::fine_tune::{fine_tune, FineTune};
use crate::jobs::profile::{profile, ProfileJob};
use anyhow::{Context, Result};
use occult_core::analysis::cost::projection::{ProjectReport, ProjectSettings};
use occult_core::analysis::placement::Placement;
use occult_core::analysis::pruning::{PruneLimit, PruneRule};
use occult_core::analysis::run_key::MoeMode;
use occult_core::analysis::trace::Trace;
use occult_core::models::config::ModelConfig;
use occult_train::log::StepRecord;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// The model on the recipe's ranks in Occult dispatch, without a placement.
pub fn ranks_spec(model: &str, r: &Recipe) -> ModelSpec {
    let mut o = ModelSpec::local(model);
    o.dtype = r.model.dtype.clone();
    o.devices = r.devices;
    o.backend = r.backend;
    o.comm_timeout = r.comm_timeout;
    o.mode = Some(MoeMode::Occult);
    o
}

/// The model on the recipe's ranks under `placement`, served or fine-tuned under `routing`
/// (the similarity rule's tables from the calibration trace).
pub fn routed_spec(model: &str, r: &Recipe, placement: &Placed, routing: Routing) -> ModelSpec {
    let mut o = ranks_spec(model, r);
    o.placement = Some(placement.placement.clone());
    o.placement_file = Some(placement.file.clone());
    if let Some((limit, rule)) = routing.prune {
        o.prune = Some(limit);
        if let PruneLimit::Nodes {
            devices_per_node, ..
        } = limit
        {
            o.devices_per_node = Some(devices_per_node);
        }
        o.prune_rule = rule;
        if rule == PruneRule::Similarity {
            o.calibration = Some(placement.trace_file.clone());
            o.calibration_trace = Some(placement.trace.clone());
        }
    }
    o
}

/// Our placement, as every stage after the table serves under it, with the files it and the
/// calibration trace were written to.
pub struct Placed {
    pub placement: Placement,
    pub file: PathBuf,
    pub trace_file: PathBuf,
    /// The calibration trace, in memory (the similarity rule's tables come from it).
    pub trace: Arc<Trace>,
}

/// The routing profile on the calibration text, on the recipe's ranks (one device locally);
/// written to `trace.safetensors` and returned on every rank.
pub fn profile_stage(recipe: &Recipe, s: &Subject, ranks: &Ranks, out: &Path) -> Result<Trace> {
    let spec = if ranks.mpi() {
        ranks_spec(&s.model, recipe)
    } else {
        let mut o = ModelSpec::local(&s.model);
        o.dtype = recipe.model.dtype.clone();
        o
    };
    let job = ProfileJob {
        seq_len: recipe.calibration.seq_len,
        max_tokens: recipe.calibration.max_tokens,
        ..ProfileJob::new(&s.calibration)
    };
    let file = out.join("trace.safetensors");
    spec.check_io(&[Some(&s.calibration)], &[Some(&file)])?;
    let profiled = profile(&spec, &job)?;
    if let Some(p) = &profiled {
        p.trace.write(&file)?;
        eprintln!("{}", p.summary(&file));
    }
    ranks.share(profiled.map(|p| p.trace), &file, |p| Ok(Trace::read(p)?))
}

/// The three placements and the E[C_T] table (rank 0's; the placements are written beside the
/// report), and our placement on every rank.
pub fn placement_stage(
    recipe: &Recipe,
    cfg: &ModelConfig,
    trace: &Arc<Trace>,
    ranks: &Ranks,
    out: &Path,
) -> Result<(Vec<Step>, Option<Placements>, Placed)> {
    let router = cfg.router_rule();
    let file = out.join("placement-occult.json");
    let (steps, placements) = if ranks.root() {
        let (steps, placements) = ect_ladder(
            trace,
            &LadderSettings {
                devices: recipe.devices,
                row_bytes: cfg.hidden_size as u64 * recipe.analysis.row_dtype.bytes(),
                restarts: recipe.analysis.restarts,
                seed: 0,
                prune_devices: &recipe.analysis.prune_devices,
                rules: &recipe.analysis.prune_rules,
                router: &router,
            },
        )?;
        for (m, p) in placements.iter() {
            p.write(&out.join(format!("placement-{}.json", m.name())))?;
        }
        (steps, Some(placements))
    } else {
        (Vec::new(), None)
    };
    let ours = placements.as_ref().map(|p| p.ours().clone());
    let placement = ranks.share(ours, &file, |p| Ok(Placement::read(p)?))?;
    let placed = Placed {
        placement,
        file,
        trace_file: out.join("trace.safetensors"),
        trace: trace.clone(),
    };
    Ok((steps, placements, placed))
}

/// The speed stage (measured and projected), then again over shaped links where the machine
/// allows; the shaped run's outcome (`None` where the recipe skips it).
pub fn speed_stage(
    recipe: &Recipe,
    s: &Subject,
    placed: &Placed,
    ranks: &Ranks,
    out: &Path,
    progress: &mut Progress,
) -> Result<(Vec<SpeedRow>, Option<ShapedOutcome>)> {
    if recipe.speed.skip {
        return Ok((Vec::new(), None));
    }
    progress.stage(Stage::Speed);
    let spec = routed_spec(&s.model, recipe, placed, Routing { prune: None });
    let mut speed = speed::speed(&spec, &recipe.speed)?;
    if recipe.shaped.skip {
        return Ok((speed, None));
    }
    progress.stage(Stage::Shaped);
    let why = if ranks.mpi() {
        Some("the recipe runs under mpirun, and the shaped run starts its own".to_string())
    } else {
        shaped::unavailable(&shaped::script())
    };
    let shaped = match why {
        Some(why) => {
            eprintln!("  skipped: {why}");
            ShapedOutcome::skipped(why)
        }
        // A machine that refuses namespaces or shaping costs this stage, not the run.
        None => match shaped::run(
            &recipe.shaped,
            &s.model,
            &placed.file,
            recipe.devices,
            recipe.analysis.node_size(recipe.devices),
            out,
        ) {
            Ok(rows) => {
                speed.extend(rows);
                ShapedOutcome::ran(&recipe.shaped.rate)
            }
            Err(e) => {
                eprintln!("  failed: {e:#}");
                ShapedOutcome::skipped(format!("{e:#}"))
            }
        },
    };
    Ok((speed, Some(shaped)))
}

/// The placements section: every placement method on the recipe's devices, with E / 8
/// replicas (up to a multiple of the devices) for EPLB and for Occult's copies, E[C_T] and
/// max/mean device load each (`bench place --replicas`).
pub fn replica_stage(
    recipe: &Recipe,
    trace: &Trace,
    trace_file: &Path,
) -> Result<Vec<crate::bench::place::PlaceRun>> {
    let cfg = occult_core::analysis::placement::SearchConfig {
        restarts: recipe.analysis.restarts,
        seed: 0,
        max_load_factor: None,
        nodes: None,
    };
    let replicas = (trace.meta.num_experts / 8).max(1);
    let proj = crate::bench::place::PlaceProjection::olmoe_on(&["pcie4", "nvlink-h100"], 2048)?;
    crate::bench::place::runs_on(trace, trace_file, recipe.devices, &cfg, replicas, &proj)
}

/// A fine-tuned model: the routing it was fine-tuned under, its seed and its folder.
pub struct FineTuned {
    pub routing: Routing,
    pub seed: u64,
    pub dir: PathBuf,
}

/// A folder or file name for `name` fine-tuned with `seed`: `-seedS` after it for seeds other
/// than 0.
fn seeded(name: &str, seed: u64) -> String {
    match seed {
        0 => name.to_string(),
        s => format!("{name}-seed{s}"),
    }
}

/// Fine-tuning from the same start under each routing, once per seed (the seed orders the
/// data); the models on every rank, their rows on rank 0.
pub fn finetune_stage(
    recipe: &Recipe,
    s: &Subject,
    placed: &Placed,
    routings: &[Routing],
    ranks: &Ranks,
    out: &Path,
    progress: &Progress,
) -> Result<(Vec<FineTuned>, Vec<FinetuneRow>)> {
    let data = s.instructions.clone().expect("checked");
    let (mut models, mut rows) = (Vec::new(), Vec::new());
    let seeds = recipe.quality.seeds() as u64;
    let runs: Vec<(u64, Routing)> = (0..seeds)
        .flat_map(|s| routings.iter().map(move |r| (s, *r)))
        .collect();
    for (i, &(seed, routing)) in runs.iter().enumerate() {
        let name = seeded(&routing.name(), seed);
        let dir = out.join("finetune").join(&name);
        progress.item(&name, i, runs.len());
        let t = Instant::now();
        let job = FineTune {
            steps: recipe.finetune.steps,
            seq_len: recipe.finetune.seq_len,
            batch_size: recipe.finetune.batch_size,
            lr: recipe.finetune.lr,
            warmup: Some(recipe.finetune.steps / 10),
            overwrite: true,
            eval_data: s.held_out.clone(),
            seed,
            ..FineTune::new(&data, &dir)
        };
        let log = fine_tune(&routed_spec(&s.model, recipe, placed, routing), &job)
            .with_context(|| format!("fine-tuning under {name}"))?;
        ranks.sync()?;
        if let (true, Some(log)) = (ranks.root(), log) {
            let _ = std::fs::remove_dir_all(dir.join("state"));
            let seconds = t.elapsed().as_secs_f64();
            rows.push(
                finetune_row(&log, routing, seed, seconds)
                    .with_context(|| format!("fine-tuning under {name}"))?,
            );
        }
        models.push(FineTuned { routing, seed, dir });
    }
    Ok((models, rows))
}

/// Quality on the tasks: the start served under every routing, the standard fine-tuned model
/// likewise, and each pruned fine-tuned model under its own routing (every seed's). Each
/// evaluation's results are written under `quality/`; the rows are rank 0's.
pub fn quality_stage(
    recipe: &Recipe,
    s: &Subject,
    placed: &Placed,
    routings: &[Routing],
    finetuned: &[FineTuned],
    out: &Path,
    progress: &Progress,
) -> Result<Vec<QualityRow>> {
    let mut quality = Vec::new();
    let job = EvalJob {
        data: s.task_data.clone(),
        num_fewshot: recipe.quality.num_fewshot,
        limit: recipe.quality.limit,
        // Per-item scores, for the paired intervals.
        samples: true,
        ..EvalJob::new(s.tasks.clone())
    };
    let task_inputs = job.inputs()?;
    let standards = finetuned
        .iter()
        .filter(|f| f.routing.prune.is_none())
        .count();
    let pruned = finetuned.len() - standards;
    // The standard fine-tuned model under every routing, or exact alone.
    let standard_routings: Vec<Routing> = if recipe.quality.standard_served_pruned {
        routings.to_vec()
    } else {
        routings
            .iter()
            .copied()
            .filter(|r| r.prune.is_none())
            .collect()
    };
    let evaluations = routings.len() + standards * standard_routings.len() + pruned;
    let mut started = 0;
    let mut evaluate_one = |variant: &str, model: &str, seed: Option<u64>, routing: Routing| {
        let label = seeded(variant, seed.unwrap_or(0));
        let file = out
            .join("quality")
            .join(format!("{label}--served-{}.json", routing.name()));
        std::fs::create_dir_all(file.parent().expect("a folder"))?;
        progress.item(
            &format!("{label}, served {}", routing.name()),
            started,
            evaluations,
        );
        started += 1;
        let spec = routed_spec(model, recipe, placed, routing);
        let more: Vec<Option<&Path>> = task_inputs.iter().map(|p| Some(p.as_path())).collect();
        spec.check_io(&more, &[Some(&file)])?;
        let scored = evaluate(&spec, &job)
            .and_then(|done| {
                let Some(done) = done else { return Ok(()) };
                done.write(&file, false)?;
                done.check(job.tasks.len())?;
                let rows = quality_rows(&done, variant, seed, routing)?;
                quality.extend(rows);
                Ok(())
            })
            .with_context(|| format!("evaluating {variant} served {}", routing.name()));
        scored
    };
    for &routing in routings {
        evaluate_one("base", &s.model, None, routing)?;
    }
    for standard in finetuned.iter().filter(|f| f.routing.prune.is_none()) {
        let model = standard.dir.display().to_string();
        for &routing in &standard_routings {
            evaluate_one("exact", &model, Some(standard.seed), routing)?;
        }
    }
    for f in finetuned.iter().filter(|f| f.routing.prune.is_some()) {
        let model = f.dir.display().to_string();
        evaluate_one(&f.routing.name(), &model, Some(f.seed), f.routing)?;
    }
    Ok(quality)
}

/// Exact routing, then each pruning of the recipe with each rule: to devices, then to nodes
/// (of the recipe's node size).
pub fn routings(recipe: &Recipe) -> Vec<Routing> {
    let a = &recipe.analysis;
    let devices = a.prune_devices.iter().map(|&n| PruneLimit::Devices(n));
    let nodes = a.node_limits(recipe.devices);
    std::iter::once(Routing { prune: None })
        .chain(devices.chain(nodes).flat_map(|limit| {
            a.prune_rules.iter().map(move |&r| Routing {
                prune: Some((limit, r)),
            })
        }))
        .collect()
}

/// Collaboration before and after pruned fine-tuning: the routing the fine-tuned model chooses
/// on its own (unpruned) on the calibration text, under our placement; its E[C_T] beside the
/// start's, and the co-activation heat maps of the first MoE layer.
pub fn collaboration(
    recipe: &Recipe,
    cfg: &ModelConfig,
    trace: &Trace,
    after: &Trace,
    best: &Placement,
    routing: Routing,
    out: &Path,
) -> Result<(CollaborationShift, PathBuf)> {
    let row = cfg.hidden_size as u64 * 2;
    let before_ect = occult_core::analysis::trace_stats(trace, best, row, true)?.mean_ect;
    let after_ect = occult_core::analysis::trace_stats(after, best, row, true)?.mean_ect;
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
    let shift = CollaborationShift {
        variant: routing.name(),
        ect_before: before_ect,
        ect_after: after_ect,
    };
    Ok((shift, p))
}

/// The projection stage: `occult project` on the profiled trace.
pub fn project(
    p: &recipe::ProjectionRecipe,
    recipe: &Recipe,
    cfg: &ModelConfig,
    trace: &Trace,
) -> Result<ProjectReport> {
    let own = crate::jobs::project::layer_sizes(cfg);
    let profiles = crate::jobs::project::load_profiles(&p.links)?;
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
    crate::jobs::project::project(trace, &profiles, &settings)
}

/// The routing the pruned-to-2 fine-tuned model chooses on its own (unpruned) on the
/// calibration text: its trace, profiled on the recipe's ranks and written beside the report;
/// rank 0's, and `None` without that model.
pub fn collaboration_trace(
    finetuned: &[FineTuned],
    recipe: &Recipe,
    s: &Subject,
    out: &Path,
    mpi: bool,
) -> Result<Option<(Routing, Trace)>> {
    let Some(f) = finetuned
        .iter()
        .find(|f| f.routing.max_devices() == Some(2))
    else {
        return Ok(None);
    };
    if !f.dir.join("config.json").exists() {
        return Ok(None);
    }
    let model = f.dir.display().to_string();
    let spec = if mpi {
        ranks_spec(&model, recipe)
    } else {
        ModelSpec::local(&model)
    };
    let job = ProfileJob {
        seq_len: recipe.calibration.seq_len,
        max_tokens: recipe.calibration.max_tokens,
        logits: false,
        ..ProfileJob::new(&s.calibration)
    };
    let Some(p) = profile(&spec, &job)? else {
        return Ok(None);
    };
    let file = out.join(format!("trace-finetuned-{}.safetensors", f.routing.name()));
    p.trace.write(&file)?;
    eprintln!("{}", p.summary(&file));
    Ok(Some((f.routing, p.trace)))
}

/// A fine-tuning run's row: its first and last losses, its last held-out loss and its mean
/// E[C_T] over steps, from its log.
pub fn finetune_row(
    log: &[StepRecord],
    routing: Routing,
    seed: u64,
    seconds: f64,
) -> Result<FinetuneRow> {
    let (Some(first), Some(last)) = (log.first(), log.last()) else {
        anyhow::bail!("the run logged no steps");
    };
    Ok(FinetuneRow {
        variant: routing.name(),
        seed,
        max_devices: routing.max_devices(),
        max_nodes: routing.max_nodes(),
        rule: routing.rule(),
        first_loss: first.loss,
        last_loss: last.loss,
        held_out_loss: last.eval_loss,
        mean_ect: log.iter().map(|r| r.mean_ect).sum::<f64>() / log.len() as f64,
        seconds,
    })
}

/// The quality rows of one evaluation, by task name: each task's accuracy with its standard
/// error, and each item's score and question in `doc_id` order (the same order for every
/// model).
pub fn quality_rows(
    done: &Evaluated,
    variant: &str,
    seed: Option<u64>,
    routing: Routing,
) -> Result<Vec<QualityRow>> {
    let mut tasks: Vec<&(String, TaskOutcome)> = done.tasks.iter().collect();
    tasks.sort_by(|a, b| a.0.cmp(&b.0));
    tasks
        .into_iter()
        .map(|(task, t)| {
            let items = t
                .item_scores()
                .with_context(|| format!("{task}: an item without its prompt_hash"))?;
            let (metric, acc) = t.headline();
            Ok(QualityRow {
                variant: variant.to_string(),
                fine_tuned: seed.is_some(),
                seed,
                max_devices: routing.max_devices(),
                max_nodes: routing.max_nodes(),
                rule: routing.rule(),
                task: task.clone(),
                metric,
                acc: acc.value,
                acc_stderr: acc.stderr,
                acc_norm: t.acc_norm(),
                items: items.len(),
                item_acc: items.iter().map(|i| i.score).collect(),
                item_question: items.iter().map(|i| i.question).collect(),
            })
        })
        .collect()
}
