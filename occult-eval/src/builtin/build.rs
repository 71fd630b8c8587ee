//! Building the built-in model: its data ([`super::data`]), a random OLMoE-shaped checkpoint
//! (64 experts, top-8, as OLMoE routes) and its pre-training from scratch with `occult train
//! --train all --aux-loss` on the generated text, or, where the data and the random start are
//! the ones the committed weights were built from, those weights ([`super::committed`]:
//! seconds instead of minutes). The result is cached: a folder holds the data, `model/` (the
//! trained checkpoint, with its `log.jsonl`), `recipe.json` and `provenance.json` (committed or
//! pre-trained, and how long each part took); a folder whose recipe matches is used as it is.
//! The folder is built beside its final place and renamed into it, so an interrupted build
//! leaves nothing half-made in the cache.

use super::committed;
use super::data::{write_data, DataSizes};
use super::world::World;
use crate::context::ModelSpec;
use crate::jobs::fine_tune::{fine_tune, FineTune, TrainWhat};
use crate::jobs::profile::{profile, ProfileJob};
use anyhow::{Context, Result};
use occult_core::models::family::family;
use occult_core::models::synth::SynthModel;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Everything the built-in model is made from; a cached model is reused only if its recipe is
/// this one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BuiltinRecipe {
    /// Bumped whenever the generators change what they write.
    pub version: u32,
    pub seed: u64,
    pub sizes: DataSizes,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    pub steps: u64,
    pub batch_size: usize,
    pub seq_len: usize,
    pub lr: f64,
}

impl Default for BuiltinRecipe {
    fn default() -> Self {
        BuiltinRecipe {
            version: 5,
            seed: 2025,
            sizes: DataSizes::default(),
            hidden: 64,
            layers: 4,
            heads: 4,
            experts: 64,
            top_k: 8,
            expert_intermediate: 32,
            steps: 800,
            batch_size: 16,
            seq_len: 128,
            lr: 3e-3,
        }
    }
}

impl BuiltinRecipe {
    /// A recipe from a TOML file of the fields to change (the rest default).
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the recipe {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("in the recipe {}", path.display()))
    }
}

/// Where built models are cached: `$OCCULT_CACHE`, else `$XDG_CACHE_HOME/occult`, else
/// `~/.cache/occult`.
pub fn cache_root() -> PathBuf {
    if let Some(d) = std::env::var_os("OCCULT_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("occult");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("occult")
}

/// The built-in model's folder in the cache.
pub fn default_dir() -> PathBuf {
    cache_root().join("builtin")
}

/// The cache folder of a built-in recipe: [`default_dir`] for the default one, else one named
/// by the recipe's fingerprint.
pub fn dir_for(recipe: &BuiltinRecipe) -> PathBuf {
    if *recipe == BuiltinRecipe::default() {
        return default_dir();
    }
    let text = serde_json::to_string(recipe).expect("serialisable");
    let print = occult_core::models::data_parallel::fingerprint(text.into_bytes());
    cache_root().join(format!("builtin-{print:016x}"))
}

/// The built-in model of `recipe` in its cache folder; built now unless `may_build` is false
/// (one of several MPI processes must not build it), which asks for it to be built first.
pub fn ensure_cached(recipe: &BuiltinRecipe, may_build: bool) -> Result<Builtin> {
    let dir = dir_for(recipe);
    let built = recipe_in(&dir).as_ref() == Some(recipe)
        && dir.join("model").join("model.safetensors").is_file();
    if !may_build && !built {
        anyhow::bail!(
            "the built-in model is not built yet in {}: run `occult model builtin` (or the same \
             command without mpirun) once before starting the ranks",
            dir.display()
        );
    }
    ensure(&dir, recipe, false)
}

/// The built model, its data and its recipe, in `dir`.
#[derive(Clone, Debug)]
pub struct Builtin {
    pub dir: PathBuf,
    pub recipe: BuiltinRecipe,
}

impl Builtin {
    /// The trained checkpoint.
    pub fn model(&self) -> PathBuf {
        self.dir.join("model")
    }
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Occult's placement of the model's experts on `devices` devices, from its routing on its
    /// calibration text; made on first use and kept beside the model.
    pub fn placement(&self, devices: usize) -> Result<PathBuf> {
        use occult_core::analysis::placement::{Method, SearchConfig};
        let path = self.file(&format!("placement-occult-{devices}.json"));
        if path.is_file() {
            return Ok(path);
        }
        eprintln!("placing the built-in model's experts on {devices} devices (once)");
        let trace = self.file("trace-calibration.safetensors");
        let job = ProfileJob {
            seq_len: Some(128),
            max_tokens: Some(20000),
            logits: false,
            ..ProfileJob::new(&self.file("calibration.jsonl"))
        };
        let spec = ModelSpec::local(&self.model().display().to_string());
        let p = profile(&spec, &job)?.context("profiling runs in this process")?;
        p.trace.write(&trace)?;
        eprintln!("{}", p.summary(&trace));
        let t = p.trace;
        let (placement, _) = occult_core::analysis::place_trace(
            &t,
            devices,
            Method::Occult,
            &SearchConfig::default(),
            &|| (),
        )?;
        placement.write(&path)?;
        Ok(path)
    }
}

fn recipe_in(dir: &Path) -> Option<BuiltinRecipe> {
    let text = std::fs::read_to_string(dir.join("recipe.json")).ok()?;
    serde_json::from_str(&text).ok()
}

/// How the built-in model's weights came about, kept beside it as `provenance.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    /// `committed` (the weights in occult-eval/builtin/, their data and start matching) or
    /// `pre-trained` (here, from nothing).
    pub weights: String,
    /// Why the committed weights were not taken, where they were not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why_trained: Option<String>,
    /// SHA-256 of the random start's `model.safetensors`.
    pub start_sha256: String,
    /// Seconds to generate the data and the random start, and to pre-train (0 for committed
    /// weights).
    pub data_seconds: f64,
    pub pretrain_seconds: f64,
}

impl Builtin {
    /// How the weights came about (`None` for a folder built before this was kept).
    pub fn provenance(&self) -> Option<Provenance> {
        let text = std::fs::read_to_string(self.file("provenance.json")).ok()?;
        serde_json::from_str(&text).ok()
    }
}

/// The built-in model of `recipe` in `dir`: the cached one if it was made from this recipe,
/// else built now: from the committed weights where they are this recipe's (seconds), else
/// pre-trained from nothing (minutes; progress on stderr). `rebuild` builds it again from
/// nothing anyway.
pub fn ensure(dir: &Path, recipe: &BuiltinRecipe, rebuild: bool) -> Result<Builtin> {
    let done = Builtin {
        dir: dir.to_path_buf(),
        recipe: recipe.clone(),
    };
    if !rebuild
        && recipe_in(dir).as_ref() == Some(recipe)
        && done.model().join("model.safetensors").is_file()
    {
        return Ok(done);
    }
    let name = dir
        .file_name()
        .map_or_else(|| "builtin".into(), |n| n.to_string_lossy().to_string());
    let tmp = dir.with_file_name(format!(".{name}.building-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
    }
    eprintln!(
        "building the built-in model in {} (once; it is cached)",
        dir.display()
    );
    build_into(&tmp, recipe, rebuild)?;
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::rename(&tmp, dir)
        .with_context(|| format!("moving {} to {}", tmp.display(), dir.display()))?;
    Ok(done)
}

/// Writes the recipe's data and its random start (`dir/random`, a model folder with the
/// tokenizer) into `dir`; returns the start's folder.
pub(crate) fn write_inputs(dir: &Path, recipe: &BuiltinRecipe) -> Result<PathBuf> {
    let world = World::new(recipe.seed);
    let vocab = write_data(dir, &world, recipe.sizes, recipe.seed)?;
    let random = dir.join("random");
    let synth = SynthModel {
        family: family("olmoe").expect("the olmoe family"),
        vocab: vocab.div_ceil(8) * 8,
        hidden: recipe.hidden,
        layers: recipe.layers,
        heads: recipe.heads,
        kv_heads: recipe.heads,
        experts: recipe.experts,
        top_k: recipe.top_k,
        expert_intermediate: recipe.expert_intermediate,
        dense_intermediate: 0,
        shared_intermediate: 0,
        dense_layers: 0,
        fused: false,
        dtype: safetensors::Dtype::F32,
        seed: recipe.seed,
        // A small start, as language models initialise (0.02 of a much wider model).
        std: 0.05,
        // What the recipe's model has been built with since version 1.
        rms_norm_eps: 1e-6,
    };
    synth.write(&random)?;
    std::fs::copy(dir.join("tokenizer.json"), random.join("tokenizer.json"))
        .context("copying the tokenizer")?;
    Ok(random)
}

/// Pre-trains the start in `start` on `dir`'s text into `dir/model`, with `occult train
/// --train all --aux-loss`; `stop_at` stops early (the schedule still runs over the recipe's
/// steps). The step records.
pub(crate) fn pretrain(
    dir: &Path,
    recipe: &BuiltinRecipe,
    start: &Path,
    stop_at: Option<u64>,
) -> Result<Vec<occult_train::log::StepRecord>> {
    let pretrain = FineTune {
        steps: recipe.steps,
        seq_len: Some(recipe.seq_len),
        batch_size: recipe.batch_size,
        lr: recipe.lr,
        warmup: Some(recipe.steps / 20),
        min_lr_ratio: 0.1,
        weight_decay: 0.01,
        seed: recipe.seed,
        overwrite: true,
        aux_loss: true,
        stop_at,
        train: TrainWhat::All,
        ..FineTune::new(
            &dir.join("pretrain.jsonl").display().to_string(),
            &dir.join("model"),
        )
    };
    let log = fine_tune(&ModelSpec::local(&start.display().to_string()), &pretrain)
        .context("pre-training the built-in model")?;
    log.context("pre-training runs in this process")
}

fn build_into(dir: &Path, recipe: &BuiltinRecipe, from_nothing: bool) -> Result<()> {
    let clock = std::time::Instant::now();
    let random = write_inputs(dir, recipe)?;
    let data_seconds = clock.elapsed().as_secs_f64();
    let start_sha256 = committed::file_sha256(&random.join("model.safetensors"))?;
    let why_trained = if from_nothing {
        Some("asked to rebuild from nothing".to_string())
    } else {
        committed::mismatch(&committed::manifest()?, recipe, dir, &random)?
    };
    let clock = std::time::Instant::now();
    match &why_trained {
        None => {
            eprintln!("the committed weights fit this recipe's data and start: taking them");
            committed::install(&random, &dir.join("model"))?;
        }
        Some(why) => {
            if *recipe == BuiltinRecipe::default() {
                eprintln!("pre-training from nothing (minutes): the committed weights are not used: {why}");
            }
            pretrain(dir, recipe, &random, None)?;
            std::fs::remove_dir_all(dir.join("model/state"))
                .context("removing the training state")?;
        }
    }
    let provenance = Provenance {
        weights: if why_trained.is_none() {
            "committed"
        } else {
            "pre-trained"
        }
        .into(),
        why_trained,
        start_sha256,
        data_seconds,
        pretrain_seconds: clock.elapsed().as_secs_f64(),
    };
    std::fs::remove_dir_all(&random).context("removing the random start")?;
    occult_core::atomic::write_json_atomic(&dir.join("provenance.json"), &provenance)?;
    let text = serde_json::to_string_pretty(recipe)?;
    std::fs::write(dir.join("recipe.json"), text).context("writing recipe.json")?;
    Ok(())
}
