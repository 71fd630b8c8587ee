//! The `nccl` backend (cargo feature `nccl`): one process per GPU, with NCCL's point-to-point
//! send and receive (through cudarc, as candle's `nccl` feature builds it). NCCL has no
//! variable all-to-all, so [`NcclComm::all_to_all_v_device`] first gathers every rank's row
//! counts (`ncclAllGather`), then sends and receives each peer's rows in one NCCL group, self
//! included.
//!
//! The ranks agree on a unique id before they build the communicator: rank 0 makes it and
//! hands it over through MPI under `mpirun` ([`NcclComm::from_peers`] over the MPI
//! communicator), or through a file on a file system every rank sees ([`NcclComm::from_file`]).
//!
//! The MoE layer's tensor rows on the GPU (dispatch, combine and their backward) move
//! between GPUs with [`NcclComm::all_to_all_v_device`], never through host memory (see
//! `ep::exchange`). The [`Communicator`] trait's calls on host bytes (routing metadata,
//! statistics, gathers) are copied to the GPU, exchanged there and copied back, so that every
//! other caller runs unchanged. Every call runs on the communicator's own CUDA stream behind
//! one mutex, and ends with that stream synchronised. A [`Watchdog`] turns a call
//! that does not finish within the timeout (a peer died) into an error message and an exit.
//!
//! Written and type-checked without a GPU (see `scripts/cuda-check.sh`); `scripts/gpu-check.sh`
//! runs its tests on one.

use super::watchdog::Watchdog;
use super::{CommStats, Communicator, RecvBuffer, StatsCell};
use crate::{Error, Result};
use candle::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DeviceRepr, DeviceSlice, ValidAsZeroBits,
};
use candle::cuda_backend::cudarc::nccl::{self, Comm, Id, NcclType};
use candle::CudaDevice;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use super::id_file::ID_BYTES;

/// The NCCL communicator, which is a raw handle: not `Send` in cudarc.
struct CommCell(Comm);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time, with its
// device's context current. Every use goes through `NcclComm::comm`'s mutex, after binding the
// context to the calling thread.
unsafe impl Send for CommCell {}

/// This process's rank of an NCCL communicator on one GPU.
pub struct NcclComm {
    comm: Mutex<CommCell>,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    stats: StatsCell,
    /// Exchanges of rows that were on a GPU already ([`NcclComm::all_to_all_v_device`]).
    direct: AtomicU64,
    watchdog: Watchdog,
}

/// The NCCL communicator `comm` is, if it is one.
pub fn nccl_of(comm: &dyn Communicator) -> Option<&NcclComm> {
    comm.as_any()?.downcast_ref::<NcclComm>()
}

fn nccl_error(what: &str, e: nccl::result::NcclError) -> Error {
    Error::Comm(format!("nccl: {what}: {:?}", e.0))
}

fn cuda_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Comm(format!("nccl: {what}: {e}"))
}

/// A new unique id, as bytes (rank 0 makes it; the others receive it).
pub fn new_id() -> Result<[u8; ID_BYTES]> {
    let id = Id::new().map_err(|e| nccl_error("making a unique id", e))?;
    // `c_char` is i8 or u8 by platform: the bits are kept either way.
    Ok(id.internal().map(|c| c as u8))
}

impl NcclComm {
    /// Rank `rank` of `size`, on `device`, from the unique id rank 0 made ([`new_id`]).
    pub fn with_id(
        device: &CudaDevice,
        rank: usize,
        size: usize,
        id: &[u8; ID_BYTES],
        timeout: Duration,
    ) -> Result<Self> {
        if size == 0 || rank >= size {
            return Err(Error::Comm(format!(
                "nccl: rank {rank} of a group of {size}"
            )));
        }
        let context = device.cuda_stream().context().clone();
        context
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the device", e))?;
        // A stream of its own: candle's default one is the calling thread's.
        let stream = context
            .new_stream()
            .map_err(|e| cuda_error("making a stream", e))?;
        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
        // Joining waits for every rank: a rank that never comes is the watchdog's too.
        let watchdog = Watchdog::start(rank, timeout)?;
        let comm = {
            let _armed = watchdog.arm();
            Comm::from_rank(stream.clone(), rank, size, id)
                .map_err(|e| nccl_error("joining the communicator", e))?
        };
        Ok(NcclComm {
            comm: Mutex::new(CommCell(comm)),
            stream,
            rank,
            size,
            stats: StatsCell::new(rank, size),
            direct: AtomicU64::new(0),
            watchdog,
        })
    }

    /// Rank `rank` of `size` on `device`, the unique id handed over through `path`: rank 0
    /// writes it (atomically), the others wait up to `timeout` for it to appear. The path must
    /// be new for each run (an id left by an earlier run would join ranks to a dead group).
    pub fn from_file(
        device: &CudaDevice,
        rank: usize,
        size: usize,
        path: &Path,
        timeout: Duration,
    ) -> Result<Self> {
        let id = if rank == 0 {
            let id = new_id()?;
            super::id_file::write(path, &id)?;
            id
        } else {
            super::id_file::read(path, timeout)?
        };
        Self::with_id(device, rank, size, &id, timeout)
    }

    /// This process's rank of a group whose ranks already talk through `peers` (MPI under
    /// `mpirun`, one process per GPU): rank 0 makes the unique id and every rank takes it from
    /// an all-gather over `peers`. Collective over `peers`.
    pub fn from_peers(
        device: &CudaDevice,
        peers: &dyn Communicator,
        timeout: Duration,
    ) -> Result<Self> {
        let mine = if peers.rank() == 0 {
            new_id()?
        } else {
            [0u8; ID_BYTES]
        };
        let all = peers.all_gather_bytes(&mine)?;
        let id: [u8; ID_BYTES] = all
            .get(..ID_BYTES)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| Error::Comm("nccl: rank 0's unique id did not arrive".into()))?;
        Self::with_id(device, peers.rank(), peers.size(), &id, timeout)
    }

    /// The stream every call of this communicator runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The GPU this communicator runs on.
    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// Variable all-to-all of rows already on the GPU: `send` holds `send_counts[p]` rows of
    /// `row_width` elements for each rank `p`, in rank order. Returns the received rows in
    /// source-rank order and the row count from each source. The receive buffer belongs to
    /// `out` (the stream its reader runs on, such as candle's), so that its reads and its
    /// release are ordered with that stream's work. Whatever wrote `send` must have finished
    /// (its stream is synchronised first); the rows have arrived when this returns.
    pub fn all_to_all_v_device<T: NcclType + DeviceRepr + ValidAsZeroBits>(
        &self,
        send: &CudaView<'_, T>,
        send_counts: &[usize],
        row_width: usize,
        out: &Arc<CudaStream>,
    ) -> Result<(CudaSlice<T>, Vec<usize>)> {
        self.direct.fetch_add(1, Ordering::Relaxed);
        self.exchange_on_device(send, send_counts, row_width, out)
    }

    /// How many exchanges took rows that were on a GPU already (not staged from host bytes).
    pub fn direct_exchanges(&self) -> u64 {
        self.direct.load(Ordering::Relaxed)
    }

    /// [`NcclComm::all_to_all_v_device`], for either kind of caller.
    fn exchange_on_device<T: NcclType + DeviceRepr + ValidAsZeroBits>(
        &self,
        send: &CudaView<'_, T>,
        send_counts: &[usize],
        row_width: usize,
        out: &Arc<CudaStream>,
    ) -> Result<(CudaSlice<T>, Vec<usize>)> {
        let start = Instant::now();
        let row_bytes = row_width * std::mem::size_of::<T>();
        let guard = self
            .comm
            .lock()
            .map_err(|_| Error::Comm("the NCCL communicator's lock is poisoned".into()))?;
        let comm = &guard.0;
        let _armed = self.watchdog.arm();
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the device", e))?;
        if !Arc::ptr_eq(send.stream(), &self.stream) {
            send.stream()
                .synchronize()
                .map_err(|e| cuda_error("waiting for the rows to send", e))?;
        }
        let recv_rows =
            self.exchange_counts(comm, send.len(), send_counts, row_width, row_bytes)?;
        let recv_len = recv_rows.iter().sum::<usize>() * row_width;
        // One spare element when nothing arrives: an empty buffer has no address.
        let mut recv = if recv_len == 0 {
            out.alloc_zeros::<T>(1)
        } else {
            // SAFETY: the receives below write every element (the counts tile the buffer)
            // before anything reads it, and T is plain numeric data.
            unsafe { out.alloc::<T>(recv_len) }
        }
        .map_err(|e| cuda_error("allocating the receive buffer", e))?;
        // The allocation is ordered on `out`; NCCL writes the buffer on this stream.
        self.stream
            .join(out)
            .map_err(|e| cuda_error("ordering the receive buffer", e))?;
        nccl::group_start().map_err(|e| nccl_error("starting a group", e))?;
        let sent = (|| -> Result<()> {
            let (mut at, mut at_recv) = (0, 0);
            for peer in 0..self.size {
                let (n_out, n_in) = (send_counts[peer] * row_width, recv_rows[peer] * row_width);
                if n_out > 0 {
                    comm.send(&send.slice(at..at + n_out), peer as i32)
                        .map_err(|e| nccl_error("send", e))?;
                }
                if n_in > 0 {
                    comm.recv(&mut recv.slice_mut(at_recv..at_recv + n_in), peer as i32)
                        .map_err(|e| nccl_error("receive", e))?;
                }
                at += n_out;
                at_recv += n_in;
            }
            Ok(())
        })();
        // The group is closed whatever happened inside it.
        let ended = nccl::group_end().map_err(|e| nccl_error("ending a group", e));
        sent?;
        ended?;
        // Load-bearing: NCCL enqueues a group's transfers at its end, after cudarc recorded the
        // buffers' events, so those events do not cover the transfers. Waiting here does:
        // nothing reads `recv` or reuses `send` before the rows have moved.
        self.stream
            .synchronize()
            .map_err(|e| cuda_error("waiting for the exchange", e))?;
        drop(guard);
        self.stats.record(send_counts, &recv_rows, row_bytes, start);
        Ok((recv, recv_rows))
    }

    /// Every rank's row counts and row size, gathered (`send_len` and `row_width` in elements,
    /// `row_bytes` for the comparison across ranks); checks them all on every rank, so that
    /// every rank takes the same decision (no rank enters the exchange alone). Returns the
    /// rows this rank receives from each source.
    fn exchange_counts(
        &self,
        comm: &Comm,
        send_len: usize,
        send_counts: &[usize],
        row_width: usize,
        row_bytes: usize,
    ) -> Result<Vec<usize>> {
        let n = self.size;
        let local = super::check_send_len(n, send_len, send_counts, row_width);
        // [ok, row_bytes, counts...] from every rank.
        let width = n + 2;
        let mut mine = vec![0u64; width];
        mine[0] = u64::from(local.is_ok());
        mine[1] = row_bytes as u64;
        if local.is_ok() {
            for (m, &c) in mine[2..].iter_mut().zip(send_counts) {
                *m = c as u64;
            }
        }
        let dev_mine = self
            .stream
            .clone_htod(&mine)
            .map_err(|e| cuda_error("copying the counts", e))?;
        let mut dev_all = self
            .stream
            .alloc_zeros::<u64>(width * n)
            .map_err(|e| cuda_error("allocating the counts", e))?;
        comm.all_gather(&dev_mine, &mut dev_all)
            .map_err(|e| nccl_error("gathering the counts", e))?;
        let all = self
            .stream
            .clone_dtoh(&dev_all)
            .map_err(|e| cuda_error("copying the counts back", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda_error("waiting for the counts", e))?;
        local?;
        let ranks: Vec<&[u64]> = all.chunks_exact(width).collect();
        if let Some(bad) = ranks.iter().position(|r| r[0] == 0) {
            return Err(Error::Comm(format!(
                "all_to_all_v: rank {bad} rejected this exchange (rank {} had no problem)",
                self.rank
            )));
        }
        // Decided from the gathered table alone, so that every rank decides the same: any
        // rows sent between two ranks that disagree on their width.
        for (src, r) in ranks.iter().enumerate() {
            if let Some(dst) = (0..n).find(|&d| r[2 + d] > 0 && r[1] != ranks[d][1]) {
                return Err(Error::Comm(format!(
                    "all_to_all_v: rank {src} sent {}-byte rows to rank {dst}, which expected {}",
                    r[1], ranks[dst][1]
                )));
            }
        }
        Ok(ranks.iter().map(|r| r[2 + self.rank] as usize).collect())
    }
}

impl Communicator for NcclComm {
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
        recv: &mut dyn RecvBuffer,
    ) -> Result<Vec<usize>> {
        // One spare byte, as in the receive buffer.
        let mut staged = send.to_vec();
        staged.push(0);
        let dev_send = self
            .stream
            .clone_htod(&staged)
            .map_err(|e| cuda_error("copying the rows to the GPU", e))?;
        let (dev_recv, rows) = self.exchange_on_device(
            &dev_send.slice(..send.len()),
            send_counts,
            row_bytes,
            &self.stream,
        )?;
        let len = rows.iter().sum::<usize>() * row_bytes;
        let host = self
            .stream
            .clone_dtoh(&dev_recv.slice(..len))
            .map_err(|e| cuda_error("copying the rows back", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda_error("waiting for the copy", e))?;
        recv.prepare(len).copy_from_slice(&host);
        Ok(rows)
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn reset_stats(&self) {
        self.stats.reset()
    }
}
