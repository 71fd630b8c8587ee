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

/// A zip entry's bytes, refused where it declares more than `limit`.
fn entry(
    zip: &mut zip::ZipArchive<std::io::Cursor<&[u8]>>,
    name: &str,
    limit: u64,
) -> Result<Vec<u8>, String> {
    let size = zip
        .by_name(name)
        .map_err(|e| format!("{name}: {e}"))?
        .size();
    if size > limit {
        return Err(format!("{name}: declares {size} bytes"));
    }
    entry_prefix(zip, name, limit)
}

/// A zip entry's first `n` bytes (all of it if shorter): a tensor's storage may hold more than
/// the tensor (a view saves its whole storage).
fn entry_prefix(
    zip: &mut zip::ZipArchive<std::io::Cursor<&[u8]>>,
    name: &str,
    n: u64,
) -> Result<Vec<u8>, String> {
    let f = zip.by_name(name).map_err(|e| format!("{name}: {e}"))?;
    let mut out = Vec::with_capacity(f.size().min(n) as usize);
    f.take(n)
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
/// read from its storage entry (from `offset`, and no further than the shape needs). (candle's
/// own reader does not take int32 storages, which SGLang writes.)
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
    let data = entry_prefix(zip, &path, need as u64)?;
    if data.len() < need {
        return Err(format!(
            "{what}: its storage holds {} bytes, the shape needs {need}",
            data.len()
        ));
    }
    decode(descr, shape, &data[start * size..need])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A pickle of the few opcodes `torch.save` writes for SGLang's dump (protocol 2).
    #[derive(Default)]
    struct Pickle(Vec<u8>);

    impl Pickle {
        fn str(&mut self, s: &str) {
            self.0.push(b'X');
            self.0.extend((s.len() as u32).to_le_bytes());
            self.0.extend(s.as_bytes());
        }
        fn int(&mut self, v: i64) {
            self.0.push(b'J');
            self.0.extend((v as i32).to_le_bytes());
        }
        /// LONG1, as pickle writes integers past 32 bits (here any, to read both kinds).
        fn long(&mut self, v: i64) {
            self.0.extend([0x8a, 8]);
            self.0.extend(v.to_le_bytes());
        }
        fn tuple(&mut self, items: impl FnOnce(&mut Self)) {
            self.0.push(b'(');
            items(self);
            self.0.push(b't');
        }
        fn global(&mut self, module: &str, name: &str) {
            self.0.push(b'c');
            self.0.extend(format!("{module}\n{name}\n").as_bytes());
        }
        /// `torch._utils._rebuild_tensor_v2` of storage `key` (a `storage` class).
        fn tensor(&mut self, storage: &str, key: &str, t: &Tensor, rebuild: &str) {
            self.global("torch._utils", rebuild);
            self.tuple(|p| {
                p.tuple(|p| {
                    p.str("storage");
                    p.global("torch", storage);
                    p.str(key);
                    p.str("cpu");
                    p.int(t.values.len() as i64);
                });
                p.0.push(b'Q'); // BINPERSID
                p.long(t.offset);
                p.tuple(|p| t.shape.iter().for_each(|&d| p.int(d as i64)));
                p.tuple(|p| t.strides().iter().for_each(|&d| p.int(d as i64)));
                p.0.push(0x89); // NEWFALSE: requires_grad
                p.global("collections", "OrderedDict");
                p.0.extend(b")R"); // OrderedDict(): backward hooks
            });
            self.0.push(b'R');
        }
    }

    /// A tensor to write: shape, values, its storage offset, and strides if not contiguous.
    #[derive(Clone)]
    struct Tensor {
        shape: Vec<usize>,
        values: Vec<i64>,
        offset: i64,
        strides: Option<Vec<usize>>,
    }

    impl Tensor {
        fn new(shape: &[usize], values: &[i64]) -> Self {
            Tensor {
                shape: shape.to_vec(),
                values: values.to_vec(),
                offset: 0,
                strides: None,
            }
        }
        fn strides(&self) -> Vec<usize> {
            self.strides.clone().unwrap_or_else(|| {
                let mut s = vec![1; self.shape.len()];
                for i in (0..self.shape.len().saturating_sub(1)).rev() {
                    s[i] = s[i + 1] * self.shape[i + 1];
                }
                s
            })
        }
    }

    /// What to write: the records' ids (int32), the map (int64), extra top-level string
    /// entries, whether the entries are deflated, whether every record reads record 0's
    /// storage, and the function that rebuilds the records' tensors.
    struct Dump {
        records: Vec<Tensor>,
        map: Tensor,
        map_storage: &'static str,
        extra: Vec<(&'static str, String)>,
        deflate: bool,
        shared: bool,
        rebuild: &'static str,
    }

    impl Dump {
        /// Two layers of four physical experts; layer 1's map reverses them.
        fn new(records: Vec<Tensor>) -> Self {
            Dump {
                records,
                map: Tensor::new(&[2, 4], &[0, 1, 2, 3, 3, 2, 1, 0]),
                map_storage: "LongStorage",
                extra: vec![],
                deflate: false,
                shared: false,
                rebuild: "_rebuild_tensor_v2",
            }
        }

        fn bytes(&self) -> Vec<u8> {
            let mut p = Pickle::default();
            p.0.extend([0x80, 2, b'}', b'(']); // PROTO 2, EMPTY_DICT, MARK
                                               // Extra entries go before and after the two the reader takes.
            for (k, v) in &self.extra {
                p.str(&format!("{k}_first"));
                p.str(v);
            }
            p.str("records");
            p.0.extend([b']', b'(']); // EMPTY_LIST, MARK
            let key = |i: usize| if self.shared { 1 } else { i + 1 };
            for (i, r) in self.records.iter().enumerate() {
                p.0.extend([b'}', b'(']);
                p.str("topk_ids_of_layer");
                p.tensor("IntStorage", &key(i).to_string(), r, self.rebuild);
                p.0.push(b'u'); // SETITEMS
            }
            p.0.push(b'e'); // APPENDS
            p.str("last_physical_to_logical_map");
            p.tensor(self.map_storage, "0", &self.map, "_rebuild_tensor_v2");
            for (k, v) in &self.extra {
                p.str(k);
                p.str(v);
            }
            p.0.extend([b'u', b'.']); // SETITEMS, STOP
            let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
            let stored = zip::write::SimpleFileOptions::default()
                .compression_method(zip::CompressionMethod::Stored);
            let packed = if self.deflate {
                stored.compression_method(zip::CompressionMethod::Deflated)
            } else {
                stored
            };
            w.start_file("archive/data.pkl", packed).unwrap();
            w.write_all(&p.0).unwrap();
            w.start_file("archive/data/0", stored).unwrap();
            for &v in &self.map.values {
                w.write_all(&v.to_le_bytes()).unwrap();
            }
            for (i, r) in
                self.records
                    .iter()
                    .enumerate()
                    .take(if self.shared { 1 } else { usize::MAX })
            {
                w.start_file(format!("archive/data/{}", i + 1), packed)
                    .unwrap();
                for &v in &r.values {
                    w.write_all(&(v as i32).to_le_bytes()).unwrap();
                }
            }
            w.finish().unwrap().into_inner()
        }
    }

    fn ints(a: &Array) -> (&[usize], &[i64]) {
        let Values::Ints(v) = &a.values else {
            panic!("floats")
        };
        (&a.shape, v)
    }

    /// Records of [2 layers, tokens, 2]: layer 0 maps physical ids as they are, layer 1 in
    /// reverse; -1 stays -1; records are concatenated by token.
    fn two_records() -> Vec<Tensor> {
        vec![
            Tensor::new(&[2, 2, 2], &[0, 1, 2, -1, 0, 3, 1, 2]),
            Tensor::new(&[2, 1, 2], &[3, 2, -1, -1]),
        ]
    }

    #[test]
    fn a_hand_built_dump_reads_its_logical_ids() {
        let out = read_per_token_dump(&Dump::new(two_records()).bytes()).unwrap();
        let (shape, ids) = ints(&out["topk_ids"]);
        assert_eq!(shape, [2, 3, 2]);
        assert_eq!(ids, [0, 1, 2, -1, 3, 2, 3, 0, 2, 1, -1, -1]);
        assert_eq!(ints(&out["layer_ids"]).1, [0, 1]);
        // A layer that recorded nothing is left out; a tensor may start inside its storage and
        // end before its end; a dimension of one may have any stride.
        let mut records = two_records();
        records[1].values = vec![99, 3, 2, -1, -1, 77];
        records[1].offset = 1;
        records[1].strides = Some(vec![2, 7, 1]);
        records[0].values[4..].fill(-1);
        let out = read_per_token_dump(&Dump::new(records).bytes()).unwrap();
        assert_eq!(
            ints(&out["topk_ids"]),
            (&[1, 3, 2][..], &[0, 1, 2, -1, 3, 2][..])
        );
        assert_eq!(ints(&out["layer_ids"]).1, [0]);
    }

    /// Other top-level entries are ignored, and a deflated data.pkl may expand up to 1032
    /// times the file (here a 200 KB pickle in a file of a few KB).
    #[test]
    fn other_entries_and_a_deflated_pickle_are_read() {
        let mut dump = Dump::new(two_records());
        dump.extra = vec![("note", "x".repeat(200_000))];
        dump.deflate = true;
        let bytes = dump.bytes();
        assert!(bytes.len() < 2000, "{}", bytes.len());
        let out = read_per_token_dump(&bytes).unwrap();
        assert_eq!(ints(&out["topk_ids"]).0, [2, 3, 2]);
    }

    /// Every tensor's bytes count against what the file can expand to (1032 times its size),
    /// also where records share one storage: a small file cannot make the reader allocate
    /// without bound.
    #[test]
    fn records_sharing_a_storage_count_against_the_files_size_each() {
        let tokens = 1 << 16;
        let record = Tensor::new(&[2, tokens, 2], &vec![0; 4 * tokens]);
        let need = 4 * tokens * 4;
        let mut outcomes = vec![];
        for n in 1..=5 {
            let mut dump = Dump::new(vec![record.clone(); n]);
            (dump.deflate, dump.shared) = (true, true);
            let bytes = dump.bytes();
            let fits = n * need + 8 * 8 <= bytes.len() * 1032;
            match read_per_token_dump(&bytes) {
                Ok(out) => {
                    assert!(
                        fits,
                        "{n} records of {need} bytes from {} bytes",
                        bytes.len()
                    );
                    assert_eq!(ints(&out["topk_ids"]).0, [2, n * tokens, 2]);
                }
                Err(e) => {
                    assert!(!fits, "{n}: {e}");
                    assert!(e.contains("is larger than the file can hold"), "{e}");
                }
            }
            outcomes.push(fits);
        }
        assert!(outcomes[0] && !outcomes[4], "{outcomes:?}");
    }

    /// A change to a dump that should make it refused.
    type Edit<'a> = &'a dyn Fn(&mut Dump);

    #[test]
    fn malformed_dumps_are_refused_with_reasons() {
        let with = |edit: &dyn Fn(&mut Dump)| {
            let mut d = Dump::new(two_records());
            edit(&mut d);
            read_per_token_dump(&d.bytes()).unwrap_err()
        };
        let cases: Vec<(Edit, &str)> = vec![
            (
                &|d| d.records[0].values[1] = 4,
                "record 0 layer 0: physical expert 4 of 4",
            ),
            (
                &|d| d.records[1].values[0] = 5,
                "record 1 layer 0: physical expert 5 of 4",
            ),
            (
                &|d| d.records[0].values[7] = -2,
                "record 0 layer 1: physical expert -2 of 4",
            ),
            (
                &|d| d.records[1] = Tensor::new(&[2, 2], &[0, 1, 2, 3]),
                "record 1: topk_ids_of_layer has shape [2, 2], expected [2, tokens, k]",
            ),
            (
                &|d| d.records[1] = Tensor::new(&[1, 2, 2], &[0, 1, 2, 3]),
                "record 1: topk_ids_of_layer has shape [1, 2, 2], expected [2, tokens, k]",
            ),
            (
                &|d| d.records[1] = Tensor::new(&[2, 1, 3], &[0, 1, 2, 3, 0, 1]),
                "record 1: 3 columns, record 0 has 2",
            ),
            (
                &|d| d.records[1].strides = Some(vec![1, 2, 2]),
                "topk_ids_of_layer is not contiguous (strides [1, 2, 2])",
            ),
            (
                &|d| d.records[1].values.pop().map(drop).unwrap_or(()),
                "topk_ids_of_layer: its storage holds 12 bytes, the shape needs 16",
            ),
            (
                &|d| d.map = Tensor::new(&[8], &[0, 1, 2, 3, 3, 2, 1, 0]),
                "last_physical_to_logical_map has shape [8], expected [layers, physical \
                 experts]",
            ),
            (
                &|d| d.map_storage = "FloatStorage",
                "last_physical_to_logical_map is a FloatStorage, not integers",
            ),
            (&|d| d.records.clear(), "the dump holds no records"),
            (
                &|d| d.rebuild = "_rebuild_parameter",
                "topk_ids_of_layer is not a tensor this reader knows",
            ),
            (
                &|d| d.records.iter_mut().for_each(|r| r.values.fill(-1)),
                "every recorded id is -1",
            ),
        ];
        for (i, (edit, want)) in cases.into_iter().enumerate() {
            let e = with(edit);
            assert!(e.contains(want), "case {i}: {e}");
        }
        assert!(read_per_token_dump(b"PK not a zip").is_err());
        // data.pkl's declared size (in the local header and the central directory), past
        // what the file can expand to and at it.
        let declared = |size: u32| {
            let mut bytes = Dump::new(two_records()).bytes();
            let at = |b: &[u8], sig: &[u8]| b.windows(4).position(|w| w == sig).unwrap();
            for o in [
                at(&bytes, b"PK\x03\x04") + 22,
                at(&bytes, b"PK\x01\x02") + 24,
            ] {
                bytes[o..o + 4].copy_from_slice(&size.to_le_bytes());
            }
            (read_per_token_dump(&bytes), bytes.len() as u32 * 1032)
        };
        let limit = declared(0).1;
        let e = declared(limit + 1).0.unwrap_err();
        assert_eq!(e, format!("archive/data.pkl: declares {} bytes", limit + 1));
        if let Err(e) = declared(limit).0 {
            assert!(!e.contains("declares"), "{e}");
        }
    }
}
