//! One module per `occult` command, plus the helpers they share: flags, progress and printing;
//! the work is one call into the library.
//!
//! | module | command |
//! |---|---|
//! | [`trace`] | `occult trace synth`, `import`, `remap` |
//! | [`collab`] | `occult collab` |
//! | [`place`] | `occult place` |
//! | [`prune`] | `occult prune` |
//! | [`project`] | `occult project` |
//! | [`export`] | `occult export checkpoint`, `sglang` |
//! | [`profile`] | `occult profile` |
//! | [`generate`] | `occult generate` |
//! | [`loglik`] | `occult loglik` |
//! | [`eval`] | `occult eval` |
//! | [`loss`] | `occult loss` |
//! | [`train`] | `occult train` |
//! | [`model`] | `occult model synth`, `info`, `check`, `builtin` |
//! | [`bench`] | `occult bench` (every suite) |
//! | [`reproduce`] | `occult reproduce` |
//! | [`model_opts`] | the model flags every model command shares, turned into a `ModelSpec` |

pub mod bench;
pub mod collab;
pub mod eval;
pub mod export;
pub mod generate;
pub mod loglik;
pub mod loss;
pub mod model;
pub mod model_opts;
pub mod place;
pub mod profile;
pub mod project;
pub mod prune;
pub mod reproduce;
pub mod trace;
pub mod train;

use anyhow::{bail, Context, Result};
use occult_core::analysis::placement::{self, Placement};
use occult_core::analysis::trace::Trace;
use std::path::Path;

pub use crate::output::{check_io, with_provenance, write_json};

/// Reads and validates a trace.
pub fn load_trace(path: &Path) -> Result<Trace> {
    Ok(Trace::read(path)?)
}

/// The placement to analyse: a file, or the contiguous map on `devices` devices.
pub fn resolve_placement(
    trace: &Trace,
    devices: Option<usize>,
    file: Option<&Path>,
) -> Result<Placement> {
    match (devices, file) {
        (Some(_), Some(_)) => bail!("give either --devices or --placement, not both"),
        (None, None) => bail!("give --devices D (contiguous placement) or --placement FILE"),
        (Some(d), None) => {
            placement::check_sizes(trace.meta.num_experts, d)?;
            Ok(Placement::uniform(
                &trace.layer_ids(),
                placement::contiguous(trace.meta.num_experts, d),
                d,
                "contiguous",
            ))
        }
        (None, Some(p)) => {
            let pl = Placement::read(p)?;
            occult_core::analysis::check_placement_fits(trace, &pl)
                .with_context(|| format!("{} does not fit the trace", p.display()))?;
            Ok(pl)
        }
    }
}
