//! The device a rank computes on: a CUDA device (offset by the node-local rank under NCCL, one
//! GPU per process), or the CPU.

use super::backend::{local_rank, Backend};
use anyhow::{bail, Context, Result};
use candle::Device;

/// The device of `--cuda` under `backend`: CUDA device N (offset by the node-local rank under
/// `--backend nccl`, which needs a GPU), or the CPU.
pub fn pick_device(cuda: Option<usize>, backend: Backend) -> Result<Device> {
    let nccl = backend == Backend::Nccl;
    let base = match cuda {
        Some(n) => n,
        None if nccl => 0,
        None => return Ok(Device::Cpu),
    };
    if !candle::utils::cuda_is_available() {
        if nccl {
            bail!(
                "--backend nccl runs on GPUs: this occult was built without CUDA; rebuild with \
                 `--features occult-eval/nccl`"
            );
        }
        bail!(
            "--cuda {base}: this occult was built without CUDA; rebuild with `--features \
             occult-eval/cuda`"
        );
    }
    let n = match nccl {
        true => base
            .checked_add(local_rank())
            .with_context(|| format!("--cuda {base} plus this rank's place on its node"))?,
        false => base,
    };
    Device::new_cuda(n).with_context(|| format!("opening CUDA device {n}"))
}

/// `device` in words: `cpu` or `cuda:N`.
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle::DeviceLocation::Cpu => "cpu".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}
