//! The cost model: what a placement and a dispatch cost on a machine. Link profiles (a
//! machine's devices and links) and a measured step's projection onto them ([`links`]), rows
//! at two levels on a cluster of nodes and E[C_N] ([`cluster`]), layer and training-step times
//! projected from a trace for D devices ([`projection`]), and one placement's projected layer
//! time with copies chosen by a rule ([`replica_projection`]).

pub mod cluster;
pub mod links;
pub mod projection;
pub mod replica_projection;
