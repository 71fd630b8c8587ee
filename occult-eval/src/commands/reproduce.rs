//! `occult reproduce`: the paper's experiments end to end (see [`crate::reproduce`]); with no
//! recipe, on the built-in model.

use crate::reproduce::recipe::Recipe;
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    occult reproduce                                   # the built-in model, 4 devices\n  \
    occult reproduce configs/reproduce/olmoe.toml --out results/olmoe\n  \
    occult reproduce configs/reproduce/builtin-full.toml --out full   # 3 seeds, 1,000 items\n  \
    occult model builtin && mpirun -np 4 occult reproduce --backend mpi   # feature mpi")]
pub struct ReproduceArgs {
    /// Recipe file (TOML); the built-in one (configs/reproduce/builtin.toml) when omitted.
    pub recipe: Option<PathBuf>,
    /// Output folder (created if missing).
    #[arg(long, default_value = "out/reproduce")]
    pub out: PathBuf,
    /// Override the recipe's backend: local (threads) or mpi (under mpirun -np DEVICES).
    #[arg(long, value_enum)]
    pub backend: Option<crate::context::Backend>,
    /// Fine-tune every routing with N seeds (data orders 0..N) and pool the quality
    /// differences over them; overrides the recipe's `[quality] seeds` (default 1).
    #[arg(long, value_name = "N")]
    pub seeds: Option<usize>,
}

pub fn run(a: ReproduceArgs) -> Result<()> {
    let (mut recipe, origin) = Recipe::load(a.recipe.as_deref())?;
    if let Some(b) = a.backend {
        recipe.backend = b;
    }
    if let Some(n) = a.seeds {
        recipe.quality.seeds = Some(n);
        recipe.check().context("--seeds")?;
    }
    crate::reproduce::run(&recipe, &origin, &a.out)
}
