//! What every result records about the software and the machine that made it.

use serde::Serialize;

/// Software version and machine of a result.
#[derive(Clone, Debug, Serialize)]
pub struct Provenance {
    pub occult_version: &'static str,
    pub git_commit: Option<String>,
    pub host: Option<String>,
    pub cpus: usize,
    pub os: &'static str,
    pub arch: &'static str,
}

/// Reads the provenance of the running binary.
pub fn provenance() -> Provenance {
    let git_commit = Some(env!("OCCULT_GIT_COMMIT"))
        .filter(|s| !s.is_empty())
        .map(String::from);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string());
    Provenance {
        occult_version: env!("CARGO_PKG_VERSION"),
        git_commit,
        host,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        os: std::env::consts::OS,
        arch: std::env::consts::ARCH,
    }
}
