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
}
