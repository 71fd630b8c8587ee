//! Whole models data + expert parallel under MPI: run with `mpirun -np D mpi-model`. On every
//! committed fixture family and both exact modes, each rank runs its own share of sequences and
//! checks their logits against the one-device reference, then takes one training step on the
//! union batch and checks every gradient (see `occult_tests::data_parallel`). Prints one `ok`
//! line per rank and exits 0, or names what differs and exits 1. `--die-rank R --die-at
//! forward|backward` makes rank R exit there in the first gradient step, so that the others
//! must fail rather than hang (`--timeout S`, default 20).

use occult_core::analysis::run_key::DispatchMode;
use occult_core::ep::comm::mpi::MpiComm;
use occult_core::ep::comm::Communicator;
use occult_tests::data_parallel::{
    check_gradients, check_logits, gradient_shares, open, Die, ARCHS,
};
use std::sync::Arc;
use std::time::Duration;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let die_rank: Option<usize> = flag("--die-rank").and_then(|s| s.parse().ok());
    let die_at = match flag("--die-at").as_deref() {
        Some("forward") => Some(Die::BeforeForward),
        Some("backward") => Some(Die::BeforeBackward),
        _ => None,
    };
    let timeout = Duration::from_secs(flag("--timeout").and_then(|s| s.parse().ok()).unwrap_or(20));
    let comm = match MpiComm::init_with_timeout(timeout) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let (rank, d) = (comm.rank(), comm.size());
    let comm: Arc<dyn Communicator> = Arc::new(comm);
    let shares = gradient_shares(d);
    let mut first = true;
    for (a, arch) in ARCHS.iter().enumerate() {
        for mode in [DispatchMode::Occult, DispatchMode::Standard] {
            let seed = 10 * a as u64 + d as u64;
            let logits = check_logits(&open(arch, false), &comm, mode, seed);
            let die = (die_rank == Some(rank) && first)
                .then_some(die_at)
                .flatten();
            first = false;
            let grads = logits.and_then(|_| {
                check_gradients(&open(arch, true), &comm, mode, 100 + seed, &shares, die)
            });
            if let Err(msg) = grads {
                eprintln!("error: rank {rank}: {arch} {mode:?}: {msg}");
                std::process::exit(1);
            }
        }
    }
    println!(
        "rank {rank} of {d}: ok ({} families, both modes)",
        ARCHS.len()
    );
}
