//! The all-to-all of tensor rows as a differentiable op. Its gradient is the reverse exchange:
//! the gradient of each received row goes back to the rank that sent the row. Every rank must
//! run its exchanges, forward and backward, in the same order; the MoE layer guarantees that by
//! keeping dispatch and combine on one chain of the graph (gate weights travel as extra columns
//! of the dispatched rows).

use crate::ep::comm::Communicator;
use crate::{Error, Result};
use candle::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use std::sync::{Arc, Mutex};

/// Exchanges the rows of `x` (`[rows, width]`, f32, bf16 or f16): the first `send_counts[0]` rows go to
/// rank 0, and so on. Returns the received rows (`[received, width]`, in source-rank order)
/// and the count from each source. Differentiable with respect to `x`.
pub fn exchange_rows(
    comm: &Arc<dyn Communicator>,
    x: &Tensor,
    send_counts: &[usize],
) -> Result<(Tensor, Vec<usize>)> {
    let recv_counts = Arc::new(Mutex::new(None));
    let op = Exchange {
        comm: comm.clone(),
        send_counts: send_counts.to_vec(),
        recv_counts: recv_counts.clone(),
    };
    let y = x.contiguous()?.apply_op1(op)?;
    let counts = recv_counts
        .lock()
        .map_err(|_| Error::Comm("exchange state poisoned".into()))?
        .clone()
        .ok_or_else(|| Error::Comm("exchange did not record its receive counts".into()))?;
    Ok((y, counts))
}

struct Exchange {
    comm: Arc<dyn Communicator>,
    send_counts: Vec<usize>,
    /// Filled by the forward pass; the backward pass sends this many rows back to each peer.
    recv_counts: Arc<Mutex<Option<Vec<usize>>>>,
}

impl Exchange {
    /// Sends this rank's rows (`width` elements each) and records the receive counts.
    fn exchange<T: bytemuck::Pod>(
        &self,
        send: &[T],
        width: usize,
    ) -> candle::Result<(Vec<T>, usize)> {
        let mut recv = Vec::<T>::new();
        let counts = self
            .comm
            .all_to_all_v_into(
                bytemuck::cast_slice(send),
                &self.send_counts,
                width * std::mem::size_of::<T>(),
                &mut recv,
            )
            .map_err(|e| candle::Error::Msg(e.to_string()))?;
        let rows: usize = counts.iter().sum();
        *self
            .recv_counts
            .lock()
            .map_err(|_| candle::Error::Msg("exchange state poisoned".into()))? = Some(counts);
        Ok((recv, rows))
    }
}

#[cfg(feature = "nccl")]
impl Exchange {
    /// The rows of `storage` (on the communicator's GPU) sent straight from GPU to GPU; the
    /// received rows are candle's, on its stream.
    fn on_gpus(
        &self,
        nccl: &crate::ep::comm::nccl::NcclComm,
        storage: &candle::CudaStorage,
        layout: &Layout,
    ) -> candle::Result<(candle::CudaStorage, Shape)> {
        use candle::backend::BackendStorage;
        use candle::cuda_backend::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
        use candle::cuda_backend::cudarc::nccl::NcclType;
        use candle::cuda_backend::CudaDType;
        let (_, width) = layout.shape().dims2()?;
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle::bail!("exchange_rows needs a contiguous tensor");
        };
        let ordinal = storage.device().cuda_stream().context().ordinal();
        if ordinal != nccl.ordinal() {
            candle::bail!(
                "rows on CUDA device {ordinal}, the NCCL communicator runs on device {}",
                nccl.ordinal()
            );
        }
        fn exchange<T: CudaDType + NcclType + DeviceRepr + ValidAsZeroBits>(
            op: &Exchange,
            nccl: &crate::ep::comm::nccl::NcclComm,
            storage: &candle::CudaStorage,
            (start, end, width): (usize, usize, usize),
        ) -> candle::Result<(candle::CudaStorage, Vec<usize>)> {
            let stream = storage.device().cuda_stream();
            let rows = storage.as_cuda_slice::<T>()?.slice(start..end);
            let (recv, counts) = nccl
                .all_to_all_v_device(&rows, &op.send_counts, width, &stream)
                .map_err(|e| candle::Error::Msg(e.to_string()))?;
            let out = candle::CudaStorage::wrap_cuda_slice(recv, storage.device().clone());
            Ok((out, counts))
        }
        let at = (start, end, width);
        let (out, counts) = match storage.dtype() {
            candle::DType::F32 => exchange::<f32>(self, nccl, storage, at)?,
            candle::DType::BF16 => exchange::<half::bf16>(self, nccl, storage, at)?,
            candle::DType::F16 => exchange::<half::f16>(self, nccl, storage, at)?,
            _ => candle::bail!("exchange_rows supports f32, bf16 and f16 tensors"),
        };
        let rows: usize = counts.iter().sum();
        *self
            .recv_counts
            .lock()
            .map_err(|_| candle::Error::Msg("exchange state poisoned".into()))? = Some(counts);
        Ok((out, Shape::from((rows, width))))
    }
}

impl CustomOp1 for Exchange {
    fn name(&self) -> &'static str {
        "occult-all-to-all"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle::Result<(CpuStorage, Shape)> {
        let dims = layout.dims();
        if dims.len() != 2 {
            candle::bail!("exchange_rows expects [rows, width], got {:?}", dims);
        }
        let width = dims[1];
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle::bail!("exchange_rows needs a contiguous tensor");
        };
        let (out, rows) = match storage {
            CpuStorage::F32(d) => {
                let (v, rows) = self.exchange(&d[start..end], width)?;
                (CpuStorage::F32(v), rows)
            }
            CpuStorage::BF16(d) => {
                let (v, rows) = self.exchange(&d[start..end], width)?;
                (CpuStorage::BF16(v), rows)
            }
            CpuStorage::F16(d) => {
                let (v, rows) = self.exchange(&d[start..end], width)?;
                (CpuStorage::F16(v), rows)
            }
            _ => candle::bail!("exchange_rows supports f32, bf16 and f16 tensors"),
        };
        Ok((out, Shape::from((rows, width))))
    }

    /// Rows on a GPU move between GPUs directly over an NCCL communicator; over any other
    /// communicator (threads, MPI) they pass through the host.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle::CudaStorage,
        layout: &Layout,
    ) -> candle::Result<(candle::CudaStorage, Shape)> {
        use candle::backend::{BackendDevice, BackendStorage};
        #[cfg(feature = "nccl")]
        if let Some(nccl) = crate::ep::comm::nccl::nccl_of(self.comm.as_ref()) {
            return self.on_gpus(nccl, storage, layout);
        }
        let (out, shape) = self.cpu_fwd(&storage.to_cpu_storage()?, layout)?;
        Ok((storage.device().storage_from_cpu_storage(&out)?, shape))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle::Result<Option<Tensor>> {
        let back = self
            .recv_counts
            .lock()
            .map_err(|_| candle::Error::Msg("exchange state poisoned".into()))?
            .clone()
            .ok_or_else(|| candle::Error::Msg("backward before forward".into()))?;
        let (g, counts) = exchange_rows(&self.comm, grad_res, &back)
            .map_err(|e| candle::Error::Msg(e.to_string()))?;
        if counts != self.send_counts {
            candle::bail!(
                "reverse exchange returned {counts:?} rows, the forward sent {:?}",
                self.send_counts
            );
        }
        Ok(Some(g))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ep::comm::local::run_local;
    use candle::{Device, Var};

    #[test]
    fn exchange_moves_rows_and_gradients_back() {
        let out = run_local(3, |comm| {
            let c = comm.as_ref();
            let me = c.rank() as f32;
            // Rank r sends r rows to each peer (rank 0 sends nothing), width 2.
            let n = c.rank() * 3;
            let data: Vec<f32> = (0..n * 2).map(|i| me * 100.0 + i as f32).collect();
            let x = Var::from_vec(data, (n, 2), &Device::Cpu)?;
            let (y, counts) = exchange_rows(comm, x.as_tensor(), &[c.rank(); 3])?;
            assert_eq!(counts, vec![0, 1, 2]);
            // Weight each received row by (source rank + 1): the gradient of a sent row is
            // then (its destination's view of) that weight.
            let w: Vec<f32> = counts
                .iter()
                .enumerate()
                .flat_map(|(s, &k)| std::iter::repeat_n((s + 1) as f32, k * 2))
                .collect();
            let w = Tensor::from_vec(w, y.dims(), &Device::Cpu)?;
            let loss = (y * w)?.sum_all()?;
            let grads = loss.backward()?;
            let g = grads
                .get(x.as_tensor())
                .map(|g| g.to_vec2::<f32>())
                .transpose()?;
            Ok((c.rank(), g))
        });
        for r in out {
            let (rank, g) = r.unwrap();
            if rank == 0 {
                // Rank 0 sent nothing; an empty input may or may not get an (empty) gradient.
                assert!(g.is_none_or(|g| g.is_empty()));
                continue;
            }
            let g = g.expect("ranks that sent rows get gradients back");
            // Rows sent by `rank` were weighted by rank + 1 wherever they landed.
            assert!(g.iter().flatten().all(|&v| v == (rank + 1) as f32), "{g:?}");
            assert_eq!(g.len(), rank * 3);
        }
    }
}
