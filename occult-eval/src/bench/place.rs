//! `occult bench place`: each placement method of `Method::ALL` (contiguous, greedy, occult)
//! timed on the same traces and device counts in one run, with E[C_T] and the busiest
//! device's load side by side. With `--replicas R`, also Occult under a 1.05 load cap, and
//! under each copy rule an engine serves with (Occult's cover, SGLang's static table,
//! TensorRT-LLM's uniform choice), like with like: DeepSeek's EPLB and TensorRT-LLM's
//! co-occurrence placement with R redundant slots, and Occult's partitions with R copies chosen
//! under that rule. Every row is also projected onto machines ([`PlaceProjection`]): the layer
//! time of its one-row-per-device exchange and its slowest device's expert compute.

use crate::table::Table;
use anyhow::Result;
use occult_core::analysis::cost::links::LinkProfile;
use occult_core::analysis::cost::projection::LayerSizes;
use occult_core::analysis::cost::replica_projection::{project_placement, PlacementTime};
use occult_core::analysis::drivers::replica_trace::{
    replica_trace_stats, replicate_trace, ReplicaJob,
};
use occult_core::analysis::place_trace;
use occult_core::analysis::placement::eplb::EplbGroups;
use occult_core::analysis::placement::replicas::CopyRule;
use occult_core::analysis::placement::{Method, Placement, SearchConfig};
use occult_core::analysis::trace::Trace;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// One timed placement run.
#[derive(Clone, Debug, Serialize)]
pub struct PlaceRun {
    pub trace: String,
    pub method: String,
    /// The copy rule the row is counted under ("any" for a placement without replicas, which
    /// every rule serves alike).
    pub rule: String,
    pub devices: usize,
    pub layers: usize,
    pub tokens: usize,
    pub seconds: f64,
    pub ect: f64,
    /// The busiest device's (token, expert) pairs over the mean, token-weighted over layers.
    pub max_load_ratio: f64,
    /// The placement's projected MoE layer on each machine.
    pub projected: Vec<PlacementTime>,
}

/// What every placement is projected with: the machines, the layer's sizes and the tokens each
/// device holds.
#[derive(Clone, Debug)]
pub struct PlaceProjection {
    pub profiles: Vec<LinkProfile>,
    pub sizes: LayerSizes,
    pub tokens_per_device: usize,
    pub seed: u64,
}

impl PlaceProjection {
    /// OLMoE-1B-7B's layer (hidden 2048, routed experts of 1024, no shared expert) with 2,048
    /// tokens per device, on a PCIe box and an NVLink node (`configs/links/`).
    pub fn olmoe_on(profiles: &[&str], tokens_per_device: usize) -> Result<Self> {
        Ok(PlaceProjection {
            profiles: profiles
                .iter()
                .map(|p| LinkProfile::load(p))
                .collect::<occult_core::Result<_>>()?,
            sizes: LayerSizes {
                hidden: 2048,
                intermediate: 1024,
                shared_intermediate: 0,
            },
            tokens_per_device,
            seed: 0,
        })
    }
}

/// Times every method on every trace and device count, prints the table (and, with `routes`,
/// the routes table of [`super::routes`], placed with that configuration) and writes the runs
/// as JSON to `json`.
pub fn run(
    traces: &[PathBuf],
    devices: &[usize],
    cfg: &SearchConfig,
    replicas: usize,
    proj: &PlaceProjection,
    routes: Option<&SearchConfig>,
    json: Option<&Path>,
) -> Result<()> {
    let (mut runs, mut route_runs) = (Vec::new(), Vec::new());
    for path in traces {
        let trace = Trace::read(path)?;
        for &d in devices {
            runs.extend(runs_on(&trace, path, d, cfg, replicas, proj)?);
            if let Some(rc) = routes {
                let name = path.display().to_string();
                route_runs.extend(super::routes::route_runs(&trace, &name, d, rc, replicas)?);
            }
        }
    }
    print!("{}", render(&runs));
    if let Some(rc) = routes {
        let cap = rc
            .max_load_factor
            .map_or(String::new(), |c| format!(", within a load cap of {c}"));
        println!("\nRoutes: the same placements as each engine serves them{cap}\n");
        print!("{}", super::routes::render(&route_runs));
    }
    if let Some(out) = json {
        let body = serde_json::json!({ "results": runs, "routes": route_runs });
        super::report::write(out, "place", body)?;
    }
    Ok(())
}

/// Load caps tried, in order, where no partition meets 1.05: copies then balance the first one
/// found.
const LOOSER_CAPS: [f64; 4] = [1.1, 1.2, 1.35, 1.5];

/// One trace on `d` devices, placed with `cfg` and projected with `proj`: what every step of
/// [`runs_on`] works on.
struct On<'a> {
    trace: &'a Trace,
    path: &'a Path,
    d: usize,
    cfg: &'a SearchConfig,
    proj: &'a PlaceProjection,
}

impl On<'_> {
    /// The run of `placed` (found in `seconds`) under `rule`, named `name`.
    fn measured(
        &self,
        name: &str,
        seconds: f64,
        placed: &Placement,
        rule: CopyRule,
    ) -> Result<PlaceRun> {
        let mut run = measured(
            self.trace, self.path, name, seconds, placed, rule, self.proj,
        )?;
        if !placed.has_replicas() {
            run.rule = "any".into();
        }
        Ok(run)
    }

    /// Places with method `m` under `cfg`: the placement, the seconds it took and E[C_T] as the
    /// placer found it; `None` where `cfg`'s load cap is one no balanced map meets on this trace
    /// (a finding, not a failure; said on stderr when `say_none`).
    fn place(
        &self,
        name: &str,
        m: Method,
        cfg: &SearchConfig,
        say_none: bool,
    ) -> Result<Option<(Placement, f64, f64)>> {
        let start = Instant::now();
        match place_trace(self.trace, self.d, m, cfg, &|| {}) {
            Ok((placed, infos)) => {
                let from_placer = occult_core::analysis::collab::token_weighted_mean(
                    infos.iter().map(|i| (i.ect, i.tokens)),
                );
                Ok(Some((placed, start.elapsed().as_secs_f64(), from_placer)))
            }
            Err(err) if cfg.max_load_factor.is_some() => {
                if say_none {
                    eprintln!("{} D={} {name}: none ({err})", self.path.display(), self.d);
                }
                Ok(None)
            }
            Err(err) => Err(err.into()),
        }
    }
}

/// An Occult partition that copies are added to: its name, placement and load cap.
type Partition = (String, Placement, Option<f64>);

/// Every method's run on `trace` (read from `path`) on `d` devices; with `replicas`, also
/// Occult under a 1.05 load cap, and under each copy rule EPLB, TensorRT-LLM's co-occurrence
/// placement and Occult's partitions with copies chosen under that rule.
pub fn runs_on(
    trace: &Trace,
    path: &Path,
    d: usize,
    cfg: &SearchConfig,
    replicas: usize,
    proj: &PlaceProjection,
) -> Result<Vec<PlaceRun>> {
    let on = On {
        trace,
        path,
        d,
        cfg,
        proj,
    };
    let (mut runs, mut partitions, base) = method_runs(&on, replicas > 0)?;
    if replicas == 0 {
        return Ok(runs);
    }
    // Without a partition within 1.05, the first looser cap one meets, for copies to balance.
    if partitions.iter().all(|p| p.2.is_none()) {
        if let Some((run, partition)) = looser_partition(&on)? {
            runs.push(run);
            partitions.push(partition);
        }
    }
    let Some(base) = base else {
        return Ok(runs);
    };
    for rule in CopyRule::ALL {
        let (rivals, balances) = rival_runs(&on, &base, replicas, rule)?;
        runs.extend(rivals);
        let (copies, found) = copies_runs(&on, &mut partitions, replicas, &balances, rule)?;
        runs.extend(found);
        runs.extend(copies);
    }
    Ok(runs)
}

/// Each method of [`Method::ALL`] (and, for copies, Occult's under a 1.05 load cap): the runs,
/// Occult's partitions, and the first other placement (for EPLB to start from).
fn method_runs(
    on: &On,
    for_copies: bool,
) -> Result<(Vec<PlaceRun>, Vec<Partition>, Option<Placement>)> {
    let capped = SearchConfig {
        max_load_factor: Some(1.05),
        ..on.cfg.clone()
    };
    let mut methods: Vec<(String, Method, &SearchConfig)> = Method::ALL
        .iter()
        .map(|&m| (m.name().to_string(), m, on.cfg))
        .collect();
    if for_copies {
        methods.push(("occult, load cap 1.05".into(), Method::Occult, &capped));
    }
    let (mut runs, mut partitions, mut base) = (Vec::new(), Vec::new(), None);
    for (name, m, c) in methods {
        let Some((placed, seconds, from_placer)) = on.place(&name, m, c, true)? else {
            continue;
        };
        let run = on.measured(&name, seconds, &placed, CopyRule::Cover)?;
        eprintln!(
            "{} D={} {}: {:.2} s, E[C_T] {:.3} (from the placer {from_placer:.3})",
            run.trace, on.d, run.method, run.seconds, run.ect,
        );
        runs.push(run);
        if m == Method::Occult {
            partitions.push((name, placed, c.max_load_factor));
        } else if base.is_none() {
            base = Some(placed);
        }
    }
    Ok((runs, partitions, base))
}

/// Occult's partition placed within `cap`, and its run; `None` where the search finds none.
fn capped_partition(on: &On, cap: f64) -> Result<Option<(PlaceRun, Partition)>> {
    let c = SearchConfig {
        max_load_factor: Some(cap),
        ..on.cfg.clone()
    };
    let name = format!("occult, load cap {cap}");
    let Some((placed, seconds, _)) = on.place(&name, Method::Occult, &c, false)? else {
        return Ok(None);
    };
    let run = on.measured(&name, seconds, &placed, CopyRule::Cover)?;
    Ok(Some((run, (name, placed, Some(cap)))))
}

/// Occult's partition under the first of [`LOOSER_CAPS`] that one meets.
fn looser_partition(on: &On) -> Result<Option<(PlaceRun, Partition)>> {
    for cap in LOOSER_CAPS {
        if let Some(found) = capped_partition(on, cap)? {
            return Ok(Some(found));
        }
    }
    Ok(None)
}

/// The rivals with `replicas` redundant slots (up to the next count that fills the devices
/// evenly), counted under `rule`: DeepSeek's EPLB and TensorRT-LLM's co-occurrence placement
/// (slots either would put twice on one device spread); and their balances (max/mean load).
fn rival_runs(
    on: &On,
    base: &Placement,
    replicas: usize,
    rule: CopyRule,
) -> Result<(Vec<PlaceRun>, Vec<f64>)> {
    let (e, d) = (on.trace.meta.num_experts, on.d);
    let r = (replicas..)
        .find(|r| (e + r).is_multiple_of(d))
        .expect("exists");
    let (mut runs, mut balances) = (Vec::new(), Vec::new());
    for method in [Method::Eplb, Method::Cooccurrence] {
        let job = ReplicaJob {
            method,
            replicas: r,
            max_load_factor: None,
            eplb: EplbGroups::GLOBAL,
            rule,
        };
        let start = Instant::now();
        let placed = replicate_trace(on.trace, base, job)?;
        let seconds = start.elapsed().as_secs_f64();
        let name = format!("{} R={r}", method.name());
        let run = on.measured(&name, seconds, &placed, rule)?;
        eprintln!(
            "{} D={d} {name}, {} rule: E[C_T] {:.3}, max/mean {:.3}",
            run.trace,
            rule.name(),
            run.ect,
            run.max_load_ratio
        );
        balances.push(run.max_load_ratio);
        runs.push(run);
    }
    Ok((runs, balances))
}

/// The load caps Occult's copies are held to under a rule: 1.05, and each rival's balance under
/// the rule plus 0.02 (floored to 0.001), ascending.
fn target_caps(balances: &[f64]) -> Vec<f64> {
    let mut caps = vec![1.05];
    caps.extend(
        balances
            .iter()
            .map(|b| ((b + 0.02) * 1000.0).floor() / 1000.0),
    );
    caps.sort_by(f64::total_cmp);
    caps.dedup_by(|a, b| (*a - *b).abs() < 1e-9);
    caps
}

/// Occult's partition placed within `cap`: one of `partitions` placed so, else one searched for
/// now (and its run, as found), else the tightest one placed within a looser cap, else the one
/// placed without a cap (its copies then balance it down).
fn partition_within(
    on: &On,
    partitions: &mut Vec<Partition>,
    cap: f64,
) -> Result<(Option<Partition>, Option<PlaceRun>)> {
    let same = |p: &Partition| p.2.is_some_and(|c| (c - cap).abs() < 1e-9);
    if let Some(p) = partitions.iter().find(|p| same(p)) {
        return Ok((Some(p.clone()), None));
    }
    if let Some((run, p)) = capped_partition(on, cap)? {
        partitions.push(p.clone());
        return Ok((Some(p), Some(run)));
    }
    // Else the tightest partition within a looser cap, else the one without a cap: its copies
    // balance it down.
    let looser = partitions
        .iter()
        .filter(|p| p.2.is_some_and(|c| c > cap))
        .min_by(|a, b| a.2.unwrap_or(0.0).total_cmp(&b.2.unwrap_or(0.0)))
        .or_else(|| partitions.iter().find(|p| p.2.is_none()))
        .cloned();
    Ok((looser, None))
}

/// Occult's copies chosen under `rule` where they save the most devices (R up to a multiple
/// of D): on the partition without a cap, and held to each of [`target_caps`] (from a partition
/// placed within that cap where one is found, else balanced down from a looser one). Returns
/// the runs, and the runs of partitions placed for a cap on the way.
fn copies_runs(
    on: &On,
    partitions: &mut Vec<Partition>,
    replicas: usize,
    balances: &[f64],
    rule: CopyRule,
) -> Result<(Vec<PlaceRun>, Vec<PlaceRun>)> {
    let d = on.d;
    let r = (replicas..).find(|r| r.is_multiple_of(d)).expect("exists");
    let mut jobs: Vec<(String, Placement, Option<f64>)> = Vec::new();
    let mut found = Vec::new();
    if let Some((name, placed, None)) = partitions.iter().find(|p| p.2.is_none()).cloned() {
        jobs.push((format!("{name} + R={r} copies"), placed, None));
    }
    for cap in target_caps(balances) {
        let (partition, run) = partition_within(on, partitions, cap)?;
        found.extend(run);
        let Some((name, placed, pcap)) = partition else {
            eprintln!(
                "{} D={d} copies within {cap}, {} rule: none (no partition within a cap)",
                on.path.display(),
                rule.name()
            );
            continue;
        };
        let name = if pcap.is_some_and(|p| (p - cap).abs() < 1e-9) {
            format!("{name} + R={r} copies")
        } else {
            format!("{name} + R={r} copies, load cap {cap}")
        };
        jobs.push((name, placed, Some(cap)));
    }
    let mut runs = Vec::new();
    for (name, placed, cap) in jobs {
        let job = ReplicaJob {
            method: Method::Occult,
            replicas: r,
            max_load_factor: cap,
            eplb: EplbGroups::GLOBAL,
            rule,
        };
        let start = Instant::now();
        let copies = match replicate_trace(on.trace, &placed, job) {
            Ok(c) => c,
            Err(err) if cap.is_some() => {
                eprintln!(
                    "{} D={d} {name}, {} rule: none ({err})",
                    on.path.display(),
                    rule.name()
                );
                continue;
            }
            Err(err) => return Err(err.into()),
        };
        let seconds = start.elapsed().as_secs_f64();
        let run = on.measured(&name, seconds, &copies, rule)?;
        eprintln!(
            "{} D={d} {name}, {} rule: E[C_T] {:.3}, max/mean {:.3} ({seconds:.1} s)",
            run.trace,
            rule.name(),
            run.ect,
            run.max_load_ratio
        );
        runs.push(run);
    }
    Ok((runs, found))
}

/// One method's run: its E[C_T] and loads under `rule` as `occult collab` counts them (a
/// partition is a placement with one slot per expert), each token on its rank of an even split;
/// and its projection on each machine of `proj`.
fn measured(
    trace: &Trace,
    path: &Path,
    method: &str,
    seconds: f64,
    placement: &Placement,
    rule: CopyRule,
    proj: &PlaceProjection,
) -> Result<PlaceRun> {
    let st = replica_trace_stats(trace, placement, rule, true, None)?;
    let projected = proj
        .profiles
        .iter()
        .map(|p| {
            let t = proj.tokens_per_device;
            project_placement(trace, placement, rule, p, t, &proj.sizes, proj.seed)
        })
        .collect::<occult_core::Result<_>>()?;
    Ok(PlaceRun {
        trace: path.display().to_string(),
        method: method.to_string(),
        rule: rule.name().to_string(),
        devices: placement.num_devices,
        layers: st.layers.len(),
        tokens: trace.layers.first().map_or(0, |l| l.tokens),
        seconds,
        ect: st.mean_ect,
        max_load_ratio: st.mean_max_load_ratio,
        projected,
    })
}

fn render(runs: &[PlaceRun]) -> String {
    let profiles: Vec<String> = runs
        .first()
        .map(|r| r.projected.iter().map(|p| p.profile.clone()).collect())
        .unwrap_or_default();
    let mut head: Vec<String> = [
        "trace",
        "D",
        "method",
        "rule",
        "seconds",
        "mean E[C_T]",
        "max/mean load",
        "vs contiguous",
        "vs greedy",
    ]
    .map(String::from)
    .to_vec();
    head.extend(profiles.iter().map(|p| format!("{p} layer ms")));
    let head: Vec<&str> = head.iter().map(String::as_str).collect();
    let mut t = Table::new(&head);
    for r in runs {
        let find = |m: &str| {
            runs.iter()
                .find(|x| x.trace == r.trace && x.devices == r.devices && x.method == m)
                .map(|x| x.ect)
        };
        let ratio = |b: Option<f64>| b.map_or("-".into(), |b| format!("{:.3}", r.ect / b));
        let mut row = vec![
            r.trace.clone(),
            r.devices.to_string(),
            r.method.clone(),
            r.rule.clone(),
            format!("{:.2}", r.seconds),
            format!("{:.3}", r.ect),
            format!("{:.3}", r.max_load_ratio),
            ratio(find("contiguous")),
            ratio(find("greedy")),
        ];
        row.extend(
            r.projected
                .iter()
                .map(|p| format!("{:.3}", p.layer_s * 1e3)),
        );
        t.row(row);
    }
    t.render()
}
