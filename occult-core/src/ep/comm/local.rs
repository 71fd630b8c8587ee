//! The `local` backend: D ranks as threads of one process, exchanging buffers through shared
//! memory. Byte and row counts are exact. A rank that does not arrive within the timeout, or
//! one that panics, breaks the group: every other rank's call then fails with a clear error
//! instead of hanging.

use super::{CommStats, Communicator, StatsCell, DEFAULT_TIMEOUT};
use crate::{Error, Result};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// One posted block: rows, row width, and a copy of the bytes.
struct Post {
    rows: usize,
    row_bytes: usize,
    bytes: Vec<u8>,
}

struct Shared {
    size: usize,
    /// `mail[src * size + dst]`: what src posted for dst in the current collective.
    mail: Mutex<Vec<Option<Post>>>,
    barrier: Barrier,
    timeout: Duration,
}

/// A barrier with a timeout that can be broken (by a timeout or a dying rank).
struct Barrier {
    state: Mutex<BarrierState>,
    cv: Condvar,
    n: usize,
}

struct BarrierState {
    arrived: usize,
    generation: u64,
    broken: Option<String>,
}

impl Barrier {
    fn wait(&self, rank: usize, what: &str, timeout: Duration) -> Result<()> {
        let mut st = self.state.lock().map_err(|_| poisoned())?;
        if let Some(why) = &st.broken {
            return Err(Error::Comm(why.clone()));
        }
        let gen = st.generation;
        st.arrived += 1;
        if st.arrived == self.n {
            st.arrived = 0;
            st.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        while st.generation == gen && st.broken.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let why = format!(
                    "rank {rank}: peers did not reach {what} within {:.0} s (a rank may have \
                     died or taken a different path)",
                    timeout.as_secs_f64()
                );
                st.broken = Some(why.clone());
                self.cv.notify_all();
                return Err(Error::Comm(why));
            }
            st = self.cv.wait_timeout(st, left).map_err(|_| poisoned())?.0;
        }
        match &st.broken {
            Some(why) if st.generation == gen => Err(Error::Comm(why.clone())),
            _ => Ok(()),
        }
    }

    fn break_with(&self, why: String) {
        if let Ok(mut st) = self.state.lock() {
            st.broken.get_or_insert(why);
            self.cv.notify_all();
        }
    }
}

fn poisoned() -> Error {
    Error::Comm("a rank panicked while holding the communicator".into())
}

/// One rank's handle on a local group.
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
    stats: StatsCell,
}

/// Creates `size` connected ranks; hand one to each thread.
pub fn local_group(size: usize) -> Vec<LocalComm> {
    local_group_with_timeout(size, DEFAULT_TIMEOUT)
}

/// As [`local_group`], with a chosen timeout.
pub fn local_group_with_timeout(size: usize, timeout: Duration) -> Vec<LocalComm> {
    assert!(size > 0, "a group needs at least one rank");
    let shared = Arc::new(Shared {
        size,
        mail: Mutex::new((0..size * size).map(|_| None).collect()),
        barrier: Barrier {
            state: Mutex::new(BarrierState {
                arrived: 0,
                generation: 0,
                broken: None,
            }),
            cv: Condvar::new(),
            n: size,
        },
        timeout,
    });
    (0..size)
        .map(|rank| LocalComm {
            rank,
            shared: shared.clone(),
            stats: StatsCell::new(rank, size),
        })
        .collect()
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_to_all_v_into(
        &self,
        send: &[u8],
        send_counts: &[usize],
        row_bytes: usize,
        recv: &mut dyn super::RecvBuffer,
    ) -> Result<Vec<usize>> {
        let start = Instant::now();
        let n = self.shared.size;
        let me = self.rank;
        super::check_send(n, send, send_counts, row_bytes)?;
        {
            let mut mail = self.shared.mail.lock().map_err(|_| poisoned())?;
            let mut at = 0;
            for (dst, &rows) in send_counts.iter().enumerate() {
                let len = rows * row_bytes;
                mail[me * n + dst] = Some(Post {
                    rows,
                    row_bytes,
                    bytes: send[at..at + len].to_vec(),
                });
                at += len;
            }
        }
        let timeout = self.shared.timeout;
        self.shared.barrier.wait(me, "all_to_all_v", timeout)?;
        let mut recv_counts = vec![0; n];
        let mut mismatch = None;
        {
            let mut mail = self.shared.mail.lock().map_err(|_| poisoned())?;
            let posts: Vec<Post> = (0..n)
                .map(|src| {
                    mail[src * n + me]
                        .take()
                        .ok_or_else(|| Error::Comm(format!("rank {me}: nothing posted by {src}")))
                })
                .collect::<Result<_>>()?;
            drop(mail);
            let total: usize = posts.iter().map(|p| p.bytes.len()).sum();
            let out = recv.prepare(total);
            let mut at = 0;
            for (src, p) in posts.iter().enumerate() {
                if p.row_bytes != row_bytes && p.rows > 0 {
                    mismatch = Some((src, p.row_bytes));
                }
                recv_counts[src] = p.rows;
                out[at..at + p.bytes.len()].copy_from_slice(&p.bytes);
                at += p.bytes.len();
            }
        }
        // Everyone has collected before anyone posts again.
        self.shared.barrier.wait(me, "all_to_all_v", timeout)?;
        if let Some((src, width)) = mismatch {
            return Err(Error::Comm(format!(
                "all_to_all_v: rank {src} sent {width}-byte rows, rank {me} expected {row_bytes}"
            )));
        }
        self.stats
            .record(send_counts, &recv_counts, row_bytes, start);
        Ok(recv_counts)
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    fn reset_stats(&self) {
        self.stats.reset()
    }
}

/// Runs `f` on every rank of a new local group, one thread each; returns their results in rank
/// order. A rank that fails or panics breaks the group, so the others fail instead of hanging.
pub fn run_local<T, F>(size: usize, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(&Arc<dyn Communicator>) -> Result<T> + Sync,
{
    run_local_with_timeout(size, DEFAULT_TIMEOUT, f)
}

/// As [`run_local`], with a chosen timeout for the group's collectives.
pub fn run_local_with_timeout<T, F>(size: usize, timeout: Duration, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(&Arc<dyn Communicator>) -> Result<T> + Sync,
{
    let comms = local_group_with_timeout(size, timeout);
    // Each rank computes on its share of the cores, in a pool of its own, as a rank owns its
    // device: its kernels' parallel loops then run on its own workers (inline with one), never
    // handed across threads to a pool the other ranks' loops share.
    let per_rank = (rayon::current_num_threads() / size.max(1)).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || {
                    let shared = c.shared.clone();
                    let rank = c.rank;
                    let comm: Arc<dyn Communicator> = Arc::new(c);
                    let run = || match rayon::ThreadPoolBuilder::new()
                        .num_threads(per_rank)
                        .thread_name(move |i| format!("rank{rank}-{i}"))
                        .build()
                    {
                        Ok(pool) => pool.install(|| f(&comm)),
                        Err(_) => f(&comm),
                    };
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run))
                        .unwrap_or_else(|_| Err(Error::Comm(format!("rank {rank} panicked"))));
                    if let Err(e) = &r {
                        shared.barrier.break_with(format!("rank {rank} died: {e}"));
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Comm(format!("rank {rank} panicked"))))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ep::comm::all_to_all_v;

    #[test]
    fn variable_all_to_all_with_empty_peers_and_exact_stats() {
        let out = run_local(3, |c| {
            let me = c.rank() as u32;
            // Rank r sends r + d rows of width 2 to each d (so rank 0 sends nothing to itself).
            let counts: Vec<usize> = (0..3).map(|d| c.rank() + d).collect();
            let send: Vec<u32> = counts
                .iter()
                .enumerate()
                .flat_map(|(d, &n)| (0..n * 2).map(move |i| me * 100 + d as u32 * 10 + i as u32))
                .collect();
            let (recv, rc) = all_to_all_v(c.as_ref(), &send, &counts, 2)?;
            Ok((recv, rc, c.stats()))
        });
        for (me, r) in out.into_iter().enumerate() {
            let (recv, rc, stats) = r.unwrap();
            assert_eq!(rc, (0..3).map(|s| s + me).collect::<Vec<_>>());
            let expect: Vec<u32> = (0..3u32)
                .flat_map(|s| {
                    (0..(s as usize + me) * 2).map(move |i| s * 100 + me as u32 * 10 + i as u32)
                })
                .collect();
            assert_eq!(recv, expect);
            assert_eq!(stats.peers[1].rows_sent, (me + 1) as u64);
            assert_eq!(stats.peers[1].bytes_sent, ((me + 1) * 8) as u64);
            assert_eq!(stats.collectives, 1);
        }
    }

    #[test]
    fn gather_reduce_barrier() {
        let out = run_local(4, |c| {
            let mut x = vec![c.rank() as f32, 1.0];
            c.all_reduce_sum_f32(&mut x)?;
            c.barrier()?;
            let g = c.all_gather_bytes(&[c.rank() as u8])?;
            Ok((x, g))
        });
        for r in out {
            let (x, g) = r.unwrap();
            assert_eq!(x, vec![6.0, 4.0]);
            assert_eq!(g, vec![0, 1, 2, 3]);
        }
    }

    #[test]
    fn a_dead_or_absent_rank_is_an_error_not_a_hang() {
        let start = Instant::now();
        let out = run_local(3, |c| {
            if c.rank() == 1 {
                return Err(Error::invalid("rank 1 gives up"));
            }
            c.barrier()
        });
        assert!(out.iter().all(|r| r.is_err()));
        let msg = out[0].as_ref().unwrap_err().to_string();
        assert!(msg.contains("rank 1 died: rank 1 gives up"), "{msg}");
        assert!(start.elapsed() < Duration::from_secs(10));

        // A rank that panics.
        let out = run_local(2, |c| {
            if c.rank() == 0 {
                panic!("boom");
            }
            c.barrier()
        });
        assert!(out[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("panicked"));
        let msg = out[1].as_ref().unwrap_err().to_string();
        assert!(msg.contains("rank 0 died"), "{msg}");

        // A rank that never calls: the timeout fires.
        let comms = local_group_with_timeout(2, Duration::from_millis(200));
        let err = comms[0].barrier().unwrap_err().to_string();
        assert!(err.contains("did not reach"), "{err}");
    }

    #[test]
    fn mismatched_counts_are_rejected() {
        let out = run_local(2, |c| {
            c.all_to_all_v_bytes(&[0u8; 3], &[1, 1], 2).map(|_| ())
        });
        assert!(out[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("do not match"));
    }
}
