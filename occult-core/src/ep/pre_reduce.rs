//! Occult's pre-reduction as one op: every received row's expert outputs, gate-weighted and
//! summed into the row, `out[r] = Σ weight[weight_at[p]] · y[p]` over the pairs `p` of row `r`,
//! in f32. On a GPU it is one kernel (`occult-core/kernels/pre_reduce.cu`, compiled to PTX by
//! the build with the `cuda` feature) instead of candle's gather of the weights, broadcast
//! multiply, zero fill and scatter-add: one pass over the outputs instead of three, and a sum
//! order fixed by the plan (no atomics). On the CPU the same sums run on rayon's threads.
//!
//! The pairs are listed per row once on the host (a counting sort of `pair_row`, stable, so
//! each row sums its pairs in plan order); the op holds those index maps on the device. Its
//! backward is candle ops: `dy[p] = weight[weight_at[p]] · dout[row p]` and
//! `dweight[weight_at[p]] = y[p] · dout[row p]`. [`reference`] is the same sums in candle ops
//! (what the layer ran before the op), and tests hold the two together, forward and backward,
//! on the CPU and on a GPU.

use crate::{bail, Result};
use candle::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

/// The pairs of each row: pairs `row_start[r]..row_start[r + 1]` of `row_pairs` are row `r`'s,
/// in ascending pair order.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RowPairs {
    row_start: Vec<u32>,
    row_pairs: Vec<u32>,
}

impl RowPairs {
    /// Lists the pairs of each of `num_rows` rows from the row of each pair; a row out of range
    /// is an error.
    fn new(pair_row: &[u32], num_rows: usize) -> Result<Self> {
        if u32::try_from(pair_row.len()).is_err() || u32::try_from(num_rows).is_err() {
            bail!(
                "pre-reduction of {} pairs into {num_rows} rows: 2^32 or more",
                pair_row.len()
            );
        }
        let mut row_start = vec![0u32; num_rows + 1];
        for &r in pair_row {
            if r as usize >= num_rows {
                bail!("a pair names row {r}, but {num_rows} rows were received");
            }
            row_start[r as usize + 1] += 1;
        }
        for r in 0..num_rows {
            row_start[r + 1] += row_start[r];
        }
        let mut next = row_start.clone();
        let mut row_pairs = vec![0u32; pair_row.len()];
        for (p, &r) in pair_row.iter().enumerate() {
            row_pairs[next[r as usize] as usize] = p as u32;
            next[r as usize] += 1;
        }
        Ok(RowPairs {
            row_start,
            row_pairs,
        })
    }
}

/// `[num_rows, H]` f32: the sum into row `pair_row[p]` of every output row `y[p]` (`[pairs,
/// H]`, f32), each times `weights[weight_at[p]]` when `gate` is `(weights, weight_at)`.
/// Differentiable in `y` and the weights.
pub fn pre_reduce(
    y: &Tensor,
    gate: Option<(&Tensor, &[u32])>,
    pair_row: &[u32],
    num_rows: usize,
) -> Result<Tensor> {
    let (pairs, hidden) = y.dims2()?;
    if y.dtype() != DType::F32 {
        bail!("pre_reduce sums f32 rows, got {:?}", y.dtype());
    }
    if pair_row.len() != pairs {
        bail!("{} pair rows for {pairs} outputs", pair_row.len());
    }
    let dev = y.device();
    let by_row = RowPairs::new(pair_row, num_rows)?;
    let op = PreReduce {
        #[cfg(feature = "cuda")]
        on_gpu: cuda_row_index(&by_row, dev)?,
        pair_row: Tensor::from_slice(pair_row, pairs, dev)?,
        weight_at: None,
        by_row,
        num_rows,
        hidden,
    };
    let y = y.contiguous()?;
    match gate {
        None => Ok(y.apply_op1(op)?),
        Some((weights, weight_at)) => {
            let n = weights.elem_count();
            if weights.dtype() != DType::F32 || weights.rank() != 1 {
                bail!(
                    "pre_reduce takes flat f32 gate weights, got {:?} {:?}",
                    weights.dtype(),
                    weights.dims()
                );
            }
            if weight_at.len() != pairs {
                bail!("{} weight indices for {pairs} outputs", weight_at.len());
            }
            if let Some(&bad) = weight_at.iter().find(|&&i| i as usize >= n) {
                bail!("a pair reads gate weight {bad} of {n}");
            }
            let op = PreReduce {
                weight_at: Some((
                    weight_at.to_vec(),
                    Tensor::from_slice(weight_at, pairs, dev)?,
                )),
                ..op
            };
            Ok(y.apply_op2(&weights.contiguous()?, op)?)
        }
    }
}

/// The row index the CUDA kernel reads (`row_start`, `row_pairs`) on the GPU; `None` on the CPU.
#[cfg(feature = "cuda")]
fn cuda_row_index(by_row: &RowPairs, dev: &candle::Device) -> Result<Option<(Tensor, Tensor)>> {
    if dev.is_cpu() {
        return Ok(None);
    }
    Ok(Some((
        Tensor::from_slice(&by_row.row_start, by_row.row_start.len(), dev)?,
        Tensor::from_slice(&by_row.row_pairs, by_row.row_pairs.len(), dev)?,
    )))
}

/// The same sums in candle ops: a gather of the weights, a broadcast multiply and a
/// scatter-add into zeros.
pub fn reference(
    y: &Tensor,
    gate: Option<(&Tensor, &[u32])>,
    pair_row: &[u32],
    num_rows: usize,
) -> Result<Tensor> {
    let (pairs, hidden) = y.dims2()?;
    let dev = y.device();
    let mut y = y.clone();
    if let Some((w, at)) = gate {
        let at = Tensor::from_slice(at, pairs, dev)?;
        y = y.broadcast_mul(&w.index_select(&at, 0)?.unsqueeze(1)?)?;
    }
    let zeros = Tensor::zeros((num_rows, hidden), y.dtype(), dev)?;
    Ok(zeros.index_add(&Tensor::from_slice(pair_row, pairs, dev)?, &y, 0)?)
}

struct PreReduce {
    by_row: RowPairs,
    /// `by_row`'s `row_start` and `row_pairs` on the rows' GPU.
    #[cfg(feature = "cuda")]
    on_gpu: Option<(Tensor, Tensor)>,
    /// `[pairs]`: the row of each pair (for the backward).
    pair_row: Tensor,
    /// Where each pair's gate weight is, on the host and on the device (weighted form only).
    weight_at: Option<(Vec<u32>, Tensor)>,
    num_rows: usize,
    hidden: usize,
}

fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle::Result<&'a [f32]> {
    let (CpuStorage::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
        candle::bail!("pre_reduce: {what} must be contiguous f32");
    };
    Ok(&v[a..b])
}

/// A contiguous f32 operand on the GPU.
#[cfg(feature = "cuda")]
fn f32_view<'a>(
    s: &'a candle::CudaStorage,
    l: &Layout,
) -> candle::Result<candle::cuda_backend::cudarc::driver::CudaView<'a, f32>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle::bail!("pre_reduce: rows and weights must be contiguous");
    };
    Ok(s.as_cuda_slice::<f32>()?.slice(a..b))
}

/// An index map's elements on the GPU (made by [`pre_reduce`]: contiguous u32 from the start).
#[cfg(feature = "cuda")]
fn index(
    s: &candle::Storage,
) -> candle::Result<&candle::cuda_backend::cudarc::driver::CudaSlice<u32>> {
    match s {
        candle::Storage::Cuda(c) => c.as_cuda_slice::<u32>(),
        _ => candle::bail!("pre_reduce: an index map is not on the rows' GPU"),
    }
}

impl PreReduce {
    /// The sums on the CPU, rows in parallel.
    fn cpu(&self, y: &[f32], weights: Option<&[f32]>) -> candle::Result<(CpuStorage, Shape)> {
        use rayon::prelude::*;
        let h = self.hidden;
        let RowPairs {
            row_start,
            row_pairs,
        } = &self.by_row;
        let weight_at = self.weight_at.as_ref().map(|(at, _)| at.as_slice());
        let mut out = vec![0f32; self.num_rows * h];
        out.par_chunks_mut(h.max(1))
            .enumerate()
            .for_each(|(r, row)| {
                for &p in &row_pairs[row_start[r] as usize..row_start[r + 1] as usize] {
                    let p = p as usize;
                    let src = &y[p * h..(p + 1) * h];
                    match (weights, weight_at) {
                        (Some(w), Some(at)) => {
                            let g = w[at[p] as usize];
                            row.iter_mut().zip(src).for_each(|(o, v)| *o += g * v);
                        }
                        _ => row.iter_mut().zip(src).for_each(|(o, v)| *o += v),
                    }
                }
            });
        Ok((CpuStorage::F32(out), Shape::from((self.num_rows, h))))
    }

    /// The kernel on the rows' GPU.
    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        y: &candle::CudaStorage,
        y_layout: &Layout,
        weights: Option<(&candle::CudaStorage, &Layout)>,
    ) -> candle::Result<(candle::CudaStorage, Shape)> {
        use candle::backend::BackendStorage;
        use candle::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle::cuda_backend::WrapErr;
        let dev = y.device().clone();
        let Some((row_start, row_pairs)) = &self.on_gpu else {
            candle::bail!("pre_reduce: the index maps were made for the CPU");
        };
        let (start_guard, _) = row_start.storage_and_layout();
        let (pairs_guard, _) = row_pairs.storage_and_layout();
        let (row_start, row_pairs) = (index(&start_guard)?, index(&pairs_guard)?);
        let (rows, hidden) = (self.num_rows as u32, self.hidden as u32);
        let n = self.num_rows * self.hidden;
        // SAFETY: the kernel writes every element before anything reads it.
        let mut out = unsafe { dev.alloc::<f32>(n.max(1))? };
        let blocks = n.div_ceil(256).clamp(1, 1 << 20) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let y = f32_view(y, y_layout)?;
        match (weights, &self.weight_at) {
            (Some((w, wl)), Some((_, at))) => {
                let w = f32_view(w, wl)?;
                let (at_guard, _) = at.storage_and_layout();
                let at = index(&at_guard)?;
                let func = dev.get_or_load_custom_func(
                    "pre_reduce_weighted_f32",
                    "occult_pre_reduce",
                    kernels::PRE_REDUCE,
                )?;
                let mut b = func.builder();
                b.arg(&y).arg(&w).arg(at).arg(row_start).arg(row_pairs);
                b.arg(&mut out).arg(&rows).arg(&hidden);
                // SAFETY: the arguments match the kernel's, and the index maps were checked
                // on the host (rows and weights in range).
                unsafe { b.launch(cfg) }.w()?;
            }
            _ => {
                let func = dev.get_or_load_custom_func(
                    "pre_reduce_f32",
                    "occult_pre_reduce",
                    kernels::PRE_REDUCE,
                )?;
                let mut b = func.builder();
                b.arg(&y).arg(row_start).arg(row_pairs);
                b.arg(&mut out).arg(&rows).arg(&hidden);
                // SAFETY: as above.
                unsafe { b.launch(cfg) }.w()?;
            }
        }
        let out = candle::CudaStorage::wrap_cuda_slice(out, dev);
        Ok((out, Shape::from((self.num_rows, self.hidden))))
    }

    /// The gradient of the outputs at each pair's row, `[pairs, H]` f32.
    fn grad_at_pairs(&self, grad_res: &Tensor) -> candle::Result<Tensor> {
        grad_res
            .to_dtype(DType::F32)?
            .index_select(&self.pair_row, 0)
    }
}

#[cfg(feature = "cuda")]
mod kernels {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

impl CustomOp1 for PreReduce {
    fn name(&self) -> &'static str {
        "occult-pre-reduce"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle::Result<(CpuStorage, Shape)> {
        self.cpu(contiguous_f32(s, l, "the rows")?, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle::CudaStorage,
        l: &Layout,
    ) -> candle::Result<(candle::CudaStorage, Shape)> {
        self.cuda(s, l, None)
    }

    fn bwd(&self, _y: &Tensor, _res: &Tensor, grad_res: &Tensor) -> candle::Result<Option<Tensor>> {
        Ok(Some(self.grad_at_pairs(grad_res)?))
    }
}

impl CustomOp2 for PreReduce {
    fn name(&self) -> &'static str {
        "occult-pre-reduce-weighted"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle::Result<(CpuStorage, Shape)> {
        let y = contiguous_f32(s1, l1, "the rows")?;
        self.cpu(y, Some(contiguous_f32(s2, l2, "the gate weights")?))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> candle::Result<(candle::CudaStorage, Shape)> {
        self.cuda(s1, l1, Some((s2, l2)))
    }

    fn bwd(
        &self,
        y: &Tensor,
        weights: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle::Result<(Option<Tensor>, Option<Tensor>)> {
        let Some((_, at)) = &self.weight_at else {
            candle::bail!("pre_reduce: the weighted backward without weight indices");
        };
        let g = self.grad_at_pairs(grad_res)?;
        let w = weights.index_select(at, 0)?;
        let grad_y = g.broadcast_mul(&w.unsqueeze(1)?)?;
        let grad_w_pairs = (y * &g)?.sum(1)?;
        let grad_w = weights.zeros_like()?.index_add(at, &grad_w_pairs, 0)?;
        Ok((Some(grad_y), Some(grad_w)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::Device;

    /// Every input check names what was wrong (the sums themselves are checked against
    /// [`reference`] in tests/src/grouping.rs).
    #[test]
    fn bad_inputs_are_refused_with_reasons() {
        let dev = Device::Cpu;
        let y = Tensor::ones((3, 4), DType::F32, &dev).unwrap();
        let w = Tensor::ones(3, DType::F32, &dev).unwrap();
        let err = |r: Result<Tensor>| r.unwrap_err().to_string();
        let e = err(pre_reduce(
            &y.to_dtype(DType::F16).unwrap(),
            None,
            &[0, 1, 1],
            2,
        ));
        assert!(e.contains("sums f32 rows"), "{e}");
        assert!(err(pre_reduce(&y, None, &[0, 1], 2)).contains("2 pair rows for 3 outputs"));
        assert!(err(pre_reduce(&y, None, &[0, 1, 2], 2)).contains("row"));
        let f16 = w.to_dtype(DType::F16).unwrap();
        let e = err(pre_reduce(&y, Some((&f16, &[0, 1, 2])), &[0, 1, 1], 2));
        assert!(e.contains("flat f32 gate weights"), "{e}");
        let flat_2d = w.reshape((3, 1)).unwrap();
        let e = err(pre_reduce(&y, Some((&flat_2d, &[0, 1, 2])), &[0, 1, 1], 2));
        assert!(e.contains("flat f32 gate weights"), "{e}");
        let e = err(pre_reduce(&y, Some((&w, &[0, 1])), &[0, 1, 1], 2));
        assert!(e.contains("2 weight indices for 3 outputs"), "{e}");
        let e = err(pre_reduce(&y, Some((&w, &[0, 1, 3])), &[0, 1, 1], 2));
        assert!(e.contains("gate weight 3 of 3"), "{e}");
        let ok = pre_reduce(&y, Some((&w, &[0, 1, 2])), &[0, 1, 1], 2).unwrap();
        assert_eq!(ok.to_vec2::<f32>().unwrap()[1], vec![2.0; 4]);
    }
}
