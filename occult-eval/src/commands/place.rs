//! `occult place`: place experts on devices from a routing trace.

use crate::progress::bar;
use crate::table::{fmt_opt, Table};
use anyhow::{Context, Result};
use clap::Args;
use occult_core::analysis::placement::{Method, Placement, SearchConfig};
use occult_core::analysis::{place_steps_per_layer, place_trace, PlaceInfo};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    occult place --trace olmoe-like.safetensors --devices 4 --method occult -o placed.json\n  \
    occult place --trace olmoe-like.safetensors --devices 8 --method occult --max-load-factor 1.2 -o placed.json")]
pub struct PlaceArgs {
    /// Routing trace (safetensors, format occult.trace.v1).
    #[arg(long)]
    pub trace: PathBuf,
    #[arg(long)]
    pub devices: usize,
    #[arg(long, value_enum, default_value_t = Method::Occult)]
    pub method: Method,
    /// occult method: keep each device's (token, expert) load within this factor of the mean.
    #[arg(long)]
    pub max_load_factor: Option<f64>,
    /// occult method: random starts besides the greedy and contiguous ones.
    #[arg(long, default_value_t = 2)]
    pub restarts: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output placement (JSON, format occult.placement.v1).
    #[arg(short, long)]
    pub output: PathBuf,
}

pub fn run(a: PlaceArgs) -> Result<()> {
    super::check_io(&[Some(&a.trace)], &[Some(&a.output)])?;
    let trace = super::load_trace(&a.trace)?;
    let cfg = SearchConfig {
        restarts: a.restarts,
        seed: a.seed,
        max_load_factor: a.max_load_factor,
    };
    let steps = place_steps_per_layer(a.method, &cfg) * trace.layers.len();
    let pb = bar(steps as u64, "search steps");
    let start = Instant::now();
    let (mut placement, infos) = place_trace(&trace, a.devices, a.method, &cfg, &|| pb.inc(1))
        .with_context(|| a.trace.display().to_string())?;
    let seconds = start.elapsed().as_secs_f64();
    pb.finish_and_clear();
    record_source(&mut placement, &a, seconds);
    placement.write(&a.output)?;
    print!("{}", render(&infos, &placement));
    eprintln!("placed in {seconds:.2} s; wrote {}", a.output.display());
    Ok(())
}

fn record_source(p: &mut Placement, a: &PlaceArgs, seconds: f64) {
    let s = &mut p.source;
    s.insert("trace".into(), a.trace.display().to_string().into());
    s.insert("seed".into(), a.seed.into());
    s.insert("restarts".into(), a.restarts.into());
    if let Some(f) = a.max_load_factor {
        s.insert("max_load_factor".into(), f.into());
    }
    s.insert("seconds".into(), seconds.into());
    s.insert(
        "occult_version".into(),
        env!("CARGO_PKG_VERSION").to_string().into(),
    );
}

fn render(infos: &[PlaceInfo], p: &Placement) -> String {
    let mut t = Table::new(&[
        "layer",
        "E[C_T]",
        "greedy E[C_T]",
        "max/mean load",
        "start",
        "swaps",
    ]);
    for (i, l) in infos.iter().zip(&p.layers) {
        t.row(vec![
            i.layer.to_string(),
            format!("{:.3}", i.ect),
            fmt_opt(i.greedy_ect, 3),
            fmt_opt(l.metrics.as_ref().map(|m| m.max_load_ratio), 3),
            i.start.clone().unwrap_or_else(|| "-".into()),
            i.swaps.map_or("-".into(), |s| s.to_string()),
        ]);
    }
    let mean =
        occult_core::analysis::collab::token_weighted_mean(infos.iter().map(|i| (i.ect, i.tokens)));
    format!(
        "{}\nmethod {}: mean E[C_T] {mean:.3} on {} devices\n",
        t.render(),
        p.method,
        p.num_devices
    )
}
