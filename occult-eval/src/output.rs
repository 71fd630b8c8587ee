//! Writing results: JSON written atomically (a failed write leaves no file), the provenance
//! block every result carries, and the check before any work that no output replaces an input.

use anyhow::Result;
use std::path::Path;

/// Checks before any work that every output can be written and replaces no input.
pub fn check_io(inputs: &[Option<&Path>], outputs: &[Option<&Path>]) -> Result<()> {
    Ok(occult_core::atomic::check_outputs(inputs, outputs)?)
}

/// Writes JSON atomically, creating nothing on failure.
pub fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    occult_core::atomic::write_json_atomic(path, value)?;
    Ok(())
}

/// Adds the provenance block to a JSON object.
pub fn with_provenance(mut v: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = v.as_object_mut() {
        obj.insert(
            "provenance".into(),
            serde_json::to_value(crate::version::provenance()).expect("serialisable"),
        );
    }
    v
}
