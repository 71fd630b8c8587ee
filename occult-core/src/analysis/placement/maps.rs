//! Device maps (`map[expert] = device`): the balanced capacities, the contiguous map, a
//! random balanced one, and their validation.

use crate::{bail, Result};

/// How many experts each device holds: the first `E % D` devices hold one more.
pub fn capacities(num_experts: usize, num_devices: usize) -> Vec<usize> {
    (0..num_devices)
        .map(|d| num_experts / num_devices + usize::from(d < num_experts % num_devices))
        .collect()
}

/// Checks the sizes that every placement must satisfy.
pub fn check_sizes(num_experts: usize, num_devices: usize) -> Result<()> {
    if num_devices == 0 {
        bail!("the number of devices must be at least 1");
    }
    if num_experts == 0 {
        bail!("the number of experts must be at least 1");
    }
    if num_devices > num_experts {
        bail!(
            "{num_devices} devices for {num_experts} experts: every device must hold at least one expert"
        );
    }
    Ok(())
}

/// Contiguous placement: experts split in order into balanced blocks.
pub fn contiguous(num_experts: usize, num_devices: usize) -> Vec<u32> {
    let mut map = Vec::with_capacity(num_experts);
    for (d, c) in capacities(num_experts, num_devices).into_iter().enumerate() {
        map.extend(std::iter::repeat_n(d as u32, c));
    }
    map
}

/// A uniformly random balanced placement.
pub fn random_balanced(
    num_experts: usize,
    num_devices: usize,
    rng: &mut impl rand::Rng,
) -> Vec<u32> {
    use rand::seq::SliceRandom;
    let mut order: Vec<u32> = contiguous(num_experts, num_devices);
    order.shuffle(rng);
    order
}

/// Checks that `map` is a valid balanced expert -> device map.
pub fn validate_map(map: &[u32], num_experts: usize, num_devices: usize) -> Result<()> {
    check_sizes(num_experts, num_devices)?;
    if map.len() != num_experts {
        bail!(
            "device_of_expert has {} entries, expected one per expert ({num_experts})",
            map.len()
        );
    }
    let mut sizes = vec![0usize; num_devices];
    for (e, &d) in map.iter().enumerate() {
        if d as usize >= num_devices {
            bail!("expert {e} is on device {d}, but there are only {num_devices} devices");
        }
        sizes[d as usize] += 1;
    }
    let (lo, hi) = (num_experts / num_devices, num_experts.div_ceil(num_devices));
    if let Some((d, &s)) = sizes.iter().enumerate().find(|(_, &s)| s < lo || s > hi) {
        bail!(
            "unbalanced placement: device {d} holds {s} experts, but each device must hold \
             {lo}{} (sizes {sizes:?})",
            if lo == hi {
                String::new()
            } else {
                format!(" or {hi}")
            }
        );
    }
    Ok(())
}

/// The experts each device holds, ascending: `experts_of_device[d][slot] = expert`.
pub fn experts_by_device(map: &[u32], num_devices: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); num_devices];
    for (e, &d) in map.iter().enumerate() {
        out[d as usize].push(e as u32);
    }
    out
}
