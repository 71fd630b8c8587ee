//! Communicators: how ranks exchange rows. The MoE layer sees only the [`Communicator`] trait.
//!
//! Backends: [`local`] (ranks as threads in one process, the default); with the `mpi` feature,
//! [`mpi`] (one process per rank under `mpirun`); with the `nccl` feature, `nccl` (one process
//! per GPU). Every backend counts exactly what it moves: rows, bytes and messages per peer, and
//! the time spent inside collectives. [`watchdog`] ends a process whose collective a peer never
//! joins (so the launcher stops the others instead of all of them hanging), and [`id_file`]
//! hands NCCL's unique id to every process through a shared file.

pub mod id_file;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(any(feature = "mpi", feature = "nccl"))]
pub mod watchdog;

use crate::{Error, Result};
use bytemuck::Pod;
use serde::Serialize;
use std::time::Duration;

pub use crate::analysis::cost::links::Exchange;

/// What one rank sent to and received from one peer (itself included, as local traffic).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PeerStats {
    pub rows_sent: u64,
    pub bytes_sent: u64,
    /// Non-empty sends to this peer.
    pub messages_sent: u64,
    pub rows_recv: u64,
    pub bytes_recv: u64,
}

/// Exact traffic statistics of one rank.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CommStats {
    pub rank: usize,
    /// Indexed by peer rank; entry `rank` is local traffic, which crosses no link.
    pub peers: Vec<PeerStats>,
    /// Every all-to-all, in order.
    pub exchanges: Vec<Exchange>,
    pub collectives: u64,
    /// Wall time inside collectives, waiting included.
    pub seconds: f64,
}

impl CommStats {
    pub fn new(rank: usize, size: usize) -> Self {
        CommStats {
            rank,
            peers: vec![PeerStats::default(); size],
            ..Default::default()
        }
    }

    /// Rows sent to other ranks.
    pub fn remote_rows_sent(&self) -> u64 {
        self.remote(|p| p.rows_sent)
    }

    /// Bytes sent to other ranks.
    pub fn remote_bytes_sent(&self) -> u64 {
        self.remote(|p| p.bytes_sent)
    }

    pub fn remote_messages_sent(&self) -> u64 {
        self.remote(|p| p.messages_sent)
    }

    fn remote(&self, f: impl Fn(&PeerStats) -> u64) -> u64 {
        self.peers
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != self.rank)
            .map(|(_, p)| f(p))
            .sum()
    }

    /// Records one all-to-all: rows and bytes sent to and received from each peer.
    pub fn record(&mut self, sent_rows: &[usize], recv_rows: &[usize], row_bytes: usize) {
        let mut ex = Exchange {
            bytes_to: Vec::with_capacity(sent_rows.len()),
            compute_before_s: 0.0,
        };
        for (p, (&s, &r)) in self.peers.iter_mut().zip(sent_rows.iter().zip(recv_rows)) {
            p.rows_sent += s as u64;
            p.bytes_sent += (s * row_bytes) as u64;
            p.messages_sent += u64::from(s > 0);
            p.rows_recv += r as u64;
            p.bytes_recv += (r * row_bytes) as u64;
            ex.bytes_to.push((s * row_bytes) as u64);
        }
        self.exchanges.push(ex);
    }
}

/// A rank's statistics behind a lock, as every backend keeps them.
#[derive(Debug)]
pub struct StatsCell {
    inner: std::sync::Mutex<CommStats>,
    /// When the last exchange ended (or the statistics were reset).
    last_end: std::sync::Mutex<std::time::Instant>,
    rank: usize,
    size: usize,
}

impl StatsCell {
    pub fn new(rank: usize, size: usize) -> Self {
        StatsCell {
            inner: std::sync::Mutex::new(CommStats::new(rank, size)),
            last_end: std::sync::Mutex::new(std::time::Instant::now()),
            rank,
            size,
        }
    }

    /// Records one finished all-to-all that started at `start`.
    pub fn record(
        &self,
        sent: &[usize],
        received: &[usize],
        row_bytes: usize,
        start: std::time::Instant,
    ) {
        let before = match self.last_end.lock() {
            Ok(mut last) => {
                let gap = start.saturating_duration_since(*last).as_secs_f64();
                *last = std::time::Instant::now();
                gap
            }
            Err(_) => 0.0,
        };
        if let Ok(mut st) = self.inner.lock() {
            st.record(sent, received, row_bytes);
            if let Some(ex) = st.exchanges.last_mut() {
                ex.compute_before_s = before;
            }
            st.collectives += 1;
            st.seconds += start.elapsed().as_secs_f64();
        }
    }

    pub fn snapshot(&self) -> CommStats {
        self.inner.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn reset(&self) {
        if let Ok(mut s) = self.inner.lock() {
            *s = CommStats::new(self.rank, self.size);
        }
        if let Ok(mut last) = self.last_end.lock() {
            *last = std::time::Instant::now();
        }
    }
}

/// Where received bytes go: the caller's buffer, sized once the receive counts are known, so
/// that backends write into it directly (no intermediate copy).
pub trait RecvBuffer {
    /// Makes room for exactly `bytes` bytes and returns them.
    fn prepare(&mut self, bytes: usize) -> &mut [u8];
}

impl<T: Pod> RecvBuffer for Vec<T> {
    fn prepare(&mut self, bytes: usize) -> &mut [u8] {
        let size = std::mem::size_of::<T>();
        assert!(
            bytes.is_multiple_of(size),
            "{bytes} bytes is not a whole number of elements"
        );
        self.clear();
        self.resize(bytes / size, T::zeroed());
        bytemuck::cast_slice_mut(self)
    }
}

/// A group of ranks that exchange rows. Methods are collective: every rank of the group must
/// call them in the same order, or the call fails after the backend's timeout.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;

    /// Variable all-to-all of rows of `row_bytes` bytes: the first `send_counts[0]` rows of
    /// `send` go to rank 0, the next `send_counts[1]` to rank 1, and so on. The received rows,
    /// concatenated in source-rank order, are written into `recv`; returns the row count from
    /// each source.
    fn all_to_all_v_into(
        &self,
        send: &[u8],
        send_counts: &[usize],
        row_bytes: usize,
        recv: &mut dyn RecvBuffer,
    ) -> Result<Vec<usize>>;

    /// [`Communicator::all_to_all_v_into`] into a new byte vector.
    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        row_bytes: usize,
    ) -> Result<(Vec<u8>, Vec<usize>)> {
        let mut recv = Vec::<u8>::new();
        let counts = self.all_to_all_v_into(send, send_counts, row_bytes, &mut recv)?;
        Ok((recv, counts))
    }

    /// This rank's statistics so far.
    fn stats(&self) -> CommStats;

    /// This communicator as `Any`, for a backend with more than this trait offers to find
    /// itself again (the NCCL one, through `nccl::nccl_of`: rows already on its GPU then move
    /// between GPUs directly, not through host memory); `None` for the others.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// Forgets the statistics (for example after a warm-up step).
    fn reset_stats(&self);

    /// Ranks per node, where the backend can tell: under MPI, the ranks that share memory with
    /// this one, when every node holds the same number and ranks are numbered node by node
    /// (`mpirun --map-by ppr:G:node`). `None` where it cannot tell (threads are one node).
    fn node_size(&self) -> Option<usize> {
        None
    }

    /// Gathers one equal-sized block from every rank, in rank order.
    fn all_gather_bytes(&self, block: &[u8]) -> Result<Vec<u8>> {
        let n = self.size();
        let send: Vec<u8> = (0..n).flat_map(|_| block.iter().copied()).collect();
        let (recv, counts) = self.all_to_all_v_bytes(&send, &vec![1; n], block.len())?;
        if counts.iter().any(|&c| c != 1) {
            return Err(Error::Comm(format!(
                "all_gather: blocks of different sizes across ranks ({counts:?})"
            )));
        }
        Ok(recv)
    }

    /// Every rank's `x`, in rank order.
    fn all_gather_u64(&self, x: u64) -> Result<Vec<u64>> {
        Ok(self
            .all_gather_bytes(&x.to_le_bytes())?
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect())
    }

    /// `x` summed over the ranks, in rank order (so every rank gets the same value).
    fn sum_f64(&self, x: f64) -> Result<f64> {
        Ok(self
            .all_gather_u64(x.to_bits())?
            .into_iter()
            .map(f64::from_bits)
            .sum())
    }

    /// Every rank's block length, in rank order.
    fn block_lens(&self, block: &[u8]) -> Result<Vec<usize>> {
        Ok(self
            .all_gather_u64(block.len() as u64)?
            .into_iter()
            .map(|l| l as usize)
            .collect())
    }

    /// Gathers one block of any size from every rank, in rank order.
    fn all_gather_v_bytes(&self, block: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.size();
        let lens = self.block_lens(block)?;
        let send: Vec<u8> = (0..n).flat_map(|_| block.iter().copied()).collect();
        let (recv, counts) = self.all_to_all_v_bytes(&send, &vec![block.len(); n], 1)?;
        if counts != lens {
            return Err(Error::Comm(format!(
                "all_gather_v: announced blocks of {lens:?} bytes, received {counts:?}"
            )));
        }
        let mut out = Vec::with_capacity(n);
        let mut at = 0;
        for len in counts {
            out.push(recv[at..at + len].to_vec());
            at += len;
        }
        Ok(out)
    }

    /// Gathers one block of any size from every rank on rank 0, in rank order (other ranks get
    /// an empty list). Moves at most 1 GiB per exchange, in as many rounds as it takes.
    fn gather_v_bytes_to_root(&self, block: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.size();
        let lens = self.block_lens(block)?;
        let piece = ((1usize << 30) / n.max(1)).max(1);
        let rounds = lens.iter().map(|l| l.div_ceil(piece)).max().unwrap_or(0);
        let root = self.rank() == 0;
        let mut out: Vec<Vec<u8>> = lens
            .iter()
            .map(|&l| Vec::with_capacity(if root { l } else { 0 }))
            .collect();
        for round in 0..rounds {
            let at = (round * piece).min(block.len());
            let part = &block[at..(at + piece).min(block.len())];
            let mut counts = vec![0; n];
            counts[0] = part.len();
            let (recv, from) = self.all_to_all_v_bytes(part, &counts, 1)?;
            let mut off = 0;
            for (src, len) in from.into_iter().enumerate() {
                out[src].extend_from_slice(&recv[off..off + len]);
                off += len;
            }
        }
        if !root {
            return Ok(Vec::new());
        }
        if out.iter().zip(&lens).any(|(o, &l)| o.len() != l) {
            return Err(Error::Comm(
                "gather: received blocks of the wrong size".into(),
            ));
        }
        Ok(out)
    }

    /// Element-wise sum of `x` over all ranks, in place (summed in rank order on every rank,
    /// so all ranks get bit-identical results).
    fn all_reduce_sum_f32(&self, x: &mut [f32]) -> Result<()> {
        // In pieces, so that one exchange moves at most 1 GiB (MPI counts are 32-bit).
        let piece = ((1usize << 28) / self.size().max(1)).max(1);
        let n = x.len();
        let pieces = n.div_ceil(piece).max(1);
        for p in 0..pieces {
            let part = &mut x[(p * piece).min(n)..((p + 1) * piece).min(n)];
            let all: Vec<f32> = bytes_to_vec(&self.all_gather_bytes(bytemuck::cast_slice(part))?);
            part.iter_mut().for_each(|v| *v = 0.0);
            for block in all.chunks_exact(part.len().max(1)).take(self.size()) {
                for (v, b) in part.iter_mut().zip(block) {
                    *v += b;
                }
            }
        }
        Ok(())
    }

    /// Waits until every rank has arrived.
    fn barrier(&self) -> Result<()> {
        self.all_gather_bytes(&[]).map(|_| ())
    }
}

/// Typed variable all-to-all over any plain-data element type.
pub fn all_to_all_v<T: Pod>(
    comm: &dyn Communicator,
    send: &[T],
    send_counts: &[usize],
    width: usize,
) -> Result<(Vec<T>, Vec<usize>)> {
    let mut recv = Vec::<T>::new();
    let counts = comm.all_to_all_v_into(
        bytemuck::cast_slice(send),
        send_counts,
        width * std::mem::size_of::<T>(),
        &mut recv,
    )?;
    Ok((recv, counts))
}

/// Checks a byte-level send: one count per rank, and counts that cover the buffer exactly.
pub fn check_send(size: usize, send: &[u8], send_counts: &[usize], row_bytes: usize) -> Result<()> {
    check_send_len(size, send.len(), send_counts, row_bytes)
}

/// [`check_send`] for a buffer of `len` bytes (one on a device, say).
pub fn check_send_len(
    size: usize,
    len: usize,
    send_counts: &[usize],
    row_bytes: usize,
) -> Result<()> {
    if send_counts.len() != size {
        return Err(Error::Comm(format!(
            "all_to_all_v: {} send counts for {size} ranks",
            send_counts.len()
        )));
    }
    if send_counts.iter().sum::<usize>() * row_bytes != len {
        return Err(Error::Comm(format!(
            "all_to_all_v: send counts {send_counts:?} of {row_bytes}-byte rows do not match a \
             {len}-byte buffer"
        )));
    }
    Ok(())
}

/// Copies bytes into a properly aligned vector of `T`.
pub fn bytes_to_vec<T: Pod>(bytes: &[u8]) -> Vec<T> {
    let n = bytes.len() / std::mem::size_of::<T>();
    let mut out = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut out)
        .copy_from_slice(&bytes[..n * std::mem::size_of::<T>()]);
    out
}

/// How long a rank waits for its peers before it gives up (a peer may have died).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
