//! The built-in model's weights as committed in `occult-eval/builtin/`: what the default
//! recipe's pre-training built, with a manifest of what it was built from (the recipe, a SHA-256
//! of every data file and of the random start) and the pre-training's log. A first build that
//! generates the same data and the same random start takes these weights instead of
//! pre-training for minutes; anything else (another recipe, data the generators now write
//! otherwise, `occult model builtin --rebuild`) pre-trains from nothing.
//!
//! The weights are held to their build twice over: the data and the start by their digests
//! (exact on any machine), and the pre-training by [`verify_prefix`], which runs its first steps
//! again and compares each step's loss with the committed log (equal bit for bit on the
//! machine that built them; within rounding where the kernels sum in another order).
//! `scripts/builtin-weights.sh` rebuilds them from nothing and writes the three files again.

use super::build::BuiltinRecipe;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

/// The trained weights (`model.safetensors` of the default recipe's build).
pub const WEIGHTS: &[u8] = include_bytes!("../../builtin/model.safetensors");
/// The pre-training's `log.jsonl`.
pub const LOG: &str = include_str!("../../builtin/log.jsonl");
/// What the weights were built from ([`Manifest`]).
pub const MANIFEST: &str = include_str!("../../builtin/manifest.json");

/// The manifest's format name.
pub const FORMAT: &str = "occult.builtin-weights.v1";

/// What the committed weights were built from, and how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub recipe: BuiltinRecipe,
    /// SHA-256 of every data file the recipe writes, by its path in the built folder.
    pub data: BTreeMap<String, String>,
    /// SHA-256 of the random start's `model.safetensors`.
    pub start: String,
    /// SHA-256 of the trained `model.safetensors`.
    pub weights: String,
    /// Where and how long they were built (for people; not checked).
    pub built: String,
}

/// The committed manifest.
pub fn manifest() -> Result<Manifest> {
    let m: Manifest =
        serde_json::from_str(MANIFEST).context("reading occult-eval/builtin/manifest.json")?;
    if m.format != FORMAT {
        bail!(
            "occult-eval/builtin/manifest.json is {:?}, not {FORMAT}",
            m.format
        );
    }
    Ok(m)
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// SHA-256 of a file.
pub fn file_sha256(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(sha256_hex(&bytes))
}

/// Folders and files of a built folder that are not data: the model, the random start and
/// what the build writes about itself.
const NOT_DATA: [&str; 4] = ["model", "random", "recipe.json", "provenance.json"];

/// SHA-256 of every data file under `dir` (paths relative to it, with `/`), leaving out
/// [`NOT_DATA`] and any placement or trace made later beside the model.
pub fn data_digests(dir: &Path) -> Result<BTreeMap<String, String>> {
    fn walk(root: &Path, at: &Path, out: &mut BTreeMap<String, String>) -> Result<()> {
        let entries = std::fs::read_dir(at).with_context(|| format!("listing {}", at.display()))?;
        for entry in entries {
            let path = entry?.path();
            let rel = path.strip_prefix(root).expect("under the root");
            let name = rel.to_string_lossy().replace('\\', "/");
            if NOT_DATA.contains(&name.as_str())
                || name.starts_with("placement-")
                || name.starts_with("trace-")
            {
                continue;
            }
            if path.is_dir() {
                walk(root, &path, out)?;
            } else {
                out.insert(name, file_sha256(&path)?);
            }
        }
        Ok(())
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out)?;
    Ok(out)
}

/// Why the committed weights are not the ones `recipe` builds from the data in `dir` and the
/// random start in `start` (a model folder), or `None` where they are.
pub fn mismatch(
    m: &Manifest,
    recipe: &BuiltinRecipe,
    dir: &Path,
    start: &Path,
) -> Result<Option<String>> {
    if m.recipe != *recipe {
        return Ok(Some("they were built from another recipe".into()));
    }
    let data = data_digests(dir)?;
    if data != m.data {
        let differ: Vec<&str> = data
            .keys()
            .chain(m.data.keys())
            .filter(|k| data.get(*k) != m.data.get(*k))
            .map(String::as_str)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        return Ok(Some(format!(
            "the data generators now write other data ({})",
            differ.join(", ")
        )));
    }
    if file_sha256(&start.join("model.safetensors"))? != m.start {
        return Ok(Some("the random start differs from theirs".into()));
    }
    if sha256_hex(WEIGHTS) != m.weights {
        return Ok(Some(
            "the committed weights do not match their manifest".into(),
        ));
    }
    Ok(None)
}

/// Writes the committed model into `model` (created): the weights and the log, with the
/// configuration and tokenizer of the random start in `start`.
pub fn install(start: &Path, model: &Path) -> Result<()> {
    std::fs::create_dir_all(model).with_context(|| format!("creating {}", model.display()))?;
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(start.join(name), model.join(name))
            .with_context(|| format!("copying {name} into {}", model.display()))?;
    }
    std::fs::write(model.join("model.safetensors"), WEIGHTS)
        .with_context(|| format!("writing {}", model.join("model.safetensors").display()))?;
    std::fs::write(model.join("log.jsonl"), LOG)
        .with_context(|| format!("writing {}", model.join("log.jsonl").display()))?;
    Ok(())
}

/// Writes the manifest, weights and log of the model built (trained from nothing) in `dir`
/// into `out`: what `scripts/builtin-weights.sh` commits. `start` is the random start's
/// digest, `built` a line on where and how long.
pub fn export(
    dir: &Path,
    recipe: &BuiltinRecipe,
    start: &str,
    built: &str,
    out: &Path,
) -> Result<()> {
    if *recipe != BuiltinRecipe::default() {
        bail!("only the default recipe's weights are committed; this build has another recipe");
    }
    let model = dir.join("model");
    let weights = std::fs::read(model.join("model.safetensors"))
        .with_context(|| format!("reading {}", model.join("model.safetensors").display()))?;
    let m = Manifest {
        format: FORMAT.into(),
        recipe: recipe.clone(),
        data: data_digests(dir)?,
        start: start.into(),
        weights: sha256_hex(&weights),
        built: built.into(),
    };
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let put = |name: &str, bytes: &[u8]| {
        occult_core::atomic::write_atomic(&out.join(name), |w| std::io::Write::write_all(w, bytes))
            .with_context(|| format!("writing {}", out.join(name).display()))
    };
    put("model.safetensors", &weights)?;
    let log = std::fs::read(model.join("log.jsonl"))
        .with_context(|| format!("reading {}", model.join("log.jsonl").display()))?;
    put("log.jsonl", &log)?;
    let mut text = serde_json::to_string_pretty(&m)?;
    text.push('\n');
    put("manifest.json", text.as_bytes())
}

/// One step of the committed pre-training beside the same step run again.
#[derive(Clone, Copy, Debug)]
pub struct StepPair {
    pub step: u64,
    pub committed: f64,
    pub rebuilt: f64,
}

/// What [`verify_prefix`] found: the data and start digests held (else it fails), and the
/// losses of the first steps, committed and run again.
#[derive(Clone, Debug)]
pub struct Verified {
    pub steps: Vec<StepPair>,
}

impl Verified {
    /// The largest relative difference of a step's loss.
    pub fn worst_relative(&self) -> f64 {
        self.steps
            .iter()
            .map(|p| (p.rebuilt - p.committed).abs() / p.committed.abs().max(1e-12))
            .fold(0.0, f64::max)
    }
}

/// The committed log's losses, by step.
pub fn committed_losses() -> Result<Vec<(u64, f64)>> {
    LOG.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, line)| {
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("occult-eval/builtin/log.jsonl line {}", i + 1))?;
            match (v["step"].as_u64(), v["loss"].as_f64()) {
                (Some(s), Some(l)) => Ok((s, l)),
                _ => bail!(
                    "occult-eval/builtin/log.jsonl line {}: no step or loss",
                    i + 1
                ),
            }
        })
        .collect()
}

/// Builds the default recipe's data and random start in `work` (a fresh folder), checks their
/// digests against the manifest, and pre-trains the first `steps` steps of its schedule: the
/// losses beside the committed log's. Fails where a digest differs (the generators changed:
/// rebuild the weights with `scripts/builtin-weights.sh`).
pub fn verify_prefix(work: &Path, steps: u64) -> Result<Verified> {
    let m = manifest()?;
    let recipe = BuiltinRecipe::default();
    if m.recipe != recipe {
        bail!(
            "the committed weights were built from another recipe than the default one: \
             rebuild them with scripts/builtin-weights.sh"
        );
    }
    let start = super::build::write_inputs(work, &recipe)?;
    if let Some(why) = mismatch(&m, &recipe, work, &start)? {
        bail!("the committed weights no longer fit: {why}; rebuild them with scripts/builtin-weights.sh");
    }
    let log = super::build::pretrain(work, &recipe, &start, Some(steps))?;
    let committed: BTreeMap<u64, f64> = committed_losses()?.into_iter().collect();
    let steps = log
        .iter()
        .map(|r| {
            let Some(&c) = committed.get(&r.step) else {
                bail!("the committed log has no step {}", r.step);
            };
            Ok(StepPair {
                step: r.step,
                committed: c,
                rebuilt: r.loss,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Verified { steps })
}
