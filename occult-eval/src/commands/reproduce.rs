//! `occult reproduce`: the paper's experiments end to end (see [`crate::reproduce`]); with no
//! recipe, on the built-in model.

use crate::reproduce::recipe::Recipe;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    occult reproduce                                   # the built-in model, 4 devices\n  \
    occult reproduce configs/reproduce/olmoe.toml --out results/olmoe\n  \
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
}

pub fn run(a: ReproduceArgs) -> Result<()> {
    let (mut recipe, origin) = Recipe::load(a.recipe.as_deref())?;
    if let Some(b) = a.backend {
        recipe.backend = b;
    }
    crate::reproduce::run(&recipe, &origin, &a.out)
}
