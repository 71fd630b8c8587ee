//! The trace drivers: the per-layer functions of placement, pruning and collaboration applied
//! to every layer of a trace ([`whole_trace`]), and the same for placements with replicas:
//! adding copies, and counting under a copy rule ([`replica_trace`]); and placement from expert
//! loads alone, where an engine recorded counts but not the tokens' experts ([`load_only`]).

pub mod load_only;
pub mod replica_trace;
pub mod whole_trace;
