//! The runs of a model benchmark (`bench model --devices D`, `bench train` and the speed stage
//! of `occult reproduce`): their keys for a model spec ([`plan`], from the one list of
//! [`occult_core::analysis::run_key::runs`]), and one run measured on the spec's ranks
//! ([`measure`]): the ranks check they run the same bench, rank 0 names the run, each rank
//! measures its part, and rank 0 gathers the parts.

use super::modes::RankRun;
use crate::context::ModelSpec;
use anyhow::Result;
use occult_core::analysis::pruning::PruneLimit;
use occult_core::analysis::run_key::{runs, RunKey, RunPlan};
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::Model;
use serde::Serialize;

/// What a model benchmark compares on `devices` ranks: standard and Occult dispatch, Occult
/// pruned to each of `prune_devices`, the two-level exchange across nodes of
/// `devices_per_node`, and `node_limit` in each exchange; or, under a placement with replicas,
/// each dispatch with its copy rule (said on stderr). Pruned runs take the spec's rule (the
/// router-score rule where the similarity rule has no calibration).
pub fn plan(
    spec: &ModelSpec,
    devices: usize,
    devices_per_node: Option<usize>,
    prune_devices: Vec<usize>,
    node_limit: Option<PruneLimit>,
) -> Vec<RunKey> {
    let replicas = spec.placement.as_ref().is_some_and(|p| p.has_replicas());
    if replicas {
        eprintln!(
            "the placement has replicas: standard and occult dispatch with SGLang's copies, and \
             occult with the cover rule's (pruned and two-level runs do not run replicas yet)"
        );
    }
    runs(&RunPlan {
        devices,
        devices_per_node,
        prune_devices,
        node_limit,
        rule: spec.runnable_prune_rule(),
        replicas,
    })
}

/// How one run is measured.
pub struct Measure<'a, S: Serialize> {
    pub key: RunKey,
    /// The bench's settings, which every rank must hold the same of.
    pub settings: &'a S,
    /// Train: every rank holds its own copy of the dense weights.
    pub training: bool,
    /// The node size of the two-level exchange, where the spec gives none.
    pub devices_per_node: Option<usize>,
}

/// Runs `rank_run` on every rank of `spec` running `m.key`; rank 0 gets every rank's
/// measurements (the other processes of an `mpirun` job `None`).
pub fn measure<S, F>(
    spec: &ModelSpec,
    ck: &Checkpoint,
    m: &Measure<S>,
    rank_run: F,
) -> Result<Option<Vec<RankRun>>>
where
    S: Serialize,
    F: Fn(&Model) -> Result<RankRun> + Sync,
{
    let mut o = spec.for_run(&m.key);
    o.devices_per_node = o.devices_per_node.or(m.devices_per_node);
    let work = serde_json::to_vec(m.settings)?;
    let label = m.key.to_string();
    let part = |model: &Model| -> Result<Vec<RankRun>> {
        let (rank, size) = model.rank_and_size();
        if rank == 0 {
            eprintln!("{label}: {size} ranks");
        }
        let mine = rank_run(model)?;
        Ok(model.finish_and_gather(vec![mine])?)
    };
    if m.training {
        o.run_training_same(ck, "bench settings", work, part)
    } else {
        o.run_same(ck, "bench settings", work, part)
    }
}
