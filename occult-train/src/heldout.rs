//! The held-out loss: the mean next-token cross-entropy per target position of a set of
//! examples, under the model's routing (exact or pruned), on D ranks. The examples go in
//! global batches in their order, each rank taking its share of each batch, so D ranks score
//! exactly what one device scores. Nothing trains.

use crate::batches::rank_share;
use crate::examples::Example;
use crate::step::{ect_of, share_loss, touched_over_ranks};
use crate::{Error, Result};
use candle::DType;
use occult_core::models::model::Model;

/// What [`heldout_loss`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeldOut {
    /// Mean cross-entropy per target position (nats).
    pub loss: f64,
    /// Target positions scored.
    pub targets: usize,
    /// Examples scored.
    pub examples: usize,
    /// E[C_T] of the scoring forwards over all ranks and MoE layers (1 in the reference mode).
    pub ect: f64,
}

impl HeldOut {
    /// `exp(loss)`.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// Scores `examples` in global batches of `batch`. Collective: every rank brings the same
/// examples.
pub fn heldout_loss(m: &Model, examples: &[Example], batch: usize) -> Result<HeldOut> {
    if examples.is_empty() {
        return Err(Error::Invalid("there are no held-out examples".into()));
    }
    if batch == 0 {
        return Err(Error::Invalid("the batch size must be at least 1".into()));
    }
    let (rank, size) = m.rank_and_size();
    let order: Vec<usize> = (0..examples.len()).collect();
    let (mut summed, mut targets) = (0.0, 0);
    m.take_ep_stats();
    for global in order.chunks(batch) {
        let share: Vec<&Example> = rank_share(global, rank, size)
            .iter()
            .map(|&i| &examples[i])
            .collect();
        // Divided by 1: this rank's summed cross-entropy.
        let part = share_loss(m, &share, 1, None)?;
        summed += part.ce.detach().to_dtype(DType::F64)?.to_scalar::<f64>()?;
        targets += share.iter().map(|e| e.targets()).sum::<usize>();
    }
    let stats = m.take_ep_stats();
    let summed = m.sum_over_ranks(summed)?;
    let targets = m.global_count(targets)?;
    let (touched, routed) = touched_over_ranks(m, &stats)?;
    if targets == 0 {
        return Err(Error::Invalid(
            "the held-out examples have no target positions".into(),
        ));
    }
    if !summed.is_finite() {
        return Err(Error::Invalid(format!(
            "the held-out loss is {summed}: the model's outputs are not finite"
        )));
    }
    Ok(HeldOut {
        loss: summed / targets as f64,
        targets,
        examples: examples.len(),
        ect: ect_of(touched, routed),
    })
}
