//! Running a function on every rank's model: one in-process model in the reference mode, or D
//! ranks in the expert-parallel modes (threads of this process, or this process's rank under
//! `mpirun`), each holding the dense weights and only its own experts, and each running its own
//! share of the work (data + expert parallel: see `occult_core::models::data_parallel`).

use super::spec::ModelSpec;
use anyhow::{bail, Context, Result};
use occult_core::ep::comm::local::run_local_with_timeout;
use occult_core::ep::comm::Communicator;
use occult_core::models::data_parallel::fingerprint;
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::{DenseParts, Model};
use std::sync::Arc;
use std::time::Duration;

impl ModelSpec {
    /// How long a rank waits for its peers in one exchange.
    fn timeout(&self) -> Result<Duration> {
        if !(self.comm_timeout > 0.0 && self.comm_timeout.is_finite()) {
            bail!("--comm-timeout must be a positive number of seconds");
        }
        Ok(Duration::from_secs_f64(self.comm_timeout))
    }

    /// Runs `f` on every rank's model. Returns rank 0's result; under `--backend mpi` or `nccl`
    /// (a process per rank) the other processes get `None` (they print and write nothing). Any rank's error is reported with
    /// its rank.
    pub fn run<T, F>(&self, ck: &Checkpoint, f: F) -> Result<Option<T>>
    where
        T: Send,
        F: Fn(&Model) -> Result<T> + Sync,
    {
        self.run_with(ck, false, f)
    }

    /// [`ModelSpec::run`] in lockstep: before `f`, the ranks check that they hold the same
    /// `what` (a digest of `work`, its bytes), since each process of an `mpirun` job reads its
    /// own inputs.
    pub fn run_same<T, F>(
        &self,
        ck: &Checkpoint,
        what: &str,
        work: impl IntoIterator<Item = u8>,
        f: F,
    ) -> Result<Option<T>>
    where
        T: Send,
        F: Fn(&Model) -> Result<T> + Sync,
    {
        self.run_same_with(ck, false, what, work, f)
    }

    /// [`ModelSpec::run_same`] for training (see [`ModelSpec::run_training`]).
    pub fn run_training_same<T, F>(
        &self,
        ck: &Checkpoint,
        what: &str,
        work: impl IntoIterator<Item = u8>,
        f: F,
    ) -> Result<Option<T>>
    where
        T: Send,
        F: Fn(&Model) -> Result<T> + Sync,
    {
        self.run_same_with(ck, true, what, work, f)
    }

    fn run_same_with<T, F>(
        &self,
        ck: &Checkpoint,
        own_dense: bool,
        what: &str,
        work: impl IntoIterator<Item = u8>,
        f: F,
    ) -> Result<Option<T>>
    where
        T: Send,
        F: Fn(&Model) -> Result<T> + Sync,
    {
        let work = fingerprint(work);
        self.run_with(ck, own_dense, |m| {
            m.check_same_work(what, work)?;
            f(m)
        })
    }

    /// [`ModelSpec::run`] for training: every rank loads its own copy of the dense weights
    /// (the update is applied to each copy; threads must not share them).
    pub fn run_training<T, F>(&self, ck: &Checkpoint, f: F) -> Result<Option<T>>
    where
        T: Send,
        F: Fn(&Model) -> Result<T> + Sync,
    {
        self.run_with(ck, true, f)
    }

    fn run_with<T, F>(&self, ck: &Checkpoint, own_dense: bool, f: F) -> Result<Option<T>>
    where
        T: Send,
        F: Fn(&Model) -> Result<T> + Sync,
    {
        let setup = self.setup(ck)?;
        let timeout = self.timeout()?;
        if self.backend.process_per_rank() {
            if setup.mode.is_none() {
                bail!(
                    "--backend {} runs the expert-parallel modes: give --mode occult or standard",
                    self.backend.name()
                );
            }
            let comm = self
                .backend
                .world(self.devices, ck.weights.device(), timeout)?;
            let rank = comm.rank();
            let dense = DenseParts::load(&ck.weights, &ck.cfg)?;
            let m = Model::assemble(dense, &ck.weights, &setup, Some(comm))
                .with_context(|| format!("rank {rank}"))?;
            let v = f(&m).with_context(|| format!("rank {rank}"))?;
            return Ok((rank == 0).then_some(v));
        }
        let dense = DenseParts::load(&ck.weights, &ck.cfg)?;
        if setup.mode.is_none() {
            let m = Model::assemble(dense, &ck.weights, &setup, None)?;
            return f(&m).map(Some);
        }
        let results =
            run_local_with_timeout(self.devices, timeout, |comm: &Arc<dyn Communicator>| {
                // Training: rank 0 takes the loaded copy, the others load their own.
                let dense = if own_dense && comm.rank() > 0 {
                    DenseParts::load(&ck.weights, &ck.cfg)?
                } else {
                    dense.clone()
                };
                let m = Model::assemble(dense, &ck.weights, &setup, Some(comm.clone()))?;
                f(&m).map_err(|e| occult_core::Error::invalid(format!("{e:#}")))
            });
        let mut first = None;
        for (rank, r) in results.into_iter().enumerate() {
            match r {
                Ok(v) if rank == 0 => first = Some(v),
                Ok(_) => {}
                Err(e) => return Err(anyhow::Error::from(e).context(format!("rank {rank}"))),
            }
        }
        first.context("rank 0 returned nothing").map(Some)
    }
}
