//! Arrays as frameworks write them, read into plain values: numpy's `.npy` (format versions 1
//! to 3, C order, little-endian) and `.npz` (a zip of `.npy` files, stored or deflated), and
//! safetensors. Integers may be any width; floats f16, bf16 (safetensors), f32 or f64. Sizes
//! are checked against the bytes present before anything is allocated. The one reader of
//! numpy's dtypes ([`decode`]) serves every format here, SGLang's dump included.

use std::collections::BTreeMap;

/// One array: its shape and its values, as integers or as floats.
#[derive(Clone, Debug, PartialEq)]
pub struct Array {
    pub shape: Vec<usize>,
    pub values: Values,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Values {
    Ints(Vec<i64>),
    Floats(Vec<f32>),
}
/// The arrays of a `.npz` file (a zip of `.npy` files, stored or deflated).
pub fn read_npz(bytes: &[u8]) -> std::result::Result<BTreeMap<String, Array>, String> {
    use std::io::Read;
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes))
        .map_err(|e| format!("not a readable .npz (zip) file: {e}"))?;
    let mut out = BTreeMap::new();
    for i in 0..zip.len() {
        let entry = zip.by_index(i).map_err(|e| format!("zip entry {i}: {e}"))?;
        let name = entry
            .name()
            .map_err(|e| format!("zip entry {i}'s name: {e}"))?
            .into_owned();
        // Deflate expands at most about 1032x: a declared size past that is a lie.
        // (The directory's sizes are not checked against the file by the zip reader.)
        let limit = entry
            .compressed_size()
            .min(bytes.len() as u64)
            .saturating_mul(1032)
            .max(1 << 16);
        if entry.size() > limit {
            return Err(format!(
                "{name}: declares {} bytes from {} compressed",
                entry.size(),
                entry.compressed_size()
            ));
        }
        let mut data = Vec::with_capacity(entry.size().min(limit) as usize);
        entry
            .take(limit)
            .read_to_end(&mut data)
            .map_err(|e| format!("{name}: {e}"))?;
        let array = parse_npy(&data).map_err(|e| format!("{name}: {e}"))?;
        out.insert(
            name.strip_suffix(".npy").unwrap_or(&name).to_string(),
            array,
        );
    }
    Ok(out)
}

/// One `.npy` array from its bytes (format versions 1 to 3, C order, little-endian).
pub fn parse_npy(bytes: &[u8]) -> std::result::Result<Array, String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not a .npy array (no \\x93NUMPY magic)".into());
    }
    let (len, start): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            let len = bytes
                .get(8..12)
                .ok_or("the .npy header runs past the end")?;
            (
                u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize,
                12,
            )
        }
        v => return Err(format!(".npy format version {v} is not read")),
    };
    let header = bytes
        .get(start..start.saturating_add(len))
        .ok_or("the .npy header runs past the end")?;
    let header = std::str::from_utf8(header).map_err(|_| "the .npy header is not text")?;
    let field = |key: &str| -> std::result::Result<&str, String> {
        let at = header
            .find(&format!("'{key}'"))
            .ok_or(format!("the .npy header has no '{key}'"))?;
        let rest = header[at + key.len() + 2..].trim_start();
        Ok(rest.strip_prefix(':').unwrap_or(rest).trim_start())
    };
    if field("fortran_order")?.starts_with("True") {
        return Err("Fortran-ordered arrays are not read (save with C order)".into());
    }
    let descr = field("descr")?;
    let descr = descr
        .strip_prefix('\'')
        .and_then(|d| d.split('\'').next())
        .ok_or("the .npy descr is not a quoted string")?;
    let shape_text = field("shape")?;
    let shape_text = shape_text
        .strip_prefix('(')
        .and_then(|s| s.split(')').next())
        .ok_or("the .npy shape is not a tuple")?;
    let shape = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| format!("shape entry {s:?}")))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let data = &bytes[start + len..];
    decode(descr, shape, data)
}

/// Little-endian values of numpy type `descr` (`<i8`, `|u1`, `<f4`, ...).
pub(crate) fn decode(
    descr: &str,
    shape: Vec<usize>,
    data: &[u8],
) -> std::result::Result<Array, String> {
    let Some((order, kind)) = descr.get(..1).zip(descr.get(1..)) else {
        return Err(format!("dtype {descr:?} is not read"));
    };
    if order == ">" {
        return Err(format!("big-endian {descr} is not read"));
    }
    let size: usize = kind
        .get(1..)
        .and_then(|s| s.parse().ok())
        .filter(|&s| match kind.as_bytes()[0] {
            b'i' | b'u' => matches!(s, 1 | 2 | 4 | 8),
            b'f' => matches!(s, 2 | 4 | 8),
            _ => false,
        })
        .ok_or(format!("dtype {descr:?} is not read (integers or floats)"))?;
    let n = shape
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .filter(|n| n.checked_mul(size) == Some(data.len()))
        .ok_or(format!(
            "shape {shape:?} of {descr} needs other than the {} data bytes present",
            data.len()
        ))?;
    let chunks = data.chunks_exact(size);
    let values = match (kind.as_bytes()[0], size) {
        (b'i', 1 | 2 | 4 | 8) => Values::Ints(chunks.map(sign_extend).collect()),
        (b'u', 1 | 2 | 4 | 8) => Values::Ints(
            chunks
                .map(|c| {
                    let mut b = [0u8; 8];
                    b[..c.len()].copy_from_slice(c);
                    i64::try_from(u64::from_le_bytes(b)).unwrap_or(i64::MAX)
                })
                .collect(),
        ),
        (b'f', 2) => Values::Floats(
            chunks
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        (b'f', 4) => Values::Floats(
            chunks
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
        ),
        (b'f', 8) => Values::Floats(
            chunks
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
                .collect(),
        ),
        _ => return Err(format!("dtype {descr:?} is not read (integers or floats)")),
    };
    debug_assert_eq!(n, shape.iter().product::<usize>());
    Ok(Array { shape, values })
}

fn sign_extend(c: &[u8]) -> i64 {
    let mut b = if c[c.len() - 1] & 0x80 != 0 {
        [0xffu8; 8]
    } else {
        [0u8; 8]
    };
    b[..c.len()].copy_from_slice(c);
    i64::from_le_bytes(b)
}

/// The arrays of a safetensors file.
pub fn read_safetensors(bytes: &[u8]) -> std::result::Result<BTreeMap<String, Array>, String> {
    use safetensors::Dtype;
    if let Some(name) = crate::input::duplicate_header_name(bytes) {
        return Err(format!("the header names tensor {name:?} twice"));
    }
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| format!("not a readable safetensors file ({e})"))?;
    let mut out = BTreeMap::new();
    for (name, v) in st.tensors() {
        let descr = match v.dtype() {
            Dtype::I8 => "<i1",
            Dtype::I16 => "<i2",
            Dtype::I32 => "<i4",
            Dtype::I64 => "<i8",
            Dtype::U8 => "<u1",
            Dtype::U16 => "<u2",
            Dtype::U32 => "<u4",
            Dtype::U64 => "<u8",
            Dtype::F16 => "<f2",
            Dtype::F32 => "<f4",
            Dtype::F64 => "<f8",
            Dtype::BF16 => {
                let vals = v
                    .data()
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect();
                out.insert(
                    name,
                    Array {
                        shape: v.shape().to_vec(),
                        values: Values::Floats(vals),
                    },
                );
                continue;
            }
            other => return Err(format!("{name}: dtype {other:?} is not read")),
        };
        out.insert(
            name.clone(),
            decode(descr, v.shape().to_vec(), v.data()).map_err(|e| format!("{name}: {e}"))?,
        );
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A version-1 `.npy` file of `descr` values.
    pub(crate) fn npy(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
        let dims: Vec<String> = shape.iter().map(|s| s.to_string()).collect();
        let tuple = if dims.len() == 1 {
            format!("({},)", dims[0])
        } else {
            format!("({})", dims.join(", "))
        };
        let mut h = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple}, }}");
        while (10 + h.len() + 1) % 64 != 0 {
            h.push(' ');
        }
        h.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((h.len() as u16).to_le_bytes());
        out.extend(h.as_bytes());
        out.extend(data);
        out
    }
    #[test]
    fn every_integer_width_and_float_reads() {
        let a = parse_npy(&npy("|u1", &[1, 2], &[3, 5])).unwrap();
        assert_eq!(a.values, Values::Ints(vec![3, 5]));
        let a = parse_npy(&npy("<i4", &[2], &[255, 255, 255, 255, 2, 0, 0, 0])).unwrap();
        assert_eq!(a.values, Values::Ints(vec![-1, 2]));
        let f: Vec<u8> = [0.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let a = parse_npy(&npy("<f4", &[2], &f)).unwrap();
        assert_eq!(a.values, Values::Floats(vec![0.5, -2.0]));
    }

    /// Every version of the `.npy` header: version 1's two-byte length, versions 2 and 3's
    /// four-byte one; and the shortest inputs, each refused with its own reason.
    #[test]
    fn npy_headers_of_every_version_and_length() {
        let v1 = npy("<i2", &[2], &[1, 0, 0xfe, 0xff]);
        let header_len = u16::from_le_bytes([v1[8], v1[9]]) as usize;
        for version in [2u8, 3] {
            let mut v = b"\x93NUMPY".to_vec();
            v.extend([version, 0]);
            v.extend((header_len as u32).to_le_bytes());
            v.extend(&v1[10..]);
            let a = parse_npy(&v).unwrap();
            assert_eq!((a.shape, a.values), (vec![2], Values::Ints(vec![1, -2])));
        }
        let err = |b: &[u8]| parse_npy(b).unwrap_err();
        for n in 0..10 {
            assert!(err(&v1[..n]).contains("no \\x93NUMPY magic"), "{n} bytes");
        }
        assert!(err(b"not an npy file").contains("no \\x93NUMPY magic"));
        // Ten bytes make a version-1 file with an empty header.
        let mut empty = v1[..10].to_vec();
        empty[8..10].copy_from_slice(&[0, 0]);
        assert!(err(&empty).contains("the .npy header has no 'fortran_order'"));
        for n in 10..12 {
            let mut v = v1[..n].to_vec();
            v[6] = 2;
            assert!(
                err(&v).contains("the .npy header runs past the end"),
                "{n} bytes"
            );
        }
        let mut v4 = v1.clone();
        v4[6] = 4;
        assert!(err(&v4).contains(".npy format version 4 is not read"));
    }

    /// `data` as the one entry `x.npy` of a zip, its uncompressed size declared as `declared`
    /// (in the local header and the central directory); and the entry's compressed size.
    fn zipped(
        data: &[u8],
        method: zip::CompressionMethod,
        declared: Option<u32>,
    ) -> (Vec<u8>, u32) {
        use std::io::Write;
        let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        let options = zip::write::SimpleFileOptions::default().compression_method(method);
        w.start_file("x.npy", options).unwrap();
        w.write_all(data).unwrap();
        let mut bytes = w.finish().unwrap().into_inner();
        let at = |bytes: &[u8], sig: &[u8]| bytes.windows(4).position(|w| w == sig).unwrap();
        let central = at(&bytes, b"PK\x01\x02");
        let compressed = u32::from_le_bytes(bytes[central + 20..central + 24].try_into().unwrap());
        if let Some(d) = declared {
            for o in [at(&bytes, b"PK\x03\x04") + 22, central + 24] {
                bytes[o..o + 4].copy_from_slice(&d.to_le_bytes());
            }
        }
        (bytes, compressed)
    }

    /// A `.npz` entry's declared size is held to what deflate can expand its compressed bytes
    /// to (1032 times, or 64 KiB for a small entry) before anything is allocated.
    #[test]
    fn npz_declared_sizes_are_held_to_deflates_bound() {
        use zip::CompressionMethod::{Deflated, Stored};
        let data = npy("<f8", &[1], &2.5f64.to_le_bytes());
        let (bytes, n) = zipped(&data, Stored, None);
        assert_eq!(n as usize, data.len());
        let arrays = read_npz(&bytes).unwrap();
        assert_eq!(arrays["x"].values, Values::Floats(vec![2.5]));
        let limit = n * 1032;
        assert!(limit > 1 << 16);
        let refused = |data: &[u8], method, declared: u32| {
            let (bytes, c) = zipped(data, method, Some(declared));
            match read_npz(&bytes) {
                Err(e) if e.contains("declares") => {
                    assert_eq!(
                        e,
                        format!("x.npy: declares {declared} bytes from {c} compressed")
                    );
                    true
                }
                _ => false,
            }
        };
        assert!(refused(&data, Stored, limit + 1));
        assert!(!refused(&data, Stored, limit));
        // A small deflated entry may declare up to 64 KiB (the check comes before the entry is
        // read as an array).
        let zeros = [0; 1000];
        let (_, c) = zipped(&zeros, Deflated, None);
        assert!(c * 1032 < 1 << 16, "{c}");
        assert!(!refused(&zeros, Deflated, 1 << 16));
        assert!(refused(&zeros, Deflated, (1 << 16) + 1));
    }
}
