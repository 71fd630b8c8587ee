//! Whole models data + expert parallel on local ranks (threads), on the committed transformers
//! fixtures of all eight families: each rank runs its own sequences (uneven shares, one rank
//! with none) and every sequence's logits equal the one-device reference; and the gradients of
//! D ranks on the union of their batches equal one device's on the whole batch. The same checks
//! run under mpirun in `mpi.rs`.

use occult_core::analysis::run_key::DispatchMode;
use occult_core::ep::comm::local::run_local_with_timeout;
use occult_core::ep::comm::Communicator;
use occult_tests::data_parallel::{check_gradients, check_logits, gradient_shares, open, ARCHS};
use std::sync::Arc;
use std::time::Duration;

/// A peer that never arrives fails the test in seconds rather than hanging it.
const TIMEOUT: Duration = Duration::from_secs(20);

#[test]
fn every_rank_runs_its_own_sequences_and_matches_one_device() {
    for (a, arch) in ARCHS.iter().enumerate() {
        let ck = open(arch, false);
        for (d, mode) in [
            (1, DispatchMode::Occult),
            (2, DispatchMode::Standard),
            (3, DispatchMode::Occult),
            (4, DispatchMode::Standard),
            (4, DispatchMode::Occult),
            (4, DispatchMode::TwoLevel),
        ] {
            let out = run_local_with_timeout(d, TIMEOUT, |comm: &Arc<dyn Communicator>| {
                check_logits(&ck, comm, mode, 10 * a as u64 + d as u64)
                    .map_err(occult_core::Error::invalid)
            });
            let mut checked = 0;
            for (r, res) in out.into_iter().enumerate() {
                match res {
                    Ok(n) => checked += n,
                    Err(e) => panic!("{arch} D={d} {mode:?} rank {r}: {e}"),
                }
            }
            assert_eq!(checked, 6, "{arch} D={d}: every sequence runs once");
        }
    }
}

#[test]
fn gradients_of_d_ranks_on_the_union_batch_equal_one_device() {
    for (a, arch) in ARCHS.iter().enumerate() {
        let ck = open(arch, true);
        for (d, mode) in [
            (2, DispatchMode::Occult),
            (2, DispatchMode::Standard),
            (4, DispatchMode::Occult),
            (4, DispatchMode::Standard),
            (4, DispatchMode::TwoLevel),
        ] {
            let shares = gradient_shares(d);
            let out = run_local_with_timeout(d, TIMEOUT, |comm: &Arc<dyn Communicator>| {
                check_gradients(&ck, comm, mode, 100 + a as u64, &shares, None)
                    .map_err(occult_core::Error::invalid)
            });
            for (r, res) in out.into_iter().enumerate() {
                if let Err(e) = res {
                    panic!("{arch} D={d} {mode:?} rank {r}: {e}");
                }
            }
        }
    }
}
