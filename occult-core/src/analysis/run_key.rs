//! What a run is, under one name: how token rows travel ([`DispatchMode`]), how MoE blocks
//! compute ([`MoeMode`]: the single-device reference, or expert parallelism in a dispatch
//! mode), and a run's key ([`RunKey`]: the mode, the pruning limit and rule, the copy rule)
//! with its one label ([`RunKey`]'s `Display`). [`runs`] lists the runs a benchmark makes for
//! given devices, nodes and limits; the layer, model and training benchmarks all take their
//! runs from it, and the report and plots find rows by their key, never by label text.
//!
//! The cost model counts the same modes: standard dispatch is one row per (token, expert);
//! Occult's is one row per (token, device); the two-level exchange one row per (token, node)
//! across nodes, forwarded inside the node.

use crate::analysis::placement::replicas::CopyRule;
use crate::analysis::pruning::{PruneLimit, PruneRule};
use serde::{Deserialize, Serialize};
use std::fmt;

/// How token rows travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum DispatchMode {
    /// One row per (token, expert).
    Standard,
    /// One row per (token, device), pre-reduced on the device.
    Occult,
    /// One row per (token, node) across nodes, to the node's proxy, which forwards it to each
    /// device of its node that needs it; pre-reduced on the device, then at the proxy.
    #[serde(rename = "two-level")]
    TwoLevel,
}

impl DispatchMode {
    pub fn name(self) -> &'static str {
        match self {
            DispatchMode::Standard => "standard",
            DispatchMode::Occult => "occult",
            DispatchMode::TwoLevel => "two-level",
        }
    }

    /// Rows carry the token's gate weights and come back pre-reduced.
    pub fn pre_reduces(self) -> bool {
        self != DispatchMode::Standard
    }

    /// The exchanges of one forward of the EP layer, in order: `true` for those that carry
    /// hidden-state rows, `false` for index metadata.
    pub fn forward_exchanges(self) -> &'static [bool] {
        match self {
            // Metadata, rows out, rows back.
            DispatchMode::Standard | DispatchMode::Occult => &[false, true, true],
            // Across: ids, rows; inside: metadata, rows; back inside, back across.
            DispatchMode::TwoLevel => &[false, true, false, true, true, true],
        }
    }
}

/// How MoE blocks compute: the one-device reference loop, or expert parallelism in one of the
/// dispatch modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum MoeMode {
    /// The single-device reference (a plain loop over experts).
    Reference,
    /// Expert parallelism, one row per (token, expert).
    Standard,
    /// Expert parallelism, one row per (token, device), pre-reduced on the device.
    Occult,
    /// Expert parallelism across nodes: one row per (token, node) to the node's proxy, which
    /// forwards it inside the node; pre-reduced on the device and at the proxy.
    #[serde(rename = "two-level")]
    TwoLevel,
}

impl MoeMode {
    /// The EP layer's dispatch mode, `None` for the reference.
    pub fn dispatch(self) -> Option<DispatchMode> {
        match self {
            MoeMode::Reference => None,
            MoeMode::Standard => Some(DispatchMode::Standard),
            MoeMode::Occult => Some(DispatchMode::Occult),
            MoeMode::TwoLevel => Some(DispatchMode::TwoLevel),
        }
    }

    /// The mode that runs `dispatch`.
    pub fn of(dispatch: DispatchMode) -> Self {
        match dispatch {
            DispatchMode::Standard => MoeMode::Standard,
            DispatchMode::Occult => MoeMode::Occult,
            DispatchMode::TwoLevel => MoeMode::TwoLevel,
        }
    }

    pub fn name(self) -> &'static str {
        self.dispatch().map_or("reference", DispatchMode::name)
    }
}

/// What one run is: how its MoE blocks compute, how far routing is pruned and by which rule,
/// and, under a placement with replicas, which copy of an expert a token uses. Its label is
/// its `Display`: `standard`, `occult`, `two-level`, `reference (1 device)`, then `, pruned to
/// LIMIT (RULE)` and `, RULE copies` where they apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunKey {
    pub mode: MoeMode,
    /// How far each token's experts may spread (`None`: exact routing).
    #[serde(default)]
    pub prune: Option<PruneLimit>,
    /// The pruning rule (with `prune` only).
    #[serde(default)]
    pub rule: Option<PruneRule>,
    /// The copy rule under a placement with replicas (`None` without replicas).
    #[serde(default)]
    pub copies: Option<CopyRule>,
}

impl RunKey {
    /// `mode` with exact routing and no replicas.
    pub fn exact(mode: MoeMode) -> Self {
        RunKey {
            mode,
            prune: None,
            rule: None,
            copies: None,
        }
    }

    /// `mode` pruned to `limit` by `rule`.
    pub fn pruned(mode: MoeMode, limit: PruneLimit, rule: PruneRule) -> Self {
        RunKey {
            prune: Some(limit),
            rule: Some(rule),
            ..RunKey::exact(mode)
        }
    }

    /// `mode` under a placement with replicas, copies chosen by `copies`.
    pub fn with_copies(mode: MoeMode, copies: CopyRule) -> Self {
        RunKey {
            copies: Some(copies),
            ..RunKey::exact(mode)
        }
    }

    /// The baseline every ratio is taken against: standard dispatch, exact routing (under
    /// replicas, with whichever copy rule the run has).
    pub fn is_baseline(&self) -> bool {
        self.mode == MoeMode::Standard && self.prune.is_none()
    }

    /// An expert-parallel run whose rows are pre-reduced (Occult's dispatch or the two-level
    /// exchange), pruned or not.
    pub fn pre_reduces(&self) -> bool {
        self.mode.dispatch().is_some_and(DispatchMode::pre_reduces)
    }

    /// The dispatch mode (`None` for the reference).
    pub fn dispatch(&self) -> Option<DispatchMode> {
        self.mode.dispatch()
    }

    /// The device limit of device-limited pruning.
    pub fn max_devices(&self) -> Option<usize> {
        match self.prune {
            Some(PruneLimit::Devices(n)) => Some(n),
            _ => None,
        }
    }
}

impl fmt::Display for RunKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.mode {
            MoeMode::Reference => f.write_str("reference (1 device)")?,
            m => f.write_str(m.name())?,
        }
        if let Some(limit) = self.prune {
            write!(f, ", pruned to {}", limit.label())?;
            if let Some(rule) = self.rule {
                write!(f, " ({})", rule.name())?;
            }
        }
        if let Some(c) = self.copies {
            write!(f, ", {} copies", c.name())?;
        }
        Ok(())
    }
}

/// What a benchmark compares, for [`runs`].
#[derive(Clone, Debug, PartialEq)]
pub struct RunPlan {
    pub devices: usize,
    /// Devices per node: below `devices`, the two-level exchange runs too (and with a node
    /// limit, pruned to it as well).
    pub devices_per_node: Option<usize>,
    /// Occult's dispatch pruned to each of these device limits (those from 1 to D - 1 run).
    pub prune_devices: Vec<usize>,
    /// A node limit, run in Occult's dispatch and in the two-level exchange.
    pub node_limit: Option<PruneLimit>,
    /// The rule every pruned run prunes by.
    pub rule: PruneRule,
    /// The placement has replicas: standard and Occult dispatch with SGLang's copies (what
    /// serving there gives) and Occult's with the cover rule's. Pruning and the two-level
    /// exchange do not run replicas.
    pub replicas: bool,
}

/// The runs of `plan`, in the order a benchmark makes and reports them: standard, Occult,
/// Occult pruned to each device limit, the two-level exchange, then the node limit in Occult's
/// dispatch and in the two-level exchange.
pub fn runs(plan: &RunPlan) -> Vec<RunKey> {
    if plan.replicas {
        return vec![
            RunKey::with_copies(MoeMode::Standard, CopyRule::Sglang),
            RunKey::with_copies(MoeMode::Occult, CopyRule::Sglang),
            RunKey::with_copies(MoeMode::Occult, CopyRule::Cover),
        ];
    }
    let nodes = plan
        .devices_per_node
        .is_some_and(|g| g >= 1 && g < plan.devices);
    let mut out = vec![
        RunKey::exact(MoeMode::Standard),
        RunKey::exact(MoeMode::Occult),
    ];
    for &n in &plan.prune_devices {
        if n >= 1 && n < plan.devices {
            out.push(RunKey::pruned(
                MoeMode::Occult,
                PruneLimit::Devices(n),
                plan.rule,
            ));
        }
    }
    if nodes {
        out.push(RunKey::exact(MoeMode::TwoLevel));
    }
    if let Some(limit) = plan.node_limit {
        out.push(RunKey::pruned(MoeMode::Occult, limit, plan.rule));
        if nodes {
            out.push(RunKey::pruned(MoeMode::TwoLevel, limit, plan.rule));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moe_modes_name_their_dispatch() {
        assert_eq!(MoeMode::Reference.dispatch(), None);
        for d in [
            DispatchMode::Standard,
            DispatchMode::Occult,
            DispatchMode::TwoLevel,
        ] {
            assert_eq!(MoeMode::of(d).dispatch(), Some(d));
            assert_eq!(MoeMode::of(d).name(), d.name());
            assert_eq!(serde_json::to_value(d).unwrap(), d.name());
        }
        for (m, name) in [
            (MoeMode::Reference, "reference"),
            (MoeMode::Standard, "standard"),
            (MoeMode::Occult, "occult"),
            (MoeMode::TwoLevel, "two-level"),
        ] {
            assert_eq!(m.name(), name);
            assert_eq!(serde_json::to_value(m).unwrap(), name);
        }
    }

    /// The command-line names of the core's enums are their serde names (`--features clap`).
    #[cfg(feature = "clap")]
    #[test]
    fn command_line_names_are_the_serde_names() {
        use crate::analysis::placement::Method;
        use clap::ValueEnum;
        fn check<T: ValueEnum + Serialize>() {
            for v in T::value_variants() {
                let name = v.to_possible_value().unwrap().get_name().to_string();
                assert_eq!(serde_json::to_value(v).unwrap(), name);
            }
        }
        check::<Method>();
        check::<PruneRule>();
        check::<DispatchMode>();
        check::<MoeMode>();
        check::<CopyRule>();
    }

    #[test]
    fn every_key_has_one_label_and_reads_back() {
        let node = PruneLimit::Nodes {
            devices_per_node: 2,
            max_nodes: 1,
            devices_in_node: None,
        };
        for (key, label) in [
            (RunKey::exact(MoeMode::Standard), "standard"),
            (RunKey::exact(MoeMode::Reference), "reference (1 device)"),
            (
                RunKey::pruned(MoeMode::Occult, PruneLimit::Devices(2), PruneRule::Router),
                "occult, pruned to 2 devices (router)",
            ),
            (
                RunKey::pruned(MoeMode::TwoLevel, node, PruneRule::Similarity),
                "two-level, pruned to 1 node (similarity)",
            ),
            (
                RunKey::with_copies(MoeMode::Occult, CopyRule::Sglang),
                "occult, sglang copies",
            ),
        ] {
            assert_eq!(key.to_string(), label);
            let back: RunKey = serde_json::from_value(serde_json::to_value(key).unwrap()).unwrap();
            assert_eq!(back, key);
        }
        // A key written with only its mode reads as exact routing without replicas.
        let bare: RunKey = serde_json::from_str(r#"{"mode": "occult"}"#).unwrap();
        assert_eq!(bare, RunKey::exact(MoeMode::Occult));
    }

    #[test]
    fn a_plan_lists_its_runs_in_order() {
        let plan = RunPlan {
            devices: 4,
            devices_per_node: None,
            prune_devices: vec![2, 1, 4, 0],
            node_limit: None,
            rule: PruneRule::Router,
            replicas: false,
        };
        let labels =
            |p: &RunPlan| -> Vec<String> { runs(p).iter().map(|k| k.to_string()).collect() };
        assert_eq!(
            labels(&plan),
            [
                "standard",
                "occult",
                "occult, pruned to 2 devices (router)",
                "occult, pruned to 1 device (router)"
            ]
        );
        let node = PruneLimit::Nodes {
            devices_per_node: 2,
            max_nodes: 1,
            devices_in_node: None,
        };
        let nodes = RunPlan {
            devices_per_node: Some(2),
            prune_devices: vec![],
            node_limit: Some(node),
            ..plan.clone()
        };
        assert_eq!(
            labels(&nodes),
            [
                "standard",
                "occult",
                "two-level",
                "occult, pruned to 1 node (router)",
                "two-level, pruned to 1 node (router)"
            ]
        );
        // A node as large as the run is one node: no two-level runs.
        let one = RunPlan {
            devices_per_node: Some(4),
            ..nodes.clone()
        };
        assert_eq!(
            labels(&one),
            ["standard", "occult", "occult, pruned to 1 node (router)"]
        );
        let replicas = RunPlan {
            replicas: true,
            ..nodes
        };
        assert_eq!(
            labels(&replicas),
            [
                "standard, sglang copies",
                "occult, sglang copies",
                "occult, cover copies"
            ]
        );
        assert!(runs(&replicas).iter().all(|k| k.prune.is_none()));
    }
}
