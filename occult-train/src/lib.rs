//! Occult fine-tuning (standard and collaboration-pruned). This crate is a placeholder in the
//! workspace layout: fine-tuning builds on the expert-parallel layer and the model loaders,
//! which arrive in later issues. It exports nothing yet, so no user can reach unbuilt code.
