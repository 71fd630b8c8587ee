//! `occult bench place --routes`: for the same placements on the same trace, what each route to
//! an engine realises ([`Route`]): Occult's partition per layer, the one map shared by every
//! layer (`place --shared-across-layers`), and the partition with R copies (chosen under
//! Occult's cover rule, as `place --replicas` writes them), each written as the route's file,
//! read back as the engine reads it and counted under the engine's copy rule. A route that
//! cannot hold a placement (copies in a checkpoint, a map per layer in vLLM #34811) says so.

use crate::table::Table;
use anyhow::Result;
use occult_core::analysis::drivers::replica_trace::{
    replica_trace_stats, replicate_trace, ReplicaJob,
};
use occult_core::analysis::drivers::whole_trace::place_trace_shared;
use occult_core::analysis::place_trace;
use occult_core::analysis::placement::eplb::EplbGroups;
use occult_core::analysis::placement::replicas::CopyRule;
use occult_core::analysis::placement::{Method, Placement, SearchConfig};
use occult_core::analysis::trace::Trace;
use occult_core::interop::checkpoint::ExpertLayout;
use occult_core::interop::routes::{shared_map, Route};
use serde::Serialize;

/// One placement served by one route.
#[derive(Clone, Debug, Serialize)]
pub struct RouteRun {
    pub trace: String,
    pub devices: usize,
    /// "occult" (Occult's own runtime, the placement as placed) or the route's name.
    pub route: String,
    /// "per layer" or "shared".
    pub map: String,
    /// Redundant slots the placement holds.
    pub replicas: usize,
    /// The copy rule its copies were chosen under (none without copies).
    pub copies_for: Option<String>,
    /// The copy rule it is counted under ("any" without replicas, "-" where the route cannot
    /// hold it).
    pub rule: String,
    /// E[C_T] and the busiest device's load over the mean as the engine serves it; `None`
    /// where the route cannot hold the placement (`held` says why).
    pub ect: Option<f64>,
    pub max_load_ratio: Option<f64>,
    pub held: Option<String>,
}

/// The layout the routes' files are written for: the trace's layers as the MoE layers of a
/// model SGLang reads (a Qwen2-MoE; dense layers below the first get SGLang's identity rows).
pub fn layout_of(trace: &Trace) -> ExpertLayout {
    let moe_layers: Vec<usize> = trace.layers.iter().map(|l| l.layer).collect();
    ExpertLayout {
        model_type: "qwen2_moe".into(),
        num_experts: trace.meta.num_experts,
        num_layers: moe_layers.iter().max().map_or(0, |&l| l + 1),
        moe_layers,
        block: "mlp".into(),
        router: "gate".into(),
        groups: None,
    }
}

/// A placement the routes are compared on: its map ("per layer" or "shared"), the rule its
/// copies were chosen under (`None`: no copies), and the placement.
pub type Compared = (String, Option<CopyRule>, Placement);

/// The placements of `trace` on `d` devices the routes are compared on: Occult's partition per
/// layer, one map shared by every layer, and the partition with the first count of at least
/// `replicas` copies that fills the devices evenly, chosen under each copy rule (none when
/// `replicas` is 0); all within `cfg`'s load cap (copies chosen under a rule that cannot meet
/// it are left out, said on stderr).
pub fn placements(
    trace: &Trace,
    d: usize,
    cfg: &SearchConfig,
    replicas: usize,
) -> Result<Vec<Compared>> {
    let none = |what: &str, err: occult_core::Error| match cfg.max_load_factor {
        Some(c) => anyhow::anyhow!(
            "no {what} within --routes-load-cap {c} on {d} devices ({err}): loosen it"
        ),
        None => anyhow::Error::from(err).context(format!("{what} on {d} devices")),
    };
    let (per_layer, _) = place_trace(trace, d, Method::Occult, cfg, &|| {})
        .map_err(|e| none("partition per layer", e))?;
    let (shared, _) = place_trace_shared(trace, d, Method::Occult, cfg, &|| {})
        .map_err(|e| none("map shared by every layer", e))?;
    let mut out = vec![
        ("per layer".to_string(), None, per_layer.clone()),
        ("shared".to_string(), None, shared),
    ];
    if replicas > 0 {
        let e = trace.meta.num_experts;
        let r = (replicas..)
            .find(|r| (e + r).is_multiple_of(d))
            .expect("exists");
        for rule in CopyRule::ALL {
            let job = ReplicaJob {
                method: Method::Occult,
                replicas: r,
                max_load_factor: cfg.max_load_factor,
                eplb: EplbGroups::GLOBAL,
                rule,
            };
            match replicate_trace(trace, &per_layer, job) {
                Ok(copies) => out.push(("per layer".into(), Some(rule), copies)),
                Err(err) if cfg.max_load_factor.is_some() => {
                    eprintln!("D={d} copies for the {} rule: none ({err})", rule.name());
                }
                Err(err) => return Err(err.into()),
            }
        }
    }
    Ok(out)
}

/// Every placement of [`placements`] as Occult places it and as each route serves it: the
/// placements without copies and those with copies chosen under the cover rule on every route,
/// copies chosen under an engine's rule on the routes that serve by that rule.
pub fn route_runs(
    trace: &Trace,
    name: &str,
    d: usize,
    cfg: &SearchConfig,
    replicas: usize,
) -> Result<Vec<RouteRun>> {
    let layout = layout_of(trace);
    let mut runs = Vec::new();
    for (map, chosen_for, p) in placements(trace, d, cfg, replicas)? {
        let slots = p
            .layers
            .first()
            .and_then(|l| l.slots.as_ref())
            .map_or(0, Vec::len);
        let extra = slots.saturating_sub(p.num_experts);
        let run = |route: &str, served: Option<(&Placement, CopyRule)>, held: Option<String>| {
            let stats = served
                .map(|(q, rule)| replica_trace_stats(trace, q, rule, true, None))
                .transpose()?;
            let rule = match served {
                Some((q, rule)) if q.has_replicas() => rule.name(),
                Some(_) => "any",
                None => "-",
            };
            anyhow::Ok(RouteRun {
                trace: name.to_string(),
                devices: d,
                route: route.to_string(),
                map: map.clone(),
                replicas: extra,
                copies_for: chosen_for.map(|r| r.name().to_string()),
                rule: rule.to_string(),
                ect: stats.as_ref().map(|s| s.mean_ect),
                max_load_ratio: stats.as_ref().map(|s| s.mean_max_load_ratio),
                held,
            })
        };
        let every_route = matches!(chosen_for, None | Some(CopyRule::Cover));
        if every_route {
            runs.push(run("occult", Some((&p, CopyRule::Cover)), None)?);
        }
        for route in Route::ALL {
            if !every_route && route.rule() != chosen_for {
                continue;
            }
            let why = if route.shared_only() && !shared_map(&p) {
                Some("one map for every layer".to_string())
            } else if p.has_replicas() && route.rule().is_none() {
                Some("holds no replicas".to_string())
            } else {
                None
            };
            if let Some(why) = why {
                runs.push(run(route.name(), None, Some(why))?);
                continue;
            }
            let served = route.round_trip(&p, &layout)?;
            let rule = route.rule().unwrap_or(CopyRule::Cover);
            runs.push(run(route.name(), Some((&served, rule)), None)?);
        }
    }
    Ok(runs)
}

/// The routes table: each row's E[C_T] and load, and its E[C_T] over Occult's own per-layer
/// partition on the same trace and devices.
pub fn render(runs: &[RouteRun]) -> String {
    let mut t = Table::new(&[
        "trace",
        "D",
        "map",
        "copies",
        "chosen for",
        "route",
        "rule",
        "E[C_T]",
        "max/mean load",
        "vs Occult per layer",
    ]);
    let f3 = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.3}"));
    for r in runs {
        let base = runs
            .iter()
            .find(|x| {
                x.trace == r.trace
                    && x.devices == r.devices
                    && x.route == "occult"
                    && x.map == "per layer"
                    && x.replicas == 0
            })
            .and_then(|x| x.ect);
        let vs = match (r.ect, base) {
            (Some(a), Some(b)) => format!("{:.3}", a / b),
            _ => "-".into(),
        };
        t.row(vec![
            r.trace.clone(),
            r.devices.to_string(),
            r.map.clone(),
            r.replicas.to_string(),
            r.copies_for.clone().unwrap_or_else(|| "-".into()),
            r.route.clone(),
            r.rule.clone(),
            r.held.clone().unwrap_or_else(|| f3(r.ect)),
            f3(r.max_load_ratio),
            vs,
        ]);
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;
    use occult_core::analysis::synth::{synth_trace, SynthConfig};

    /// On a clustered trace every route that holds a placement realises it exactly (the same
    /// E[C_T] as Occult's own count where the rule is the same), the shared map costs E[C_T]
    /// against the per-layer one, and the routes that cannot hold a placement say so.
    #[test]
    fn routes_realise_what_they_hold() {
        let mut c = SynthConfig::olmoe_like(600, 5);
        c.num_experts = 16;
        c.top_k = 4;
        c.layers = 3;
        c.clusters = 4;
        let trace = synth_trace(&c, &|| ()).unwrap();
        let cfg = SearchConfig {
            restarts: 1,
            seed: 0,
            max_load_factor: None,
            nodes: None,
        };
        let runs = route_runs(&trace, "t", 4, &cfg, 4).unwrap();
        // Without copies, shared, copies for cover: every route and Occult's own; copies for
        // SGLang's rule on SGLang, for TensorRT-LLM's on it and vLLM #49572.
        assert_eq!(runs.len(), 3 * 6 + 1 + 2);
        let find = |map: &str, copies: Option<&str>, route: &str| {
            runs.iter()
                .find(|r| r.map == map && r.copies_for.as_deref() == copies && r.route == route)
                .unwrap()
        };
        let get =
            |map: &str, copies: bool, route: &str| find(map, copies.then_some("cover"), route);
        let own = get("per layer", false, "occult").ect.unwrap();
        for route in [
            "renumbered checkpoint",
            "SGLang",
            "TensorRT-LLM",
            "vLLM #49572",
        ] {
            assert_eq!(get("per layer", false, route).ect, Some(own), "{route}");
        }
        let shared = get("shared", false, "vLLM #34811").ect.unwrap();
        assert_eq!(get("shared", false, "occult").ect, Some(shared));
        assert!(shared > own, "shared {shared} vs per layer {own}");
        assert_eq!(
            get("per layer", false, "vLLM #34811").held.as_deref(),
            Some("one map for every layer")
        );
        assert_eq!(
            get("per layer", true, "renumbered checkpoint")
                .held
                .as_deref(),
            Some("holds no replicas")
        );
        assert_eq!(get("per layer", true, "SGLang").rule, "sglang");
        assert_eq!(get("per layer", true, "vLLM #49572").rule, "trtllm");
        // Copies chosen for the engine's rule serve it at least as well as the cover rule's.
        for (rule, route) in [("sglang", "SGLang"), ("trtllm", "TensorRT-LLM")] {
            let own = find("per layer", Some(rule), route).ect.unwrap();
            let cover = get("per layer", true, route).ect.unwrap();
            assert!(own <= cover + 1e-9, "{route}: {own} vs {cover}");
        }
        assert!(render(&runs).contains("vLLM #34811"));
    }
}
