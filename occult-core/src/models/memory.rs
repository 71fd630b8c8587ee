//! Memory guard: what a command will hold, estimated from the checkpoint's header before any
//! weight is read, against a limit (`--max-memory`, else what the machine has available:
//! `MemAvailable`, and the cgroup's limit where one is set, shared by the ranks of one node).
//! A run that cannot fit is refused with the estimate instead of being killed part way.
//!
//! The estimate counts the weights in the compute dtype (under MPI: the dense weights and this
//! rank's share of the experts; MXFP4 experts as they are dequantized), and for training the gradients and AdamW's two moments in
//! f32 (and f32 masters for bf16/f16 weights) of every parameter. Activations are not counted.

use super::weights::Weights;
use crate::{bail, Result};
use candle::DType;

/// Bytes one command will hold, by part.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Estimate {
    /// Weights in the compute dtype.
    pub weights: u64,
    /// Gradients, optimiser moments and f32 masters.
    pub training: u64,
}

impl Estimate {
    pub fn total(&self) -> u64 {
        self.weights.saturating_add(self.training)
    }
}

/// Whether a tensor holds routed experts (per-expert or fused), which EP splits over ranks.
pub(crate) fn is_routed_expert(name: &str) -> bool {
    name.contains(".experts.")
}

/// The elements tensor `name` of `w` holds once loaded: MXFP4 (gpt-oss) is dequantized on
/// load, two weights a block byte, the scales folded into them.
pub(crate) fn held_elements(w: &Weights, name: &str) -> u64 {
    let n = w.shape(name).map_or(0u64, |s| {
        s.iter().fold(1u64, |p, &d| p.saturating_mul(d as u64))
    });
    if w.source_dtype(name) == Some(safetensors::Dtype::U8) {
        if name.ends_with("_blocks") {
            return n.saturating_mul(2);
        } else if name.ends_with("_scales") {
            return 0;
        }
    }
    n
}

/// The estimate for `w` read as `dtype`, on one of `ranks` processes that each hold only their
/// own experts (`ranks` = 1: everything), with training state when `train` is set.
pub fn estimate(w: &Weights, dtype: DType, ranks: usize, train: bool) -> Estimate {
    let width = dtype.size_in_bytes() as u64;
    let (mut dense, mut experts) = (0u64, 0u64);
    for name in w.names() {
        let n = held_elements(w, name);
        if is_routed_expert(name) {
            experts = experts.saturating_add(n);
        } else {
            dense = dense.saturating_add(n);
        }
    }
    let held = dense.saturating_add(experts.div_ceil(ranks.max(1) as u64));
    let per_param = if dtype == DType::F32 { 12 } else { 16 };
    Estimate {
        weights: held.saturating_mul(width),
        training: if train {
            held.saturating_mul(per_param)
        } else {
            0
        },
    }
}

/// Parses a size: bytes, or a number with K, M, G or T (binary multiples, as `--mem` in
/// Slurm; an optional `B` or `iB` may follow): `512M`, `8G`, `1.5GiB`.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let digits = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let value: f64 = match num.parse() {
        Ok(v) if f64::is_finite(v) && v > 0.0 => v,
        _ => bail!("{s:?} is not a size (a positive number of bytes, or with K, M, G or T)"),
    };
    let shift = match unit.trim().to_ascii_uppercase().trim_end_matches('B') {
        "" => 0,
        "K" | "KI" => 10,
        "M" | "MI" => 20,
        "G" | "GI" => 30,
        "T" | "TI" => 40,
        _ => bail!("{s:?}: unknown unit {unit:?} (use K, M, G or T)"),
    };
    let bytes = value * (1u64 << shift) as f64;
    if bytes < 1.0 || bytes >= u64::MAX as f64 {
        bail!("{s:?} is not a size this machine can have");
    }
    Ok(bytes as u64)
}

/// A size for people: `1.52 GiB`, `152.0 GiB`.
pub fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    match (u, v < 10.0) {
        (0, _) => format!("{bytes} B"),
        (_, true) => format!("{v:.2} {}", units[u]),
        _ => format!("{v:.1} {}", units[u]),
    }
}

/// Memory this process may use: `MemAvailable`, lowered to the cgroup's free room where it
/// has a limit. `None` where neither can be read (not Linux).
pub fn available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        t.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    });
    let read = |p: &str| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok();
    let cgroup = match (
        read("/sys/fs/cgroup/memory.max"),
        read("/sys/fs/cgroup/memory.current"),
    ) {
        (Some(max), Some(cur)) => Some(max.saturating_sub(cur)),
        _ => None,
    };
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Refuses `need` over `limit` (`--max-memory`), or over this process's share of what is
/// available (split among the `local_ranks` processes of this node) when no limit is given.
/// `what` names the run in the message.
pub fn check(need: Estimate, limit: Option<u64>, local_ranks: usize, what: &str) -> Result<()> {
    let (room, source) = match limit {
        Some(l) => (l, "--max-memory".to_string()),
        None => match available() {
            Some(a) => {
                let share = a / local_ranks.max(1) as u64;
                let source = if local_ranks > 1 {
                    format!("this process's share of the memory available ({local_ranks} ranks on this node)")
                } else {
                    "the memory available".to_string()
                };
                (share, source)
            }
            None => return Ok(()),
        },
    };
    check_room(need, room, &source, what)
}

/// The free memory of `device` where it is a GPU (`None` on the CPU, in a build without CUDA,
/// or where the driver cannot say).
pub fn gpu_free(device: &candle::Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let Ok(gpu) = device.as_cuda_device() {
        let ctx = gpu.cuda_stream().context().clone();
        return ctx.mem_get_info().ok().map(|(free, _)| free as u64);
    }
    let _ = device;
    None
}

/// [`check`] for weights that load onto `device`: on a GPU, against its free memory split
/// among the `gpu_sharers` processes that load onto it, unless `limit` is given; on the CPU as
/// [`check`].
pub fn check_on(
    device: &candle::Device,
    need: Estimate,
    limit: Option<u64>,
    local_ranks: usize,
    gpu_sharers: usize,
    what: &str,
) -> Result<()> {
    if device.is_cpu() || limit.is_some() {
        return check(need, limit, local_ranks, what);
    }
    let sharers = gpu_sharers.max(1);
    let source = match sharers {
        1 => "the GPU's free memory".to_string(),
        n => format!("this process's share of the GPU's free memory ({n} ranks on it)"),
    };
    match gpu_free(device) {
        Some(free) => check_room(need, free / sharers as u64, &source, what),
        None => Ok(()),
    }
}

/// Refuses `need` over `room` bytes, which `source` names.
fn check_room(need: Estimate, room: u64, source: &str, what: &str) -> Result<()> {
    if need.total() > room {
        let parts = if need.training > 0 {
            format!(
                " ({} weights, {} gradients and optimiser state)",
                human(need.weights),
                human(need.training)
            )
        } else {
            " of weights".to_string()
        };
        bail!(
            "{what} needs about {}{parts}, more than {source} ({}); use a smaller --dtype, more \
             ranks under mpirun (each holds only its experts), or a larger --max-memory if the \
             estimate is too high",
            human(need.total()),
            human(room)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mxfp4_experts_count_as_dequantized() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
        let open = |arch: &str| {
            let files = crate::models::checkpoint::from_folder(&dir.join(arch)).unwrap();
            Weights::open(&files.weights, &candle::Device::Cpu).unwrap()
        };
        let w = open("gpt_oss_mxfp4");
        let e = estimate(&w, DType::F32, 1, false);
        // Expert weights: per layer gate_up [8, 64, 64] and down [8, 32, 64] dequantized, the
        // rest as stored; the parameter count `occult model check` reports.
        let params: u64 = w
            .names()
            .filter(|n| !n.ends_with("_blocks") && !n.ends_with("_scales"))
            .map(|n| w.shape(n).unwrap().iter().product::<usize>() as u64)
            .sum::<u64>()
            + 2 * (8 * 64 * 64 + 8 * 32 * 64);
        assert_eq!(e.weights, 4 * params);
    }

    #[test]
    fn sizes_parse_in_binary_units_and_bad_ones_are_named() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("8G").unwrap(), 8 << 30);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("2tb").unwrap(), 2 << 40);
        for bad in ["", "G", "-1G", "0", "1X", "1e99T", "nan"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert_eq!(human(1536), "1.50 KiB");
        assert_eq!(human(100 << 20), "100.0 MiB");
        assert_eq!(human(10), "10 B");
    }
}
