//! A watchdog for the multi-process backends (MPI, NCCL), whose collectives block until every
//! rank has joined: one that does not finish within the timeout (a peer died, or took another
//! path) ends this process with a clear message and [`WATCHDOG_EXIT`], so that the launcher
//! stops the other ranks instead of all of them hanging.

use crate::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Exit status of a rank whose watchdog fired.
pub const WATCHDOG_EXIT: i32 = 3;

/// The clock of the collective in progress, watched by a thread of its own.
pub struct Watchdog {
    /// Milliseconds since `epoch` when the current collective started; 0 when idle.
    busy_since: Arc<AtomicU64>,
    epoch: Instant,
}

impl Watchdog {
    /// Starts the watching thread for rank `rank`.
    pub fn start(rank: usize, timeout: Duration) -> Result<Self> {
        let busy_since = Arc::new(AtomicU64::new(0));
        let epoch = Instant::now();
        let watch = busy_since.clone();
        std::thread::Builder::new()
            .name("occult-comm-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(200));
                let since = watch.load(Ordering::Acquire);
                if since == 0 {
                    continue;
                }
                let now = epoch.elapsed().as_millis() as u64;
                if now.saturating_sub(since) > timeout.as_millis() as u64 {
                    eprintln!(
                        "error: communicator: rank {rank}: a collective did not finish within \
                         {:.0} s (a peer may have died); exiting",
                        timeout.as_secs_f64()
                    );
                    // _exit, not exit: no atexit handlers (MPI's among them) may run while
                    // another thread is blocked inside a collective.
                    // SAFETY: _exit only ends the process.
                    unsafe { libc::_exit(WATCHDOG_EXIT) };
                }
            })
            .map_err(|e| Error::Comm(format!("starting the communicator's watchdog: {e}")))?;
        Ok(Watchdog { busy_since, epoch })
    }

    /// Starts the clock for one collective; it stops when the guard drops, on every path out
    /// of the collective.
    pub fn arm(&self) -> Armed<'_> {
        let now = (self.epoch.elapsed().as_millis() as u64).max(1);
        self.busy_since.store(now, Ordering::Release);
        Armed(&self.busy_since)
    }
}

/// A collective in progress (see [`Watchdog::arm`]).
pub struct Armed<'a>(&'a AtomicU64);

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}
