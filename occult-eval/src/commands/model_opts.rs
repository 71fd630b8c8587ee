//! The options every model command shares (`--model`, `--dtype`, and the expert-parallel ones
//! `--devices`, `--backend`, `--mode`, `--placement`, `--max-devices`, `--prune-rule`), and
//! running a function on the model's ranks: one in-process model in the reference mode, or D
//! ranks in the EP modes (threads in this process, or one process each under `mpirun`), each
//! holding the dense weights and only its own experts, and each running its own share of the
//! work (data + expert parallel: see `occult_core::models::data_parallel`).

use super::Backend;
use anyhow::{bail, Context, Result};
use candle::Device;
use occult_core::analysis::placement::Placement;
use occult_core::analysis::pruning::PruneRule;
use occult_core::analysis::similarity::SimilarityTable;
use occult_core::analysis::trace::Trace;
use occult_core::ep::comm::local::run_local_with_timeout;
use occult_core::ep::comm::Communicator;
use occult_core::ep::dispatch::DispatchMode;
use occult_core::ep::PruneSpec;
use occult_core::models::loader::{parse_dtype, Checkpoint};
use occult_core::models::memory;
use occult_core::models::model::{DenseParts, Model, MoeSetup};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How MoE blocks compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModeArg {
    /// The single-device reference (a plain loop over experts).
    Reference,
    /// Expert parallelism, one row per (token, expert).
    Standard,
    /// Expert parallelism, one row per (token, device), pre-reduced on the device.
    Occult,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PruneRuleArg {
    Router,
    Similarity,
}

/// Which model to load and how to run it.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelOpts {
    /// A model folder, or a Hugging Face model id already in the local cache.
    #[arg(long)]
    pub model: String,
    /// Revision of a cached hub model (a branch such as `main`, or a commit hash).
    #[arg(long)]
    pub revision: Option<String>,
    /// Compute dtype: f32, bf16 or f16. On a CPU with AVX2 or AVX-512, bf16 keeps the weights in
    /// bf16 (half the memory), which also halves what decode reads; with AMX it runs about twice
    /// as fast as f32. f16 runs on the portable path.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Run on CUDA device N (a build with `--features occult-eval/cuda`); the CPU by default.
    /// With `--backend nccl` under mpirun, the rank mpirun numbers r on its node runs on
    /// device N + r (N defaults to 0).
    #[arg(long, value_name = "N")]
    pub cuda: Option<usize>,
    /// Expert-parallel ranks: threads (`--backend local`), or the processes mpirun started
    /// (`--backend mpi` or `nccl`, where it must equal mpirun's -np).
    #[arg(long, default_value_t = 1)]
    pub devices: usize,
    /// local: ranks as threads of this process; mpi: one process per rank under mpirun (each
    /// loads the dense weights and only its own experts; feature `mpi`); nccl: one process per
    /// GPU, rows exchanged GPU to GPU (feature `nccl`; more than one rank under mpirun, with
    /// feature `mpi` too).
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    pub backend: Backend,
    /// Seconds a rank waits in one exchange for its peers before it gives up (a peer stalled;
    /// a peer that exits ends the job at once). Covers peers that load or compute slower.
    #[arg(long, default_value_t = 120.0)]
    pub comm_timeout: f64,
    /// MoE computation; default `reference` on one device, `occult` on more.
    #[arg(long, value_enum)]
    pub mode: Option<ModeArg>,
    /// Placement file (`occult place`); default: contiguous blocks of experts.
    #[arg(long)]
    pub placement: Option<PathBuf>,
    /// Collaboration pruning: each token's experts span at most this many devices.
    #[arg(long)]
    pub max_devices: Option<usize>,
    /// Pruning rule (with --max-devices).
    #[arg(long, value_enum, default_value_t = PruneRuleArg::Router)]
    pub prune_rule: PruneRuleArg,
    /// A trace with router logits (`occult profile`) to build the similarity rule's tables.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Refuse to load a model whose estimated memory (weights in --dtype, this rank's share of
    /// the experts under mpirun, and training state for train) is over this size: bytes, or
    /// with K, M, G or T (binary). Default: the memory available (MemAvailable and the cgroup
    /// limit), shared by the ranks of a node.
    #[arg(long, value_parser = occult_core::models::memory::parse_size)]
    pub max_memory: Option<u64>,
}

impl ModelOpts {
    /// `model` on one device in the reference mode, every other option at its default.
    pub fn local(model: &str) -> Self {
        ModelOpts {
            model: model.to_string(),
            revision: None,
            dtype: "f32".into(),
            cuda: None,
            devices: 1,
            backend: Backend::Local,
            comm_timeout: 120.0,
            mode: None,
            placement: None,
            max_devices: None,
            prune_rule: PruneRuleArg::Router,
            calibration: None,
            max_memory: None,
        }
    }

    /// The files and folders this reads: the model's folder (when it is one), the placement
    /// and the calibration trace; outputs must replace none of them.
    pub fn inputs(&self) -> Vec<PathBuf> {
        let model = PathBuf::from(&self.model);
        model
            .exists()
            .then_some(model)
            .into_iter()
            .chain(self.placement.clone())
            .chain(self.calibration.clone())
            .collect()
    }

    /// The effective mode.
    pub fn mode(&self) -> ModeArg {
        self.mode.unwrap_or(if self.devices > 1 {
            ModeArg::Occult
        } else {
            ModeArg::Reference
        })
    }

    /// Opens the checkpoint, refusing one that will not fit in memory (before any weight is
    /// read).
    pub fn open(&self) -> Result<Checkpoint> {
        let ck = self.open_header()?;
        self.check_memory(&ck, false)?;
        Ok(ck)
    }

    /// Opens the checkpoint's header, config and tokenizer without the memory check (for
    /// commands that read no weights, and for train, which checks its own need).
    pub fn open_header(&self) -> Result<Checkpoint> {
        let dtype = parse_dtype(&self.dtype)?;
        if self.revision.is_some() && std::path::Path::new(&self.model).is_dir() {
            bail!(
                "--revision picks a version of a hub model in the cache; {} is a folder, which \
                 has only the version it holds",
                self.model
            );
        }
        Checkpoint::open_on(
            &self.model,
            self.revision.as_deref(),
            dtype,
            &self.device()?,
        )
        .with_context(|| format!("loading model {}", self.model))
    }

    /// The device `--cuda` names (offset by the node-local rank under `--backend nccl`), or
    /// the CPU.
    pub fn device(&self) -> Result<Device> {
        pick_device(self.cuda, self.backend)
    }

    /// `device` in words: `cpu` or `cuda:N`.
    pub fn device_name(device: &Device) -> String {
        match device.location() {
            candle::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
            candle::DeviceLocation::Cpu => "cpu".into(),
            other => format!("{other:?}").to_lowercase(),
        }
    }

    /// Refuses a model that will not fit (see [`memory`]) before its weights are read;
    /// `train` adds gradients and optimiser state.
    pub fn check_memory(&self, ck: &Checkpoint, train: bool) -> Result<()> {
        let mpi = self.backend.process_per_rank();
        let ranks = if mpi { self.devices } else { 1 };
        let need = memory::estimate(&ck.weights, ck.weights.dtype(), ranks, train);
        // Ranks that mpirun put on this node share its memory.
        let local = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|_| mpi)
            .unwrap_or(1);
        let what = format!("model {} in {}", self.model, self.dtype);
        // A GPU is each rank's own under nccl; under mpi the node's ranks share `--cuda N`.
        let device = ck.weights.device();
        let sharing = if self.backend == Backend::Nccl {
            1
        } else {
            local
        };
        Ok(memory::check_on(
            device,
            need,
            self.max_memory,
            local,
            sharing,
            &what,
        )?)
    }

    /// The MoE setup these options ask for, checked against the model.
    pub fn setup(&self, ck: &Checkpoint) -> Result<MoeSetup> {
        let cfg = &ck.cfg;
        let e = cfg.moe.num_experts;
        let mode = self.mode();
        if self.devices == 0 {
            bail!("--devices must be at least 1");
        }
        if mode == ModeArg::Reference && self.devices > 1 {
            bail!("--mode reference runs on one device; use --mode occult or standard with --devices {}", self.devices);
        }
        let moe_layers: Vec<usize> = (0..cfg.num_layers).filter(|&l| cfg.moe_layers[l]).collect();
        let (maps, num_devices) = match &self.placement {
            Some(p) => {
                let pl = Placement::read(p)?;
                if pl.num_experts != e {
                    bail!(
                        "{}: the placement is for {} experts, the model has {e}",
                        p.display(),
                        pl.num_experts
                    );
                }
                if mode != ModeArg::Reference && pl.num_devices != self.devices {
                    bail!(
                        "{}: the placement is for {} devices, the run has --devices {}",
                        p.display(),
                        pl.num_devices,
                        self.devices
                    );
                }
                let mut maps = BTreeMap::new();
                for &l in &moe_layers {
                    let map = pl.layer(l).with_context(|| format!("{}", p.display()))?;
                    maps.insert(l, map.to_vec());
                }
                (maps, pl.num_devices)
            }
            None => {
                occult_core::analysis::placement::check_sizes(e, self.devices)?;
                (BTreeMap::new(), self.devices)
            }
        };
        let mut prune = BTreeMap::new();
        if self.max_devices.is_some() && num_devices == 1 {
            bail!(
                "--max-devices prunes across devices: give --devices D > 1, or a --placement \
                 to prune the one-device reference as that placement would"
            );
        }
        if self.calibration.is_some() && self.prune_rule != PruneRuleArg::Similarity {
            eprintln!("note: --calibration is only used by --prune-rule similarity");
        }
        if let Some(n) = self.max_devices {
            let rule = match self.prune_rule {
                PruneRuleArg::Router => PruneRule::Router,
                PruneRuleArg::Similarity => PruneRule::Similarity,
            };
            let calib = match (&self.calibration, rule) {
                (Some(p), _) => Some((p, Trace::read(p)?)),
                (None, PruneRule::Similarity) => bail!(
                    "--prune-rule similarity needs --calibration TRACE (router logits from `occult profile`)"
                ),
                (None, PruneRule::Router) => None,
            };
            for &l in &moe_layers {
                let similarity = match &calib {
                    Some((p, t)) if rule == PruneRule::Similarity => {
                        let lt = t.layer(l).with_context(|| {
                            format!("{}: no routing for MoE layer {l}", p.display())
                        })?;
                        let logits = lt.router_logits.as_ref().with_context(|| {
                            format!("{}: layer {l} has no router logits", p.display())
                        })?;
                        if t.meta.num_experts != e {
                            bail!(
                                "{}: the trace is for {} experts, the model has {e}",
                                p.display(),
                                t.meta.num_experts
                            );
                        }
                        Some(SimilarityTable::from_logits(logits, e)?)
                    }
                    _ => None,
                };
                prune.insert(
                    l,
                    PruneSpec {
                        rule,
                        max_devices: n,
                        similarity,
                    },
                );
            }
        }
        Ok(MoeSetup {
            mode: match mode {
                ModeArg::Reference => None,
                ModeArg::Standard => Some(DispatchMode::Standard),
                ModeArg::Occult => Some(DispatchMode::Occult),
            },
            maps,
            num_devices,
            prune,
        })
    }

    /// How long a rank waits for its peers in one exchange.
    fn timeout(&self) -> Result<Duration> {
        if !(self.comm_timeout > 0.0 && self.comm_timeout.is_finite()) {
            bail!("--comm-timeout must be a positive number of seconds");
        }
        Ok(Duration::from_secs_f64(self.comm_timeout))
    }

    /// Runs `f` on every rank's model. Returns rank 0's result; under `--backend mpi` or `nccl`
    /// (a process per rank) the other processes get `None` (they print and write nothing). Any rank's error is reported with
    /// its rank.
    pub fn run<T, F>(&self, ck: &Checkpoint, f: F) -> Result<Option<T>>
    where
        T: Send,
        F: Fn(&Model) -> Result<T> + Sync,
    {
        self.run_with(ck, false, f)
    }

    /// [`ModelOpts::run`] for training: every rank loads its own copy of the dense weights
    /// (the update is applied to each copy; threads must not share them).
    pub fn run_training<T, F>(&self, ck: &Checkpoint, f: F) -> Result<Option<T>>
    where
        T: Send,
        F: Fn(&Model) -> Result<T> + Sync,
    {
        self.run_with(ck, true, f)
    }

    fn run_with<T, F>(&self, ck: &Checkpoint, own_dense: bool, f: F) -> Result<Option<T>>
    where
        T: Send,
        F: Fn(&Model) -> Result<T> + Sync,
    {
        let setup = self.setup(ck)?;
        let timeout = self.timeout()?;
        if self.backend.process_per_rank() {
            if setup.mode.is_none() {
                bail!(
                    "--backend {} runs the expert-parallel modes: give --mode occult or standard",
                    self.backend.name()
                );
            }
            let comm = self
                .backend
                .world(self.devices, ck.weights.device(), timeout)?;
            let rank = comm.rank();
            let dense = DenseParts::load(&ck.weights, &ck.cfg)?;
            let m = Model::assemble(dense, &ck.weights, &setup, Some(comm))
                .with_context(|| format!("rank {rank}"))?;
            let v = f(&m).with_context(|| format!("rank {rank}"))?;
            return Ok((rank == 0).then_some(v));
        }
        let dense = DenseParts::load(&ck.weights, &ck.cfg)?;
        if setup.mode.is_none() {
            let m = Model::assemble(dense, &ck.weights, &setup, None)?;
            return f(&m).map(Some);
        }
        let results =
            run_local_with_timeout(self.devices, timeout, |comm: &Arc<dyn Communicator>| {
                // Training: rank 0 takes the loaded copy, the others load their own.
                let dense = if own_dense && comm.rank() > 0 {
                    DenseParts::load(&ck.weights, &ck.cfg)?
                } else {
                    dense.clone()
                };
                let m = Model::assemble(dense, &ck.weights, &setup, Some(comm.clone()))?;
                f(&m).map_err(|e| occult_core::Error::invalid(format!("{e:#}")))
            });
        let mut first = None;
        for (rank, r) in results.into_iter().enumerate() {
            match r {
                Ok(v) if rank == 0 => first = Some(v),
                Ok(_) => {}
                Err(e) => return Err(anyhow::Error::from(e).context(format!("rank {rank}"))),
            }
        }
        first.context("rank 0 returned nothing").map(Some)
    }
}

/// The device of `--cuda` under `backend`: CUDA device N (offset by the node-local rank under
/// `--backend nccl`, which needs a GPU), or the CPU.
pub fn pick_device(cuda: Option<usize>, backend: Backend) -> Result<Device> {
    let nccl = backend == Backend::Nccl;
    let base = match cuda {
        Some(n) => n,
        None if nccl => 0,
        None => return Ok(Device::Cpu),
    };
    if !candle::utils::cuda_is_available() {
        if nccl {
            bail!(
                "--backend nccl runs on GPUs: this occult was built without CUDA; rebuild with \
                 `--features occult-eval/nccl`"
            );
        }
        bail!(
            "--cuda {base}: this occult was built without CUDA; rebuild with `--features \
             occult-eval/cuda`"
        );
    }
    let n = match nccl {
        true => base
            .checked_add(super::local_rank())
            .with_context(|| format!("--cuda {base} plus this rank's place on its node"))?,
        false => base,
    };
    Device::new_cuda(n).with_context(|| format!("opening CUDA device {n}"))
}
