//! `occult reproduce`: the end-to-end recipe. Today it runs the analysis ladder of the paper on
//! a routing trace (synthetic and OLMoE-shaped by default): standard dispatch, Occult's
//! deduplicated dispatch, greedy and our placement, then pruning to fewer devices, and writes
//! `results.json` and `report.md` with E[C_T], rows and bytes for every step.

use super::{with_provenance, write_json, RowDtype};
use crate::table::{count, Table};
use anyhow::{bail, Context, Result};
use clap::Args;
use occult_core::analysis::placement::{Method, Placement, SearchConfig};
use occult_core::analysis::pruning::PruneRule;
use occult_core::analysis::routing::RouterRule;
use occult_core::analysis::synth::{synth_trace, SynthConfig};
use occult_core::analysis::trace::Trace;
use occult_core::analysis::{place_trace, prune_trace, trace_stats, TraceStats};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;

/// The built-in recipe, `configs/reproduce.toml`.
pub const DEFAULT_RECIPE: &str = include_str!("../../../configs/reproduce.toml");

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    occult reproduce                       # built-in recipe (configs/reproduce.toml)\n  \
    occult reproduce my-recipe.toml --out results/")]
pub struct ReproduceArgs {
    /// Recipe file (TOML); the built-in one when omitted.
    pub recipe: Option<PathBuf>,
    /// Output folder (created if missing).
    #[arg(long, default_value = "out/reproduce")]
    pub out: PathBuf,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub name: String,
    pub trace: TraceRecipe,
    pub analysis: AnalysisRecipe,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRecipe {
    pub path: Option<PathBuf>,
    #[serde(default = "d64")]
    pub experts: usize,
    #[serde(default = "d8")]
    pub top_k: usize,
    #[serde(default = "d16")]
    pub layers: usize,
    #[serde(default = "d20000")]
    pub tokens: usize,
    #[serde(default = "d8")]
    pub clusters: usize,
    #[serde(default = "d2")]
    pub strength: f32,
    #[serde(default = "d03")]
    pub skew: f32,
    #[serde(default)]
    pub seed: u64,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AnalysisRecipe {
    pub devices: usize,
    #[serde(default = "d2048")]
    pub hidden_size: u64,
    #[serde(default = "dbf16")]
    pub dtype: String,
    #[serde(default = "d2u")]
    pub restarts: usize,
    #[serde(default)]
    pub prune_devices: Vec<usize>,
    #[serde(default)]
    pub prune_rules: Vec<String>,
}

fn d64() -> usize {
    64
}
fn d8() -> usize {
    8
}
fn d16() -> usize {
    16
}
fn d20000() -> usize {
    20000
}
fn d2() -> f32 {
    2.0
}
fn d03() -> f32 {
    0.3
}
fn d2u() -> usize {
    2
}
fn d2048() -> u64 {
    2048
}
fn dbf16() -> String {
    "bf16".into()
}

/// One step of the ladder.
#[derive(Clone, Debug, Serialize)]
pub struct Step {
    pub step: String,
    pub placement: String,
    pub ect: f64,
    pub rows_per_token: f64,
    pub remote_rows_per_token: f64,
    pub remote_bytes: u64,
    /// Remote bytes relative to standard dispatch under the contiguous placement.
    pub vs_standard: f64,
    /// Share of (token, expert) choices changed (pruning steps only).
    pub changed_fraction: Option<f64>,
    pub seconds: f64,
}

pub fn run(a: ReproduceArgs) -> Result<()> {
    let (text, origin) = match &a.recipe {
        Some(p) => (
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
            p.display().to_string(),
        ),
        None => (DEFAULT_RECIPE.to_string(), "built-in".to_string()),
    };
    let recipe: Recipe =
        toml::from_str(&text).with_context(|| format!("recipe {origin} is not valid"))?;
    let dtype = match recipe.analysis.dtype.as_str() {
        "f32" => RowDtype::F32,
        "bf16" => RowDtype::Bf16,
        "f16" => RowDtype::F16,
        "fp8" => RowDtype::Fp8,
        other => {
            bail!("recipe {origin}: analysis.dtype {other:?} is not one of f32, bf16, f16, fp8")
        }
    };
    let rules = recipe
        .analysis
        .prune_rules
        .iter()
        .map(|r| match r.as_str() {
            "router" => Ok(PruneRule::Router),
            "similarity" => Ok(PruneRule::Similarity),
            other => bail!("recipe {origin}: prune rule {other:?} is not router or similarity"),
        })
        .collect::<Result<Vec<_>>>()?;
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("creating output folder {}", a.out.display()))?;
    let row_bytes = recipe.analysis.hidden_size * dtype.bytes();
    let d = recipe.analysis.devices;

    eprintln!("[1/4] routing trace");
    let t0 = Instant::now();
    let trace = match &recipe.trace.path {
        Some(p) => Trace::read(p)?,
        None => {
            let t = &recipe.trace;
            let cfg = SynthConfig {
                num_experts: t.experts,
                top_k: t.top_k,
                layers: t.layers,
                tokens: t.tokens,
                seed: t.seed,
                clusters: t.clusters,
                strength: t.strength,
                skew: t.skew,
                renormalize: false,
                with_logits: true,
            };
            let trace = synth_trace(&cfg, &|| {})?;
            trace.write(&a.out.join("trace.safetensors"))?;
            trace
        }
    };
    let trace_seconds = t0.elapsed().as_secs_f64();

    eprintln!("[2/4] placement: contiguous, greedy, occult");
    let cfg = SearchConfig {
        restarts: recipe.analysis.restarts,
        seed: recipe.trace.seed,
        max_load_factor: None,
    };
    let mut placements: Vec<(Method, Placement, f64)> = Vec::new();
    for m in [Method::Contiguous, Method::Greedy, Method::Occult] {
        let t = Instant::now();
        let (p, _) = place_trace(&trace, d, m, &cfg, &|| {})?;
        let secs = t.elapsed().as_secs_f64();
        p.write(&a.out.join(format!("placement-{}.json", m.name())))?;
        placements.push((m, p, secs));
    }

    eprintln!("[3/4] statistics");
    let tokens: usize = trace.layers.iter().map(|l| l.tokens).sum();
    let per_tok = |x: u64| x as f64 / tokens.max(1) as f64;
    let sum = |s: &TraceStats, f: fn(&occult_core::analysis::collab::LayerStats) -> u64| {
        s.layers.iter().map(f).sum::<u64>()
    };
    let contiguous_stats = trace_stats(&trace, &placements[0].1, row_bytes, true)?;
    let base_bytes = sum(&contiguous_stats, |l| l.remote_rows_standard) * row_bytes;
    let step = |name: &str, placement: &str, s: &TraceStats, changed, seconds| {
        let remote = sum(s, |l| l.remote_rows_occult);
        Step {
            step: name.into(),
            placement: placement.into(),
            ect: s.mean_ect,
            rows_per_token: per_tok(sum(s, |l| l.rows_occult)),
            remote_rows_per_token: per_tok(remote),
            remote_bytes: remote * row_bytes,
            vs_standard: (remote * row_bytes) as f64 / base_bytes.max(1) as f64,
            changed_fraction: changed,
            seconds,
        }
    };
    let mut steps = vec![Step {
        step: "standard dispatch (one row per token-expert)".into(),
        placement: "contiguous".into(),
        ect: contiguous_stats.mean_ect,
        rows_per_token: per_tok(sum(&contiguous_stats, |l| l.rows_standard)),
        remote_rows_per_token: per_tok(sum(&contiguous_stats, |l| l.remote_rows_standard)),
        remote_bytes: base_bytes,
        vs_standard: 1.0,
        changed_fraction: None,
        seconds: 0.0,
    }];
    for (m, p, secs) in &placements {
        let s = trace_stats(&trace, p, row_bytes, true)?;
        let name = match m {
            Method::Contiguous => "Occult dispatch (one row per token-device)",
            Method::Greedy => "+ greedy placement (paper, Algorithm 1)",
            Method::Occult => "+ our placement (swap search)",
        };
        steps.push(step(name, m.name(), &s, None, *secs));
    }

    eprintln!("[4/4] collaboration pruning");
    let best = &placements[2].1;
    let router = RouterRule::softmax_topk(trace.meta.num_experts, trace.meta.top_k, false);
    for &n in &recipe.analysis.prune_devices {
        for &rule in &rules {
            let t = Instant::now();
            let (pruned, report) = prune_trace(&trace, best, &router, rule, n, None, &|| {})?;
            let s = trace_stats(&pruned, best, row_bytes, true)?;
            let name = format!("+ prune to {n} device(s), {} rule", rule.name());
            steps.push(step(
                &name,
                "occult",
                &s,
                Some(report.changed_fraction),
                t.elapsed().as_secs_f64(),
            ));
        }
    }

    let report = render(&recipe, &trace, &steps, &origin);
    let results = with_provenance(serde_json::json!({
        "recipe": recipe,
        "recipe_source": origin,
        "tokens_per_layer": trace.layers.first().map_or(0, |l| l.tokens),
        "row_bytes": row_bytes,
        "trace_seconds": trace_seconds,
        "steps": steps,
    }));
    write_json(&a.out.join("results.json"), &results)?;
    occult_core::atomic::write_atomic(&a.out.join("report.md"), |w| {
        w.write_all(report.as_bytes())
    })?;
    print!("{report}");
    eprintln!(
        "wrote {} and {}",
        a.out.join("report.md").display(),
        a.out.join("results.json").display()
    );
    Ok(())
}

fn render(recipe: &Recipe, trace: &Trace, steps: &[Step], origin: &str) -> String {
    let mut t = Table::new(&[
        "step",
        "placement",
        "E[C_T]",
        "rows/token",
        "remote rows/token",
        "remote bytes",
        "vs standard",
        "changed",
    ]);
    for s in steps {
        t.row(vec![
            s.step.clone(),
            s.placement.clone(),
            format!("{:.3}", s.ect),
            format!("{:.3}", s.rows_per_token),
            format!("{:.3}", s.remote_rows_per_token),
            count(s.remote_bytes),
            format!("{:.3}", s.vs_standard),
            s.changed_fraction
                .map_or("-".into(), |c| format!("{:.1}%", 100.0 * c)),
        ]);
    }
    let src = match &recipe.trace.path {
        Some(p) => format!("recorded trace {}", p.display()),
        None => format!(
            "synthetic trace ({} experts, top-{}, {} layers x {} tokens, {} clusters, strength {}, seed {})",
            recipe.trace.experts,
            recipe.trace.top_k,
            recipe.trace.layers,
            recipe.trace.tokens,
            recipe.trace.clusters,
            recipe.trace.strength,
            recipe.trace.seed
        ),
    };
    format!(
        "# Occult reproduce: {}\n\nRecipe: {origin}. Routing: {src}; {} experts, top-{}.\n\
         {} devices; rows of hidden size {} in {}; remote = rows that leave the token's source rank \
         (tokens split evenly and in order).\n\n{}",
        recipe.name,
        trace.meta.num_experts,
        trace.meta.top_k,
        recipe.analysis.devices,
        recipe.analysis.hidden_size,
        recipe.analysis.dtype,
        t.render()
    )
}
