//! Data + expert parallelism for whole models: every rank holds the dense weights and its own
//! experts, and runs its own sequences; only the MoE blocks talk, through the EP layer's two
//! all-to-alls. This module holds what keeps D ranks in step and makes their gradients those of
//! one device on the union of their batches.
//!
//! **Lockstep.** Every forward of an EP model on more than one rank is collective. It opens with
//! a one-byte all-gather ("this rank brings a step"); then each MoE block exchanges rows. A rank
//! whose work is done calls [`Model::finish`]: it keeps answering its peers' steps with zero
//! rows (each MoE block in order, on `[0, H]`) until every rank has announced that it is done.
//! So ranks may run different numbers of forwards (uneven shards, different decode lengths,
//! context reuse) and still meet in every exchange.
//!
//! **Training.** A rank with no sequences in a step calls [`Model::forward_empty`] and
//! backpropagates from the (zero) scalar it returns, so that it runs its reverse exchanges as
//! its peers do. After the backward pass, [`Model::all_reduce_grads`] sums the gradients of the
//! replicated trainable tensors (everything but the routed experts) over the ranks; expert
//! gradients stay with the expert's owner (summed over its copies under replicas). With each rank's loss divided by the global token
//! count ([`Model::global_count`]), the result equals one device's gradients on the whole
//! batch.

use super::model::{Mlp, Model, MoeExec, RoutingRecorder};
use crate::analysis::ranks::RankSplit;
use crate::ep::residual_add;
use crate::{bail, Error, Result};
use candle::backprop::GradStore;
use candle::{DType, Tensor};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::ops::Range;

/// Digests of what ranks hold, to compare them without moving it (with [`Model::check_same_work`]).
pub use super::model::fingerprint;

impl Model {
    /// This rank and the number of ranks (0 of 1 without a communicator).
    pub fn rank_and_size(&self) -> (usize, usize) {
        self.comm().map_or((0, 1), |c| (c.rank(), c.size()))
    }

    /// This rank's share of `n` items: contiguous, in order, as even as can be (the first
    /// `n % D` ranks take one more). Gathering the shares in rank order restores the order.
    pub fn shard(&self, n: usize) -> Range<usize> {
        let (rank, size) = self.rank_and_size();
        RankSplit::new(n, size).range(rank)
    }

    /// Ends this rank's work ([`Model::finish`]) and gathers every rank's byte block on rank 0,
    /// in rank order (other ranks get an empty list).
    pub fn finish_and_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.finish()?;
        match self.comm().filter(|c| c.size() > 1) {
            Some(c) => c.gather_v_bytes_to_root(&mine),
            None => Ok(vec![mine]),
        }
    }

    /// Ends this rank's work and gathers every rank's items (JSON on the wire) on rank 0,
    /// concatenated in rank order: with [`Model::shard`], the items in their original order.
    /// Other ranks get an empty list.
    pub fn finish_and_gather<T: Serialize + DeserializeOwned>(
        &self,
        mine: Vec<T>,
    ) -> Result<Vec<T>> {
        if !self.is_distributed() {
            return Ok(mine);
        }
        let bytes = serde_json::to_vec(&mine)
            .map_err(|e| Error::invalid(format!("encoding results to gather: {e}")))?;
        let mut out = Vec::new();
        for (rank, block) in self.finish_and_gather_bytes(bytes)?.into_iter().enumerate() {
            let items: Vec<T> = serde_json::from_slice(&block).map_err(|e| {
                Error::Comm(format!("rank {rank}'s gathered results do not decode: {e}"))
            })?;
            out.extend(items);
        }
        Ok(out)
    }

    /// Ends this rank's work and gathers every rank's routing into one recorder on rank 0, in
    /// rank order (with [`Model::shard`], the token order of one device). Other ranks get an
    /// empty recorder.
    pub fn finish_and_gather_routing(&self, mine: RoutingRecorder) -> Result<RoutingRecorder> {
        if !self.is_distributed() {
            return Ok(mine);
        }
        let mut all = RoutingRecorder::default();
        for block in self.finish_and_gather_bytes(mine.to_bytes())? {
            all.append(RoutingRecorder::from_bytes(&block)?);
        }
        Ok(all)
    }

    /// Checks that every rank brings the same work (its `fingerprint`): ranks that read
    /// different task lists, prompts or files would otherwise pair the wrong results or wait for
    /// each other forever. The error names `what` and the ranks that differ from rank 0.
    /// Collective.
    pub fn check_same_work(&self, what: &str, fingerprint: u64) -> Result<()> {
        let Some(c) = self.comm().filter(|c| c.size() > 1) else {
            return Ok(());
        };
        let all = c.all_gather_bytes(&fingerprint.to_le_bytes())?;
        let prints: Vec<&[u8]> = all.chunks_exact(8).collect();
        let differ: Vec<usize> = (1..prints.len())
            .filter(|&r| prints[r] != prints[0])
            .collect();
        if !differ.is_empty() {
            bail!(
                "rank(s) {differ:?} hold different {what} from rank 0 (each process reads its \
                 own inputs: give every rank the same files and flags)"
            );
        }
        Ok(())
    }

    /// Whether forwards are collective over more than one rank.
    pub fn is_distributed(&self) -> bool {
        self.comm().is_some_and(|c| c.size() > 1)
    }

    /// This rank's part of a step in which it has no tokens: every MoE block in order, on
    /// `[0, H]`, chained as the layers chain (so that a backward pass runs the same reverse
    /// exchanges). Returns the final empty hidden state.
    fn idle_step(&self) -> Result<Tensor> {
        let h = self.cfg.hidden_size;
        let mut x = Tensor::zeros((0, h), self.embed.dtype(), self.embed.device())?;
        for layer in &self.layers {
            if let Mlp::Moe(block) = &layer.mlp {
                if let MoeExec::Parallel(ep) = &block.exec {
                    let (y, _) = ep.forward(&x)?;
                    x = residual_add(&x, &y)?;
                }
            }
        }
        Ok(x)
    }

    /// Takes part in the peers' remaining forwards with no tokens until every rank has called
    /// `finish`. Call it once a rank's own work is done (inference). Returns at once on one
    /// rank.
    pub fn finish(&self) -> Result<()> {
        if !self.is_distributed() {
            return Ok(());
        }
        while self.announce(false)? {
            self.idle_step()?;
        }
        Ok(())
    }

    /// A forward step with no tokens on this rank, for training: returns a zero scalar whose
    /// backward runs this rank's reverse exchanges. Collective, like [`Model::forward`].
    pub fn forward_empty(&self) -> Result<Tensor> {
        self.announce(true)?;
        let x = self.idle_step()?;
        // The sum of an empty tensor, kept on the graph: candle's binary and unary ops return
        // an empty operand as it is, but a matmul with an empty inner dimension records itself.
        let zero = x.t()?.matmul(&x)?.to_dtype(DType::F32)?.sum_all()?;
        Ok(zero)
    }

    /// `local` summed over the ranks (for example the token count that normalises the loss).
    pub fn global_count(&self, local: usize) -> Result<usize> {
        let Some(c) = self.comm().filter(|c| c.size() > 1) else {
            return Ok(local);
        };
        Ok(c.all_gather_u64(local as u64)?
            .into_iter()
            .map(|x| x as usize)
            .sum())
    }

    /// `x` summed over the ranks, the same value on every rank (`x` itself on one rank).
    pub fn sum_over_ranks(&self, x: f64) -> Result<f64> {
        match self.comm().filter(|c| c.size() > 1) {
            Some(c) => c.sum_f64(x),
            None => Ok(x),
        }
    }

    /// Counts summed over the ranks element by element, in place (exact; one all-gather).
    /// Every rank must bring as many.
    pub fn sum_counts_over_ranks(&self, x: &mut [u64]) -> Result<()> {
        let Some(c) = self.comm().filter(|c| c.size() > 1) else {
            return Ok(());
        };
        let mine: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = c.all_gather_bytes(&mine)?;
        if all.len() != mine.len() * c.size() {
            bail!(
                "ranks brought different numbers of counts ({} bytes from {} ranks, {} here)",
                all.len(),
                c.size(),
                mine.len()
            );
        }
        x.fill(0);
        for block in all.chunks(mine.len().max(1)) {
            for (v, b) in x.iter_mut().zip(block.chunks_exact(8)) {
                *v += u64::from_le_bytes(b.try_into().expect("8 bytes"));
            }
        }
        Ok(())
    }

    /// Sums the gradients of the replicated trainable tensors over the ranks, in place (a
    /// tensor without a gradient on some rank counts as zeros there). Routed experts keep their
    /// owner's gradient; an expert with copies (a placement with replicas) gets the sum of its
    /// copies' ([`Model::sum_copy_grads`]). Collective; one all-reduce for all tensors, and
    /// one per layer with replicas.
    pub fn all_reduce_grads(&self, grads: &mut GradStore) -> Result<()> {
        self.sum_copy_grads(grads)?;
        let Some(c) = self.comm().filter(|c| c.size() > 1) else {
            return Ok(());
        };
        let replicated: Vec<Tensor> = self
            .replicated_params()
            .into_iter()
            .map(|(_, t)| t)
            .filter(|t| t.is_variable())
            .collect();
        let mut flat = Vec::new();
        for t in &replicated {
            match grads.get(t) {
                Some(g) => {
                    if g.dims() != t.dims() {
                        bail!(
                            "a gradient of shape {:?} for a tensor of shape {:?}",
                            g.dims(),
                            t.dims()
                        );
                    }
                    flat.extend(g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
                }
                None => flat.extend(std::iter::repeat_n(0.0, t.elem_count())),
            }
        }
        c.all_reduce_sum_f32(&mut flat)?;
        let mut at = 0;
        for t in &replicated {
            let n = t.elem_count();
            let g = Tensor::from_slice(&flat[at..at + n], t.dims(), t.device())?;
            grads.insert(t, g.to_dtype(t.dtype())?);
            at += n;
        }
        Ok(())
    }
}
