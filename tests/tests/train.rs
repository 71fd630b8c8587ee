//! Fine-tuning building blocks across ranks: the global gradient norm of D ranks on the union of
//! their batches equals one device's, and clipping by it scales every rank alike.

use occult_core::analysis::run_key::DispatchMode;
use occult_core::ep::comm::local::run_local_with_timeout;
use occult_core::ep::comm::Communicator;
use occult_tests::data_parallel::{gradient_shares, open, rank_step, reference_step, setup};
use occult_tests::storage::{relayout, relayout_sized, ExpertStorage};
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
        // Held to the sum of squares over every trainable tensor, each once (one device has no
        // copies), with the experts' share in it.
        let mut squares = (0.0, 0.0);
        for (name, p) in reference.params() {
            if let Some(g) = grads.get(&p).filter(|_| p.is_variable()) {
                let g = g.to_dtype(candle::DType::F64).unwrap();
                let s = g
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
                squares.0 += s;
                squares.1 += if name.contains(".experts.") { s } else { 0.0 };
            }
        }
        assert!(squares.1 > 0.0, "{arch}: no expert gradient");
        assert!(
            ((want - squares.0.sqrt()) / want).abs() < 1e-9,
            "{arch}: {want} vs {squares:?}"
        );
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

/// Runs `steps` optimiser steps of a global batch of 4 on `d` ranks (`None`: one device, the
/// reference mode); returns every rank's trainable tensors by name (experts as the full rows
/// of the expert ids each rank owns), the frozen attention tensors, and the step reports.
type Trained = (
    std::collections::BTreeMap<String, Vec<f32>>,
    Vec<Vec<f32>>,
    Vec<occult_train::step::StepReport>,
);

fn train_on(arch: &str, d: Option<(usize, DispatchMode)>, steps: u64, lr: f64) -> Trained {
    train_with(arch, d, steps, lr, &[9; 6], None)
}

/// [`train_on`] on sequences of `lens` tokens, with the load-balancing loss `aux`.
fn train_with(
    arch: &str,
    d: Option<(usize, DispatchMode)>,
    steps: u64,
    lr: f64,
    lens: &[usize],
    aux: Option<occult_core::models::config::AuxLoss>,
) -> Trained {
    train_full(arch, d, None, steps, lr, lens, aux)
}

/// [`train_with`], under a random placement with replicas (two more slots per device, copies
/// chosen by `replicas`) when given. Copies of an expert (on any rank, or twice on one) must
/// hold bit-identical values after the steps, or this panics.
fn train_full(
    arch: &str,
    d: Option<(usize, DispatchMode)>,
    replicas: Option<occult_core::analysis::placement::replicas::CopyRule>,
    steps: u64,
    lr: f64,
    lens: &[usize],
    aux: Option<occult_core::models::config::AuxLoss>,
) -> Trained {
    use occult_core::models::model::{DenseParts, Model, MoeSetup};
    use occult_train::batches::{global_batch, rank_share};
    use occult_train::examples::Example;
    use occult_train::optim::{AdamW, AdamWConfig};
    use occult_train::step::{train_step, StepSettings};
    let mut ck = open(arch, false);
    ck.weights.set_trainable_only(ck.cfg.moe_prefixes());
    let seqs = occult_tests::data_parallel::sequences(lens, ck.cfg.vocab_size, 11);
    let examples: Vec<Example> = seqs
        .into_iter()
        .map(|ids| Example {
            target: (0..ids.len()).map(|i| i > 0).collect(),
            ids,
        })
        .collect();
    let flat = |t: &candle::Tensor| -> Vec<f32> {
        t.to_dtype(candle::DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let run = |m: &Model, rank: usize, size: usize| -> occult_core::Result<Trained> {
        let params: Vec<candle::Tensor> = m
            .params()
            .into_iter()
            .map(|(_, t)| t)
            .filter(|t| t.is_variable())
            .collect();
        let mut opt = AdamW::new(&params, AdamWConfig::default())
            .map_err(|e| occult_core::Error::invalid(e.to_string()))?;
        let mut reports = Vec::new();
        for step in 0..steps {
            let global = global_batch(examples.len(), 4, 5, step)
                .map_err(|e| occult_core::Error::invalid(e.to_string()))?;
            let share: Vec<&Example> = rank_share(&global, rank, size)
                .iter()
                .map(|&i| &examples[i])
                .collect();
            reports.push(
                train_step(
                    m,
                    &mut opt,
                    &share,
                    &StepSettings {
                        max_norm: Some(1.0),
                        aux,
                        ..StepSettings::new(lr)
                    },
                )
                .map_err(|e| occult_core::Error::invalid(e.to_string()))?,
            );
        }
        let mut trained = std::collections::BTreeMap::new();
        let mut frozen = Vec::new();
        for (name, t) in m.params() {
            if !t.is_variable() {
                if name.contains("self_attn") {
                    frozen.push(flat(&t));
                }
                continue;
            }
            if name.contains(".experts.") && size > 1 {
                // One entry per owned expert, named by its global id.
                let layer: usize = name.split('.').nth(2).unwrap().parse().unwrap();
                let mine = &m_locations(m, layer).experts_of[rank];
                for (slot, &e) in mine.iter().enumerate() {
                    let v = flat(&t.get(slot).unwrap());
                    if let Some(old) = trained.insert(format!("{name}[{e}]"), v.clone()) {
                        assert!(
                            same_bits(&old, &v),
                            "{name}[{e}]: two copies on rank {rank} differ"
                        );
                    }
                }
            } else if name.contains(".experts.") {
                for e in 0..t.dims()[0] {
                    trained.insert(format!("{name}[{e}]"), flat(&t.get(e).unwrap()));
                }
            } else {
                trained.insert(name, flat(&t));
            }
        }
        Ok((trained, frozen, reports))
    };
    match d {
        None => {
            let m = Model::load_reference(&ck.weights, &ck.cfg).unwrap();
            run(&m, 0, 1).unwrap()
        }
        Some((d, mode)) => {
            let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(21);
            let replicas = (0..ck.cfg.num_layers)
                .filter(|&l| ck.cfg.moe_layers[l] && replicas.is_some())
                .map(|l| {
                    let e = ck.cfg.moe.num_experts;
                    let map = occult_tests::parity::random_replicas(&mut rng, e, d, 2);
                    let rule = replicas.expect("asked for");
                    (l, occult_core::ep::Replicas { map, rule })
                })
                .collect();
            let setup = MoeSetup {
                mode: Some(mode),
                maps: occult_tests::placements::random_maps(&ck.cfg, d, 9),
                num_devices: d,
                prune: Default::default(),
                devices_per_node: (mode == DispatchMode::TwoLevel).then_some(2),
                replicas,
            };
            let out = run_local_with_timeout(
                d,
                Duration::from_secs(30),
                |comm: &Arc<dyn Communicator>| {
                    // Each rank loads its own copy of the replicated tensors: it updates them.
                    let dense = DenseParts::load(&ck.weights, &ck.cfg)?;
                    let m = Model::assemble(dense, &ck.weights, &setup, Some(comm.clone()))?;
                    run(&m, comm.rank(), d)
                },
            );
            let mut merged = std::collections::BTreeMap::new();
            let mut first = None;
            for (rank, r) in out.into_iter().enumerate() {
                let (trained, frozen, reports) = r.unwrap();
                for (k, v) in trained {
                    if let Some(old) = merged.insert(k.clone(), v.clone()) {
                        assert!(same_bits(&old, &v), "{k}: the copy on rank {rank} differs");
                    }
                }
                first.get_or_insert((frozen, reports));
            }
            let (frozen, reports) = first.unwrap();
            (merged, frozen, reports)
        }
    }
}

/// Whether two tensors' values are the same bits.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Where an EP model's MoE layer keeps each expert (each slot, under replicas).
fn m_locations(
    m: &occult_core::models::model::Model,
    layer: usize,
) -> occult_core::ep::ExpertLocations {
    use occult_core::models::model::{Mlp, MoeExec};
    match &m.layers[layer].mlp {
        Mlp::Moe(b) => match &b.exec {
            MoeExec::Parallel(ep) => ep.locations.clone(),
            MoeExec::Reference { .. } => unreachable!("an EP model"),
        },
        Mlp::Dense(_) => unreachable!("a MoE layer"),
    }
}

#[test]
fn d_ranks_take_the_steps_of_one_device_and_only_moe_tensors_move() {
    for arch in [
        "qwen2_moe",
        "glm4_moe",
        "deepseek_v3",
        "deepseek_v2",
        "gpt_oss",
        "gpt_oss_mxfp4",
    ] {
        d_ranks_take_one_devices_steps(arch);
    }
}

/// [`d_ranks_take_the_steps_of_one_device_and_only_moe_tensors_move`] for one family, in every
/// dispatch mode.
fn d_ranks_take_one_devices_steps(arch: &str) {
    let before = train_on(arch, None, 0, 0.0);
    let (one, frozen_one, rep_one) = train_on(arch, None, 3, 1e-3);
    assert_eq!(
        before.1, frozen_one,
        "frozen attention tensors stay bit-identical"
    );
    assert!(
        one.keys().all(|k| k.contains(".mlp.")),
        "only MoE blocks train"
    );
    let still: Vec<&String> = one
        .iter()
        .filter(|(k, v)| before.0[*k] == **v)
        .map(|(k, _)| k)
        .collect();
    // Only experts no token reached may stay put (a few, on 54 tokens).
    assert!(
        still.len() * 5 <= one.len() && still.iter().all(|k| k.contains(".experts.")),
        "{arch}: these did not move: {still:?}"
    );
    for (d, mode) in [
        (2, DispatchMode::Occult),
        (3, DispatchMode::Standard),
        (4, DispatchMode::Occult),
        (4, DispatchMode::TwoLevel),
    ] {
        let (many, _, rep) = train_on(arch, Some((d, mode)), 3, 1e-3);
        same_steps(
            (&one, &rep_one),
            (&many, &rep),
            &format!("{arch} D={d} {mode:?}"),
        );
        assert!(rep.iter().all(|r| r.ect >= 1.0 && r.ect <= d as f64));
    }
}

/// Under placements with replicas (random, two more slots per device, two copies on one
/// device now and then), D ranks take one device's steps: every copy of an expert ends
/// bit-identical to its others (checked in [`train_full`]) and within the tolerance of the
/// one-device run, as do the losses and the gradient norms (each expert counted once).
#[test]
fn replicated_experts_train_as_one_expert() {
    use occult_core::analysis::placement::replicas::CopyRule;
    let arch = "qwen2_moe";
    let lens = [9; 6];
    let (one, _, rep_one) = train_full(arch, None, None, 3, 1e-3, &lens, None);
    for (d, mode, rule) in [
        (2, DispatchMode::Occult, CopyRule::Cover),
        (4, DispatchMode::Standard, CopyRule::Sglang),
        (3, DispatchMode::Occult, CopyRule::Sglang),
    ] {
        let (many, _, rep) = train_full(arch, Some((d, mode)), Some(rule), 3, 1e-3, &lens, None);
        same_steps(
            (&one, &rep_one),
            (&many, &rep),
            &format!("D={d} {mode:?} {rule:?}"),
        );
    }
}

/// Summing the copies' gradients on one rank: a layer whose map replicates no expert is left
/// alone (an expert without a gradient keeps none), and a gradient whose shape is not its
/// experts' is refused.
#[test]
fn copy_gradients_leave_unreplicated_layers_alone_and_refuse_misshapen_ones() {
    use occult_core::analysis::placement::replicas::CopyRule;
    use occult_core::models::model::{DenseParts, Model, MoeSetup};
    let mut ck = open("qwen2_moe", false);
    ck.weights.set_trainable_only(ck.cfg.moe_prefixes());
    for extra in [0, 3] {
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(5);
        let e = ck.cfg.moe.num_experts;
        let setup = MoeSetup {
            mode: Some(DispatchMode::Standard),
            maps: occult_tests::placements::random_maps(&ck.cfg, 1, 9),
            num_devices: 1,
            prune: Default::default(),
            devices_per_node: None,
            replicas: (0..ck.cfg.num_layers)
                .filter(|&l| ck.cfg.moe_layers[l])
                .map(|l| {
                    let map = occult_tests::parity::random_replicas(&mut rng, e, 1, extra);
                    (
                        l,
                        occult_core::ep::Replicas {
                            map,
                            rule: CopyRule::Cover,
                        },
                    )
                })
                .collect(),
        };
        let out = run_local_with_timeout(
            1,
            Duration::from_secs(30),
            |comm: &Arc<dyn Communicator>| {
                let dense = DenseParts::load(&ck.weights, &ck.cfg)?;
                let m = Model::assemble(dense, &ck.weights, &setup, Some(comm.clone()))?;
                let experts: Vec<candle::Tensor> = m
                    .params()
                    .into_iter()
                    .filter(|(n, t)| n.contains(".experts.") && t.is_variable())
                    .map(|(_, t)| t)
                    .collect();
                assert!(!experts.is_empty());
                // A store holding no expert's gradient.
                let v = candle::Var::new(1f32, &candle::Device::Cpu)?;
                let mut grads = v.as_tensor().sqr()?.backward()?;
                m.sum_copy_grads(&mut grads)?;
                let untouched = experts.iter().all(|t| grads.get(t).is_none());
                let wrong = experts[0].flatten_all()?.narrow(0, 1, 4)?;
                grads.insert(&experts[0], wrong);
                Ok((
                    untouched,
                    m.sum_copy_grads(&mut grads).map_err(|e| e.to_string()),
                ))
            },
        );
        let (untouched, misshapen) = out.into_iter().next().unwrap().unwrap();
        if extra == 0 {
            assert!(untouched, "a layer without copies got gradients");
            assert!(misshapen.is_ok(), "{misshapen:?}");
        } else {
            assert!(!untouched, "copies without gradients get zeros");
            let e = misshapen.unwrap_err();
            assert!(
                e.contains("a gradient of shape [4] for experts of shape"),
                "{e}"
            );
        }
    }
}

/// Holds a D-rank run's tensors and step reports to one device's: the same tensors, each within
/// 1e-4 (Adam turns float noise in near-zero gradients into updates of up to lr per step: a
/// thirtieth of three steps' largest update), losses within 1e-5, gradient norms within 1e-4
/// relative, the same targets and tokens.
fn same_steps(
    (one, rep_one): (
        &std::collections::BTreeMap<String, Vec<f32>>,
        &[occult_train::step::StepReport],
    ),
    (many, rep): (
        &std::collections::BTreeMap<String, Vec<f32>>,
        &[occult_train::step::StepReport],
    ),
    label: &str,
) {
    assert_eq!(many.len(), one.len(), "{label}: the same tensors");
    for (k, v) in one {
        let err = v
            .iter()
            .zip(&many[k])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err < 1e-4, "{label} {k}: {err}");
    }
    for (a, b) in rep_one.iter().zip(rep) {
        assert!(
            (a.loss - b.loss).abs() < 1e-5,
            "{label}: loss {} vs {}",
            a.loss,
            b.loss
        );
        assert!(
            (a.grad_norm - b.grad_norm).abs() < 1e-4 * a.grad_norm.max(1.0),
            "{label}: gradient norm {} vs {}",
            a.grad_norm,
            b.grad_norm
        );
        assert_eq!((a.targets, a.tokens), (b.targets, b.tokens), "{label}");
    }
}

/// The load-balancing loss of step 0, by hand: each sequence of the global batch run alone (no
/// padding) with its routing recorded, then the family's formula in f64.
fn aux_by_hand(arch: &str, lens: &[usize], aux: occult_core::models::config::AuxLoss) -> f64 {
    use occult_core::models::config::AuxForm;
    use occult_core::models::model::{Logits, Model, RoutingRecorder};
    let ck = open(arch, false);
    let m = Model::load_reference(&ck.weights, &ck.cfg).unwrap();
    let seqs = occult_tests::data_parallel::sequences(lens, ck.cfg.vocab_size, 11);
    let (e, k) = (ck.cfg.moe.num_experts, ck.cfg.moe.top_k);
    // Per sequence, per MoE layer: (tokens, counts c_i, summed probabilities S_i).
    type Sums = (f64, Vec<f64>, Vec<f64>);
    let mut stats: Vec<Vec<Sums>> = Vec::new();
    for i in occult_train::batches::global_batch(lens.len(), 4, 5, 0).unwrap() {
        let s = &seqs[i][..seqs[i].len() - 1];
        let ids = candle::Tensor::from_slice(s, (1, s.len()), &candle::Device::Cpu).unwrap();
        let mut rec = RoutingRecorder::default();
        m.forward(&ids, None, Some(&mut rec), Logits::All).unwrap();
        let per_layer = rec
            .layers
            .values()
            .map(|r| {
                let mut c = vec![0.0; e];
                r.ids.iter().for_each(|&x| c[x as usize] += 1.0);
                let mut p = vec![0.0; e];
                for row in r.logits.chunks(e) {
                    let max = row.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
                    let z: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
                    for (pi, &x) in p.iter_mut().zip(row) {
                        *pi += (x as f64 - max).exp() / z;
                    }
                }
                (r.tokens as f64, c, p)
            })
            .collect();
        stats.push(per_layer);
    }
    let layers = stats[0].len();
    let term = |n: f64, c: &[f64], p: &[f64]| -> f64 {
        c.iter().zip(p).map(|(c, p)| (c / n) * (p / n)).sum::<f64>()
    };
    let sum_over_seqs = |l: usize| -> Sums {
        let n = stats.iter().map(|s| s[l].0).sum();
        let c = (0..e)
            .map(|i| stats.iter().map(|s| s[l].1[i]).sum())
            .collect();
        let p = (0..e)
            .map(|i| stats.iter().map(|s| s[l].2[i]).sum())
            .collect();
        (n, c, p)
    };
    let (e, k) = (e as f64, k as f64);
    match aux.form {
        AuxForm::AllLayers => {
            let all: Vec<_> = (0..layers).map(sum_over_seqs).collect();
            let n: f64 = all.iter().map(|x| x.0).sum();
            let c: Vec<f64> = (0..e as usize)
                .map(|i| all.iter().map(|x| x.1[i]).sum())
                .collect();
            let p: Vec<f64> = (0..e as usize)
                .map(|i| all.iter().map(|x| x.2[i]).sum())
                .collect();
            aux.coef * e * term(n, &c, &p)
        }
        AuxForm::PerLayer => (0..layers)
            .map(|l| {
                let (n, c, p) = sum_over_seqs(l);
                aux.coef * e / k * term(n, &c, &p)
            })
            .sum(),
        AuxForm::PerSequence => (0..layers)
            .map(|l| {
                let per_seq: f64 = stats
                    .iter()
                    .map(|s| aux.coef * e / k * term(s[l].0, &s[l].1, &s[l].2))
                    .sum();
                per_seq / stats.len() as f64
            })
            .sum(),
    }
}

#[test]
fn the_load_balancing_loss_is_the_familys_formula_and_the_same_on_d_ranks() {
    use occult_core::models::config::{AuxForm, AuxLoss};
    // Uneven lengths: every D pads differently, and the loss must not see it.
    let lens = [5, 9, 3, 12, 7, 4];
    for (arch, form) in [
        ("qwen2_moe", AuxForm::AllLayers),
        ("deepseek", AuxForm::PerSequence),
        ("deepseek", AuxForm::PerLayer),
    ] {
        let aux = AuxLoss { form, coef: 0.5 };
        let (one, _, rep_one) = train_with(arch, None, 2, 1e-3, &lens, Some(aux));
        let want = aux_by_hand(arch, &lens, aux);
        let got = rep_one[0].aux_loss.unwrap();
        assert!(
            (got - want).abs() < 1e-5 * want,
            "{arch} {form:?}: step loss {got}, by hand {want}"
        );
        // It changes the routers' updates.
        let (plain, _, rep_plain) = train_with(arch, None, 2, 1e-3, &lens, None);
        assert!(rep_plain[0].aux_loss.is_none());
        assert!((rep_plain[0].loss - rep_one[0].loss).abs() < 1e-9);
        let router = one
            .keys()
            .find(|k| k.ends_with(".mlp.gate.weight"))
            .unwrap();
        assert_ne!(one[router], plain[router], "{arch}: {router}");
        for (d, mode) in [(2, DispatchMode::Occult), (4, DispatchMode::Standard)] {
            let (many, _, rep) = train_with(arch, Some((d, mode)), 2, 1e-3, &lens, Some(aux));
            for (a, b) in rep_one.iter().zip(&rep) {
                let (x, y) = (a.aux_loss.unwrap(), b.aux_loss.unwrap());
                assert!(
                    (x - y).abs() < 1e-6 * x,
                    "{arch} {form:?} D={d}: {x} vs {y}"
                );
            }
            for (k, v) in &one {
                // D ranks add in another order than one, and AdamW divides by the root of the
                // squared gradients: where an element's gradients cancel across the two steps,
                // a rounding-level difference moves its update by a fraction of a step (lr,
                // 1e-3; measured up to 1.2e-4 on one element of ~50k, the rest under 1.6e-5).
                // A tensor that is reduced wrongly moves by about a step in most elements.
                let errs: Vec<f32> = v.iter().zip(&many[k]).map(|(a, b)| (a - b).abs()).collect();
                let worst = errs.iter().cloned().fold(0.0, f32::max);
                let off = errs.iter().filter(|&&e| e > 2e-5).count();
                assert!(
                    worst < 5e-4 && off * 1000 <= errs.len().max(1000),
                    "{arch} {form:?} D={d} {k}: largest difference {worst}, {off} of {} over 2e-5",
                    errs.len()
                );
            }
        }
    }
}

#[test]
fn the_loss_falls_on_a_tiny_model() {
    let (_, _, reports) = train_on("mixtral", None, 40, 1e-2);
    let first = reports[0].loss;
    let last = reports.last().unwrap().loss;
    assert!(last < 0.7 * first, "loss {first} -> {last}");
}

#[test]
fn training_data_from_files_with_named_faults() {
    use occult_train::dataset::{build, read_records, DataKind};
    let t = tempfile::tempdir().unwrap();
    let ck = open("qwen3_moe", false);
    let tok = ck.tokenizer().unwrap();
    let alpaca = t.path().join("alpaca.jsonl");
    std::fs::write(
        &alpaca,
        "{\"instruction\": \"Say hi.\", \"input\": \"\", \"output\": \"hi\"}\n\
         {\"instruction\": \"Add.\", \"input\": \"2 3\", \"output\": \"5\"}\n",
    )
    .unwrap();
    let docs = read_records(alpaca.to_str().unwrap()).unwrap();
    let d = build(&docs, tok, 256, false).unwrap();
    assert_eq!(
        (d.kind, d.examples.len(), d.skipped),
        (DataKind::Instructions, 2, 0)
    );
    // A folder reads its train split; plain text packs.
    let dir = t.path().join("corpus");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("train.jsonl"),
        "{\"text\": \"the cat sat on the mat\"}\n",
    )
    .unwrap();
    let d = build(&read_records(dir.to_str().unwrap()).unwrap(), tok, 4, false).unwrap();
    assert_eq!(d.kind, DataKind::Text);
    assert!(d.examples.iter().all(|e| e.ids.len() <= 4));
    // Faults name the file and row.
    std::fs::write(
        &alpaca,
        "{\"instruction\": \"Say hi.\", \"output\": \"hi\"}\n{\"instruction\": \"x\"}\n",
    )
    .unwrap();
    let e = build(
        &read_records(alpaca.to_str().unwrap()).unwrap(),
        tok,
        256,
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("alpaca.jsonl row 1: no `output`"), "{e}");
    std::fs::write(&alpaca, "").unwrap();
    let e = read_records(alpaca.to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("no records"), "{e}");
    std::fs::write(&alpaca, "{\"question\": 1}\n").unwrap();
    let e = build(
        &read_records(alpaca.to_str().unwrap()).unwrap(),
        tok,
        256,
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("neither an instruction record"), "{e}");
    assert!(read_records("/no/such/file.jsonl").is_err());
}

/// Every family in every expert layout the loader reads: fine-tuned on 2 ranks, saved in the
/// source's own layout (the same tensor names and shapes), reloaded with the same logits.
#[test]
fn a_fine_tuned_model_saves_in_its_own_layout_and_reloads_with_the_same_logits() {
    for arch in occult_tests::data_parallel::ARCHS {
        for layout in [
            ExpertStorage::PerExpert,
            ExpertStorage::Fused,
            ExpertStorage::Transposed,
        ] {
            let t = tempfile::tempdir().unwrap();
            let src = t.path().join("source");
            if arch.starts_with("gpt_oss") {
                // One layout only (fused, interleaved; MXFP4 written unquantized): as stored.
                if layout != ExpertStorage::Fused {
                    continue;
                }
                copy_folder(&occult_tests::data_parallel::fixture_dir(arch), &src);
            } else {
                relayout(arch, layout, &src);
            }
            save_and_reload(&format!("{arch} {layout:?}"), &src, &t.path().join("tuned"));
        }
    }
}

/// The fused layouts where one stack's shape alone cannot tell them apart: H = 2I (the gate-up
/// stacks `[E, 2I, H]` and `[E, H, 2I]` agree) and H = I (the down stacks agree). Saved as the
/// source stores them, reloaded with the same logits.
#[test]
fn fused_layouts_whose_shapes_coincide_save_in_their_own_layout() {
    let arch = "olmoe";
    let h = occult_tests::data_parallel::open(arch, false)
        .cfg
        .hidden_size;
    for layout in [ExpertStorage::Fused, ExpertStorage::Transposed] {
        for i in [h / 2, h] {
            let t = tempfile::tempdir().unwrap();
            let src = t.path().join("source");
            relayout_sized(arch, layout, Some(i), &src);
            save_and_reload(
                &format!("{arch} {layout:?} I {i}"),
                &src,
                &t.path().join("tuned"),
            );
        }
    }
}

/// A copy of folder `from`'s files in `to`.
fn copy_folder(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for f in std::fs::read_dir(from).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, to.join(f.file_name().unwrap())).unwrap();
    }
}

/// Fine-tunes the checkpoint in `src` on 2 ranks, saves it to `out` and checks the reload.
fn save_and_reload(what: &str, src: &std::path::Path, out: &std::path::Path) {
    use occult_core::models::loader::Checkpoint;
    use occult_core::models::model::{DenseParts, Logits, Model, MoeSetup};
    use occult_train::examples::Example;
    use occult_train::optim::{AdamW, AdamWConfig};
    use occult_train::save::save_model;
    use occult_train::step::{train_step, StepSettings};
    let src_open = || Checkpoint::open(src.to_str().unwrap(), None, candle::DType::F32).unwrap();
    let arch = what;
    {
        let mut ck = src_open();
        ck.weights.set_trainable_only(ck.cfg.moe_prefixes());
        let seqs = occult_tests::data_parallel::sequences(&[9; 4], ck.cfg.vocab_size, 21);
        let probe = candle::Tensor::from_slice(&seqs[0], (1, 9), &candle::Device::Cpu).unwrap();
        let setup = MoeSetup {
            mode: Some(DispatchMode::Occult),
            maps: occult_tests::placements::random_maps(&ck.cfg, 2, 4),
            num_devices: 2,
            prune: Default::default(),
            devices_per_node: None,
            replicas: Default::default(),
        };
        let logits = run_local_with_timeout(
            2,
            Duration::from_secs(30),
            |comm: &Arc<dyn Communicator>| {
                let dense = DenseParts::load(&ck.weights, &ck.cfg)?;
                let m = Model::assemble(dense, &ck.weights, &setup, Some(comm.clone()))?;
                let params: Vec<candle::Tensor> = m
                    .params()
                    .into_iter()
                    .map(|(_, t)| t)
                    .filter(|t| t.is_variable())
                    .collect();
                let mut opt = AdamW::new(&params, AdamWConfig::default()).unwrap();
                let mine: Vec<Example> = seqs[comm.rank() * 2..comm.rank() * 2 + 2]
                    .iter()
                    .map(|s| Example {
                        ids: s.clone(),
                        target: (0..9).map(|i| i > 0).collect(),
                    })
                    .collect();
                for _ in 0..2 {
                    train_step(
                        &m,
                        &mut opt,
                        &mine.iter().collect::<Vec<_>>(),
                        &StepSettings::new(1e-2),
                    )
                    .unwrap();
                }
                save_model(&m, &ck, out).map_err(|e| occult_core::Error::invalid(e.to_string()))?;
                let l = m.forward(&probe, None, None, Logits::All)?;
                m.finish()?;
                Ok(l)
            },
        );
        let trained = out_ok(logits);
        let back = Checkpoint::open(out.to_str().unwrap(), None, candle::DType::F32).unwrap();
        assert!(
            back.tokenizer.is_some(),
            "{arch}: the tokenizer comes along"
        );
        let reloaded = Model::load_reference(&back.weights, &back.cfg)
            .unwrap()
            .forward(&probe, None, None, Logits::All)
            .unwrap();
        let diff = (&trained - &reloaded)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-4, "{arch}: {diff}");
        // Untrained tensors are copied bit for bit; trained ones changed; the names are the
        // source's.
        let source = src_open();
        // MXFP4 experts (gpt-oss) come back unquantized, under their unquantized names.
        let mut names: Vec<String> = source
            .weights
            .names()
            .filter(|n| !n.ends_with("_scales"))
            .map(|n| n.strip_suffix("_blocks").unwrap_or(n).to_string())
            .collect();
        names.sort();
        let saved: Vec<String> = {
            let mut v: Vec<String> = back.weights.names().map(String::from).collect();
            v.sort();
            v
        };
        assert_eq!(names, saved, "{arch}");
        for n in &names {
            if source.weights.contains(n) {
                assert_eq!(source.weights.shape(n), back.weights.shape(n), "{arch} {n}");
            }
        }
        let same = |n: &str| {
            let a = source
                .weights
                .raw(n)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let b = back
                .weights
                .raw(n)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            a == b
        };
        let l = (0..source.cfg.num_layers)
            .find(|&l| source.cfg.moe_layers[l])
            .unwrap();
        let names = source.cfg.family.names;
        // Attention stays as it was (its output projection: every attention has one).
        assert!(same(&format!("model.layers.{l}.self_attn.o_proj.weight")));
        assert!(
            !same(&format!(
                "model.layers.{l}.{}.{}.weight",
                names.block, names.router
            )),
            "{arch}: the router trained"
        );
    }
}

fn out_ok(r: Vec<occult_core::Result<candle::Tensor>>) -> candle::Tensor {
    let mut first = None;
    for (rank, x) in r.into_iter().enumerate() {
        let t = x.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        first.get_or_insert(t);
    }
    first.unwrap()
}
