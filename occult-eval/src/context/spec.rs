//! [`ModelSpec`]: which model to load and how to run it, as a plain value (the commands build
//! it from their flags; the pipelines build it directly), and opening its checkpoint.

use super::backend::Backend;
use super::device::pick_device;
use anyhow::{bail, Context, Result};
use candle::Device;
use occult_core::analysis::placement::replicas::CopyRule;
use occult_core::analysis::placement::Placement;
use occult_core::analysis::pruning::{PruneLimit, PruneRule};
use occult_core::analysis::run_key::{MoeMode, RunKey};
use occult_core::analysis::trace::Trace;
use occult_core::models::config::ModelConfig;
use occult_core::models::loader::{parse_dtype, Checkpoint};
use occult_core::models::memory;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Which model to load and how to run it.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    /// A model folder, or a Hugging Face model id already in the local cache.
    pub model: String,
    /// Revision of a cached hub model.
    pub revision: Option<String>,
    /// Compute dtype: f32, bf16 or f16.
    pub dtype: String,
    /// CUDA device N (offset by the node-local rank under NCCL); the CPU when `None`.
    pub cuda: Option<usize>,
    /// Expert-parallel ranks.
    pub devices: usize,
    pub backend: Backend,
    /// Seconds a rank waits in one exchange for its peers.
    pub comm_timeout: f64,
    /// MoE computation; `None`: reference on one device, occult on more.
    pub mode: Option<MoeMode>,
    /// Where experts live; contiguous blocks when `None`.
    pub placement: Option<Placement>,
    /// The file the placement was read from, for reports and the input check.
    pub placement_file: Option<PathBuf>,
    /// Collaboration pruning: how far each token's experts may spread.
    pub prune: Option<PruneLimit>,
    /// Devices per node (rank r in node r / G): the node size of two-level dispatch, and of
    /// the row counts within and across nodes; under MPI the ranks of one host by default.
    pub devices_per_node: Option<usize>,
    pub prune_rule: PruneRule,
    /// A trace with router logits to build the similarity rule's tables (its file).
    pub calibration: Option<PathBuf>,
    /// The same trace already in memory (read from `calibration` when `None`).
    pub calibration_trace: Option<Arc<Trace>>,
    /// The most memory the model may need (bytes); the memory available by default.
    pub max_memory: Option<u64>,
    /// Under a placement with replicas: which copy of an expert a token uses.
    pub copy_rule: CopyRule,
}

impl ModelSpec {
    /// The device limit of device-limited pruning (`None` without, or when limited by nodes).
    pub fn max_devices(&self) -> Option<usize> {
        match self.prune {
            Some(PruneLimit::Devices(n)) => Some(n),
            _ => None,
        }
    }

    /// `model` on one device in the reference mode, every other option at its default.
    pub fn local(model: &str) -> Self {
        ModelSpec {
            model: model.to_string(),
            revision: None,
            dtype: "f32".into(),
            cuda: None,
            devices: 1,
            backend: Backend::Local,
            comm_timeout: 120.0,
            mode: None,
            placement: None,
            placement_file: None,
            prune: None,
            devices_per_node: None,
            prune_rule: PruneRule::Router,
            calibration: None,
            calibration_trace: None,
            max_memory: None,
            copy_rule: CopyRule::Cover,
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
            .chain(self.placement_file.clone())
            .chain(self.calibration.clone())
            .collect()
    }

    /// Checks before any work that every output can be written and replaces none of this
    /// model's inputs nor `more`.
    pub fn check_io(&self, more: &[Option<&Path>], outputs: &[Option<&Path>]) -> Result<()> {
        let inputs = self.inputs();
        let mut all: Vec<Option<&Path>> = inputs.iter().map(|p| Some(p.as_path())).collect();
        all.extend_from_slice(more);
        crate::output::check_io(&all, outputs)
    }

    /// This spec with the placement read from `file` (validated as a placement file; it is
    /// checked against the model when the model is set up).
    pub fn with_placement_file(mut self, file: Option<&Path>) -> Result<Self> {
        self.placement = file.map(Placement::read).transpose()?;
        self.placement_file = file.map(Path::to_path_buf);
        Ok(self)
    }

    /// This spec running `key`: its mode, pruning and copy rule.
    pub fn for_run(&self, key: &RunKey) -> ModelSpec {
        let mut o = self.clone();
        o.mode = Some(key.mode);
        o.prune = key.prune;
        if let Some(rule) = key.rule {
            o.prune_rule = rule;
        }
        if let Some(copies) = key.copies {
            o.copy_rule = copies;
        }
        o
    }

    /// The pruning rule runs can take: the spec's, or the router-score rule where the
    /// similarity rule has no calibration trace to build its tables from.
    pub fn runnable_prune_rule(&self) -> PruneRule {
        match self.prune_rule {
            PruneRule::Similarity
                if self.calibration.is_none() && self.calibration_trace.is_none() =>
            {
                PruneRule::Router
            }
            rule => rule,
        }
    }

    /// The effective mode.
    pub fn mode(&self) -> MoeMode {
        self.mode.unwrap_or(if self.devices > 1 {
            MoeMode::Occult
        } else {
            MoeMode::Reference
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

    /// The device `cuda` names (offset by the node-local rank under NCCL), or the CPU.
    pub fn device(&self) -> Result<Device> {
        pick_device(self.cuda, self.backend)
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
}

/// A model's config: a folder's config.json, or the cached checkpoint of a hub id.
pub fn model_config(model: &str) -> Result<ModelConfig> {
    let local = Path::new(model).join("config.json");
    if local.is_file() {
        Ok(ModelConfig::read(&local)?)
    } else {
        Ok(ModelSpec::local(model).open()?.cfg)
    }
}
