//! GPU parity (features `cuda`, and `nccl` for the communicator): the five families' forward
//! passes on CUDA against the CPU reference in f32 and bf16, gradients of a next-token loss,
//! the expert-parallel layer's forward and backward on a GPU in f32 and bf16 (over threads and
//! over NCCL), the pre-reduction kernel and the padded experts against their candle-op
//! references, a model expert-parallel on a GPU, the memory check on a GPU, and the NCCL
//! communicator on one rank (self send and receive). They need a CUDA device:
//! `scripts/gpu-check.sh` runs them on a GPU machine. The CPU build does not compile this file.
#![cfg(feature = "cuda")]

use candle::{DType, Device, Tensor};
use occult_core::analysis::run_key::DispatchMode;
use occult_core::ep::comm::Communicator;
use occult_core::models::config::ModelConfig;
use occult_core::models::model::{DenseParts, Logits, Model, MoeSetup};
use occult_core::models::synth::SynthModel;
use occult_core::models::weights::Weights;
use occult_core::models::{Family, FAMILIES};
use occult_tests::compare::{max_abs_diff, mean_abs_diff, next_token_loss, scale};
use occult_tests::parity::{device_cases, Fixture, BF16_LAYER_BOUNDS};
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::sync::Arc;

fn gpu() -> Device {
    Device::new_cuda(0).expect("these tests need a CUDA device (ordinal 0)")
}

fn family(model_type: &str) -> &'static Family {
    FAMILIES
        .iter()
        .find(|f| f.model_type == model_type)
        .unwrap()
}

fn write(f: &'static Family, dir: &Path) -> ModelConfig {
    let mut s = SynthModel::tiny(f);
    s.layers = 2;
    s.seed = FAMILIES.iter().position(|g| *g == f).unwrap() as u64 + 11;
    s.write(dir).unwrap().0
}

fn open(dir: &Path, device: &Device, dtype: DType) -> Weights {
    Weights::open_as(&[dir.join("model.safetensors")], device, dtype).unwrap()
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| r.random_range(0..vocab as u32)).collect()
}

fn ids(v: &[u32], device: &Device) -> Tensor {
    Tensor::from_slice(v, (1, v.len()), device).unwrap()
}

/// Logits of every position, as f32 on the CPU.
fn logits(m: &Model, seq: &[u32], device: &Device) -> Tensor {
    m.forward(&ids(seq, device), None, None, Logits::All)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap()
}

/// Largest and mean absolute difference, relative to the largest |value| of `want`.
fn errors(got: &Tensor, want: &Tensor) -> (f32, f32) {
    let scale = scale(want).max(1e-6);
    (
        max_abs_diff(got, want) / scale,
        mean_abs_diff(got, want) / scale,
    )
}

/// The model of `w` expert-parallel (occult dispatch) over `comm`, a group of one.
fn expert_parallel(w: &Weights, cfg: &ModelConfig, comm: Arc<dyn Communicator>) -> Model {
    let mut setup = MoeSetup::reference();
    setup.mode = Some(DispatchMode::Occult);
    Model::assemble(DenseParts::load(w, cfg).unwrap(), w, &setup, Some(comm)).unwrap()
}

#[test]
fn every_family_on_the_gpu_matches_the_cpu_reference() {
    let dev = gpu();
    for f in FAMILIES {
        let t = tempfile::tempdir().unwrap();
        let cfg = write(f, t.path());
        let seq = tokens(24, cfg.vocab_size, 5);
        let cpu = Model::load_reference(&open(t.path(), &Device::Cpu, DType::F32), &cfg).unwrap();
        let want = logits(&cpu, &seq, &Device::Cpu);
        // f32: the same sums in another order (cuBLAS); bf16: the CPU test's bounds for bf16
        // against f32 (see `half_precision_forwards_run_and_stay_close_to_f32`).
        for (dtype, max_bound, mean_bound) in
            [(DType::F32, 1e-4, 1e-5), (DType::BF16, 0.25, 0.0075)]
        {
            let m = Model::load_reference(&open(t.path(), &dev, dtype), &cfg).unwrap();
            let (max, mean) = errors(&logits(&m, &seq, &dev), &want);
            eprintln!("{f} {dtype:?} on the GPU: max error {max:.2e}, mean {mean:.2e} of scale");
            assert!(max <= max_bound && mean <= mean_bound, "{f} {dtype:?}");
        }
    }
}

#[test]
fn gradients_on_the_gpu_match_the_cpu() {
    let dev = gpu();
    let t = tempfile::tempdir().unwrap();
    let cfg = write(family("qwen3_moe"), t.path());
    let seq = tokens(48, cfg.vocab_size, 3);
    let grads = |device: &Device| {
        let mut w = open(t.path(), device, DType::F32);
        w.set_trainable(true);
        let m = Model::assemble(
            DenseParts::load(&w, &cfg).unwrap(),
            &w,
            &MoeSetup::reference(),
            None,
        )
        .unwrap();
        let logits = m
            .forward(&ids(&seq[..47], device), None, None, Logits::All)
            .unwrap()
            .squeeze(0)
            .unwrap();
        let target = Tensor::from_slice(&seq[1..], 47, device).unwrap();
        let g = next_token_loss(&logits, &target).backward().unwrap();
        m.params()
            .into_iter()
            .map(|(name, p)| {
                let gp = g.get(&p).unwrap_or_else(|| panic!("{name}: no gradient"));
                (name, gp.to_device(&Device::Cpu).unwrap())
            })
            .collect::<Vec<_>>()
    };
    let (want, got) = (grads(&Device::Cpu), grads(&dev));
    assert_eq!(want.len(), got.len());
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        let (max, _) = errors(g, w);
        assert!(
            max <= 1e-3,
            "{name}: gradient differs by {max:.2e} of its scale"
        );
    }
}

/// Training steps (cross-entropy and the load-balancing loss, backward, AdamW) of a model
/// expert-parallel on the GPU against the same on the CPU, with a resume from a state read
/// onto the CPU in between: the losses and the updated weights.
#[test]
fn training_steps_on_the_gpu_match_the_cpu() {
    use occult_core::models::config::{AuxForm, AuxLoss};
    use occult_train::examples::Example;
    use occult_train::optim::{AdamW, AdamWConfig, AdamWState};
    use occult_train::step::{train_step, StepSettings};
    let t = tempfile::tempdir().unwrap();
    let cfg = write(family("qwen3_moe"), t.path());
    let examples: Vec<Example> = (0..3)
        .map(|i| Example {
            ids: tokens(20, cfg.vocab_size, 30 + i),
            target: (0..20).map(|j| j > 0).collect(),
        })
        .collect();
    let train = |device: &Device| {
        let mut w = open(t.path(), device, DType::F32);
        w.set_trainable(true);
        let comm = Arc::new(occult_core::ep::comm::local::local_group(1).pop().unwrap());
        let m = expert_parallel(&w, &cfg, comm);
        let params = m.trainable_params();
        let mut opt = AdamW::new(&params, AdamWConfig::default()).unwrap();
        let mut settings = StepSettings::new(1e-3);
        settings.aux = Some(AuxLoss {
            form: AuxForm::AllLayers,
            coef: 0.01,
        });
        let share: Vec<&Example> = examples.iter().collect();
        let mut losses: Vec<f64> = (0..2)
            .map(|_| train_step(&m, &mut opt, &share, &settings).unwrap().loss)
            .collect();
        // A resume: the state as a checkpoint reads it (onto the CPU), then one more step.
        let state = opt.state().unwrap();
        let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
        let read = AdamWState {
            step: state.step,
            values: state.values.iter().map(cpu).collect(),
            moments: state
                .moments
                .iter()
                .map(|(a, b)| (cpu(a), cpu(b)))
                .collect(),
        };
        opt.load_state(read).unwrap();
        losses.push(train_step(&m, &mut opt, &share, &settings).unwrap().loss);
        let weights: Vec<Tensor> = params
            .iter()
            .map(|p| p.to_device(&Device::Cpu).unwrap())
            .collect();
        (losses, weights)
    };
    let (want_loss, want) = train(&Device::Cpu);
    let (got_loss, got) = train(&gpu());
    for (a, b) in got_loss.iter().zip(&want_loss) {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "loss {a} on the GPU, {b} on the CPU"
        );
    }
    assert_eq!(got.len(), want.len());
    // Adam moves a weight by about the learning rate whatever its gradient's size, so a
    // gradient within rounding of zero may step either way: at most 2 x 1e-3 per step (three
    // steps) for some weights, and a small mean.
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let (_, mean) = errors(g, w);
        let max = max_abs_diff(g, w);
        assert!(
            max <= 6e-3 && mean <= 1e-4,
            "parameter {i} after three steps: largest difference {max:.2e} (absolute), mean \
             {mean:.2e} of its scale"
        );
    }
}

#[test]
fn the_expert_parallel_layer_on_the_gpu_matches_the_reference() {
    let dev = gpu();
    for f in FAMILIES {
        let t = tempfile::tempdir().unwrap();
        let cfg = write(f, t.path());
        let seq = tokens(16, cfg.vocab_size, 9);
        let w = open(t.path(), &dev, DType::F32);
        let reference = Model::load_reference(&w, &cfg).unwrap();
        let want = logits(&reference, &seq, &dev);
        let comm = Arc::new(occult_core::ep::comm::local::local_group(1).pop().unwrap());
        let m = expert_parallel(&w, &cfg, comm);
        // cuBLAS may pick other algorithms for other row counts: f32 rounding apart.
        let (max, _) = errors(&logits(&m, &seq, &dev), &want);
        assert!(max <= 1e-4, "{f}: {max:.2e}");
    }
}

/// The expert-parallel layer of the parity fixtures on the GPU, forward and backward (the
/// output, the input's gradient and every weight's), in f32 and bf16, against the f32 CPU
/// reference; `comm` makes a group of one.
fn check_the_layer_on_the_gpu(comm: impl Fn(&Device) -> Arc<dyn Communicator>) {
    let dev = gpu();
    for c in device_cases() {
        let f = Fixture::new(&c);
        for (dtype, bounds) in [(DType::F32, (1e-4, 1e-5)), (DType::BF16, BF16_LAYER_BOUNDS)] {
            let run = f.run_on(&dev, dtype, comm(&dev)).unwrap();
            run.check(&f, bounds, &format!("seed {} {dtype:?} on the GPU", c.seed));
        }
    }
}

/// The memory check before loading reads the GPU's free memory, and refuses a model over it.
#[test]
fn the_memory_check_reads_the_gpus_free_memory() {
    use occult_core::models::memory::{check_on, gpu_free, Estimate};
    let dev = gpu();
    let free = gpu_free(&dev).expect("the driver reports free memory");
    assert!(free > 0);
    assert_eq!(gpu_free(&Device::Cpu), None);
    let need = |weights| Estimate {
        weights,
        training: 0,
    };
    assert!(check_on(&dev, need(1 << 20), None, 1, 1, "a small model").is_ok());
    let err = check_on(&dev, need(free + (1 << 30)), None, 1, 1, "a huge model").unwrap_err();
    assert!(err.to_string().contains("the GPU's free memory"), "{err}");
    // Two ranks on one GPU share it.
    let err = check_on(&dev, need(free / 2 + (1 << 30)), None, 2, 2, "a model").unwrap_err();
    assert!(err.to_string().contains("2 ranks on it"), "{err}");
}

/// The pre-reduction kernel against the same sums in candle ops, forward and backward.
#[test]
fn the_pre_reduction_kernel_matches_candle_ops() {
    occult_tests::grouping::pre_reduce_matches_candle_ops(&gpu());
}

/// The padded, batched expert compute (three strided batched cuBLAS products) against one
/// expert at a time, forward and backward.
#[test]
fn padded_experts_on_the_gpu_match_one_at_a_time() {
    occult_tests::grouping::padded_experts_match_one_at_a_time(&gpu());
}

#[test]
fn the_layer_forward_and_backward_on_the_gpu_match_the_cpu() {
    check_the_layer_on_the_gpu(|_| {
        Arc::new(occult_core::ep::comm::local::local_group(1).pop().unwrap())
    });
}

#[cfg(feature = "nccl")]
mod nccl {
    use super::*;
    use occult_core::ep::comm::nccl::{new_id, NcclComm};
    use std::time::Duration;

    /// One NCCL rank on `dev`: the model's own device, as the commands build it, so that
    /// the communicator's stream and the model's share one context (and cudarc's tracking of
    /// buffers across streams is on for both).
    fn one_rank(dev: &Device) -> NcclComm {
        NcclComm::with_id(
            dev.as_cuda_device().unwrap(),
            0,
            1,
            &new_id().unwrap(),
            Duration::from_secs(60),
        )
        .unwrap()
    }

    #[test]
    fn one_rank_sends_its_rows_to_itself() {
        let comm = one_rank(&gpu());
        let rows: Vec<u8> = (0..5 * 12).map(|i| i as u8).collect();
        let (back, counts) = comm.all_to_all_v_bytes(&rows, &[5], 12).unwrap();
        assert_eq!((back, counts), (rows.clone(), vec![5]));
        // Nothing to send is an exchange too.
        let (none, counts) = comm.all_to_all_v_bytes(&[], &[0], 12).unwrap();
        assert_eq!((none.len(), counts), (0, vec![0]));
        let st = comm.stats();
        assert_eq!((st.peers[0].rows_sent, st.peers[0].bytes_sent), (5, 60));
        assert_eq!(st.remote_bytes_sent(), 0);
        assert_eq!(st.collectives, 2);
        // Counts that do not cover the buffer are refused (after the counts' all-gather, before
        // any rows move).
        assert!(comm.all_to_all_v_bytes(&rows, &[4], 12).is_err());
    }

    #[test]
    fn rows_on_the_device_stay_there() {
        let dev = gpu();
        let comm = one_rank(&dev);
        // f32 rows of 4, received into a buffer of another stream (candle's, as the layer does).
        let rows: Vec<f32> = (0..3 * 4).map(|i| i as f32 * 0.5).collect();
        let dev_rows = comm.stream().clone_htod(&rows).unwrap();
        let theirs = dev.as_cuda_device().unwrap().cuda_stream();
        let (got, counts) = comm
            .all_to_all_v_device(&dev_rows.slice(..), &[3], 4, &theirs)
            .unwrap();
        assert_eq!(counts, vec![3]);
        let host = theirs.clone_dtoh(&got.slice(..rows.len())).unwrap();
        assert_eq!(host, rows);
        let st = comm.stats();
        assert_eq!((st.peers[0].rows_sent, st.peers[0].bytes_sent), (3, 48));
        // A row count that does not match the buffer is refused.
        assert!(comm
            .all_to_all_v_device(&dev_rows.slice(..), &[2], 4, &theirs)
            .is_err());
    }

    /// The layer's rows travel GPU to GPU through NCCL (self send and receive), forward and
    /// backward.
    #[test]
    fn the_layer_forward_and_backward_over_nccl_match_the_cpu() {
        let used = std::sync::Mutex::new(Vec::new());
        check_the_layer_on_the_gpu(|dev| {
            let comm = Arc::new(one_rank(dev));
            used.lock().unwrap().push(comm.clone());
            comm
        });
        for comm in used.into_inner().unwrap() {
            // Rows out and back, and the backward's two reverse exchanges, GPU to GPU (the
            // metadata and the layout check travel from host bytes).
            assert!(comm.direct_exchanges() >= 4, "{:?}", comm.stats());
            assert!(comm.stats().collectives > comm.direct_exchanges());
        }
    }

    #[test]
    fn a_model_runs_expert_parallel_over_nccl() {
        let dev = gpu();
        let t = tempfile::tempdir().unwrap();
        let cfg = write(family("olmoe"), t.path());
        let seq = tokens(16, cfg.vocab_size, 13);
        let w = open(t.path(), &dev, DType::F32);
        let want = logits(&Model::load_reference(&w, &cfg).unwrap(), &seq, &dev);
        let comm: Arc<dyn Communicator> = Arc::new(one_rank(&dev));
        let m = expert_parallel(&w, &cfg, comm.clone());
        let (max, _) = errors(&logits(&m, &seq, &dev), &want);
        assert!(max <= 1e-4, "{max:.2e}");
        assert!(
            comm.stats().collectives > 0,
            "the layer used the communicator"
        );
    }
}
