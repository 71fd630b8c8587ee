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


#[test]
fn instruction_examples_train_on_the_response_and_eos_only() {
    use occult_train::examples::Instruction;
    let ck = open("qwen3_moe", false);
    let tok = ck.tokenizer().unwrap();
    let eos = tok.eos[0];
    let r = Instruction {
        instruction: "Name a colour.".into(),
        input: String::new(),
        output: " Blue is a colour.".into(),
    };
    let ex = r.encode(tok, 512, false).unwrap().unwrap();
    let prompt = tok.encode(&r.prompt(), false).unwrap();
    // The prompt's tokens carry no loss; everything after, EOS included, does.
    assert_eq!(ex.target.iter().position(|&t| t), Some(prompt.len()));
    assert!(ex.target[prompt.len()..].iter().all(|&t| t));
    assert_eq!(*ex.ids.last().unwrap(), eos);
    assert_eq!(&ex.ids[..prompt.len()], &prompt[..]);
    // Cut at the sequence length; a prompt that fills it leaves nothing to train on.
    let cut = r.encode(tok, prompt.len() + 2, false).unwrap().unwrap();
    assert_eq!((cut.ids.len(), cut.targets()), (prompt.len() + 2, 2));
    assert!(r.encode(tok, prompt.len(), false).unwrap().is_none());
}

#[test]
fn plain_text_packs_into_windows_with_eos_between_documents() {
    use occult_train::examples::pack_text;
    let ck = open("qwen3_moe", false);
    let tok = ck.tokenizer().unwrap();
    let docs = vec!["the cat sat".to_string(), "on the mat".to_string()];
    let all: usize = docs
        .iter()
        .map(|d| tok.encode(d, false).unwrap().len() + 1)
        .sum();
    let windows = pack_text(&docs, tok, 4, false).unwrap();
    assert_eq!(
        windows.iter().map(|w| w.ids.len()).sum::<usize>(),
        all - (all % 4 == 1) as usize
    );
    assert!(windows.iter().all(|w| w.ids.len() <= 4 && !w.target[0]));
    assert!(windows
        .iter()
        .flat_map(|w| &w.ids)
        .any(|&t| t == tok.eos[0]));
    assert!(pack_text(&docs, tok, 1, false).is_err());
}
