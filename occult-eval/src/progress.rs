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
