//! Atomic file output: write into a temporary file beside the target, then rename over it,
//! so that a failed or interrupted run never leaves a half-written file in place of a good one.

use crate::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `path` atomically; `fill` receives a buffered writer onto the temporary file.
///
/// A symbolic link is written through: its target gets the new content and the link stays. A
/// path that is a folder, FIFO, device or socket is refused before any work, since renaming
/// over it would replace it. A new file gets the mode the umask allows (0644 under the usual
/// 022); a file that exists keeps its mode.
pub fn write_atomic<F>(path: &Path, fill: F) -> Result<()>
where
    F: FnOnce(&mut dyn Write) -> std::io::Result<()>,
{
    let target = output_target(path)?;
    let path = target.as_path();
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
    // A temporary file is private (0600); the output gets the file's old mode, or what the
    // umask allows for a new file.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode =
            std::fs::metadata(path).map_or(new_file_mode(), |m| m.permissions().mode() & 0o777);
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

/// The file an output path stands for: itself, or the end of its chain of symbolic links (a
/// dangling link's target is created). Refuses what is not a regular file.
pub fn output_target(path: &Path) -> Result<PathBuf> {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        let meta = match std::fs::symlink_metadata(&p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(p),
            Err(e) => return Err(Error::io(path, e)),
        };
        let kind = meta.file_type();
        if kind.is_symlink() {
            let next = std::fs::read_link(&p).map_err(|e| Error::io(path, e))?;
            p = match p.parent() {
                Some(dir) if next.is_relative() => dir.join(next),
                _ => next,
            };
            continue;
        }
        if kind.is_file() {
            return Ok(p);
        }
        let what = if kind.is_dir() {
            "a folder"
        } else {
            crate::input::special_kind(&kind)
        };
        return Err(Error::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "the output {} is {what}, not a regular file; writing it would replace it",
                    p.display()
                ),
            ),
        ));
    }
    Err(Error::io(
        path,
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the output is a chain of more than 40 symbolic links",
        ),
    ))
}

/// The mode of a new file under this process's umask (0644 when it cannot be read).
pub fn new_file_mode() -> u32 {
    let umask = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| umask_of(&s))
        .unwrap_or(0o022);
    0o666 & !umask
}

/// The `Umask:` field of a `/proc/PID/status` text.
fn umask_of(status: &str) -> Option<u32> {
    let line = status.lines().find(|l| l.starts_with("Umask:"))?;
    u32::from_str_radix(line["Umask:".len()..].trim(), 8).ok()
}

/// The real path of `p`: resolved when it exists, else its folder's real path and its name
/// (so that two spellings of one file compare equal).
pub fn absolute_path(p: &Path) -> PathBuf {
    if let Ok(c) = std::fs::canonicalize(p) {
        return c;
    }
    match (p.parent(), p.file_name()) {
        (Some(dir), Some(name)) => {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            std::fs::canonicalize(dir).map_or_else(|_| p.to_path_buf(), |d| d.join(name))
        }
        _ => p.to_path_buf(),
    }
}

/// Checks, before any work, that each output can be written and replaces none of the inputs:
/// its folder exists and takes new files, it is not an input file nor inside an input folder
/// (a model's folder), and no two outputs are the same file. `None` entries are skipped.
pub fn check_outputs(inputs: &[Option<&Path>], outputs: &[Option<&Path>]) -> Result<()> {
    let inputs: Vec<PathBuf> = inputs.iter().flatten().map(|p| absolute_path(p)).collect();
    let mut seen: Vec<PathBuf> = Vec::new();
    for out in outputs.iter().flatten() {
        let target = absolute_path(&output_target(out)?);
        let refuse = |why: String| {
            Err(Error::io(
                out,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, why),
            ))
        };
        for input in &inputs {
            if *input == target {
                return refuse(format!(
                    "the output is the input {}; writing it would destroy it",
                    input.display()
                ));
            }
            if input.is_dir() && target.starts_with(input) {
                return refuse(format!(
                    "the output lies inside the input folder {}; write it elsewhere",
                    input.display()
                ));
            }
        }
        if seen.contains(&target) {
            return refuse("two outputs are the same file".into());
        }
        let dir = target.parent().unwrap_or(Path::new("."));
        if !dir.is_dir() {
            return refuse(format!(
                "the output folder {} does not exist",
                dir.display()
            ));
        }
        tempfile::Builder::new()
            .prefix(".occult-check-")
            .tempfile_in(dir)
            .map_err(|e| Error::io(out, e))?;
        seen.push(target);
    }
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
        assert_eq!(mode(&p), new_file_mode());
        // A file that had its own mode keeps it.
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        write_json_atomic(&p, &2).unwrap();
        assert_eq!(mode(&p), 0o600);
    }

    #[test]
    fn the_umask_is_read_from_proc() {
        assert_eq!(umask_of("Name:\tx\nUmask:\t0027\nState:\tR\n"), Some(0o027));
        assert_eq!(umask_of("Name:\tx\n"), None);
        let m = new_file_mode();
        assert_eq!(m & 0o111, 0);
        assert_eq!(m & 0o600, 0o600);
    }

    #[cfg(unix)]
    #[test]
    fn links_are_written_through_and_special_files_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // A link to an existing file, and a dangling relative link.
        std::fs::write(d.join("real.json"), b"old").unwrap();
        std::os::unix::fs::symlink("real.json", d.join("link.json")).unwrap();
        write_json_atomic(&d.join("link.json"), &7).unwrap();
        assert!(std::fs::symlink_metadata(d.join("link.json"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read_to_string(d.join("real.json")).unwrap(), "7\n");
        std::os::unix::fs::symlink("made.json", d.join("dangling.json")).unwrap();
        write_json_atomic(&d.join("dangling.json"), &8).unwrap();
        assert_eq!(std::fs::read_to_string(d.join("made.json")).unwrap(), "8\n");
        // A folder and a FIFO are refused, and stay what they were.
        std::fs::create_dir(d.join("folder")).unwrap();
        let err = write_json_atomic(&d.join("folder"), &1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("a folder"), "{err}");
        let fifo = d.join("fifo");
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        let err = write_json_atomic(&fifo, &1).unwrap_err().to_string();
        assert!(err.contains("a FIFO"), "{err}");
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());
        let err = write_json_atomic(Path::new("/dev/null"), &1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("a device"), "{err}");
        // A loop of links is named.
        std::os::unix::fs::symlink("b", d.join("a")).unwrap();
        std::os::unix::fs::symlink("a", d.join("b")).unwrap();
        assert!(write_json_atomic(&d.join("a"), &1).is_err());
    }

    #[test]
    fn outputs_that_would_replace_inputs_are_refused_before_work() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir(d.join("model")).unwrap();
        std::fs::write(d.join("model/model.safetensors"), b"w").unwrap();
        std::fs::write(d.join("trace.st"), b"t").unwrap();
        let model = d.join("model");
        let trace = d.join("trace.st");
        let ins = [Some(model.as_path()), Some(trace.as_path()), None];
        let check = |out: &Path| check_outputs(&ins, &[Some(out)]).map_err(|e| e.to_string());
        assert!(check(&d.join("model/model.safetensors"))
            .unwrap_err()
            .contains("inside the input folder"));
        assert!(check(&d.join("model/new.json")).is_err());
        assert!(check(&trace).unwrap_err().contains("destroy"));
        // The same file under another spelling, and through a link.
        assert!(check(&d.join("model/../trace.st")).is_err());
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(&trace, d.join("alias")).unwrap();
            assert!(check(&d.join("alias")).is_err());
        }
        assert!(check(&d.join("missing/out.json"))
            .unwrap_err()
            .contains("does not exist"));
        check(&d.join("fine.json")).unwrap();
        let a = d.join("a.json");
        assert!(check_outputs(&ins, &[Some(&a), Some(&d.join("./a.json"))]).is_err());
        // Nothing was created by the checks.
        let names: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(
            names
                .iter()
                .all(|n| ["model", "trace.st", "alias"].contains(&n.to_str().unwrap())),
            "{names:?}"
        );
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
