//! Reading inputs: every file a command reads must be a regular file. A folder, FIFO, device
//! or socket gets a clear error naming it, instead of `/dev/zero` being read until memory runs
//! out or a FIFO blocking the run.

use crate::{Error, Result};
use std::fs::File;
use std::path::Path;

/// Checks that `path` (through links) is a regular file.
pub fn check_regular(path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_file() {
        return Ok(());
    }
    let what = if meta.is_dir() {
        "a folder"
    } else {
        special_kind(&meta.file_type())
    };
    Err(Error::io(
        path,
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("the input is {what}, not a regular file"),
        ),
    ))
}

#[cfg(unix)]
pub(crate) fn special_kind(kind: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_block_device() || kind.is_char_device() {
        "a device"
    } else {
        "not a file"
    }
}

#[cfg(not(unix))]
pub(crate) fn special_kind(_: &std::fs::FileType) -> &'static str {
    "not a file"
}

/// Opens a regular file for reading.
pub fn open_regular(path: &Path) -> Result<File> {
    check_regular(path)?;
    File::open(path).map_err(|e| Error::io(path, e))
}

/// Reads a regular file as UTF-8 text.
pub fn read_text(path: &Path) -> Result<String> {
    check_regular(path)?;
    std::fs::read_to_string(path).map_err(|e| Error::io(path, e))
}

/// Reads a regular file's bytes.
pub fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    check_regular(path)?;
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

/// A safetensors header's first name that appears twice (serde, like the safetensors crate,
/// would otherwise keep the last silently); `None` when the names are unique or the header is
/// not JSON at all (the safetensors reader reports that).
pub fn duplicate_header_name(file: &[u8]) -> Option<String> {
    let n = u64::from_le_bytes(file.get(..8)?.try_into().ok()?);
    let end = 8usize.checked_add(usize::try_from(n).ok()?)?;
    let header = file.get(8..end)?;
    serde_json::from_slice::<FirstDuplicate>(header).ok()?.0
}

/// The first key of a JSON object that appears twice.
struct FirstDuplicate(Option<String>);

impl<'de> serde::Deserialize<'de> for FirstDuplicate {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Keys;
        impl<'de> serde::de::Visitor<'de> for Keys {
            type Value = FirstDuplicate;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<FirstDuplicate, A::Error> {
                let mut seen = std::collections::HashSet::new();
                let mut dup = None;
                while let Some(k) = map.next_key::<String>()? {
                    map.next_value::<serde::de::IgnoredAny>()?;
                    if dup.is_none() && !seen.insert(k.clone()) {
                        dup = Some(k);
                    }
                }
                Ok(FirstDuplicate(dup))
            }
        }
        d.deserialize_map(Keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_files_are_named_not_read() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "hi").unwrap();
        assert_eq!(read_text(&dir.path().join("a.txt")).unwrap(), "hi");
        let err = read_text(dir.path()).unwrap_err().to_string();
        assert!(err.contains("a folder"), "{err}");
        #[cfg(unix)]
        {
            let err = read_bytes(Path::new("/dev/zero")).unwrap_err().to_string();
            assert!(
                err.contains("/dev/zero") && err.contains("a device"),
                "{err}"
            );
            let fifo = dir.path().join("fifo");
            assert!(std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .unwrap()
                .success());
            let err = open_regular(&fifo).unwrap_err().to_string();
            assert!(err.contains("a FIFO"), "{err}");
        }
        assert!(read_text(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn a_name_given_twice_in_a_header_is_found() {
        let file = |h: &str| {
            let mut b = (h.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(h.as_bytes());
            b
        };
        let t = r#""dtype":"F32","shape":[1],"data_offsets":[0,4]"#;
        let twice = format!(r#"{{"a":{{{t}}},"b":{{{t}}},"a":{{{t}}}}}"#);
        assert_eq!(duplicate_header_name(&file(&twice)), Some("a".into()));
        let once = format!(r#"{{"a":{{{t}}},"b":{{{t}}}}}"#);
        assert_eq!(duplicate_header_name(&file(&once)), None);
        assert_eq!(duplicate_header_name(b"\xff\xff"), None);
        assert_eq!(duplicate_header_name(&file("not json")), None);
    }
}

thread_local! {
    /// Set while [`contain_panics`] runs a decoder on this thread.
    static CONTAINING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs a third-party decoder of untrusted bytes, turning a panic inside it into `Err` with
/// the panic's message, and keeping that panic off stderr. For decoders that assert on
/// malformed input instead of returning errors (the parquet crate does; fuzzing found it).
/// A panic anywhere else still reaches the hook that was installed before (a test's, or a
/// fuzzer's that aborts).
pub fn contain_panics<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !CONTAINING.with(|c| c.get()) {
                previous(info);
            }
        }));
    });
    let was = CONTAINING.with(|c| c.replace(true));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CONTAINING.with(|c| c.set(was));
    out.map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into())
    })
}
