//! `occult bench place`: each placement method (contiguous, greedy, occult) timed on the same
//! traces and device counts in one run, with E[C_T] side by side.

use crate::table::Table;
use anyhow::Result;
use occult_core::analysis::place_trace;
use occult_core::analysis::placement::{Method, SearchConfig};
use occult_core::analysis::trace::Trace;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

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

/// Times every method on every trace and device count, prints the table and writes the runs
/// as JSON to `json`.
pub fn run(
    traces: &[PathBuf],
    devices: &[usize],
    cfg: &SearchConfig,
    json: Option<&Path>,
) -> Result<()> {
    let mut runs = Vec::new();
    for path in traces {
        let trace = Trace::read(path)?;
        for &d in devices {
            for m in Method::ALL {
                let start = Instant::now();
                let (_, infos) = place_trace(&trace, d, m, cfg, &|| {})?;
                let seconds = start.elapsed().as_secs_f64();
                let run = PlaceRun {
                    trace: path.display().to_string(),
                    method: m.name(),
                    devices: d,
                    layers: infos.len(),
                    tokens: trace.layers.first().map_or(0, |l| l.tokens),
                    seconds,
                    ect: occult_core::analysis::collab::token_weighted_mean(
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
    if let Some(out) = json {
        super::report::write(out, "place", serde_json::json!({ "results": runs }))?;
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
