//! The flags every model command shares (`--model`, `--dtype`, and the expert-parallel ones
//! `--devices`, `--backend`, `--mode`, `--placement`, `--max-devices`, `--max-nodes`,
//! `--devices-per-node`, `--prune-rule`, `--copy-rule`), turned
//! into the library's [`ModelSpec`] (the placement file read and checked once, here).

use crate::context::{Backend, ModelSpec};
use anyhow::Result;
use occult_core::analysis::placement::replicas::CopyRule;
use occult_core::analysis::pruning::{PruneLimit, PruneRule};
use occult_core::analysis::run_key::MoeMode;
use std::path::PathBuf;

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
    pub mode: Option<MoeMode>,
    /// Placement file (`occult place`: occult.placement.v1, or v2 with replicas, each copy
    /// loaded on its device and picked by --copy-rule); default: contiguous blocks of experts.
    #[arg(long)]
    pub placement: Option<PathBuf>,
    #[command(flatten)]
    pub limit: PruneLimitOpts,
    /// Pruning rule (with --max-devices or --max-nodes).
    #[arg(long, value_enum, default_value_t = PruneRule::Router)]
    pub prune_rule: PruneRule,
    /// A trace with router logits (`occult profile`) to build the similarity rule's tables.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Refuse to load a model whose estimated memory (weights in --dtype, this rank's share of
    /// the experts under mpirun, and training state for train) is over this size: bytes, or
    /// with K, M, G or T (binary). Default: the memory available (MemAvailable and the cgroup
    /// limit), shared by the ranks of a node.
    #[arg(long, value_parser = occult_core::models::memory::parse_size)]
    pub max_memory: Option<u64>,
    /// Under a placement with replicas (`occult place --replicas R`): which copy of an
    /// expert a token uses. cover: the copies that cover the token's experts with the fewest
    /// devices; sglang: SGLang's static dispatch table, as SGLang builds it from the file;
    /// trtllm: TensorRT-LLM's uniform choice (a hash of the token picks the copy).
    #[arg(long, value_enum, default_value_t = CopyRule::Cover)]
    pub copy_rule: CopyRule,
}

/// The flags of collaboration pruning's limit (shared by the model commands and `prune`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct PruneLimitOpts {
    /// Collaboration pruning: each token's experts span at most this many devices.
    #[arg(long, conflicts_with = "max_nodes")]
    pub max_devices: Option<usize>,
    /// Node-limited pruning, as DeepSeek-V3 routes: every token keeps its this-many best nodes
    /// (each scored by its best two experts) and takes its top-k inside them, nodes of
    /// --devices-per-node.
    #[arg(long, requires = "devices_per_node")]
    pub max_nodes: Option<usize>,
    /// Devices per node (device d in node d / G): the nodes of --max-nodes and of `--mode
    /// two-level`, and of the row counts within and across nodes. Under mpirun the ranks of
    /// one host form a node unless this says otherwise (to emulate nodes on one host).
    #[arg(long)]
    pub devices_per_node: Option<usize>,
    /// With --max-nodes: at most this many devices in each kept node too.
    #[arg(long, requires = "max_nodes")]
    pub max_devices_per_node: Option<usize>,
}

impl PruneLimitOpts {
    /// The limit the flags ask for (`None`: no pruning).
    pub fn limit(&self) -> Option<PruneLimit> {
        match (self.max_devices, self.max_nodes, self.devices_per_node) {
            (Some(n), _, _) => Some(PruneLimit::Devices(n)),
            (None, Some(m), Some(g)) => Some(PruneLimit::Nodes {
                devices_per_node: g,
                max_nodes: m,
                devices_in_node: self.max_devices_per_node,
            }),
            _ => None,
        }
    }
}

impl ModelOpts {
    /// The library's value of these flags, with the placement file read.
    pub fn spec(&self) -> Result<ModelSpec> {
        ModelSpec {
            model: self.model.clone(),
            revision: self.revision.clone(),
            dtype: self.dtype.clone(),
            cuda: self.cuda,
            devices: self.devices,
            backend: self.backend,
            comm_timeout: self.comm_timeout,
            mode: self.mode,
            placement: None,
            placement_file: None,
            prune: self.limit.limit(),
            devices_per_node: self.limit.devices_per_node,
            prune_rule: self.prune_rule,
            calibration: self.calibration.clone(),
            calibration_trace: None,
            max_memory: self.max_memory,
            copy_rule: self.copy_rule,
        }
        .with_placement_file(self.placement.as_deref())
    }
}
