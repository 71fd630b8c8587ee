//! The one error type of `occult-core`: every failure names the file or value that was wrong.

use std::path::PathBuf;

/// Errors of `occult-core`. Messages are written for the person who gave the input.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing a file failed at the operating-system level.
    /// (The cause is part of the message, not a separate source, so it prints once.)
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    /// A file exists but its contents are not what the format requires.
    #[error("{path}: {msg}")]
    BadFile { path: PathBuf, msg: String },
    /// An argument or an in-memory value is invalid.
    #[error("{0}")]
    Invalid(String),
    /// A collective failed: a peer died, timed out, or called with mismatched arguments.
    #[error("communicator: {0}")]
    Comm(String),
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Tensor(#[from] candle::Error),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            err: source,
        }
    }
    pub fn bad_file(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::BadFile {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::Invalid(msg.into())
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Returns `Err(Error::Invalid(..))` built from a format string.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::Error::Invalid(format!($($arg)*)))
    };
}
