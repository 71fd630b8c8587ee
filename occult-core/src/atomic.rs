//! Atomic file output: write into a temporary file beside the target, then rename over it,
//! so that a failed or interrupted run never leaves a half-written file in place of a good one.

use crate::{Error, Result};
use std::io::Write;
use std::path::Path;

/// Writes `path` atomically; `fill` receives a buffered writer onto the temporary file.
pub fn write_atomic<F>(path: &Path, fill: F) -> Result<()>
where
    F: FnOnce(&mut dyn Write) -> std::io::Result<()>,
{
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(Error::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("output folder {} does not exist", dir.display()),
            ),
        ));
    }
    let mut builder = tempfile::Builder::new();
    builder.prefix(".occult-tmp-");
    // A temporary file is private (0600); the output gets the file's old mode, or the usual
    // 0644 for a new file.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path).map_or(0o644, |m| m.permissions().mode() & 0o777);
        builder.permissions(std::fs::Permissions::from_mode(mode));
    }
    let tmp = builder.tempfile_in(dir).map_err(|e| Error::io(path, e))?;
    {
        let mut w = std::io::BufWriter::new(tmp.as_file());
        fill(&mut w).map_err(|e| Error::io(path, e))?;
        w.flush().map_err(|e| Error::io(path, e))?;
    }
    tmp.as_file().sync_all().map_err(|e| Error::io(path, e))?;
    tmp.persist(path).map_err(|e| Error::io(path, e.error))?;
    Ok(())
}

/// Writes a value as pretty JSON, atomically.
pub fn write_json_atomic<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    write_atomic(path, |w| {
        serde_json::to_writer_pretty(&mut *w, value).map_err(std::io::Error::other)?;
        w.write_all(b"\n")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn outputs_are_readable_by_others_as_files_usually_are() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("new.json");
        write_json_atomic(&p, &1).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&p), 0o644);
        // A file that had its own mode keeps it.
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        write_json_atomic(&p, &2).unwrap();
        assert_eq!(mode(&p), 0o600);
    }

    #[test]
    fn failed_fill_leaves_old_file_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.json");
        std::fs::write(&p, b"good").unwrap();
        let r = write_atomic(&p, |w| {
            w.write_all(b"partial")?;
            Err(std::io::Error::other("boom"))
        });
        assert!(r.is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"good");
        // No temporary files are left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn missing_folder_is_a_clear_error() {
        let r = write_atomic(Path::new("/nonexistent-occult-dir/x.json"), |_| Ok(()));
        let msg = r.unwrap_err().to_string();
        assert!(msg.contains("does not exist"), "{msg}");
    }
}
