//! The PNG plots of `occult reproduce`, drawn with plotters and the DejaVu Sans font compiled in
//! (so no system font is needed): E[C_T] per step of the table, each mode's prefill speed-up
//! over standard dispatch against tokens (measured locally, measured over shaped links, and
//! projected), and mean task accuracy against the E[C_T] of the routing served, with 95%
//! intervals, per rule. Colours are Okabe and Ito's, which read on white and apart for
//! colour-blind readers (their yellow left out).

use super::ladder::Step;
use super::results::QualityRow;
use super::speed::SpeedRow;
use anyhow::{anyhow, Result};
use occult_core::analysis::placement::Method;
use occult_core::analysis::run_key::{DispatchMode, MoeMode, RunKey};
use plotters::prelude::*;
use std::path::{Path, PathBuf};

const FONT: &str = "sans-serif";

/// Okabe and Ito's colours without the yellow, then darker shades of a few: all read on white.
const COLOURS: [RGBColor; 10] = [
    RGBColor(0, 114, 178),   // blue
    RGBColor(213, 94, 0),    // vermillion
    RGBColor(0, 158, 115),   // bluish green
    RGBColor(204, 121, 167), // reddish purple
    RGBColor(230, 159, 0),   // orange
    RGBColor(86, 180, 233),  // sky blue
    RGBColor(0, 0, 0),       // black
    RGBColor(0, 70, 110),    // dark blue
    RGBColor(140, 60, 0),    // dark vermillion
    RGBColor(0, 100, 70),    // dark green
];

/// The colour of series `i`.
fn colour(i: usize) -> RGBAColor {
    COLOURS[i % COLOURS.len()].to_rgba()
}

/// One named series of points, each with an optional vertical error bar: how far it reaches
/// below and above the point.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    errors: Vec<(f64, f64)>,
}

impl Series {
    fn plain(name: String, points: Vec<(f64, f64)>) -> Self {
        Series {
            name,
            points,
            errors: Vec::new(),
        }
    }
}
const SIZE: (u32, u32) = (800, 480);

fn register_font() -> Result<()> {
    static ONCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *ONCE.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the plot font could not be loaded"))
    }
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing a plot: {e:?}")
}

/// E[C_T] per step, as bars.
pub fn ect_bars(path: &Path, steps: &[Step]) -> Result<()> {
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let top = steps.iter().map(|s| s.ect).fold(1.0, f64::max) * 1.1;
    let n = steps.len() as i32;
    let mut c = ChartBuilder::on(&root)
        .caption("E[C_T]: devices per token", (FONT, 22))
        .margin(12)
        .x_label_area_size(70)
        .y_label_area_size(50)
        .build_cartesian_2d((0..n).into_segmented(), 0.0..top)
        .map_err(err)?;
    let label = |i: usize| -> String {
        let s = &steps[i];
        match (s.max_devices, &s.rule) {
            (Some(d), Some(r)) => format!("prune {d} ({})", &r[..3]),
            _ => {
                s.placement.clone()
                    + if s.dispatch == DispatchMode::Standard {
                        " k-copy"
                    } else {
                        ""
                    }
            }
        }
    };
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(steps.len())
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) if (*i as usize) < steps.len() => label(*i as usize),
            _ => String::new(),
        })
        .x_label_style((FONT, 12))
        .y_desc("E[C_T]")
        .draw()
        .map_err(err)?;
    c.draw_series(steps.iter().enumerate().map(|(i, s)| {
        let mut bar = Rectangle::new(
            [
                (SegmentValue::Exact(i as i32), 0.0),
                (SegmentValue::Exact(i as i32 + 1), s.ect),
            ],
            BLUE.mix(0.6).filled(),
        );
        bar.set_margin(0, 0, 6, 6);
        bar
    }))
    .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// One series per name, `(x, y)` points each (with error bars where given), joined by lines if
/// `connect`; the y axis from 0 unless `y_from_data`.
fn lines(
    path: &Path,
    caption: &str,
    (x_desc, y_desc): (&str, &str),
    series: &[Series],
    connect: bool,
) -> Result<()> {
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for s in series {
        for (i, &(x, y)) in s.points.iter().enumerate() {
            let (down, up) = s.errors.get(i).copied().unwrap_or((0.0, 0.0));
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y - down), y1.max(y + up));
        }
    }
    if x0 > x1 {
        return Ok(());
    }
    let pad = |a: f64, b: f64| {
        if b > a {
            (b - a) * 0.08
        } else {
            a.abs().max(1e-9) * 0.1
        }
    };
    let (px, py) = (pad(x0, x1), pad(y0, y1));
    let mut c = ChartBuilder::on(&root)
        .caption(caption, (FONT, 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((x0 - px)..(x1 + px), (y0 - py).max(0.0)..(y1 + py))
        .map_err(err)?;
    c.configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .label_style((FONT, 12))
        .draw()
        .map_err(err)?;
    for (i, s) in series.iter().enumerate() {
        let color = colour(i);
        let line = if connect {
            s.points.clone()
        } else {
            Vec::new()
        };
        c.draw_series(LineSeries::new(line, color.stroke_width(2)))
            .map_err(err)?
            .label(s.name.clone())
            .legend(move |(x, y)| {
                EmptyElement::at((x + 9, y))
                    + PathElement::new(vec![(-9, 0), (9, 0)], color.stroke_width(2))
                    + Circle::new((0, 0), 4, color.filled())
            });
        c.draw_series(
            s.points
                .iter()
                .map(|&pt| Circle::new(pt, 4, color.filled())),
        )
        .map_err(err)?;
        let bars = s
            .points
            .iter()
            .zip(&s.errors)
            .map(|(&(x, y), &(down, up))| {
                ErrorBar::new_vertical(x, y - down, y, y + up, color.stroke_width(2), 8)
            });
        c.draw_series(bars).map_err(err)?;
    }
    c.configure_series_labels()
        .label_font((FONT, 13))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Writes every plot the results allow into `out`; returns the files written.
pub fn draw_all(
    out: &Path,
    steps: &[Step],
    speed: &[SpeedRow],
    quality: &[QualityRow],
) -> Result<Vec<PathBuf>> {
    register_font()?;
    let mut written = Vec::new();
    let p = out.join("ect.png");
    ect_bars(&p, steps)?;
    written.push(p);
    let series = speedup_series(speed);
    if !series.is_empty() {
        let p = out.join("speedup_vs_tokens.png");
        let axes = ("tokens over all ranks", "speed-up over standard dispatch");
        lines(
            &p,
            "Prefill speed-up over standard dispatch",
            axes,
            &series,
            true,
        )?;
        written.push(p);
    }
    let groups = quality_series(steps, quality);
    if !groups.is_empty() {
        let p = out.join("quality_vs_ect.png");
        let axes = (
            "E[C_T] of the routing served",
            "mean accuracy (95% interval)",
        );
        lines(&p, "Mean task accuracy against E[C_T]", axes, &groups, true)?;
        written.push(p);
    }
    Ok(written)
}

/// Each run's prefill speed-up over standard dispatch at each size: measured locally, measured
/// over shaped links, and projected onto the local suite's link profile (series with points
/// only).
fn speedup_series(speed: &[SpeedRow]) -> Vec<Series> {
    let mut series: Vec<Series> = Vec::new();
    for (suite, kind) in [("prefill", "local"), ("prefill, shaped", "shaped links")] {
        let rows: Vec<&SpeedRow> = speed.iter().filter(|r| r.suite == suite).collect();
        let mut keys: Vec<RunKey> = Vec::new();
        for r in &rows {
            if !keys.contains(&r.key) {
                keys.push(r.key);
            }
        }
        let compared = keys
            .into_iter()
            .filter(|k| !k.is_baseline() && k.mode != MoeMode::Reference);
        for key in compared {
            let speedup = |projected: bool| -> Vec<(f64, f64)> {
                let time = |r: &SpeedRow| {
                    if projected {
                        r.projected_seconds
                    } else {
                        Some(r.seconds)
                    }
                };
                rows.iter()
                    .filter(|r| r.key == key)
                    .filter_map(|r| {
                        let std = rows
                            .iter()
                            .find(|s| s.key.is_baseline() && s.tokens == r.tokens)?;
                        Some((r.tokens as f64, time(std)? / time(r)?.max(1e-12)))
                    })
                    .collect()
            };
            series.push(Series::plain(
                format!("{key}, measured ({kind})"),
                speedup(false),
            ));
            if kind == "local" {
                let link = rows.first().map_or("", |r| r.link.as_str());
                series.push(Series::plain(
                    format!("{key}, projected ({link})"),
                    speedup(true),
                ));
            }
        }
    }
    series.retain(|s| !s.points.is_empty());
    series
}

/// Mean accuracy against the E[C_T] of the routing served, with the report's 95% intervals:
/// one series per (model, rule): the start, standard and pruned fine-tuning, each pruned
/// serving drawn with its rule's series; exact serving belongs to every rule's series. Node
/// limits have no E[C_T] row of their own in the table and are not drawn.
fn quality_series(steps: &[Step], quality: &[QualityRow]) -> Vec<Series> {
    let ect_of = |n: Option<usize>, rule: &Option<String>| -> Option<f64> {
        match n {
            None => steps
                .iter()
                .find(|s| s.placement == Method::Occult.name() && s.max_devices.is_none()),
            Some(n) => steps
                .iter()
                .find(|s| s.max_devices == Some(n) && s.rule.as_ref() == rule.as_ref()),
        }
        .map(|s| s.ect)
    };
    let mut groups: Vec<Series> = Vec::new();
    let rules: Vec<String> = {
        let mut r: Vec<String> = quality.iter().filter_map(|r| r.rule.clone()).collect();
        r.sort();
        r.dedup();
        r
    };
    for ((variant, _), _) in super::report::mean_acc(quality) {
        let model = if variant == "base" {
            "start"
        } else if variant == "exact" {
            "standard fine-tuning"
        } else {
            "pruned fine-tuning"
        };
        let rows: Vec<&QualityRow> = quality
            .iter()
            .filter(|r| r.variant == variant && r.max_nodes.is_none())
            .collect();
        let mut served: Vec<(Option<usize>, Option<String>)> = rows
            .iter()
            .map(|r| (r.max_devices, r.rule.clone()))
            .collect();
        served.dedup();
        for (n, rule) in served {
            let at: Vec<&QualityRow> = rows
                .iter()
                .copied()
                .filter(|r| r.max_devices == n && r.rule == rule)
                .collect();
            let Some(ect) = ect_of(n, &rule) else {
                continue;
            };
            // The 95% interval of the report's table (over seeds too when there are several).
            let Ok(p) = super::report::mean_interval(&at) else {
                continue;
            };
            let (mean, error) = (p.diff, (p.diff - p.lo, p.hi - p.diff));
            let names: Vec<String> = match &rule {
                Some(r) => vec![format!("{model}, {r} rule")],
                None => rules.iter().map(|r| format!("{model}, {r} rule")).collect(),
            };
            for name in names {
                add_point(&mut groups, name, (ect, mean), error);
            }
        }
    }
    for g in groups.iter_mut() {
        let mut both: Vec<((f64, f64), (f64, f64))> = g
            .points
            .iter()
            .copied()
            .zip(g.errors.iter().copied())
            .collect();
        both.sort_by(|a, b| a.0 .0.total_cmp(&b.0 .0));
        (g.points, g.errors) = both.into_iter().unzip();
    }
    groups.retain(|g| !g.points.is_empty());
    groups
}

/// Adds `point` with its error bar to the series named `name` (made when new), once.
fn add_point(groups: &mut Vec<Series>, name: String, point: (f64, f64), error: (f64, f64)) {
    let g = match groups.iter().position(|g| g.name == name) {
        Some(i) => &mut groups[i],
        None => {
            groups.push(Series::plain(name, Vec::new()));
            groups.last_mut().expect("just pushed")
        }
    };
    if !g.points.contains(&point) {
        g.points.push(point);
        g.errors.push(error);
    }
}

/// Co-activation of experts in one layer: `m[i][j]` = tokens that chose both `i` and `j`
/// (`i != j`), divided by the largest entry; experts in `order`.
pub fn coactivation(
    layer: &occult_core::analysis::trace::LayerTrace,
    k: usize,
    order: &[usize],
) -> Vec<Vec<f64>> {
    let e = order.len();
    let mut pos = vec![0; e];
    for (p, &x) in order.iter().enumerate() {
        pos[x] = p;
    }
    let mut m = vec![vec![0.0; e]; e];
    for t in 0..layer.tokens {
        let ids = layer.ids(t, k);
        for &a in ids {
            for &b in ids {
                if a != b {
                    m[pos[a as usize]][pos[b as usize]] += 1.0;
                }
            }
        }
    }
    let top = m.iter().flatten().fold(0.0f64, |a, &b| a.max(b)).max(1.0);
    m.iter_mut().flatten().for_each(|x| *x /= top);
    m
}

/// Two co-activation heatmaps side by side (before and after), experts grouped by device.
pub fn heatmaps(path: &Path, panels: [(&str, &[Vec<f64>]); 2], devices: usize) -> Result<()> {
    register_font()?;
    let root = BitMapBackend::new(path, (1000, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let halves = root.split_evenly((1, 2));
    for (area, (title, m)) in halves.iter().zip(panels) {
        let e = m.len() as i32;
        let mut c = ChartBuilder::on(area)
            .caption(title, (FONT, 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(30)
            .build_cartesian_2d(0..e, 0..e)
            .map_err(err)?;
        c.configure_mesh()
            .disable_mesh()
            .x_desc("expert (by device)")
            .label_style((FONT, 11))
            .draw()
            .map_err(err)?;
        c.draw_series(m.iter().enumerate().flat_map(|(i, row)| {
            row.iter().enumerate().map(move |(j, &v)| {
                let shade = (255.0 * (1.0 - v.sqrt())) as u8;
                Rectangle::new(
                    [(j as i32, i as i32), (j as i32 + 1, i as i32 + 1)],
                    RGBColor(shade, shade, 255).filled(),
                )
            })
        }))
        .map_err(err)?;
        // Device boundaries.
        let per = (e as usize).div_ceil(devices.max(1)) as i32;
        for d in 1..devices as i32 {
            let x = d * per;
            c.draw_series(std::iter::once(PathElement::new(vec![(x, 0), (x, e)], RED)))
                .map_err(err)?;
            c.draw_series(std::iter::once(PathElement::new(vec![(0, x), (e, x)], RED)))
                .map_err(err)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}
