//! Helpers shared by the unit tests.

use candle::{DType, Tensor};

/// A JSON fixture of `tests/fixtures/` (`rel` below it), parsed.
pub fn fixture_json(rel: &str) -> serde_json::Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

/// Every element of `t`, in row-major order, as f64.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .expect("a tensor of numbers")
}

/// A random placement with replicas: expert x on device x % d, then copies of random experts
/// (none twice on a device) until every device holds `per_device` slots.
pub fn random_replica_map(
    rng: &mut impl rand::Rng,
    e: usize,
    d: usize,
    per_device: usize,
) -> crate::analysis::placement::replicas::ReplicaMap {
    let mut slots: Vec<Vec<u32>> = vec![Vec::new(); d];
    for x in 0..e as u32 {
        slots[x as usize % d].push(x);
    }
    for dev in slots.iter_mut() {
        while dev.len() < per_device {
            let x = rng.random_range(0..e as u32);
            if !dev.contains(&x) {
                dev.push(x);
            }
        }
    }
    crate::analysis::placement::replicas::ReplicaMap::new(slots.concat(), e, d, None)
        .expect("a valid replica map")
}
