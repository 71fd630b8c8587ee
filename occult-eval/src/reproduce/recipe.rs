//! `occult reproduce` recipes (TOML): which model, on how many devices, with which calibration
//! text, fine-tuning data and tasks, and how much of each. The default recipe
//! (`configs/reproduce/builtin.toml`, compiled in) runs on the built-in model, whose data fills
//! every slot left empty; a recipe for a real checkpoint names its own.

use anyhow::{bail, Context, Result};
use occult_core::analysis::pruning::{PruneLimit, PruneRule};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The built-in recipe.
pub const DEFAULT_RECIPE: &str = include_str!("../../../configs/reproduce/builtin.toml");

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub name: String,
    /// Expert-parallel ranks of every stage.
    pub devices: usize,
    /// `local` (ranks as threads of this process) or `mpi` (run the recipe under
    /// `mpirun -np DEVICES`, with occult built with MPI).
    #[serde(default = "local")]
    pub backend: crate::context::Backend,
    /// Seconds a rank waits for its peers before the run fails.
    #[serde(default = "comm_timeout")]
    pub comm_timeout: f64,
    pub model: ModelRecipe,
    #[serde(default)]
    pub calibration: CalibrationRecipe,
    #[serde(default)]
    pub analysis: AnalysisRecipe,
    #[serde(default)]
    pub finetune: FinetuneRecipe,
    #[serde(default)]
    pub quality: QualityRecipe,
    #[serde(default)]
    pub speed: super::speed::SpeedRecipe,
    #[serde(default)]
    pub projection: ProjectionRecipe,
    /// The speed stage again over shaped links, where the machine allows it.
    #[serde(default)]
    pub shaped: super::shaped::ShapedRecipe,
    /// The built-in model's recipe, where it differs from the default (a smaller one for
    /// tests); each is built and cached on its own.
    #[serde(default)]
    pub builtin: Option<crate::builtin::BuiltinRecipe>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRecipe {
    /// The built-in model (built and cached on first use).
    #[serde(default)]
    pub builtin: bool,
    /// A model folder or a Hugging Face id in the local cache.
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default = "f32_name")]
    pub dtype: String,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CalibrationRecipe {
    /// Text to profile routing on (JSONL `text`, or one document per line); the built-in
    /// model's calibration text by default.
    pub data: Option<PathBuf>,
    pub seq_len: Option<usize>,
    pub max_tokens: Option<usize>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AnalysisRecipe {
    /// Element type of the rows the table counts bytes for (f32, bf16, f16, fp8).
    #[serde(default = "bf16_rows")]
    pub row_dtype: crate::rows::RowDtype,
    /// Placement search restarts.
    #[serde(default = "two")]
    pub restarts: usize,
    #[serde(default = "prune_devices")]
    pub prune_devices: Vec<usize>,
    /// Node-limited pruning: at most this many nodes per token, as DeepSeek-V3 routes (each
    /// with every rule of `prune_rules`, fine-tuned and served like the device limits).
    #[serde(default = "prune_nodes")]
    pub prune_nodes: Vec<usize>,
    /// Devices per node of the node limits and of the E[C_N] columns; `devices / 2` when
    /// absent (two nodes).
    #[serde(default)]
    pub devices_per_node: Option<usize>,
    #[serde(default = "prune_rules")]
    pub prune_rules: Vec<PruneRule>,
}

impl AnalysisRecipe {
    /// The node size: as given, or two nodes of `devices / 2` (none for fewer than 4
    /// devices or an odd number).
    pub fn node_size(&self, devices: usize) -> Option<usize> {
        self.devices_per_node
            .or_else(|| (devices >= 4 && devices.is_multiple_of(2)).then_some(devices / 2))
    }

    /// The node limits to prune to, on `devices` devices (none without a node size, and none
    /// that keeps every node).
    pub fn node_limits(&self, devices: usize) -> Vec<PruneLimit> {
        let Some(g) = self.node_size(devices) else {
            return Vec::new();
        };
        let nodes = devices.div_ceil(g.max(1));
        self.prune_nodes
            .iter()
            .filter(|&&m| m >= 1 && m < nodes)
            .map(|&m| PruneLimit::Nodes {
                devices_per_node: g,
                max_nodes: m,
                devices_in_node: None,
            })
            .collect()
    }
}

impl Default for AnalysisRecipe {
    fn default() -> Self {
        AnalysisRecipe {
            row_dtype: bf16_rows(),
            restarts: 2,
            prune_devices: prune_devices(),
            prune_nodes: prune_nodes(),
            devices_per_node: None,
            prune_rules: prune_rules(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FinetuneRecipe {
    /// Skip fine-tuning (and the fine-tuned rows of the quality table).
    #[serde(default)]
    pub skip: bool,
    /// Alpaca-format data; the built-in model's instructions by default.
    pub data: Option<String>,
    #[serde(default = "steps")]
    pub steps: u64,
    #[serde(default = "sixteen")]
    pub batch_size: usize,
    #[serde(default = "lr")]
    pub lr: f64,
    pub seq_len: Option<usize>,
}

impl Default for FinetuneRecipe {
    fn default() -> Self {
        FinetuneRecipe {
            skip: false,
            data: None,
            steps: steps(),
            batch_size: sixteen(),
            lr: lr(),
            seq_len: None,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct QualityRecipe {
    /// Tasks (names or task files); the built-in model's four tasks by default.
    #[serde(default)]
    pub tasks: Vec<String>,
    /// TASK = PATH data sources (else the hub cache).
    #[serde(default)]
    pub data: std::collections::BTreeMap<String, String>,
    /// Items per task (all when absent).
    pub limit: Option<usize>,
    pub num_fewshot: Option<usize>,
    /// Fine-tuning runs per routing, seeds 0..N of the data order (1 when absent); the
    /// differences are then pooled over them.
    pub seeds: Option<usize>,
    /// Serve the standard fine-tuned model under every pruning too (rows that no difference
    /// or verdict uses; the default recipe leaves them out to finish sooner).
    #[serde(default = "yes")]
    pub standard_served_pruned: bool,
    /// With the built-in model's default tasks, also its generative task (the arithmetic
    /// questions answered in writing, scored by exact match).
    #[serde(default = "yes")]
    pub generative: bool,
}

impl Default for QualityRecipe {
    fn default() -> Self {
        QualityRecipe {
            tasks: Vec::new(),
            data: Default::default(),
            limit: None,
            num_fewshot: None,
            seeds: None,
            standard_served_pruned: true,
            generative: true,
        }
    }
}

fn yes() -> bool {
    true
}

impl QualityRecipe {
    /// Fine-tuning seeds per routing.
    pub fn seeds(&self) -> usize {
        self.seeds.unwrap_or(1)
    }
}

/// The cluster projection (`occult project`) from the recipe's routing trace.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProjectionRecipe {
    pub skip: bool,
    /// Layer sizes to project at (the model's own when absent).
    pub hidden: Option<usize>,
    pub intermediate: Option<usize>,
    pub shared_intermediate: Option<usize>,
    /// What the sizes are, for the report (for example the model they come from).
    pub sizes_from: Option<String>,
    pub devices: Vec<usize>,
    pub tokens_per_device: Vec<usize>,
    /// Machine profiles (built-in names or files).
    pub links: Vec<String>,
    /// Load caps of the alternative Occult placements (see `occult project --load-caps`).
    pub load_caps: Vec<f64>,
}

impl Default for ProjectionRecipe {
    fn default() -> Self {
        ProjectionRecipe {
            skip: false,
            hidden: None,
            intermediate: None,
            shared_intermediate: None,
            sizes_from: None,
            devices: vec![4, 8, 16, 32, 64],
            tokens_per_device: vec![4096],
            links: vec!["pcie4".into(), "nvlink-h100".into(), "ib-ndr".into()],
            load_caps: vec![1.25, 1.1, 1.05],
        }
    }
}

fn local() -> crate::context::Backend {
    crate::context::Backend::Local
}
fn comm_timeout() -> f64 {
    600.0
}
fn f32_name() -> String {
    "f32".into()
}
fn bf16_rows() -> crate::rows::RowDtype {
    crate::rows::RowDtype::Bf16
}
fn two() -> usize {
    2
}
fn prune_devices() -> Vec<usize> {
    vec![2, 1]
}
fn prune_nodes() -> Vec<usize> {
    vec![1]
}
fn prune_rules() -> Vec<PruneRule> {
    vec![PruneRule::Router, PruneRule::Similarity]
}
fn steps() -> u64 {
    200
}
fn sixteen() -> usize {
    16
}
fn lr() -> f64 {
    1e-3
}

impl Recipe {
    /// Reads a recipe (the built-in one for `None`); returns it with where it came from.
    pub fn load(path: Option<&std::path::Path>) -> Result<(Recipe, String)> {
        let (text, origin) = match path {
            Some(p) => (occult_core::input::read_text(p)?, p.display().to_string()),
            None => (DEFAULT_RECIPE.to_string(), "built-in".to_string()),
        };
        let r: Recipe =
            toml::from_str(&text).with_context(|| format!("recipe {origin} is not valid"))?;
        r.check().with_context(|| format!("recipe {origin}"))?;
        Ok((r, origin))
    }

    /// Checks the recipe as loading does (after a command line changed it).
    pub fn check(&self) -> Result<()> {
        match (self.model.builtin, &self.model.path) {
            (true, Some(_)) => bail!("[model] gives both builtin = true and a path"),
            (false, None) => bail!("[model] needs builtin = true or a path"),
            _ => {}
        }
        if !(self.comm_timeout.is_finite() && self.comm_timeout > 0.0) {
            bail!("comm_timeout must be a positive number of seconds");
        }
        if self.quality.seeds == Some(0) {
            bail!("[quality] seeds = 0: at least one fine-tuning run per routing");
        }
        if self.finetune.skip && self.quality.seeds() > 1 {
            bail!(
                "[quality] seeds = {}: seeds repeat the fine-tuning, which [finetune] skip = true \
                 leaves out",
                self.quality.seeds()
            );
        }
        if self.devices < 2 {
            bail!(
                "devices = {}: expert parallelism needs at least 2",
                self.devices
            );
        }
        if !self.model.builtin {
            if self.calibration.data.is_none() {
                bail!("[calibration] data is required for a model other than the built-in one");
            }
            if !self.finetune.skip && self.finetune.data.is_none() {
                bail!("[finetune] data is required (or skip = true) for a model other than the built-in one");
            }
            if self.quality.tasks.is_empty() {
                bail!("[quality] tasks are required for a model other than the built-in one");
            }
        }
        let p = &self.projection;
        if !p.skip {
            if p.devices.is_empty() || p.tokens_per_device.is_empty() || p.links.is_empty() {
                bail!("[projection] devices, tokens_per_device and links must not be empty");
            }
            if p.tokens_per_device.contains(&0) || [p.hidden, p.intermediate].contains(&Some(0)) {
                bail!("[projection] tokens_per_device, hidden and intermediate must be positive");
            }
            if p.load_caps.iter().any(|&c| c.is_nan() || c < 1.0) {
                bail!("[projection] load_caps are factors of the mean load, at least 1");
            }
            for l in &p.links {
                occult_core::analysis::cost::links::LinkProfile::load(l)
                    .with_context(|| format!("[projection] links: {l}"))?;
            }
        }
        let sp = &self.speed;
        let sizes = [
            sp.prefill_seq_len,
            sp.decode_prompt_len,
            sp.train_seq_len,
            sp.repeats,
        ];
        if !sp.skip
            && (sp.prefill_tokens.contains(&0)
                || sp.decode_batches.contains(&0)
                || sizes.contains(&0)
                || sp.train_batch_per_rank == 0)
        {
            bail!("[speed] token counts, batches, lengths and repeats must be positive");
        }
        if let Some(&n) = self
            .analysis
            .prune_devices
            .iter()
            .find(|&&n| n == 0 || n >= self.devices)
        {
            bail!(
                "[analysis] prune_devices {n} must be between 1 and devices - 1 ({})",
                self.devices - 1
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_stage_settings_are_named() {
        let base = DEFAULT_RECIPE;
        for (extra, needle) in [
            ("[projection]\ndevices = []\n", "must not be empty"),
            ("[projection]\ntokens_per_device = [0]\n", "positive"),
            ("[projection]\nload_caps = [0.5]\n", "at least 1"),
            ("[projection]\nlinks = ['nope']\n", "nope"),
        ] {
            // Replace the shipped table with the bad one.
            let cut = base.find("[projection]").unwrap();
            let rest = &base[cut..];
            let end = rest[1..].find("\n[").map_or(rest.len(), |i| i + 2);
            let text = format!("{}{extra}{}", &base[..cut], &rest[end..]);
            let r: Recipe = toml::from_str(&text).unwrap();
            let err = format!("{:#}", r.check().unwrap_err());
            assert!(err.contains(needle), "{extra}: {err}");
        }
        let text = base.replace("seeds = 1", "seeds = 0");
        let r: Recipe = toml::from_str(&text).unwrap();
        assert!(format!("{:#}", r.check().unwrap_err()).contains("seeds = 0"));
        let text = base.replace("seeds = 1", "seeds = 2") + "\n";
        let mut r: Recipe = toml::from_str(&text).unwrap();
        r.finetune.skip = true;
        assert!(format!("{:#}", r.check().unwrap_err()).contains("skip = true"));
        let text = base.replace("decode_batches = [1, 4, 16]", "decode_batches = [0]");
        let r: Recipe = toml::from_str(&text).unwrap();
        assert!(format!("{:#}", r.check().unwrap_err()).contains("[speed]"));
    }

    #[test]
    fn the_shipped_recipes_read() {
        let (r, _) = Recipe::load(None).unwrap();
        assert!(r.model.builtin && r.devices == 4);
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/reproduce");
        let mut n = 0;
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let (r, _) =
                Recipe::load(Some(&p)).unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
            assert_eq!(r.devices, 4, "{}", p.display());
            n += 1;
        }
        assert_eq!(n, 5, "builtin, builtin-full, olmoe, qwen-moe, deepseek-moe");
        // The full recipe is the default one with three seeds and every row.
        let (full, _) = Recipe::load(Some(&dir_full())).unwrap();
        let (default, _) = Recipe::load(None).unwrap();
        assert_eq!((full.quality.seeds(), default.quality.seeds()), (3, 1));
        assert!(full.quality.standard_served_pruned && !default.quality.standard_served_pruned);
        let strip = |r: &Recipe| {
            let mut r = r.clone();
            r.name.clear();
            r.quality.seeds = None;
            r.quality.standard_served_pruned = true;
            serde_json::to_string(&r).unwrap()
        };
        assert_eq!(strip(&full), strip(&default));
    }

    fn dir_full() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../configs/reproduce/builtin-full.toml")
    }
}
