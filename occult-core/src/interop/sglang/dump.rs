//! SGLang's expert-distribution dump in `per_token` mode (`--expert-distribution-recorder-mode
//! per_token`, then `/dump_expert_distribution_record`; checked against sglang 0.5.23,
//! `srt/eplb/expert_distribution.py`), read into routing arrays for
//! [`crate::interop::routing_import`].
//!
//! Each rank writes `expert_distribution_recorder_{time}_{rank}.pt`, a `torch.save` of
//! `{"records": [...], "last_physical_to_logical_map": int [layers, physical experts]}`. Each
//! record (one forward pass) holds `topk_ids_of_layer`, int32 `[layers, tokens, 8]`: the
//! *physical* expert ids each token was sent to, `-1` where nothing was recorded (dense layers,
//! columns past the top-k, padded tokens). Records are concatenated in order, physical ids are
//! mapped to logical ones through the map, and layers that recorded nothing are left out.
//!
//! The pickle is parsed with candle's reader; tensor storage is read from the zip with its size
//! checked against the entry before anything is allocated.

use crate::interop::arrays::{decode, Array, Values};
use candle::pickle::{Object, Stack};
use std::collections::BTreeMap;
use std::io::Read;

/// The routing arrays of one rank's dump: `topk_ids` `[layers, tokens, width]` (logical ids, -1
/// padding) and `layer_ids`.
pub fn read_per_token_dump(bytes: &[u8]) -> Result<BTreeMap<String, Array>, String> {
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes))
        .map_err(|e| format!("not a torch.save file (zip): {e}"))?;
    let pkl = (0..zip.len())
        .filter_map(|i| {
            zip.by_index(i)
                .ok()
                .and_then(|f| f.name().ok().map(|n| n.into_owned()))
        })
        .find(|n| n.ends_with("data.pkl"))
        .ok_or("no data.pkl: not a torch.save file")?;
    let dir = std::path::PathBuf::from(pkl.strip_suffix(".pkl").expect("ends with .pkl"));
    let pickle = entry(&mut zip, &pkl, bytes.len() as u64 * 1032)?;
    // candle's pickle reader can panic on hostile input (an overlong LONG1): contained here.
    let obj = crate::input::contain_panics(|| {
        let mut stack = Stack::empty();
        stack.read_loop(&mut std::io::BufReader::new(&pickle[..]))?;
        stack.finalize()
    })
    .map_err(|e| format!("data.pkl: {e}"))?
    .map_err(|e| format!("data.pkl: {e}"))?;
    let Object::Dict(top) = obj else {
        return Err("the dump is not a dict: not SGLang's per_token expert distribution".into());
    };
    let mut records = None;
    let mut map = None;
    for (k, v) in top {
        match k {
            Object::Unicode(k) if k == "records" => records = Some(v),
            Object::Unicode(k) if k == "last_physical_to_logical_map" => map = Some(v),
            _ => {}
        }
    }
    let (Some(Object::List(records)), Some(map)) = (records, map) else {
        return Err(
            "the dump has no `records` list and `last_physical_to_logical_map`: not SGLang's \
                    per_token mode (a `stat` dump holds only counts)"
                .into(),
        );
    };
    // Every tensor's bytes together stay within what the file can expand to.
    let mut budget = bytes.len().saturating_mul(1032);
    let map = tensor(
        &mut zip,
        &dir,
        map,
        "last_physical_to_logical_map",
        &mut budget,
    )?;
    if map.shape.len() != 2 {
        return Err(format!(
            "last_physical_to_logical_map has shape {:?}, expected [layers, physical experts]",
            map.shape
        ));
    }
    let Values::Ints(map_v) = &map.values else {
        return Err("last_physical_to_logical_map holds floats".into());
    };
    let (n_layers, n_phys) = (map.shape[0], map.shape[1]);
    let mut per_layer: Vec<Vec<i64>> = vec![Vec::new(); n_layers];
    let mut width = None;
    for (i, rec) in records.into_iter().enumerate() {
        let Object::Dict(fields) = rec else {
            return Err(format!("record {i} is not a dict"));
        };
        let ids = fields
            .into_iter()
            .find(|(k, _)| matches!(k, Object::Unicode(k) if k == "topk_ids_of_layer"))
            .map(|(_, v)| v)
            .ok_or(format!("record {i} has no topk_ids_of_layer"))?;
        let a = tensor(&mut zip, &dir, ids, "topk_ids_of_layer", &mut budget)?;
        let Values::Ints(v) = a.values else {
            return Err(format!("record {i}: topk_ids_of_layer holds floats"));
        };
        if a.shape.len() != 3 || a.shape[0] != n_layers {
            return Err(format!(
                "record {i}: topk_ids_of_layer has shape {:?}, expected [{n_layers}, tokens, k]",
                a.shape
            ));
        }
        let w = *width.get_or_insert(a.shape[2]);
        if a.shape[2] != w {
            return Err(format!(
                "record {i}: {} columns, record 0 has {w}",
                a.shape[2]
            ));
        }
        let per = a.shape[1] * w;
        for (l, chunk) in v.chunks_exact(per.max(1)).enumerate().take(n_layers) {
            for &x in chunk {
                let logical = match x {
                    -1 => -1,
                    x if x >= 0 && (x as usize) < n_phys => map_v[l * n_phys + x as usize],
                    x => {
                        return Err(format!(
                            "record {i} layer {l}: physical expert {x} of {n_phys}"
                        ))
                    }
                };
                per_layer[l].push(logical);
            }
        }
    }
    let width = width.ok_or("the dump holds no records: nothing was recorded")?;
    let layers: Vec<usize> = (0..n_layers)
        .filter(|&l| per_layer[l].iter().any(|&x| x != -1))
        .collect();
    if layers.is_empty() {
        return Err("every recorded id is -1: no MoE layer recorded any token".into());
    }
    let tokens = per_layer[layers[0]].len() / width;
    let ids: Vec<i64> = layers
        .iter()
        .flat_map(|&l| per_layer[l].iter().copied())
        .collect();
    Ok(BTreeMap::from([
        (
            "topk_ids".to_string(),
            Array {
                shape: vec![layers.len(), tokens, width],
                values: Values::Ints(ids),
            },
        ),
        (
            "layer_ids".to_string(),
            Array {
                shape: vec![layers.len()],
                values: Values::Ints(layers.iter().map(|&l| l as i64).collect()),
            },
        ),
    ]))
}

/// A zip entry's bytes, refused past `limit`.
fn entry(
    zip: &mut zip::ZipArchive<std::io::Cursor<&[u8]>>,
    name: &str,
    limit: u64,
) -> Result<Vec<u8>, String> {
    let f = zip.by_name(name).map_err(|e| format!("{name}: {e}"))?;
    if f.size() > limit {
        return Err(format!("{name}: declares {} bytes", f.size()));
    }
    let mut out = Vec::with_capacity(f.size() as usize);
    f.take(limit)
        .read_to_end(&mut out)
        .map_err(|e| format!("{name}: {e}"))?;
    Ok(out)
}

fn int_of(o: &Object) -> Option<i64> {
    match o {
        Object::Int(x) => Some(*x as i64),
        Object::Long(x) => Some(*x),
        _ => None,
    }
}

fn usizes(o: &Object) -> Option<Vec<usize>> {
    let Object::Tuple(v) = o else { return None };
    v.iter()
        .map(|x| int_of(x).and_then(|x| usize::try_from(x).ok()))
        .collect()
}

/// A contiguous integer tensor of the pickle (`torch._utils._rebuild_tensor_v2` of a storage),
/// read from its storage entry. (candle's own reader does not take int32 storages, which SGLang
/// writes.)
fn tensor(
    zip: &mut zip::ZipArchive<std::io::Cursor<&[u8]>>,
    dir: &std::path::Path,
    obj: Object,
    what: &str,
    budget: &mut usize,
) -> Result<Array, String> {
    let not = || format!("{what} is not a tensor this reader knows");
    let Object::Reduce { callable, args } = obj else {
        return Err(not());
    };
    match *callable {
        Object::Class {
            ref module_name,
            ref class_name,
        } if module_name == "torch._utils" && class_name == "_rebuild_tensor_v2" => {}
        _ => return Err(not()),
    }
    let Object::Tuple(args) = *args else {
        return Err(not());
    };
    let (Some(Object::PersistentLoad(storage)), Some(offset), Some(shape), Some(stride)) = (
        args.first(),
        args.get(1).and_then(int_of),
        args.get(2).and_then(usizes),
        args.get(3).and_then(usizes),
    ) else {
        return Err(not());
    };
    let Object::Tuple(storage) = storage.as_ref() else {
        return Err(not());
    };
    let (Some(Object::Class { class_name, .. }), Some(Object::Unicode(key))) =
        (storage.get(1), storage.get(2))
    else {
        return Err(not());
    };
    let (descr, size) = match class_name.as_str() {
        "LongStorage" => ("<i8", 8),
        "IntStorage" => ("<i4", 4),
        "ShortStorage" => ("<i2", 2),
        "CharStorage" => ("<i1", 1),
        "ByteStorage" => ("|u1", 1),
        other => return Err(format!("{what} is a {other}, not integers")),
    };
    if stride.len() != shape.len() {
        return Err(not());
    }
    let mut expect = 1usize;
    for (i, &d) in shape.iter().enumerate().rev() {
        if d > 1 && stride[i] != expect {
            return Err(format!("{what} is not contiguous (strides {stride:?})"));
        }
        expect = expect.saturating_mul(d);
    }
    let n = shape
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .ok_or(format!("{what}: shape {shape:?} overflows"))?;
    let start = usize::try_from(offset).map_err(|_| format!("{what}: offset {offset}"))?;
    let need = start
        .checked_add(n)
        .and_then(|x| x.checked_mul(size))
        .filter(|&x| x <= *budget)
        .ok_or(format!(
            "{what}: shape {shape:?} is larger than the file can hold"
        ))?;
    *budget -= need;
    let path = format!("{}/{key}", dir.display());
    let data = entry(zip, &path, need as u64)?;
    if data.len() < need {
        return Err(format!(
            "{what}: its storage holds {} bytes, the shape needs {need}",
            data.len()
        ));
    }
    decode(descr, shape, &data[start * size..need])
}
