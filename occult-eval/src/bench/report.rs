//! The one JSON envelope every benchmark writes: `{"bench": NAME, ...its fields, "provenance"}`,
//! written atomically, with a line on stderr saying where.

use anyhow::Result;
use std::path::Path;

/// Writes benchmark `name`'s `fields` (a JSON object) to `path`.
pub fn write(path: &Path, name: &str, mut fields: serde_json::Value) -> Result<()> {
    if let Some(obj) = fields.as_object_mut() {
        obj.insert("bench".into(), name.into());
    }
    crate::output::write_json(path, &crate::output::with_provenance(fields))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// Writes an expert-parallel benchmark's results (`results`, one summary per mode, projected
/// onto `link` when given) with its settings (`config`), the model's name (when it runs one)
/// and the backend its ranks ran on.
pub fn write_modes(
    path: &Path,
    name: &str,
    model: Option<&str>,
    backend: crate::context::Backend,
    config: &impl serde::Serialize,
    link: Option<&occult_core::analysis::cost::links::LinkProfile>,
    results: &[super::modes::ModeSummary],
) -> Result<()> {
    let mut v = serde_json::json!({
        "backend": backend,
        "config": config,
        "link": link,
        "projected_with_link_model": link.is_some(),
        "results": results,
    });
    if let Some(m) = model {
        v["model"] = m.into();
    }
    write(path, name, v)
}
