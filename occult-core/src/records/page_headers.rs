//! The few fields of a Parquet page header that size the parquet crate's buffers, read from
//! the header's Thrift compact-protocol bytes before the crate decodes the page.
//!
//! The crate allocates from two header fields before it checks them against the data: the
//! uncompressed page size (the decompression buffer) and a dictionary page's value count (the
//! dictionary, resized to that count before a value is read). A malformed header can ask for
//! tens of gigabytes, and a failed allocation aborts the process, past any panic handler. This
//! reader takes those fields, and the length of the header, and skips every other field without
//! allocating. (The `thrift` crate's reader is no help here: it allocates a binary field's
//! declared length before reading it.) Thrift's compact protocol:
//! <https://github.com/apache/thrift/blob/master/doc/specs/thrift-compact-protocol.md>.

/// A page header's sizes, as the file states them (not yet checked).
#[derive(Debug, Clone, PartialEq)]
pub struct PageHeader {
    /// The page type (0 data, 1 index, 2 dictionary, 3 data v2).
    pub kind: i32,
    /// The page's size once decompressed, in bytes.
    pub uncompressed: i32,
    /// The page's size in the file after the header, in bytes.
    pub compressed: i32,
    /// A dictionary page's value count.
    pub dictionary_values: Option<i32>,
    /// The header's own length in bytes.
    pub len: usize,
}

/// Page types, as `PageHeader::kind` holds them.
pub const DICTIONARY_PAGE: i32 = 2;

/// Values nested deeper than this are refused (a page header nests three deep), so that a
/// header of nested lists cannot run the stack out.
const MAX_DEPTH: u32 = 32;

fn deep_enough(depth: u32) -> Result<(), String> {
    if depth > MAX_DEPTH {
        return Err(format!("the page header nests over {MAX_DEPTH} deep"));
    }
    Ok(())
}

// Compact-protocol type codes.
const BOOL_TRUE: u8 = 1;
const BOOL_FALSE: u8 = 2;
const BYTE: u8 = 3;
const I16: u8 = 4;
const I32: u8 = 5;
const I64: u8 = 6;
const DOUBLE: u8 = 7;
const BINARY: u8 = 8;
const LIST: u8 = 9;
const SET: u8 = 10;
const MAP: u8 = 11;
const STRUCT: u8 = 12;
const UUID: u8 = 13;

/// Reads the page header at the start of `bytes`.
pub fn read(bytes: &[u8]) -> Result<PageHeader, String> {
    let mut r = Reader { bytes, pos: 0 };
    let (mut kind, mut uncompressed, mut compressed, mut dictionary_values) =
        (None, None, None, None);
    r.fields(0, &mut |r, id, ty| {
        match (id, ty) {
            (1, I32) => kind = Some(r.i32()?),
            (2, I32) => uncompressed = Some(r.i32()?),
            (3, I32) => compressed = Some(r.i32()?),
            (7, STRUCT) => r.fields(1, &mut |r, id, ty| {
                match (id, ty) {
                    (1, I32) => dictionary_values = Some(r.i32()?),
                    _ => r.skip(ty, 2)?,
                }
                Ok(())
            })?,
            _ => r.skip(ty, 1)?,
        }
        Ok(())
    })?;
    let missing = |name: &str| format!("the page header has no {name}");
    Ok(PageHeader {
        kind: kind.ok_or_else(|| missing("page type"))?,
        uncompressed: uncompressed.ok_or_else(|| missing("uncompressed size"))?,
        compressed: compressed.ok_or_else(|| missing("compressed size"))?,
        dictionary_values,
        len: r.pos,
    })
}

/// A cursor over the header's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> Result<u8, String> {
        let b = *self
            .bytes
            .get(self.pos)
            .ok_or("the page header runs past its column chunk")?;
        self.pos += 1;
        Ok(b)
    }

    fn advance(&mut self, n: u64) -> Result<(), String> {
        let left = (self.bytes.len() - self.pos) as u64;
        if n > left {
            return Err("the page header runs past its column chunk".into());
        }
        self.pos += n as usize;
        Ok(())
    }

    /// An unsigned LEB128 varint of at most 64 bits.
    fn varint(&mut self) -> Result<u64, String> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("a varint in the page header runs over 64 bits".into())
    }

    /// A zigzag-encoded 32-bit integer.
    fn i32(&mut self) -> Result<i32, String> {
        let n = self.varint()?;
        let v = (n >> 1) as i64 ^ -((n & 1) as i64);
        i32::try_from(v).map_err(|_| format!("{v} in the page header does not fit 32 bits"))
    }

    /// Calls `visit` with each field's id and type until the struct's end; `visit` reads or
    /// skips the value.
    fn fields(
        &mut self,
        depth: u32,
        visit: &mut dyn FnMut(&mut Self, i16, u8) -> Result<(), String>,
    ) -> Result<(), String> {
        deep_enough(depth)?;
        let mut last = 0i16;
        loop {
            let b = self.byte()?;
            if b == 0 {
                return Ok(());
            }
            let (delta, ty) = (b >> 4, b & 0x0f);
            let id = if delta == 0 {
                i16::try_from(self.i32()?).map_err(|_| "a field id over 16 bits".to_string())?
            } else {
                last.wrapping_add(i16::from(delta))
            };
            last = id;
            visit(self, id, ty)?;
        }
    }

    /// Skips a value of type `ty`. A boolean field holds its value in its type; a boolean in a
    /// list takes a byte (`in_list`).
    fn skip_value(&mut self, ty: u8, depth: u32, in_list: bool) -> Result<(), String> {
        deep_enough(depth)?;
        match ty {
            BOOL_TRUE | BOOL_FALSE => self.advance(u64::from(in_list)),
            BYTE => self.advance(1),
            I16 | I32 | I64 => self.varint().map(drop),
            DOUBLE => self.advance(8),
            UUID => self.advance(16),
            BINARY => {
                let n = self.varint()?;
                self.advance(n)
            }
            LIST | SET => {
                let b = self.byte()?;
                let n = match b >> 4 {
                    15 => self.varint()?,
                    n => u64::from(n),
                };
                // Every element takes at least a byte, so a count past the end fails there.
                for _ in 0..n {
                    self.skip_value(b & 0x0f, depth + 1, true)?;
                }
                Ok(())
            }
            MAP => {
                let n = self.varint()?;
                if n > 0 {
                    let kinds = self.byte()?;
                    for _ in 0..n {
                        self.skip_value(kinds >> 4, depth + 1, true)?;
                        self.skip_value(kinds & 0x0f, depth + 1, true)?;
                    }
                }
                Ok(())
            }
            STRUCT => self.fields(depth + 1, &mut |r, _, ty| r.skip(ty, depth + 1)),
            other => Err(format!("unknown Thrift type {other} in the page header")),
        }
    }

    fn skip(&mut self, ty: u8, depth: u32) -> Result<(), String> {
        self.skip_value(ty, depth, false)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A page header of the given type and sizes, with a dictionary header if `values` is
    /// given.
    pub(in crate::records) fn header(
        kind: i32,
        uncompressed: i64,
        compressed: i64,
        values: Option<i64>,
    ) -> Vec<u8> {
        let mut h = vec![0x15];
        h.extend(zz(kind.into()));
        h.push(0x15);
        h.extend(zz(uncompressed));
        h.push(0x15);
        h.extend(zz(compressed));
        if let Some(v) = values {
            h.push(0x4c); // field 7, a struct
            h.push(0x15);
            h.extend(zz(v));
            h.push(0);
        }
        h.push(0);
        h
    }

    /// Zigzag varint bytes of `v`.
    fn zz(v: i64) -> Vec<u8> {
        let mut n = ((v << 1) ^ (v >> 63)) as u64;
        let mut out = vec![];
        loop {
            let b = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(b);
                return out;
            }
            out.push(b | 0x80);
        }
    }

    /// A dictionary page header as pyarrow writes it: type, sizes, a CRC, then the dictionary
    /// header (values, encoding, is_sorted).
    fn dictionary_header(values: i64) -> Vec<u8> {
        let mut h = vec![0x15];
        h.extend(zz(2));
        h.push(0x15);
        h.extend(zz(48));
        h.push(0x15);
        h.extend(zz(30));
        h.push(0x15);
        h.extend(zz(-12345));
        // Field 7 (delta 3 from 4), a struct.
        h.push(0x3c);
        h.push(0x15);
        h.extend(zz(values));
        h.push(0x15);
        h.extend(zz(0));
        h.push(0x12); // is_sorted = false, in its type
        h.push(0);
        h.push(0);
        h
    }

    #[test]
    fn a_dictionary_header_reads_its_sizes_and_length() {
        let mut bytes = dictionary_header(2_411_724_798 / 2);
        let len = bytes.len();
        bytes.extend([0xde, 0xad]);
        let h = read(&bytes).unwrap();
        assert_eq!(
            h,
            PageHeader {
                kind: DICTIONARY_PAGE,
                uncompressed: 48,
                compressed: 30,
                dictionary_values: Some(1_205_862_399),
                len,
            }
        );
    }

    #[test]
    fn unknown_fields_of_every_type_are_skipped() {
        let mut h = vec![0x05]; // field 1 with its id in long form
        h.extend(zz(1));
        h.extend(zz(0));
        h.push(0x15); // field 2
        h.extend(zz(2));
        h.push(0x15); // field 3
        h.extend(zz(7));
        h.extend([0x19, 0x21, 1, 2]); // field 4: a list of two bools
        h.extend([0x19, 0xf5, 20]); // field 5: a list of 20 i32s, its count as a varint
        for i in 0..20 {
            h.extend(zz(i * 1000));
        }
        h.extend([0x1b, 2, 0x86, 1, b'a']); // field 6: a map of two, binary to i64
        h.extend(zz(-5));
        h.extend([3, b'x', b'y', b'z']);
        h.extend(zz(6));
        h.extend([0x19, 0x21, 1, 1]); // field 7, a list where the dictionary header goes
        h.extend([0x18, 3, b'a', b'b', b'c']); // field 8: binary
        h.push(0x17); // field 9: a double
        h.extend([0; 8]);
        h.push(0x1d); // field 10: a uuid
        h.extend([7; 16]);
        // Field 11: a struct holding a set of two bytes, a true and a byte.
        h.extend([0x1c, 0x1a, 0x23, 0, 0, 0x11, 0x13, 9, 0]);
        h.push(0);
        let header = read(&h).unwrap();
        assert_eq!(
            header,
            PageHeader {
                kind: 0,
                uncompressed: 2,
                compressed: 7,
                dictionary_values: None,
                len: h.len(),
            }
        );
    }

    #[test]
    fn malformed_headers_are_refused_without_allocating() {
        let mut huge_binary = vec![0x15, 0, 0x18];
        huge_binary.extend([0xff, 0xff, 0xff, 0xff, 0x0f]);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "runs past its column chunk"),
            (
                dictionary_header(1)[..5].to_vec(),
                "runs past its column chunk",
            ),
            (huge_binary, "runs past its column chunk"),
            // A list declaring billions of i32s.
            (
                vec![0x19, 0xf5, 0xff, 0xff, 0xff, 0xff, 0x0f, 0],
                "runs past",
            ),
            (
                vec![0x15, 0x80, 0x80, 0x80, 0x80, 0x20, 0],
                "does not fit 32 bits",
            ),
            (
                vec![0x15; 1].into_iter().chain([0xff; 11]).collect(),
                "over 64 bits",
            ),
            (vec![0x1e, 0], "unknown Thrift type 14"),
            (vec![0x15, 4, 0x15, 4, 0], "no compressed size"),
            (vec![0x1c; 40], "nests over 32 deep"),
            (vec![0x19; 40], "nests over 32 deep"),
        ];
        for (bytes, want) in cases {
            let e = read(&bytes).unwrap_err();
            assert!(e.contains(want), "{bytes:?}: {e}");
        }
    }
}
