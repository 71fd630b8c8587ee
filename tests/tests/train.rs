//! Fine-tuning building blocks across ranks: the global gradient norm of D ranks on the union of
//! their batches equals one device's, and clipping by it scales every rank alike.

use occult_core::ep::comm::local::run_local_with_timeout;
use occult_core::ep::comm::Communicator;
use occult_core::ep::dispatch::DispatchMode;
use occult_tests::data_parallel::{gradient_shares, open, rank_step, reference_step, setup};
use occult_train::grad_norm::{clip_global_norm, global_norm};
use std::sync::Arc;
use std::time::Duration;

#[test]
fn the_global_gradient_norm_of_d_ranks_is_one_devices() {
    for (a, arch) in ["qwen2_moe", "mixtral"].iter().enumerate() {
        let ck = open(arch, true);
        let seed = 300 + a as u64;
        let (reference, grads) = reference_step(&ck, 4, seed).unwrap();
        let want = global_norm(&reference, &grads).unwrap();
        assert!(want > 0.0);
        for (d, mode) in [(2, DispatchMode::Occult), (4, DispatchMode::Standard)] {
            let shares = gradient_shares(d);
            let setup = setup(&ck, d, mode, seed);
            let out = run_local_with_timeout(
                d,
                Duration::from_secs(20),
                |comm: &Arc<dyn Communicator>| {
                    let (m, mut grads) = rank_step(&ck, comm, &setup, seed, &shares, None)
                        .map_err(occult_core::Error::invalid)?;
                    let norm = global_norm(&m, &grads)
                        .map_err(|e| occult_core::Error::invalid(e.to_string()))?;
                    // Clipping to half the norm leaves a global norm of half (every rank scales).
                    clip_global_norm(&m, &mut grads, norm / 2.0)
                        .map_err(|e| occult_core::Error::invalid(e.to_string()))?;
                    let clipped = global_norm(&m, &grads)
                        .map_err(|e| occult_core::Error::invalid(e.to_string()))?;
                    Ok((norm, clipped))
                },
            );
            for (r, res) in out.into_iter().enumerate() {
                let (norm, clipped) = res.unwrap_or_else(|e| panic!("{arch} D={d} rank {r}: {e}"));
                assert!(
                    ((norm - want) / want).abs() < 1e-4,
                    "{arch} D={d} rank {r}: {norm} vs {want}"
                );
                assert!(
                    ((clipped - want / 2.0) / want).abs() < 1e-4,
                    "{arch} D={d}: {clipped}"
                );
            }
        }
    }
}
