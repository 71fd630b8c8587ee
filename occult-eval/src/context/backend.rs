//! Where ranks run: threads of this process, or one process per rank under `mpirun` (MPI, or
//! NCCL between GPUs); this process's communicator, made once and shared.

use anyhow::{bail, Result};

/// Where ranks run.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Ranks as threads of this process.
    Local,
    /// One process per rank under mpirun (feature `mpi`).
    Mpi,
    /// One process per GPU, rows exchanged over NCCL (feature `nccl`): under mpirun (with the
    /// `mpi` feature, which hands NCCL its unique id), or one rank without it.
    Nccl,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
        }
    }

    /// Whether every rank is a process of its own (it then loads only its own experts).
    pub fn process_per_rank(self) -> bool {
        self != Backend::Local
    }

    /// This process's communicator for `devices` ranks, on `device` (NCCL's GPU).
    pub fn world(
        self,
        devices: usize,
        device: &candle::Device,
        timeout: std::time::Duration,
    ) -> Result<std::sync::Arc<dyn occult_core::ep::comm::Communicator>> {
        match self {
            Backend::Local => bail!("the local backend runs its ranks as threads, not processes"),
            Backend::Mpi => mpi_world(devices, timeout),
            Backend::Nccl => nccl_world(devices, device, timeout),
        }
    }
}

/// The rank's index among the processes Open MPI's mpirun started on this node (0 without it).
pub fn local_rank() -> usize {
    std::env::var("OMPI_COMM_WORLD_LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// This process's NCCL communicator, once made (later calls share it).
#[cfg(feature = "nccl")]
static NCCL_WORLD: std::sync::Mutex<
    Option<std::sync::Arc<dyn occult_core::ep::comm::Communicator>>,
> = std::sync::Mutex::new(None);

/// This process's rank of an NCCL communicator on `device`: under Open MPI's mpirun one per
/// process, the unique id handed over through MPI; without mpirun a group of one.
#[cfg(feature = "nccl")]
pub fn nccl_world(
    devices: usize,
    device: &candle::Device,
    timeout: std::time::Duration,
) -> Result<std::sync::Arc<dyn occult_core::ep::comm::Communicator>> {
    use occult_core::ep::comm::nccl::{new_id, NcclComm};
    let mut world = NCCL_WORLD
        .lock()
        .map_err(|_| anyhow::anyhow!("the NCCL communicator's lock is poisoned"))?;
    let Some(gpu) = device.as_cuda_device().ok() else {
        bail!("--backend nccl runs on GPUs: give --cuda N");
    };
    if let Some(c) = &*world {
        if c.size() != devices {
            bail!(
                "--devices {devices}, but this process's NCCL group has {} ranks",
                c.size()
            );
        }
        let on = occult_core::ep::comm::nccl::nccl_of(c.as_ref()).map(|n| n.ordinal());
        if on != Some(gpu.cuda_stream().context().ordinal()) {
            bail!("this process's NCCL group runs on CUDA device {on:?}, not the one asked for");
        }
        return Ok(c.clone());
    }
    let comm = if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        let peers = mpi_world(devices, timeout)?;
        NcclComm::from_peers(gpu, peers.as_ref(), timeout)?
    } else if devices == 1 {
        NcclComm::with_id(gpu, 0, 1, &new_id()?, timeout)?
    } else {
        bail!(
            "--backend nccl with --devices {devices}: start one process per GPU with Open MPI's \
             `mpirun -np {devices}` (a build with the mpi feature too)"
        )
    };
    let comm: std::sync::Arc<dyn occult_core::ep::comm::Communicator> = std::sync::Arc::new(comm);
    *world = Some(comm.clone());
    Ok(comm)
}

/// Without the `nccl` feature: a clear error.
#[cfg(not(feature = "nccl"))]
pub fn nccl_world(
    _devices: usize,
    _device: &candle::Device,
    _timeout: std::time::Duration,
) -> Result<std::sync::Arc<dyn occult_core::ep::comm::Communicator>> {
    bail!("this occult was built without NCCL; rebuild with `--features occult-eval/nccl`")
}

/// The process's MPI communicator once initialised (MPI allows one initialisation per process).
#[cfg(feature = "mpi")]
static WORLD: std::sync::Mutex<Option<std::sync::Arc<dyn occult_core::ep::comm::Communicator>>> =
    std::sync::Mutex::new(None);

/// This process's rank among those mpirun started, checked against `--devices`. MPI is
/// initialised once per process (with the first call's timeout); later calls share it, and
/// [`finalize_mpi`] ends it.
#[cfg(feature = "mpi")]
pub fn mpi_world(
    devices: usize,
    timeout: std::time::Duration,
) -> Result<std::sync::Arc<dyn occult_core::ep::comm::Communicator>> {
    use occult_core::ep::comm::Communicator;
    use std::sync::Arc;
    let mut world = WORLD
        .lock()
        .map_err(|_| anyhow::anyhow!("the MPI communicator's lock is poisoned"))?;
    let comm = match &*world {
        Some(c) => c.clone(),
        None => {
            let c: Arc<dyn Communicator> = Arc::new(
                occult_core::ep::comm::mpi::MpiComm::init_with_timeout(timeout)?,
            );
            *world = Some(c.clone());
            c
        }
    };
    if comm.size() != devices {
        bail!(
            "--devices {devices} but mpirun started {} ranks; pass --devices {}",
            comm.size(),
            comm.size()
        );
    }
    Ok(comm)
}

/// Finalises MPI if this process initialised it (statics are never dropped, so without this
/// mpirun would see ranks exit without finalising). Call it once the command is done.
pub fn finalize_mpi() {
    #[cfg(feature = "mpi")]
    if let Ok(mut w) = WORLD.lock() {
        w.take();
    }
}

/// Without the `mpi` feature: a clear error.
#[cfg(not(feature = "mpi"))]
pub fn mpi_world(
    _devices: usize,
    _timeout: std::time::Duration,
) -> Result<std::sync::Arc<dyn occult_core::ep::comm::Communicator>> {
    bail!("this occult was built without MPI; rebuild with `--features occult-eval/mpi`")
}
