//! Expert parallelism: one MoE layer spread over D ranks, each holding E/D experts.
//!
//! | module | holds | stage of [`EpMoe::forward`] |
//! |---|---|---|
//! | [`router`] | router logits on the graph, top-k ids on the host, gate weights gathered back | route |
//! | [`dispatch`] | index maps: which rows go where and what each carries (standard or Occult) | plan |
//! | [`comm`] | the [`Communicator`] trait, its statistics, and its backends (threads, MPI) | dispatch, combine |
//! | [`exchange`] | the all-to-all of tensor rows as a differentiable op | dispatch, combine |
//! | [`swiglu`] | SwiGLU MLPs: stacked experts ([`SwigluStack`]) and shared experts | compute |
//! | [`experts`] | a layer's weights ([`MoeWeights`]) and the grouped compute of stacked experts over received rows | compute |
//! | [`experts_infer`] | the grouped compute's inference path on CPU: the same sums on slices, without a graph | compute |
//! | [`pre_reduce`] | the pre-reduction of a row's experts' outputs with its gate weights, as one op (a CUDA kernel on a GPU) | compute |
//! | [`moe`] | the EP layer: settings, the named stages, per-step statistics | all |
//! | [`reference`] | the plain single-device MoE forward: the oracle every EP mode must match | - |
//!
//! Plans are plain index arithmetic (tested without tensors); the layer sees only the
//! [`Communicator`] trait, never a backend.

pub mod comm;
pub mod dispatch;
pub mod exchange;
pub mod experts;
pub mod experts_infer;
pub mod moe;
pub mod pre_reduce;
pub mod reference;
pub mod router;
pub mod swiglu;

pub use comm::Communicator;
pub use dispatch::{ComputePlan, ExpertLocations, NodePlan, SendPlan};
pub use experts::MoeWeights;
pub use moe::{residual_add, EpMoe, EpSettings, Replicas, StepStats};
pub use reference::{reference_forward, reference_forward_routed};
pub use router::{route, PruneSpec, Routed};
pub use swiglu::{SharedExperts, SwigluStack};
