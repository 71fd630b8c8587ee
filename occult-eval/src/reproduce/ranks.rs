//! Where the recipe's ranks run: threads of this process (local), or
//! one of the processes mpirun started (mpi), where rank 0 alone writes files and reports and
//! the others read what it wrote after a barrier.

use super::recipe::Recipe;
use crate::context::Backend;
use anyhow::{bail, Result};
use std::path::Path;

/// Where this process stands: the recipe's ranks are threads of this process (local), or this
/// is one of the processes mpirun started (mpi), and then only rank 0 writes and reports.
pub struct Ranks {
    pub world: Option<std::sync::Arc<dyn occult_core::ep::comm::Communicator>>,
}

impl Ranks {
    pub fn new(r: &Recipe) -> Result<Self> {
        Ok(Ranks {
            world: match r.backend {
                Backend::Local => None,
                Backend::Mpi => Some(crate::context::backend::mpi_world(
                    r.devices,
                    std::time::Duration::from_secs_f64(r.comm_timeout),
                )?),
                Backend::Nccl => bail!(
                    "reproduce runs on the CPU (backend local or mpi); the GPU path runs \
                     through `occult bench`, `eval`, `loss` and `train` with --cuda and \
                     --backend nccl"
                ),
            },
        })
    }

    pub fn root(&self) -> bool {
        self.world.as_ref().is_none_or(|w| w.rank() == 0)
    }

    /// Whether this is one of mpirun's processes.
    pub fn mpi(&self) -> bool {
        self.world.is_some()
    }

    /// Waits until every rank is here (after rank 0 wrote files the others read).
    pub fn sync(&self) -> Result<()> {
        if let Some(w) = &self.world {
            w.barrier()?;
        }
        Ok(())
    }

    /// Rank 0's `value` on every rank: rank 0 wrote it to `file`, which the others read after
    /// the barrier.
    pub fn share<T>(
        &self,
        value: Option<T>,
        file: &Path,
        read: impl Fn(&Path) -> Result<T>,
    ) -> Result<T> {
        self.sync()?;
        match value {
            Some(v) => Ok(v),
            None => read(file),
        }
    }
}
