//! The one error type of `occult-train`.

/// Errors of fine-tuning. Messages are written for the person who gave the input.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument or a saved state is invalid.
    #[error("{0}")]
    Invalid(String),
    /// The model or its communicator failed.
    #[error(transparent)]
    Core(#[from] occult_core::Error),
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Tensor(#[from] candle::Error),
}

pub type Result<T> = std::result::Result<T, Error>;
