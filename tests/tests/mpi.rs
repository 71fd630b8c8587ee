//! Multi-rank runs under a real `mpirun` (feature `mpi`): EP-layer parity on 2 and 4 ranks with
//! MPI's own all-to-all, and a rank that dies making the others fail instead of hanging.
#![cfg(feature = "mpi")]

use std::process::Command;
use std::time::{Duration, Instant};

/// `mpirun -np N BIN ARGS` with the flags these machines need (2 cores, root).
fn mpirun_bin(np: usize, bin: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new("mpirun")
        .args([
            "--oversubscribe",
            "--bind-to",
            "none",
            "--mca",
            "btl",
            "self,vader",
        ])
        .args(["-np", &np.to_string()])
        .arg(bin)
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("mpirun must be installed (apt-get install openmpi-bin libopenmpi-dev)")
}

fn mpirun(np: usize, args: &[&str]) -> std::process::Output {
    mpirun_bin(
        np,
        std::path::Path::new(env!("CARGO_BIN_EXE_mpi-parity")),
        args,
    )
}

/// Runs a job that must fail, soon; returns everything it printed.
fn failing_run(np: usize, args: &[&str]) -> String {
    let start = Instant::now();
    let out = mpirun(np, args);
    assert!(!out.status.success());
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "took {:?}",
        start.elapsed()
    );
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn parity_on(np: usize) {
    let out = mpirun(np, &["10"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "mpirun -np {np} failed:\n{stdout}\n{stderr}"
    );
    for r in 0..np {
        assert!(
            stdout.contains(&format!("rank {r} of {np}: ok")),
            "rank {r} did not report:\n{stdout}\n{stderr}"
        );
    }
}

#[test]
fn parity_under_mpirun_with_2_and_4_ranks() {
    parity_on(2);
    parity_on(4);
}

#[test]
fn a_dead_rank_fails_the_job_instead_of_hanging() {
    let all = failing_run(3, &["2", "--die-rank", "1"]);
    assert!(all.contains("rank 1: exiting on purpose"), "{all}");
}

#[test]
fn bench_layer_runs_under_mpirun() {
    let bin = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("occult");
    let args = [
        "bench",
        "layer",
        "--backend",
        "mpi",
        "--devices",
        "2",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--hidden",
        "32",
        "--intermediate",
        "16",
        "--tokens",
        "24",
        "--steps",
        "1",
        "--warmup",
        "0",
    ];
    let out = mpirun_bin(2, &bin, &args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Only rank 0 prints the table.
    assert_eq!(stdout.matches("occult / standard").count(), 1, "{stdout}");
    assert!(stdout.contains("(mpi backend)"), "{stdout}");
}

#[test]
fn a_stalled_rank_trips_the_watchdog_instead_of_hanging() {
    let all = failing_run(3, &["2", "--stall-rank", "2", "--timeout", "2"]);
    assert!(
        all.contains("a collective did not finish within 2 s"),
        "{all}"
    );
}
