//! The `mpi` backend (cargo feature `mpi`): one process per rank under `mpirun`, with MPI's own
//! `MPI_Alltoallv` (through the `mpi` crate) after an `MPI_Alltoall` of the row counts.
//!
//! MPI is initialised once per process ([`MpiComm::init`]), with thread support, and every call
//! goes through one mutex. A [`Watchdog`] turns a collective that does not finish within the
//! timeout (a peer died, or took another path) into a clear error message and a non-zero exit;
//! `mpirun` then stops the other ranks.

use super::watchdog::Watchdog;
use super::{CommStats, Communicator, StatsCell, DEFAULT_TIMEOUT};
use crate::{Error, Result};
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::Communicator as _;
use mpi::traits::*;
use mpi::Threading;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use super::watchdog::WATCHDOG_EXIT;

struct Inner {
    world: SimpleCommunicator,
    // Dropped last: finalises MPI.
    _universe: Universe,
}

/// This process's rank in `MPI_COMM_WORLD`.
pub struct MpiComm {
    inner: Mutex<Inner>,
    rank: usize,
    size: usize,
    stats: StatsCell,
    watchdog: Watchdog,
    /// Ranks per node, from `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)` (see [`node_size`]).
    node_size: Option<usize>,
}

// SAFETY: MPI is initialised with at least `Threading::Serialized` and every MPI call is made
// while holding `inner`'s mutex, so no two threads ever call MPI at once.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

impl MpiComm {
    /// Initialises MPI (once per process) and starts the watchdog. Under plain execution
    /// (no `mpirun`) this is a group of one.
    pub fn init() -> Result<Self> {
        Self::init_with_timeout(DEFAULT_TIMEOUT)
    }

    pub fn init_with_timeout(timeout: Duration) -> Result<Self> {
        let (universe, level) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| Error::Comm("MPI was already initialised in this process".into()))?;
        if level < Threading::Serialized {
            return Err(Error::Comm(format!(
                "the MPI library offers thread level {level:?}; Occult needs Serialized"
            )));
        }
        let world = universe.world();
        let rank = world.rank() as usize;
        let size = world.size() as usize;
        let watchdog = Watchdog::start(rank, timeout)?;
        let node_size = node_size(&world);
        Ok(MpiComm {
            inner: Mutex::new(Inner {
                world,
                _universe: universe,
            }),
            rank,
            size,
            stats: StatsCell::new(rank, size),
            watchdog,
            node_size,
        })
    }
}

/// Ranks per node: the size of this rank's shared-memory group, when every rank's group has
/// that size and holds the ranks `node * G .. (node + 1) * G` (so that rank r is in node r / G,
/// as the two-level exchange numbers nodes). Collective over `world`.
fn node_size(world: &SimpleCommunicator) -> Option<usize> {
    let shared = world.split_shared(world.rank());
    let (g, local) = (shared.size(), shared.rank());
    let numbered = g > 0 && world.rank() % g == local && world.rank() - local + g <= world.size();
    let mine = [g, i32::from(numbered)];
    let mut all = vec![0i32; 2 * world.size() as usize];
    world.all_gather_into(&mine[..], &mut all[..]);
    all.chunks_exact(2)
        .all(|c| c[0] == g && c[1] == 1)
        .then_some(g as usize)
}

fn poisoned() -> Error {
    Error::Comm("the MPI communicator's lock is poisoned".into())
}

fn count(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| {
        Error::Comm(format!(
            "{what} of {n} bytes exceeds MPI's 2^31 - 1 limit for one exchange"
        ))
    })
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_to_all_v_into(
        &self,
        send: &[u8],
        send_counts: &[usize],
        row_bytes: usize,
        recv: &mut dyn super::RecvBuffer,
    ) -> Result<Vec<usize>> {
        let start = Instant::now();
        let n = self.size;
        super::check_send(n, send, send_counts, row_bytes)?;
        let guard = self.inner.lock().map_err(|_| poisoned())?;
        let _armed = self.watchdog.arm();
        // Rows and row widths from every peer.
        let mine: Vec<u64> = send_counts
            .iter()
            .flat_map(|&c| [c as u64, row_bytes as u64])
            .collect();
        let mut theirs = vec![0u64; 2 * n];
        guard.world.all_to_all_into(&mine[..], &mut theirs[..]);
        let recv_rows: Vec<usize> = theirs.chunks(2).map(|c| c[0] as usize).collect();
        let to_i32 = |rows: &[usize], what: &str| -> Result<(Vec<i32>, Vec<i32>)> {
            let counts = rows
                .iter()
                .map(|&r| count(r * row_bytes, what))
                .collect::<Result<Vec<i32>>>()?;
            let mut displs = Vec::with_capacity(n);
            let mut at = 0usize;
            for &c in &counts {
                displs.push(count(at, what)?);
                at += c as usize;
            }
            Ok((counts, displs))
        };
        let checked = (|| {
            if let Some(src) = theirs
                .chunks(2)
                .position(|c| c[0] > 0 && c[1] != row_bytes as u64)
            {
                return Err(Error::Comm(format!(
                    "all_to_all_v: rank {src} sent {}-byte rows, rank {} expected {row_bytes}",
                    theirs[2 * src + 1],
                    self.rank
                )));
            }
            Ok((
                to_i32(send_counts, "a send buffer")?,
                to_i32(&recv_rows, "a receive buffer")?,
            ))
        })();
        // Every rank learns whether any rank found a problem, so that all stop together
        // instead of some entering Alltoallv alone.
        let flag = i32::from(checked.is_err());
        let mut any = 0i32;
        guard
            .world
            .all_reduce_into(&flag, &mut any, mpi::collective::SystemOperation::max());
        let ((sc, sd), (rc, rd)) = match checked {
            Err(e) => return Err(e),
            Ok(_) if any != 0 => {
                return Err(Error::Comm(format!(
                    "all_to_all_v: another rank rejected this exchange (rank {} had no problem)",
                    self.rank
                )))
            }
            Ok(v) => v,
        };
        let recv_len = recv_rows.iter().sum::<usize>() * row_bytes;
        // Never hand MPI an empty slice: Rust's dangling pointer for an empty `[u8]` is 0x1,
        // which OpenMPI reads as MPI_IN_PLACE. One spare byte keeps pointers real; the counts
        // say that nothing is read from or written to it.
        let dummy = [0u8; 1];
        let mut spare = [0u8; 1];
        let send = if send.is_empty() { &dummy[..] } else { send };
        {
            let out = recv.prepare(recv_len);
            let out = if out.is_empty() { &mut spare[..] } else { out };
            let partition = Partition::new(send, &sc[..], &sd[..]);
            let mut out = PartitionMut::new(out, &rc[..], &rd[..]);
            guard.world.all_to_all_varcount_into(&partition, &mut out);
        }
        drop(guard);
        self.stats.record(send_counts, &recv_rows, row_bytes, start);
        Ok(recv_rows)
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    fn reset_stats(&self) {
        self.stats.reset()
    }

    fn node_size(&self) -> Option<usize> {
        self.node_size
    }

    fn barrier(&self) -> Result<()> {
        let guard = self.inner.lock().map_err(|_| poisoned())?;
        let _armed = self.watchdog.arm();
        guard.world.barrier();
        Ok(())
    }
}
