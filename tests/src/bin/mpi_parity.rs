//! EP-layer parity under MPI: run with `mpirun -np D mpi-parity [CASES]`. Every rank builds the
//! same fixtures from their seeds, computes the single-device reference, runs its part of the EP
//! layer on the `mpi` backend, and checks its outputs, input gradients, row counts and the
//! parameter gradients summed over ranks. Prints one `ok` line per rank and exits 0, or names
//! what differs and exits 1. `--die-rank R` makes rank R exit before the first collective;
//! `--stall-rank R` keeps rank R alive but away from the collectives, so that the others' watchdog
//! (`--timeout S` seconds, default 20) must end them (to check that nobody hangs).
//! `--nodes G` runs every case in two-level mode on nodes of G ranks (emulated nodes on one
//! host). Rank 0 first prints the node size MPI reports (`node size G`: the ranks sharing
//! memory, from `MPI_Comm_split_type`). `--replicas` runs every case (in a flat mode, unpruned)
//! under a random placement with replicas, copies chosen by the cover rule on even seeds and
//! SGLang's on odd ones.

use occult_core::ep::comm::mpi::MpiComm;
use occult_core::ep::comm::Communicator;
use occult_tests::parity::{Case, Fixture};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use std::time::Duration;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let cases: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(12);
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|s| s.parse::<u64>().ok())
    };
    let die = flag("--die-rank").map(|r| r as usize);
    let stall = flag("--stall-rank").map(|r| r as usize);
    let timeout = Duration::from_secs(flag("--timeout").unwrap_or(20));
    let nodes = flag("--nodes").map(|g| g as usize);
    let replicas = args.iter().any(|a| a == "--replicas");
    let comm = match MpiComm::init_with_timeout(timeout) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let rank = comm.rank();
    let d = comm.size();
    if rank == 0 {
        println!("node size {:?}", comm.node_size());
    }
    let comm: Arc<dyn Communicator> = Arc::new(comm);
    if die == Some(rank) {
        eprintln!("rank {rank}: exiting on purpose (--die-rank)");
        std::process::exit(7);
    }
    if stall == Some(rank) {
        eprintln!("rank {rank}: stalling on purpose (--stall-rank)");
        std::thread::sleep(timeout * 5);
        std::process::exit(0);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    for seed in 0..cases as u64 {
        let e = [8, 16, 64][seed as usize % 3].max(d);
        let mut case = Case::random_with(&mut rng, seed, d, e);
        if let Some(g) = nodes {
            case.mode = occult_core::analysis::run_key::DispatchMode::TwoLevel;
            case.devices_per_node = Some(g);
            case.replicas = None;
        }
        if replicas {
            use occult_core::analysis::placement::replicas::CopyRule;
            use occult_core::analysis::run_key::DispatchMode;
            if case.mode == DispatchMode::TwoLevel {
                case.mode = DispatchMode::Occult;
            }
            case.prune = None;
            let rule = [CopyRule::Cover, CopyRule::Sglang][seed as usize % 2];
            case.replicas = Some((1 + seed as usize % 2, rule));
        }
        if let Err(msg) = check(&case, &comm) {
            eprintln!("error: rank {rank}: {msg} in {case:?}");
            std::process::exit(1);
        }
    }
    println!("rank {rank} of {d}: ok ({cases} cases)");
}

fn check(case: &Case, comm: &Arc<dyn Communicator>) -> Result<(), String> {
    let f = Fixture::new(case);
    let reference = f.reference();
    let got = f.run_rank(comm).map_err(|e| e.to_string())?;
    f.check_rank(&reference, comm.rank(), &got)?;
    // Sum each parameter's gradient over ranks (absent = zeros; presence counted too).
    let mut summed = Vec::new();
    for (i, g) in got.gparams.iter().enumerate() {
        let len = f.vars[i].as_tensor().elem_count();
        let mut v = g.clone().unwrap_or_else(|| vec![0.0; len]);
        v.push(if g.is_some() { 1.0 } else { 0.0 });
        comm.all_reduce_sum_f32(&mut v).map_err(|e| e.to_string())?;
        let present = v.pop().unwrap_or(0.0) > 0.0;
        summed.push(present.then_some(v));
    }
    f.check_params(&reference, &summed)
}
