//! Handing a communicator's unique id (NCCL's 128 bytes) from rank 0 to the other ranks
//! through a file on a file system they all see, where no MPI is there to carry it: rank 0
//! writes it atomically, the others wait for it to appear.

use crate::{Error, Result};
use std::path::Path;
use std::time::{Duration, Instant};

/// Bytes in an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// Writes `id` to `path` (a temporary file renamed over it: readers never see half of it).
pub fn write(path: &Path, id: &[u8; ID_BYTES]) -> Result<()> {
    crate::atomic::write_atomic(path, |w| w.write_all(id))
}

/// The id at `path`, waited for up to `timeout`; a file of another size is an error.
pub fn read(path: &Path, timeout: Duration) -> Result<[u8; ID_BYTES]> {
    let start = Instant::now();
    loop {
        match std::fs::read(path) {
            Ok(bytes) => {
                let n = bytes.len();
                return bytes.try_into().map_err(|_| {
                    Error::Comm(format!(
                        "{} holds {n} bytes, not a {ID_BYTES}-byte unique id",
                        path.display()
                    ))
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if start.elapsed() > timeout {
                    return Err(Error::Comm(format!(
                        "rank 0 wrote no unique id to {} within {:.1} s",
                        path.display(),
                        timeout.as_secs_f64()
                    )));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(Error::io(path, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_written_by_rank_0_is_read_by_a_rank_waiting_for_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nccl.id");
        let id: [u8; ID_BYTES] = std::array::from_fn(|i| (i * 7) as u8);
        let reader = {
            let path = path.clone();
            std::thread::spawn(move || read(&path, Duration::from_secs(10)))
        };
        std::thread::sleep(Duration::from_millis(100));
        write(&path, &id).unwrap();
        assert_eq!(reader.join().unwrap().unwrap(), id);
    }

    #[test]
    fn a_missing_or_misshapen_id_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nccl.id");
        let err = read(&path, Duration::from_millis(100)).unwrap_err();
        assert!(err.to_string().contains("wrote no unique id"), "{err}");
        std::fs::write(&path, [1u8; 5]).unwrap();
        let err = read(&path, Duration::from_secs(1)).unwrap_err();
        assert!(err.to_string().contains("holds 5 bytes"), "{err}");
    }
}
