//! Parquet files read as records, with the checks that keep a malformed file from panicking,
//! hanging or exhausting memory in the parquet crate: every column chunk inside the file, every
//! page header read first (by `page_headers`, bounded by its chunk) with sizes the crate can
//! allocate for, and the crate's own assertions turned into errors.

use super::bad;
use super::page_headers::{self, DICTIONARY_PAGE};
use crate::Result;
use parquet::basic::Type as PhysicalType;
use parquet::file::metadata::ParquetMetaData;
use serde_json::Value;
use std::path::Path;

/// Reads a Parquet file's rows as JSON objects (lists become arrays, structs objects).
pub fn read_parquet(path: &Path) -> Result<Vec<Value>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let shown = path.display();
    let file = bytes::Bytes::from(crate::input::read_bytes(path)?);
    let decode = || -> Result<Vec<Value>> {
        let r = SerializedFileReader::new(file.clone())
            .map_err(|e| bad(format!("{shown}: not a readable Parquet file: {e}")))?;
        check_chunks(r.metadata(), file.len() as u64)
            .and_then(|()| check_pages(r.metadata(), &file))
            .map_err(|e| bad(format!("{shown}: {e}")))?;
        let rows = r
            .get_row_iter(None)
            .map_err(|e| bad(format!("{shown}: reading rows: {e}")))?;
        rows.enumerate()
            .map(|(i, row)| {
                row.map(|r| r.to_json_value())
                    .map_err(|e| bad(format!("{shown}: row {i}: {e}")))
            })
            .collect()
    };
    // The parquet crate asserts on some malformed pages instead of returning an error.
    crate::input::contain_panics(decode).unwrap_or_else(|msg| {
        Err(bad(format!(
            "{shown}: malformed Parquet data (the decoder stopped: {msg})"
        )))
    })
}

/// Every column chunk the footer names lies inside the file (the parquet crate asserts this
/// while reading, and a malformed footer would panic it).
fn check_chunks(meta: &ParquetMetaData, size: u64) -> std::result::Result<(), String> {
    for (g, group) in meta.row_groups().iter().enumerate() {
        for (c, col) in group.columns().iter().enumerate() {
            let start = col
                .dictionary_page_offset()
                .unwrap_or_else(|| col.data_page_offset());
            let len = col.compressed_size();
            if start < 0 || len < 0 || (start as u64).saturating_add(len as u64) > size {
                return Err(format!(
                    "row group {g}, column {c}: its chunk ({len} bytes at offset {start}) lies \
                     outside the file ({size} bytes)"
                ));
            }
        }
    }
    Ok(())
}

/// No page decompresses to more than this many times the whole file's size...
const MAX_EXPANSION: usize = 64;
/// ...unless it stays under this (a writer's pages are about 1 MiB).
const MIN_PAGE_LIMIT: usize = 16 << 20;

/// The largest decompressed page a file of `file_len` bytes may hold.
fn page_limit(file_len: usize) -> usize {
    file_len.saturating_mul(MAX_EXPANSION).max(MIN_PAGE_LIMIT)
}

/// Every page header of every column chunk (checked to lie inside the file) states sizes the
/// parquet crate can allocate for. The crate sizes buffers from these before it reads the data
/// (found by fuzzing: a 1.7 KB file whose dictionary page claims 1.2 billion strings aborted the
/// process on a 38 GB allocation), and its header decoder read on past a chunk's end (a hang).
fn check_pages(meta: &ParquetMetaData, file: &[u8]) -> std::result::Result<(), String> {
    for (g, group) in meta.row_groups().iter().enumerate() {
        for (c, col) in group.columns().iter().enumerate() {
            let (start, len) = col.byte_range();
            let chunk = &file[start as usize..(start + len) as usize];
            let descr = col.column_descr();
            let ty = (descr.physical_type(), descr.type_length());
            check_chunk_pages(chunk, start, ty, page_limit(file.len()))
                .map_err(|e| format!("row group {g}, column {c}: {e}"))?;
        }
    }
    Ok(())
}

/// [`check_pages`] for one column chunk of type `ty` (and its length, for fixed-length byte
/// arrays), at offset `start`: each page lies inside the chunk, decompresses to at most
/// `limit` bytes, and, if it is a dictionary, holds no more values than its bytes can encode.
fn check_chunk_pages(
    chunk: &[u8],
    start: u64,
    ty: (PhysicalType, i32),
    limit: usize,
) -> std::result::Result<(), String> {
    let mut pos = 0;
    while pos < chunk.len() {
        let at = start as usize + pos;
        let h = page_headers::read(&chunk[pos..])
            .map_err(|e| format!("the page at offset {at}: {e}"))?;
        let (Ok(compressed), Ok(uncompressed)) = (
            usize::try_from(h.compressed),
            usize::try_from(h.uncompressed),
        ) else {
            return Err(format!(
                "the page at offset {at} has a negative size ({} compressed, {} uncompressed)",
                h.compressed, h.uncompressed
            ));
        };
        if compressed > chunk.len() - pos - h.len {
            return Err(format!(
                "the page at offset {at} ({compressed} bytes after a {}-byte header) runs past \
                 its column chunk ({} bytes at offset {start})",
                h.len,
                chunk.len()
            ));
        }
        if uncompressed > limit {
            return Err(format!(
                "the page at offset {at} says it decompresses to {uncompressed} bytes, over the \
                 limit of {limit} ({MAX_EXPANSION} times the file, or {MIN_PAGE_LIMIT} bytes)"
            ));
        }
        if h.kind == DICTIONARY_PAGE {
            let values = h.dictionary_values.unwrap_or(0);
            let most = most_values(ty, uncompressed);
            if values < 0 || values as u64 > most {
                return Err(format!(
                    "the dictionary page at offset {at} says it holds {values} values, but its \
                     {uncompressed} bytes hold at most {most} of type {}",
                    ty.0
                ));
            }
        }
        pos += h.len + compressed;
    }
    Ok(())
}

/// The most values of type `ty` that `bytes` bytes of plain encoding can hold.
fn most_values(ty: (PhysicalType, i32), bytes: usize) -> u64 {
    let bytes = bytes as u64;
    match ty.0 {
        PhysicalType::BOOLEAN => bytes * 8,
        PhysicalType::INT32 | PhysicalType::FLOAT => bytes / 4,
        PhysicalType::INT64 | PhysicalType::DOUBLE => bytes / 8,
        PhysicalType::INT96 => bytes / 12,
        // A four-byte length, then the bytes.
        PhysicalType::BYTE_ARRAY => bytes / 4,
        PhysicalType::FIXED_LEN_BYTE_ARRAY => bytes / ty.1.max(1) as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use page_headers::tests::header;

    /// A page's type, uncompressed and compressed sizes, and dictionary values.
    type Page = (i32, i64, i64, Option<i64>);

    /// A chunk of pages, each a header and `compressed` bytes of zeros.
    fn chunk(pages: &[Page]) -> Vec<u8> {
        let mut out = vec![];
        for &(kind, uncompressed, compressed, values) in pages {
            out.extend(header(kind, uncompressed, compressed, values));
            out.resize(out.len() + compressed.max(0) as usize, 0);
        }
        out
    }

    const STRINGS: (PhysicalType, i32) = (PhysicalType::BYTE_ARRAY, 0);

    #[test]
    fn well_formed_pages_pass_up_to_the_bounds() {
        let pages = chunk(&[(2, 24, 24, Some(6)), (0, 4096, 10, None), (3, 0, 0, None)]);
        check_chunk_pages(&pages, 4, STRINGS, 4096).unwrap();
        // Each type's most values in 24 bytes, exactly.
        for (ty, most) in [
            ((PhysicalType::BOOLEAN, 0), 192),
            ((PhysicalType::INT32, 0), 6),
            ((PhysicalType::FLOAT, 0), 6),
            ((PhysicalType::INT64, 0), 3),
            ((PhysicalType::DOUBLE, 0), 3),
            ((PhysicalType::INT96, 0), 2),
            ((PhysicalType::FIXED_LEN_BYTE_ARRAY, 5), 4),
            ((PhysicalType::FIXED_LEN_BYTE_ARRAY, 0), 24),
        ] {
            assert_eq!(most_values(ty, 24), most, "{ty:?}");
            check_chunk_pages(&chunk(&[(2, 24, 3, Some(most as i64))]), 4, ty, 24).unwrap();
            let e = check_chunk_pages(&chunk(&[(2, 24, 3, Some(most as i64 + 1))]), 4, ty, 24)
                .unwrap_err();
            assert!(
                e.contains(&format!("but its 24 bytes hold at most {most}")),
                "{e}"
            );
        }
        assert_eq!(page_limit(1000), 16 << 20);
        assert_eq!(page_limit(1 << 20), 64 << 20);
        assert_eq!(page_limit(usize::MAX), usize::MAX);
    }

    #[test]
    fn pages_with_sizes_the_crate_cannot_allocate_for_are_refused() {
        let data = (0, 10, 10, None);
        let cases: Vec<(Vec<Page>, &str)> = vec![
            (
                vec![data, (2, 24, 24, Some(1_205_862_399))],
                "the dictionary page at offset 21 says it holds 1205862399 values, but its 24 \
                 bytes hold at most 6 of type BYTE_ARRAY",
            ),
            (vec![(2, 24, 24, Some(-1))], "says it holds -1 values"),
            (
                vec![data, (0, -1, 10, None)],
                "at offset 21 has a negative size (10 compressed, -1",
            ),
            (
                vec![(0, 10, -3, None)],
                "has a negative size (-3 compressed",
            ),
            (
                vec![(0, 4097, 10, None)],
                "decompresses to 4097 bytes, over the limit of 4096",
            ),
        ];
        for (pages, want) in cases {
            let e = check_chunk_pages(&chunk(&pages), 4, STRINGS, 4096).unwrap_err();
            assert!(e.contains(want), "{pages:?}: {e}");
        }
        // A page one byte longer than what is left of its chunk.
        let mut short = chunk(&[data, data]);
        short.pop();
        let e = check_chunk_pages(&short, 4, STRINGS, 4096).unwrap_err();
        assert!(
            e.contains(
                "the page at offset 21 (10 bytes after a 7-byte header) runs past its column \
                 chunk (33 bytes at offset 4)"
            ),
            "{e}"
        );
        let e = check_chunk_pages(&short[..20], 4, STRINGS, 4096).unwrap_err();
        assert!(
            e.contains("the page at offset 21: the page header runs past"),
            "{e}"
        );
    }
}
