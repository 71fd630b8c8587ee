//! `occult bench`: benchmarks as commands. `bench place` times each placement method on the same
//! traces and device counts in one run and reports E[C_T] side by side.

use super::{load_trace, with_provenance, write_json};
use crate::table::Table;
use anyhow::Result;
use clap::{Args, Subcommand};
use occult_core::analysis::place_trace;
use occult_core::placement::{Method, SearchConfig};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Time contiguous, greedy and occult placement on the same traces; compare E[C_T].
    #[command(after_help = "Example:\n  \
        occult trace synth --tokens 100000 -o clustered.safetensors --no-logits\n  \
        occult trace synth --tokens 100000 --uniform -o uniform.safetensors --no-logits\n  \
        occult bench place --trace clustered.safetensors --trace uniform.safetensors --devices 4,8,16")]
    Place(PlaceBenchArgs),
}

#[derive(Args, Debug)]
pub struct PlaceBenchArgs {
    /// Routing traces (repeat the flag for several).
    #[arg(long, required = true)]
    pub trace: Vec<PathBuf>,
    /// Device counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
    pub devices: Vec<usize>,
    #[arg(long, default_value_t = 2)]
    pub restarts: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One timed placement run.
#[derive(Clone, Debug, Serialize)]
pub struct PlaceRun {
    pub trace: String,
    pub method: &'static str,
    pub devices: usize,
    pub layers: usize,
    pub tokens: usize,
    pub seconds: f64,
    pub ect: f64,
}

pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Place(a) => place(a),
    }
}

fn place(a: PlaceBenchArgs) -> Result<()> {
    let cfg = SearchConfig {
        restarts: a.restarts,
        seed: a.seed,
        max_load_factor: None,
    };
    let mut runs = Vec::new();
    for path in &a.trace {
        let trace = load_trace(path)?;
        for &d in &a.devices {
            for m in [Method::Contiguous, Method::Greedy, Method::Occult] {
                let start = Instant::now();
                let (_, infos) = place_trace(&trace, d, m, &cfg, &|| {})?;
                let seconds = start.elapsed().as_secs_f64();
                let run = PlaceRun {
                    trace: path.display().to_string(),
                    method: m.name(),
                    devices: d,
                    layers: infos.len(),
                    tokens: trace.layers.first().map_or(0, |l| l.tokens),
                    seconds,
                    ect: occult_core::collab::token_weighted_mean(
                        infos.iter().map(|i| (i.ect, i.tokens)),
                    ),
                };
                eprintln!(
                    "{} D={d} {}: {:.2} s, E[C_T] {:.3}",
                    run.trace, run.method, run.seconds, run.ect
                );
                runs.push(run);
            }
        }
    }
    print!("{}", render(&runs));
    if let Some(out) = &a.json {
        let v = serde_json::json!({ "bench": "place", "results": runs });
        write_json(out, &with_provenance(v))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

fn render(runs: &[PlaceRun]) -> String {
    let mut t = Table::new(&[
        "trace",
        "D",
        "method",
        "seconds",
        "mean E[C_T]",
        "vs contiguous",
        "vs greedy",
    ]);
    for r in runs {
        let find = |m: &str| {
            runs.iter()
                .find(|x| x.trace == r.trace && x.devices == r.devices && x.method == m)
                .map(|x| x.ect)
        };
        let ratio = |b: Option<f64>| b.map_or("-".into(), |b| format!("{:.3}", r.ect / b));
        t.row(vec![
            r.trace.clone(),
            r.devices.to_string(),
            r.method.into(),
            format!("{:.2}", r.seconds),
            format!("{:.3}", r.ect),
            ratio(find("contiguous")),
            ratio(find("greedy")),
        ]);
    }
    t.render()
}
