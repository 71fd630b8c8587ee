//! Progress bars on stderr for long work (hidden when stderr is not a terminal).

use indicatif::{ProgressBar, ProgressStyle};

/// A bar of `len` steps labelled `what`, e.g. "layers".
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// [`bar`] on rank 0; a hidden bar on the other ranks (one bar per run, not one per rank).
pub fn rank_bar(rank: usize, len: u64, what: &str) -> ProgressBar {
    if rank == 0 {
        bar(len, what)
    } else {
        ProgressBar::hidden()
    }
}
