//! Shared pieces of Occult's cross-crate tests; the tests themselves live in `tests/tests/`.

pub mod compare;
pub mod data_parallel;
pub mod grouping;
pub mod parity;
pub mod placements;
pub mod plain_moe;
pub mod storage;
