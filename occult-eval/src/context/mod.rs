//! The loaded model, under the commands and the pipelines: which checkpoint, in which dtype, on
//! which device, over how many ranks and where they run, with which MoE routing and placement.
//!
//! - [`spec`]: [`ModelSpec`], the plain value every entry point takes, and opening its
//!   checkpoint (with the memory check);
//! - [`moe_setup`]: the MoE setup it asks for (mode, placement maps, pruning), checked against
//!   the model;
//! - [`ranks`]: running a function on every rank's model (one in-process model, D threads, or
//!   this process's rank under `mpirun`);
//! - [`backend`]: where ranks run, and this process's MPI or NCCL communicator;
//! - [`device`]: the CPU or the CUDA device a rank computes on.

pub mod backend;
pub mod device;
pub mod moe_setup;
pub mod ranks;
pub mod spec;

pub use backend::Backend;
pub use spec::ModelSpec;
