//! Fault injection for the tests of lost ranks. `OCCULT_FAULT_PAUSE=RANK:POINT` stops that rank
//! at that point of a training step (`forward`, `backward`) or of a save (`checkpoint`, after
//! its own part is written and before the others are told), prints its pid and waits there, so
//! that a test can kill it from outside at a known place while its peers are blocked in their
//! exchanges with it. Unset, a point costs one cached lookup.

use std::sync::OnceLock;

/// Stops here for good if `OCCULT_FAULT_PAUSE` names this rank and point.
pub fn pause_point(point: &str, rank: usize) {
    static SPEC: OnceLock<Option<(usize, String)>> = OnceLock::new();
    let spec = SPEC.get_or_init(|| {
        let v = std::env::var("OCCULT_FAULT_PAUSE").ok()?;
        let (r, p) = v.split_once(':')?;
        Some((r.trim().parse().ok()?, p.trim().to_string()))
    });
    if let Some((r, p)) = spec {
        if *r == rank && p == point {
            eprintln!(
                "rank {rank}: paused at the {point} (OCCULT_FAULT_PAUSE), pid {}",
                std::process::id()
            );
            loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }
    }
}
