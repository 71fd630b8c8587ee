//! vLLM: the placement files its open pull requests propose ([`placement_file`]: #49572's
//! expert map and #34811's expert-to-rank map), written from a placement and read back into
//! one.

pub mod placement_file;
