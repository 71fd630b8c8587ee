//! Reading a checkpoint's tensors: memory-mapped safetensors shards (no second copy of the
//! file in memory), tensors by name with their shapes checked, and a rank's experts from either
//! layout that checkpoints use:
//! - per expert: `{prefix}.experts.{j}.{gate}.weight`, `{up}`, `{down}` (Hugging Face hub files;
//!   names `gate_proj`/`up_proj`/`down_proj`, or Mixtral's `w1`/`w3`/`w2`);
//! - fused (transformers v5): `{prefix}.experts.gate_up_proj` `[E, 2I, H]` (gate rows first)
//!   and `{prefix}.experts.down_proj` `[E, H, I]`, or the transposed `[E, H, 2I]` / `[E, I, H]`.
//!
//! Under expert parallelism a rank reads only its own experts.

use super::config::ModelConfig;
use crate::ep::swiglu::SwigluStack;
use crate::{Error, Result};
use candle::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Names of one expert's projections in a per-expert checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertNames {
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

/// OLMoE, Qwen-MoE, DeepSeek-MoE, Qwen3-MoE.
pub const GATE_UP_DOWN: ExpertNames = ExpertNames {
    gate: "gate_proj",
    up: "up_proj",
    down: "down_proj",
};

/// Mixtral.
pub const W1_W3_W2: ExpertNames = ExpertNames {
    gate: "w1",
    up: "w3",
    down: "w2",
};

/// The tensors of a checkpoint's shards.
pub struct Weights {
    shards: Vec<Shard>,
    index: HashMap<String, Entry>,
    files: Vec<PathBuf>,
    device: Device,
    dtype: DType,
    trainable: bool,
    /// With `trainable`: only tensors whose names start with one of these (all when empty).
    trainable_prefixes: Vec<String>,
}

/// One mapped safetensors file.
struct Shard {
    map: memmap2::Mmap,
    /// Where the tensor data starts (after the 8-byte length and the JSON header).
    data_start: usize,
}

/// Where a tensor lives.
struct Entry {
    shard: usize,
    info: safetensors::tensor::TensorInfo,
}

/// Drops the mapped pages of `from..to` (widened to a page boundary at the start).
fn release(shard: &Shard, from: usize, to: usize) {
    let page = 4096;
    let from = from / page * page;
    // SAFETY: no reference into the mapping outlives the caller's read (the view is gone and
    // the tensor owns a copy); on a private read-only file mapping, MADV_DONTNEED only drops
    // pages, which later reads fault back in from the file. Failure is harmless.
    #[cfg(unix)]
    unsafe {
        let _ =
            shard
                .map
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, from, to - from);
    }
}

impl Weights {
    /// Maps the shards; tensors are read as f32.
    pub fn open(files: &[PathBuf], device: &Device) -> Result<Self> {
        Self::open_as(files, device, DType::F32)
    }

    /// Maps the shards; tensors are read as `dtype` (f32, bf16 or f16). Each file is checked on
    /// its own, so that a truncated or broken shard is named.
    pub fn open_as(files: &[PathBuf], device: &Device, dtype: DType) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::invalid(format!(
                "weights can be read as f32, bf16 or f16, not {dtype:?}"
            )));
        }
        if files.is_empty() {
            return Err(Error::invalid("no safetensors files to read"));
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut index: HashMap<String, Entry> = HashMap::new();
        for (k, f) in files.iter().enumerate() {
            let file = crate::input::open_regular(f)?;
            // SAFETY: the file is mapped read-only; like every mmap-based loader we rely on it
            // not being modified while mapped.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(f, e))?;
            let bad = |e: safetensors::SafeTensorError| {
                Error::bad_file(f, format!("not a readable safetensors file ({e})"))
            };
            if let Some(name) = crate::input::duplicate_header_name(&map) {
                return Err(Error::bad_file(
                    f,
                    format!("the header names tensor {name:?} twice"),
                ));
            }
            // Full validation (header, offsets within the file, no overlaps).
            safetensors::SafeTensors::deserialize(&map).map_err(bad)?;
            let (header, meta) = safetensors::SafeTensors::read_metadata(&map).map_err(bad)?;
            for (name, info) in meta.tensors() {
                if let Some(prev) = index.get(&name) {
                    return Err(Error::bad_file(
                        f,
                        format!("tensor {name} is also in {}", files[prev.shard].display()),
                    ));
                }
                index.insert(
                    name,
                    Entry {
                        shard: k,
                        info: info.clone(),
                    },
                );
            }
            shards.push(Shard {
                map,
                data_start: 8 + header,
            });
        }
        Ok(Weights {
            shards,
            index,
            files: files.to_vec(),
            device: device.clone(),
            dtype,
            trainable: false,
            trainable_prefixes: Vec::new(),
        })
    }

    /// The checkpoint's file (or files), as errors name it.
    pub fn origin(&self) -> String {
        match self.files.as_slice() {
            [one] => one.display().to_string(),
            many => format!(
                "the checkpoint in {} ({} shards)",
                many[0].parent().unwrap_or(Path::new(".")).display(),
                many.len()
            ),
        }
    }

    /// Every tensor name in the checkpoint.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The dtype `name` is stored in, if present.
    pub fn source_dtype(&self, name: &str) -> Option<safetensors::Dtype> {
        self.index.get(name).map(|e| e.info.dtype)
    }

    /// Tensor `name` as stored (its own dtype and shape; never trainable).
    pub fn raw(&self, name: &str) -> Result<Tensor> {
        self.load(name, None)
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Copies tensor `name` (or, if `rows` is given, those rows of its first dimension, stacked
    /// in that order) out of its mapping, then tells the kernel the mapped pages are no longer
    /// needed, so that a loaded model costs its tensors once, not twice.
    fn load(&self, name: &str, rows: Option<&[u32]>) -> Result<Tensor> {
        let e = self
            .index
            .get(name)
            .ok_or_else(|| Error::bad_file(self.origin(), format!("tensor {name} is missing")))?;
        let shard = &self.shards[e.shard];
        let (a, b) = e.info.data_offsets;
        let (start, end) = (shard.data_start + a, shard.data_start + b);
        let read = |from: usize, to: usize, shape: Vec<usize>| -> Result<Tensor> {
            let view =
                safetensors::tensor::TensorView::new(e.info.dtype, shape, &shard.map[from..to])
                    .map_err(|err| {
                        Error::bad_file(self.origin(), format!("tensor {name}: {err}"))
                    })?;
            let t = candle::safetensors::Load::load(&view, &self.device).map_err(|err| {
                Error::bad_file(self.origin(), format!("reading tensor {name}: {err}"))
            })?;
            release(shard, from, to);
            Ok(t)
        };
        let Some(rows) = rows else {
            return read(start, end, e.info.shape.clone());
        };
        // Rows of the first dimension are contiguous byte ranges: read only those.
        let n = e.info.shape.first().copied().unwrap_or(0);
        let inner: Vec<usize> = e.info.shape.iter().skip(1).copied().collect();
        let row_bytes = (end - start) / n.max(1);
        let mut parts = Vec::with_capacity(rows.len());
        for &r in rows {
            let r = r as usize;
            if r >= n {
                return Err(Error::invalid(format!("row {r} of {name}, which has {n}")));
            }
            let from = start + r * row_bytes;
            parts.push(read(from, from + row_bytes, inner.clone())?);
        }
        if parts.is_empty() {
            let mut shape = vec![0];
            shape.extend(&inner);
            return Ok(Tensor::zeros(shape, self.dtype, &self.device)?);
        }
        Ok(Tensor::stack(&parts, 0)?)
    }

    /// The shape of `name`, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.index.get(name).map(|e| e.info.shape.clone())
    }

    /// Makes every tensor read from now on a trainable leaf (a candle `Var`), so that
    /// gradients reach it.
    pub fn set_trainable(&mut self, trainable: bool) {
        self.trainable = trainable;
        self.trainable_prefixes.clear();
    }

    /// Makes only the tensors whose names start with one of `prefixes` trainable (for example
    /// the MoE blocks, [`super::config::ModelConfig::moe_prefixes`]); the others stay frozen.
    pub fn set_trainable_only(&mut self, prefixes: Vec<String>) {
        self.trainable = true;
        self.trainable_prefixes = prefixes;
    }

    /// `t`, read from tensor `name`, made a trainable leaf if the settings say so (for tensors
    /// a reader rearranges after reading them).
    pub fn leaf_of(&self, name: &str, t: Tensor) -> Result<Tensor> {
        self.leaf(name, t)
    }

    /// Rows `rows` of tensor `name`'s first dimension as stored (its own dtype, never
    /// trainable), which must have shape `expected`: packed data such as MXFP4 blocks.
    pub fn get_raw_rows(&self, name: &str, expected: &[usize], rows: &[u32]) -> Result<Tensor> {
        self.load_checked(name, expected, Some(rows))
    }

    /// Tensor `name` (or rows `rows` of it) as stored, after checking that it has shape
    /// `expected`.
    fn load_checked(&self, name: &str, expected: &[usize], rows: Option<&[u32]>) -> Result<Tensor> {
        let shape = self
            .shape(name)
            .ok_or_else(|| Error::bad_file(self.origin(), format!("tensor {name} is missing")))?;
        if shape != expected {
            return Err(Error::bad_file(
                self.origin(),
                format!("tensor {name} has shape {shape:?}, expected {expected:?}"),
            ));
        }
        self.load(name, rows)
    }

    /// The experts `ids` of the MoE block at `prefix` as `cfg`'s family stores them (gpt-oss's
    /// own layout, or [`Weights::experts`]), with the family's activation and biases.
    pub fn model_experts(
        &self,
        prefix: &str,
        cfg: &ModelConfig,
        ids: &[u32],
    ) -> Result<SwigluStack> {
        if cfg.moe.experts.interleaved_gate_up {
            return super::gpt_oss_experts::read(self, prefix, cfg, ids);
        }
        let (e, h, i) = (
            cfg.moe.num_experts,
            cfg.hidden_size,
            cfg.moe.expert_intermediate,
        );
        self.experts(prefix, cfg.family.names.experts, ids, e, h, i)
    }

    fn leaf(&self, name: &str, t: Tensor) -> Result<Tensor> {
        let wanted = self.trainable_prefixes.is_empty()
            || self.trainable_prefixes.iter().any(|p| name.starts_with(p));
        if self.trainable && wanted {
            Ok(candle::Var::from_tensor(&t)?.as_tensor().clone())
        } else {
            Ok(t)
        }
    }

    /// The device tensors are read onto.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The dtype tensors are read as.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Tensor `name` in the chosen dtype, which must have shape `expected`.
    pub fn get(&self, name: &str, expected: &[usize]) -> Result<Tensor> {
        self.get_rows(name, expected, None)
    }

    /// Tensor `name` of shape `expected` in f32, whatever the model's dtype, and never
    /// trainable: a buffer such as a router's selection bias, not a weight.
    pub fn get_frozen(&self, name: &str, expected: &[usize]) -> Result<Tensor> {
        Ok(self
            .load_checked(name, expected, None)?
            .to_dtype(DType::F32)?)
    }

    /// Rows `rows` of tensor `name`'s first dimension (the whole tensor for `None`), which must
    /// have shape `expected`; only those rows are read.
    pub fn get_rows(&self, name: &str, expected: &[usize], rows: Option<&[u32]>) -> Result<Tensor> {
        let t = self.load_checked(name, expected, rows)?;
        self.leaf(name, t.to_dtype(self.dtype)?)
    }

    /// The experts `ids` (in that order) of the MoE block at `prefix` (for example
    /// `model.layers.3.mlp`), with hidden size `h`, expert intermediate size `i`, and `e` experts
    /// in all. Per-expert tensors are used when present, else the fused ones.
    pub fn experts(
        &self,
        prefix: &str,
        names: ExpertNames,
        ids: &[u32],
        e: usize,
        h: usize,
        i: usize,
    ) -> Result<SwigluStack> {
        if let Some(&bad) = ids.iter().find(|&&x| x as usize >= e) {
            return Err(Error::invalid(format!("expert {bad} requested of {e}")));
        }
        let per_expert = format!("{prefix}.experts.0.{}.weight", names.gate);
        if self.contains(&per_expert) {
            let mut gate = Vec::with_capacity(ids.len());
            let mut up = Vec::with_capacity(ids.len());
            let mut down = Vec::with_capacity(ids.len());
            for &j in ids {
                let p = |n: &str| format!("{prefix}.experts.{j}.{n}.weight");
                gate.push(self.get(&p(names.gate), &[i, h])?);
                up.push(self.get(&p(names.up), &[i, h])?);
                down.push(self.get(&p(names.down), &[h, i])?);
            }
            let stacked = format!("{prefix}.experts");
            return SwigluStack::new(
                self.leaf(&stacked, Tensor::stack(&gate, 0)?)?,
                self.leaf(&stacked, Tensor::stack(&up, 0)?)?,
                self.leaf(&stacked, Tensor::stack(&down, 0)?)?,
            );
        }
        let gate_up_name = format!("{prefix}.experts.gate_up_proj");
        let down_name = format!("{prefix}.experts.down_proj");
        let Some(gu_shape) = self.shape(&gate_up_name) else {
            return Err(Error::bad_file(
                self.origin(),
                format!("no experts for {prefix}: neither {per_expert} nor {gate_up_name}"),
            ));
        };
        // The layout follows from both shapes (one of them alone is ambiguous when H = 2I or
        // H = I).
        let down_shape = self.shape(&down_name).unwrap_or_default();
        let standard = gu_shape == [e, 2 * i, h] && down_shape == [e, h, i];
        let transposed = gu_shape == [e, h, 2 * i] && down_shape == [e, i, h];
        // Only this rank's experts are copied out of the mapping.
        let (gate_up, down) = if standard {
            let gu = self.get_rows(&gate_up_name, &[e, 2 * i, h], Some(ids))?;
            (gu, self.get_rows(&down_name, &[e, h, i], Some(ids))?)
        } else if transposed {
            // Transposed storage (in, out): bring it to (out, in).
            let gu = self.get_rows(&gate_up_name, &[e, h, 2 * i], Some(ids))?;
            let d = self.get_rows(&down_name, &[e, i, h], Some(ids))?;
            (
                gu.transpose(1, 2)?.contiguous()?,
                d.transpose(1, 2)?.contiguous()?,
            )
        } else {
            return Err(Error::bad_file(
                self.origin(),
                format!(
                    "fused experts {gate_up_name} {gu_shape:?} and {down_name} {down_shape:?} \
                     match neither [{e}, {}, {h}] with [{e}, {h}, {i}] nor [{e}, {h}, {}] with \
                     [{e}, {i}, {h}]",
                    2 * i,
                    2 * i
                ),
            ));
        };
        SwigluStack::new(
            self.leaf(&gate_up_name, gate_up.narrow(1, 0, i)?.contiguous()?)?,
            self.leaf(&gate_up_name, gate_up.narrow(1, i, i)?.contiguous()?)?,
            self.leaf(&down_name, down)?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const E: usize = 4;
    const H: usize = 6;
    const I: usize = 3;

    fn value(j: usize, which: usize, r: usize, c: usize) -> f32 {
        (j * 1000 + which * 100 + r * 10 + c) as f32
    }

    fn expert_mat(j: usize, which: usize, rows: usize, cols: usize) -> Tensor {
        let v: Vec<f32> = (0..rows * cols)
            .map(|x| value(j, which, x / cols, x % cols))
            .collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
    }

    fn save(path: &Path, tensors: HashMap<String, Tensor>) {
        candle::safetensors::save(&tensors, path).unwrap();
    }

    #[test]
    fn per_expert_fused_and_transposed_layouts_agree() {
        let t = tempfile::tempdir().unwrap();
        let p = "model.layers.1.mlp";
        let mut per = HashMap::new();
        for j in 0..E {
            per.insert(format!("{p}.experts.{j}.w1.weight"), expert_mat(j, 0, I, H));
            per.insert(format!("{p}.experts.{j}.w3.weight"), expert_mat(j, 1, I, H));
            per.insert(format!("{p}.experts.{j}.w2.weight"), expert_mat(j, 2, H, I));
        }
        let stack = |f: &dyn Fn(usize) -> Tensor| {
            Tensor::stack(&(0..E).map(f).collect::<Vec<_>>(), 0).unwrap()
        };
        let gate_up =
            stack(&|j| Tensor::cat(&[expert_mat(j, 0, I, H), expert_mat(j, 1, I, H)], 0).unwrap());
        let down = stack(&|j| expert_mat(j, 2, H, I));
        let mut fused = HashMap::new();
        fused.insert(format!("{p}.experts.gate_up_proj"), gate_up.clone());
        fused.insert(format!("{p}.experts.down_proj"), down.clone());
        let mut transposed = HashMap::new();
        transposed.insert(
            format!("{p}.experts.gate_up_proj"),
            gate_up.transpose(1, 2).unwrap().contiguous().unwrap(),
        );
        transposed.insert(
            format!("{p}.experts.down_proj"),
            down.transpose(1, 2).unwrap().contiguous().unwrap(),
        );
        let mut stacks = Vec::new();
        for (name, tensors) in [("per", per), ("fused", fused), ("transposed", transposed)] {
            let f = t.path().join(format!("{name}.safetensors"));
            save(&f, tensors);
            let w = Weights::open(&[f], &Device::Cpu).unwrap();
            stacks.push(w.experts(p, W1_W3_W2, &[3, 1], E, H, I).unwrap());
        }
        for s in &stacks {
            assert_eq!(s.len(), 2);
            // Expert 3's gate row 2, column 5; expert 1's down row 4, column 1.
            let g = s.gate.to_vec3::<f32>().unwrap();
            assert_eq!(g[0][2][5], value(3, 0, 2, 5));
            let u = s.up.to_vec3::<f32>().unwrap();
            assert_eq!(u[1][0][0], value(1, 1, 0, 0));
            let d = s.down.to_vec3::<f32>().unwrap();
            assert_eq!(d[1][4][1], value(1, 2, 4, 1));
        }
    }

    #[test]
    fn missing_misshapen_and_truncated_are_named() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("m.safetensors");
        let mut m = HashMap::new();
        m.insert(
            "a".to_string(),
            Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap(),
        );
        m.insert(
            "b.experts.0.gate_proj.weight".to_string(),
            Tensor::zeros((I, H), DType::F32, &Device::Cpu).unwrap(),
        );
        save(&f, m);
        let w = Weights::open(std::slice::from_ref(&f), &Device::Cpu).unwrap();
        assert_eq!(w.get("a", &[2, 3]).unwrap().dims(), &[2, 3]);
        let e = w.get("a", &[3, 2]).unwrap_err().to_string();
        assert!(
            e.contains("tensor a has shape [2, 3], expected [3, 2]") && e.contains("m.safetensors"),
            "{e}"
        );
        assert!(w
            .get("zz", &[1])
            .unwrap_err()
            .to_string()
            .contains("tensor zz is missing"));
        // Expert 0 exists but its up projection does not.
        let e = w
            .experts("b", GATE_UP_DOWN, &[0], E, H, I)
            .unwrap_err()
            .to_string();
        assert!(e.contains("b.experts.0.up_proj.weight is missing"), "{e}");
        assert!(w
            .experts("c", GATE_UP_DOWN, &[0], E, H, I)
            .unwrap_err()
            .to_string()
            .contains("no experts for c"));
        assert!(w.experts("b", GATE_UP_DOWN, &[9], E, H, I).is_err());
        let bytes = std::fs::read(&f).unwrap();
        let cut = t.path().join("cut.safetensors");
        std::fs::write(&cut, &bytes[..bytes.len() - 7]).unwrap();
        let e = Weights::open(&[cut], &Device::Cpu)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("cut.safetensors") && e.contains("not a readable safetensors"),
            "{e}"
        );
    }
}
