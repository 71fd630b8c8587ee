//! Writing a Hugging Face checkpoint whose experts are renumbered ([`Renumbering`]), so that an
//! engine's contiguous expert sharding realises a placement with no change to the engine.
//!
//! In each MoE layer everything indexed by expert moves with it: per-expert tensors
//! (`{block}.experts.{j}.*`, whatever their suffix: weights, biases, FP8 scales), fused expert
//! tensors (`{block}.experts.*` whose first dimension is E, in any layout), and the router's
//! tensors whose first dimension is E (weight rows, bias, DeepSeek-V3's
//! `e_score_correction_bias`). Shared experts, dense layers, attention and everything else are
//! copied unchanged, as are tensors of layers past `num_hidden_layers` (DeepSeek-V3's MTP layer).
//!
//! The output has the input's tensor names, shapes, dtypes and sharding: each shard is written
//! with the input shard's header byte for byte, the index file is copied, and only the bytes of
//! expert-indexed tensors move. So it is dtype-agnostic (f32, bf16, FP8 ...) and exact. The other
//! files beside the weights (config, tokenizer, remote code) are copied; weights in other
//! formats (`.bin`, `.pt`, `.gguf` ...) are not, since they would not be renumbered. The folder
//! is assembled under a temporary name beside the output and renamed into place at the end.

use super::renumbering::{ExpertGroups, Renumbering, RENUMBERING_FILE};
use crate::atomic::write_atomic;
use crate::models::checkpoint::from_folder;
use crate::models::config::ModelConfig;
use crate::models::family::family;
use crate::{bail, Error, Result};
use safetensors::tensor::TensorInfo;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Where a model keeps the tensors the export permutes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLayout {
    pub model_type: String,
    pub num_experts: usize,
    pub num_layers: usize,
    /// The MoE layers, ascending.
    pub moe_layers: Vec<usize>,
    /// The MoE block inside `model.layers.{l}` (`mlp`, `block_sparse_moe`).
    pub block: String,
    /// The router inside the block (`gate`).
    pub router: String,
    /// Group-limited routing (DeepSeek-V2/V3, GLM-4.5 with `n_group` > 1).
    pub groups: Option<ExpertGroups>,
}

impl ExpertLayout {
    /// Reads the layout from a `config.json` value; `origin` names it in errors.
    pub fn from_config(v: &Value, origin: &str) -> Result<Self> {
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::bad_file(origin, "missing field `model_type`"))?;
        if family(model_type).is_some() {
            let cfg = ModelConfig::from_json(v, origin)?;
            let names = cfg.family.names;
            return Ok(ExpertLayout {
                model_type: model_type.into(),
                num_experts: cfg.moe.num_experts,
                num_layers: cfg.num_layers,
                moe_layers: (0..cfg.num_layers).filter(|&l| cfg.moe_layers[l]).collect(),
                block: names.block.into(),
                router: names.router.into(),
                groups: cfg.moe.router.group_limit.map(|g| ExpertGroups {
                    n_group: g.num_groups,
                    topk_group: g.topk_groups,
                }),
            });
        }
        Err(Error::bad_file(
            origin,
            format!(
                "model_type {model_type:?} is not one the export knows (it knows {})",
                crate::models::family::supported()
            ),
        ))
    }

    /// Reads the layout of the model folder `dir` (its `config.json`).
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = crate::input::read_text(&path)?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::bad_file(&path, format!("not valid JSON: {e}")))?;
        Self::from_config(&v, &path.display().to_string())
    }
}

/// Where an output tensor's bytes come from.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Source {
    /// Its own bytes, unchanged.
    Same,
    /// Another tensor's bytes (a per-expert tensor under the expert's new id).
    Renamed(String),
    /// Its own bytes with the first dimension's E rows permuted by the layer's
    /// `new_to_original`.
    Rows(usize),
}

/// What an export did, for the command to print.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExportSummary {
    /// Per-expert tensors written under their expert's new id.
    pub renamed: usize,
    /// Fused expert and router tensors whose rows were permuted.
    pub permuted: usize,
    /// Tensors copied unchanged.
    pub unchanged: usize,
    /// Bytes of tensor data written.
    pub bytes: u64,
    /// Files copied from beside the weights.
    pub copied: Vec<String>,
    /// Files and folders left out, with the reason.
    pub skipped: Vec<(String, String)>,
}

/// Weight files in formats the export does not rewrite: copying them would ship experts in the
/// old numbering beside the new.
const OTHER_WEIGHTS: [&str; 8] = ["bin", "pt", "pth", "gguf", "h5", "msgpack", "ckpt", "pkl"];

/// One mapped safetensors shard.
struct Shard {
    path: PathBuf,
    map: memmap2::Mmap,
    /// 8 + the header's length: where tensor data starts.
    data_start: usize,
    /// Its tensors in data order.
    tensors: Vec<(String, TensorInfo)>,
}

fn open_shard(path: &Path) -> Result<Shard> {
    let file = crate::input::open_regular(path)?;
    // SAFETY: mapped read-only; like every mmap-based loader we rely on the file not being
    // modified while it is mapped.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let bad = |e: safetensors::SafeTensorError| {
        Error::bad_file(path, format!("not a readable safetensors file ({e})"))
    };
    if let Some(name) = crate::input::duplicate_header_name(&map) {
        return Err(Error::bad_file(
            path,
            format!("the header names tensor {name:?} twice"),
        ));
    }
    safetensors::SafeTensors::deserialize(&map).map_err(bad)?;
    let (header, meta) = safetensors::SafeTensors::read_metadata(&map).map_err(bad)?;
    let mut tensors: Vec<(String, TensorInfo)> = meta
        .tensors()
        .into_iter()
        .map(|(n, i)| (n, i.clone()))
        .collect();
    tensors.sort_by_key(|(_, i)| i.data_offsets);
    let mut end = 0;
    for (name, info) in &tensors {
        if info.data_offsets.0 != end {
            return Err(Error::bad_file(
                path,
                format!("tensor {name}'s data does not follow the previous tensor's"),
            ));
        }
        end = info.data_offsets.1;
    }
    if 8 + header + end != map.len() {
        return Err(Error::bad_file(
            path,
            "bytes after the last tensor: not a plain safetensors file",
        ));
    }
    Ok(Shard {
        path: path.to_path_buf(),
        map,
        data_start: 8 + header,
        tensors,
    })
}

impl Shard {
    fn bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.map[self.data_start + info.data_offsets.0..self.data_start + info.data_offsets.1]
    }
}

/// `model.layers.{l}.{rest}` -> `(l, rest)`.
fn layer_of(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (l, rest) = rest.split_once('.')?;
    Some((l.parse().ok()?, rest))
}

/// Decides every tensor's source; `info` gives a tensor's dtype and shape by name.
fn plan(
    layout: &ExpertLayout,
    ren: &Renumbering,
    info: &HashMap<String, TensorInfo>,
) -> Result<HashMap<String, Source>> {
    let e = layout.num_experts;
    let mut out = HashMap::with_capacity(info.len());
    for (name, ti) in info {
        let src = match layer_of(name) {
            Some((l, rest)) if layout.moe_layers.contains(&l) => {
                let lr = ren
                    .layer(l)
                    .expect("checked: every MoE layer is renumbered");
                let experts = format!("{}.experts.", layout.block);
                let router = format!("{}.{}.", layout.block, layout.router);
                if let Some(tail) = rest.strip_prefix(&experts) {
                    match tail
                        .split_once('.')
                        .and_then(|(j, s)| Some((j.parse::<usize>().ok()?, s)))
                    {
                        Some((j, suffix)) => {
                            if j >= e {
                                bail!("{name}: expert {j} of a layer with {e} experts");
                            }
                            let from = format!(
                                "model.layers.{l}.{experts}{}.{suffix}",
                                lr.new_to_original[j]
                            );
                            let fi = info.get(&from).ok_or_else(|| {
                                Error::invalid(format!(
                                    "{name} is renumbered from {from}, which the checkpoint lacks"
                                ))
                            })?;
                            if (fi.dtype, &fi.shape) != (ti.dtype, &ti.shape) {
                                bail!(
                                    "{name} ({:?} {:?}) and {from} ({:?} {:?}) differ: experts of one \
                                     layer must be stored alike",
                                    ti.dtype,
                                    ti.shape,
                                    fi.dtype,
                                    fi.shape
                                );
                            }
                            Source::Renamed(from)
                        }
                        None => rows(name, ti, e, l)?,
                    }
                } else if rest.starts_with(&router) {
                    rows(name, ti, e, l)?
                } else {
                    Source::Same
                }
            }
            _ => Source::Same,
        };
        out.insert(name.clone(), src);
    }
    Ok(out)
}

/// A tensor whose first dimension must be the layer's experts.
fn rows(name: &str, ti: &TensorInfo, e: usize, layer: usize) -> Result<Source> {
    if ti.shape.first() != Some(&e) {
        bail!(
            "{name} has shape {:?}: a fused expert or router tensor must have the {e} experts \
             first, and the export knows no other way to renumber it",
            ti.shape
        );
    }
    Ok(Source::Rows(layer))
}

/// Checks that the renumbering fits the model: the same expert count, every MoE layer and only
/// MoE layers, and the layout's expert groups kept whole.
pub fn check_fits(layout: &ExpertLayout, ren: &Renumbering) -> Result<()> {
    ren.validate()?;
    if ren.num_experts != layout.num_experts {
        bail!(
            "the placement is for {} experts per layer, the model has {}",
            ren.num_experts,
            layout.num_experts
        );
    }
    for &l in &layout.moe_layers {
        if ren.layer(l).is_none() {
            bail!(
                "the placement has no entry for MoE layer {l} (the model's MoE layers are {:?})",
                layout.moe_layers
            );
        }
    }
    for lr in &ren.layers {
        if !layout.moe_layers.contains(&lr.layer) {
            bail!(
                "the placement lists layer {}, which is not an MoE layer of the model (its MoE \
                 layers are {:?})",
                lr.layer,
                layout.moe_layers
            );
        }
        if let Some(g) = layout.groups {
            let size = layout.num_experts / g.n_group;
            if let Some((b, _, _)) = g.first_mixed_run(&lr.new_to_original) {
                bail!(
                    "layer {}: new ids {}..{} mix experts of several groups; the model routes \
                         by groups of {size} (n_group = {}), which must stay whole",
                    lr.layer,
                    b * size,
                    (b + 1) * size,
                    g.n_group
                );
            }
        }
    }
    Ok(())
}

/// Writes `dir`'s checkpoint with its experts renumbered by `ren` into the new folder `out`,
/// with `ren` (composed with the source's own renumbering when the source is itself an export)
/// as [`RENUMBERING_FILE`]. `out` must not exist, unless `overwrite` and it is an earlier export.
/// `progress(done, total)` reports tensor bytes written.
pub fn export_checkpoint(
    dir: &Path,
    out: &Path,
    ren: &Renumbering,
    overwrite: bool,
    progress: &dyn Fn(u64, u64),
) -> Result<ExportSummary> {
    let layout = ExpertLayout::read(dir)?;
    check_fits(&layout, ren)?;
    check_output(dir, out, overwrite)?;
    let files = from_folder(dir)?;
    let shards: Vec<Shard> = files
        .weights
        .iter()
        .map(|p| open_shard(p))
        .collect::<Result<_>>()?;
    let mut where_is: HashMap<String, (usize, TensorInfo)> = HashMap::new();
    for (k, s) in shards.iter().enumerate() {
        for (n, i) in &s.tensors {
            if let Some((other, _)) = where_is.insert(n.clone(), (k, i.clone())) {
                return Err(Error::bad_file(
                    &s.path,
                    format!("tensor {n} is also in {}", shards[other].path.display()),
                ));
            }
        }
    }
    let infos: HashMap<String, TensorInfo> = where_is
        .iter()
        .map(|(n, (_, i))| (n.clone(), i.clone()))
        .collect();
    if family(&layout.model_type).is_some() {
        // A model Occult runs: its tensors must be the ones its config explains, as every
        // command that loads it requires.
        let cfg = ModelConfig::read(&files.config)?;
        let shape_of = |n: &str| infos.get(n).map(|i| (i.dtype, i.shape.clone()));
        if let Some((name, what)) = crate::models::layout::first_misfit(&cfg, &shape_of) {
            return Err(Error::bad_file(&files.dir, format!("tensor {name} {what}")));
        }
    }
    let sources = plan(&layout, ren, &infos)?;
    for &l in &layout.moe_layers {
        let router = format!("model.layers.{l}.{}.{}.weight", layout.block, layout.router);
        if !infos.contains_key(&router) {
            bail!("MoE layer {l} has no router {router} in the checkpoint");
        }
    }

    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".occult-export-")
        .tempdir_in(parent)
        .map_err(|e| Error::io(parent, e))?;
    let total: u64 = infos
        .values()
        .map(|i| (i.data_offsets.1 - i.data_offsets.0) as u64)
        .sum();
    let mut summary = ExportSummary::default();
    for s in &shards {
        let name = s.path.file_name().expect("a shard file has a name");
        write_atomic(&tmp.path().join(name), |w| {
            w.write_all(&s.map[..s.data_start])?;
            for (n, info) in &s.tensors {
                match &sources[n] {
                    Source::Same => {
                        w.write_all(s.bytes(info))?;
                        summary.unchanged += 1;
                    }
                    Source::Renamed(from) => {
                        let (k, fi) = &where_is[from];
                        w.write_all(shards[*k].bytes(fi))?;
                        summary.renamed += 1;
                    }
                    Source::Rows(l) => {
                        let bytes = s.bytes(info);
                        if bytes.len() % layout.num_experts != 0 {
                            return Err(std::io::Error::other(format!(
                                "{n}: {} bytes do not split into {} whole expert rows \
                                 (a sub-byte dtype?)",
                                bytes.len(),
                                layout.num_experts
                            )));
                        }
                        let row = bytes.len() / layout.num_experts;
                        let lr = ren.layer(*l).expect("checked");
                        for &orig in &lr.new_to_original {
                            let o = orig as usize;
                            w.write_all(&bytes[o * row..(o + 1) * row])?;
                        }
                        summary.permuted += 1;
                    }
                }
                summary.bytes += (info.data_offsets.1 - info.data_offsets.0) as u64;
                progress(summary.bytes, total);
            }
            Ok(())
        })?;
    }
    let mut own = ren.clone();
    copy_beside(dir, &files.weights, tmp.path(), &mut summary, &mut own)?;
    own.write(&tmp.path().join(RENUMBERING_FILE))?;
    put_in_place(tmp, out, overwrite)?;
    Ok(summary)
}

/// Copies the files beside the weights (not the weights, not other weight formats, not
/// folders). A source renumbering (the source is itself an export) is composed into `ren`.
fn copy_beside(
    dir: &Path,
    weights: &[PathBuf],
    to: &Path,
    summary: &mut ExportSummary,
    ren: &mut Renumbering,
) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for p in entries {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if weights.iter().any(|w| w.file_name() == p.file_name()) {
            continue;
        }
        if p.extension().is_some_and(|x| x == "safetensors") {
            summary.skipped.push((
                name,
                "safetensors weights the index does not list: not renumbered".into(),
            ));
            continue;
        }
        if name == RENUMBERING_FILE {
            *ren = compose(&Renumbering::read(&p)?, ren)?;
            continue;
        }
        if p.is_dir() {
            summary.skipped.push((name, "a folder".into()));
            continue;
        }
        let ext = p.extension().map(|x| x.to_string_lossy().to_lowercase());
        if ext.as_deref().is_some_and(|x| OTHER_WEIGHTS.contains(&x)) {
            summary.skipped.push((
                name,
                "weights in a format the export does not renumber".into(),
            ));
            continue;
        }
        if !p.is_file() {
            summary.skipped.push((name, "not a regular file".into()));
            continue;
        }
        let bytes = crate::input::read_bytes(&p)?;
        write_atomic(&to.join(&name), |w| w.write_all(&bytes))?;
        summary.copied.push(name);
    }
    Ok(())
}

/// `outer` applied to a model already renumbered by `inner`: new id -> the very first model's id.
fn compose(inner: &Renumbering, outer: &Renumbering) -> Result<Renumbering> {
    if inner.num_experts != outer.num_experts {
        bail!(
            "the source's own {RENUMBERING_FILE} is for {} experts, the new one for {}",
            inner.num_experts,
            outer.num_experts
        );
    }
    let mut out = outer.clone();
    for l in &mut out.layers {
        let Some(i) = inner.layer(l.layer) else {
            bail!(
                "the source's own {RENUMBERING_FILE} lacks layer {}",
                l.layer
            );
        };
        l.new_to_original = l
            .new_to_original
            .iter()
            .map(|&x| i.new_to_original[x as usize])
            .collect();
    }
    out.source
        .insert("composed_with_the_sources_renumbering".into(), true.into());
    Ok(out)
}

/// Refuses to write over or inside the input, and over anything but an earlier export.
fn check_output(dir: &Path, out: &Path, overwrite: bool) -> Result<()> {
    let (src, dst) = (
        crate::atomic::absolute_path(dir),
        crate::atomic::absolute_path(out),
    );
    if dst.starts_with(&src) || src.starts_with(&dst) {
        return Err(Error::io(
            out,
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "the output overlaps the input model folder {}; write it elsewhere",
                    src.display()
                ),
            ),
        ));
    }
    if std::fs::symlink_metadata(out).is_ok() {
        if !overwrite {
            return Err(Error::io(
                out,
                std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "the output exists (--overwrite replaces an earlier export)",
                ),
            ));
        }
        if !out.join(RENUMBERING_FILE).is_file() {
            return Err(Error::io(
                out,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "the output exists and is not an earlier export (no {RENUMBERING_FILE}); \
                         refusing to replace it"
                    ),
                ),
            ));
        }
    }
    Ok(())
}

/// Renames the finished temporary folder to `out`. An earlier export there is moved aside
/// first and put back if the rename fails; failing to delete it afterwards only leaves it aside.
fn put_in_place(tmp: tempfile::TempDir, out: &Path, overwrite: bool) -> Result<()> {
    let tmp = tmp.keep();
    if overwrite && out.exists() {
        let old = tmp.with_extension("old");
        if let Err(e) = std::fs::rename(out, &old) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(Error::io(out, e));
        }
        if let Err(e) = std::fs::rename(&tmp, out) {
            let _ = std::fs::rename(&old, out);
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(Error::io(out, e));
        }
        if let Err(e) = std::fs::remove_dir_all(&old) {
            eprintln!(
                "warning: the earlier export, moved to {}, could not be deleted: {e}",
                old.display()
            );
        }
    } else if let Err(e) = std::fs::rename(&tmp, out) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(Error::io(out, e));
    }
    Ok(())
}

/// Each shard's file name and its tensors' names and shapes, in data order.
pub type ShardTensors = BTreeMap<String, Vec<(String, Vec<usize>)>>;

/// The tensors of each shard of `dir`'s checkpoint (for tests and reports).
pub fn shard_tensors(dir: &Path) -> Result<ShardTensors> {
    let files = from_folder(dir)?;
    let mut out = BTreeMap::new();
    for p in &files.weights {
        let s = open_shard(p)?;
        out.insert(
            p.file_name().unwrap().to_string_lossy().into_owned(),
            s.tensors
                .iter()
                .map(|(n, i)| (n.clone(), i.shape.clone()))
                .collect(),
        );
    }
    Ok(out)
}
