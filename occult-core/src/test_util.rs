//! Helpers shared by the unit tests.

use candle::{DType, Tensor};

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
