//! One optimiser step of a model on D ranks: each rank's share of the global batch forward,
//! the loss (next-token cross-entropy on the target positions, summed and divided by the
//! global batch's target count), backward through the exchanges, replicated gradients summed
//! over ranks, clipping by the global norm, and the AdamW update. D ranks on the union of their
//! shares take the step one device takes on the whole batch (in the exact modes, to float
//! tolerance). A rank with no examples in a step still takes part. Each rank must hold its own
//! copy of the replicated trainable tensors (load them per rank): the update is applied to
//! each copy.

use crate::batches::pad;
use crate::examples::Example;
use crate::grad_norm::clip_global_norm;
use crate::optim::AdamW;
use crate::Result;
use candle::{DType, Device, Tensor, D};
use occult_core::models::model::{Logits, Model};

/// What one step did: the same on every rank, but for `ep`.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Mean loss per target position over the global batch.
    pub loss: f64,
    /// Target positions in the global batch.
    pub targets: usize,
    /// Tokens fed over all ranks.
    pub tokens: usize,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    /// E[C_T] over the step's tokens and MoE layers (1 on one device in the reference mode).
    pub ect: f64,
    /// E[C_T] of each MoE layer, in layer order (1 on one device in the reference mode).
    pub ect_by_layer: Vec<f64>,
    /// This rank's EP statistics of the step's forwards, summed over MoE layers.
    pub ep: occult_core::ep::StepStats,
}

/// This rank's loss for `examples` (padded into one batch), divided by `global_targets`: the
/// summed cross-entropy of every target position.
pub fn share_loss(m: &Model, examples: &[&Example], global_targets: usize) -> Result<Tensor> {
    if examples.is_empty() {
        return Ok(m.forward_empty()?);
    }
    let (ids, mask, t) = pad(examples);
    if t < 2 {
        return Err(crate::Error::Invalid(
            "examples of fewer than 2 tokens leave nothing to predict".into(),
        ));
    }
    let b = examples.len();
    // Position i predicts token i + 1.
    let input = Tensor::from_slice(&ids, (b, t), &Device::Cpu)?;
    let logits = m.forward(&input.narrow(1, 0, t - 1)?, None, None, Logits::All)?;
    let v = logits.dims3()?.2;
    let logp = candle_nn_log_softmax(&logits.reshape((b * (t - 1), v))?.to_dtype(DType::F32)?)?;
    let next = input.narrow(1, 1, t - 1)?.reshape((b * (t - 1), 1))?;
    let picked = logp.gather(&next.contiguous()?, 1)?.squeeze(1)?;
    let weights = Tensor::from_slice(&mask, (b, t), &Device::Cpu)?
        .narrow(1, 1, t - 1)?
        .reshape(b * (t - 1))?;
    let summed = (picked * weights)?.sum_all()?.neg()?;
    Ok((summed / global_targets.max(1) as f64)?)
}

/// `log_softmax` from differentiable primitives (candle's fused softmax has no backward).
fn candle_nn_log_softmax(x: &Tensor) -> candle::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&lse)
}

/// One optimiser step on this rank's `share` of the global batch, with learning rate `lr`
/// and gradient clipping at `max_norm` (none when `None`). Collective on D ranks.
pub fn train_step(
    m: &Model,
    opt: &mut AdamW,
    share: &[&Example],
    lr: f64,
    max_norm: Option<f64>,
) -> Result<StepReport> {
    train_step_accumulated(m, opt, share, 1, lr, max_norm)
}

/// [`train_step`] with the share run as `micro` consecutive micro-batches whose gradients add
/// up (gradient accumulation: the same step in less memory). Every rank runs `micro` forwards
/// (an empty micro-batch takes part through [`Model::forward_empty`]).
pub fn train_step_accumulated(
    m: &Model,
    opt: &mut AdamW,
    share: &[&Example],
    micro: usize,
    lr: f64,
    max_norm: Option<f64>,
) -> Result<StepReport> {
    let local_targets: usize = share.iter().map(|e| e.targets()).sum();
    let targets = m.global_count(local_targets)?;
    let tokens = m.global_count(share.iter().map(|e| e.ids.len()).sum())?;
    m.take_ep_stats();
    let params = m.trainable_params();
    let split = occult_core::analysis::ranks::RankSplit::new(share.len(), micro.max(1));
    let mut grads: Option<candle::backprop::GradStore> = None;
    let mut loss_sum = 0.0;
    for k in 0..micro.max(1) {
        let part = &share[split.range(k)];
        let loss = share_loss(m, part, targets)?;
        loss_sum += loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let g = loss.backward()?;
        grads = Some(match grads {
            None => g,
            Some(mut acc) => {
                for p in &params {
                    if let Some(new) = g.get(p) {
                        let sum = match acc.get(p) {
                            Some(old) => (old + new)?,
                            None => new.clone(),
                        };
                        acc.insert(p, sum);
                    }
                }
                acc
            }
        });
    }
    let mut grads = grads.expect("at least one micro-batch");
    m.all_reduce_grads(&mut grads)?;
    // A tensor the step did not reach (this rank's experts when it received no rows) has a zero
    // gradient, as on one device, so that AdamW moves every tensor alike.
    for p in &params {
        if grads.get(p).is_none() {
            grads.insert(p, p.zeros_like()?);
        }
    }
    let grad_norm = match max_norm {
        Some(n) => clip_global_norm(m, &mut grads, n)?,
        None => crate::grad_norm::global_norm(m, &grads)?,
    };
    opt.step(&grads, lr)?;
    let by_layer = m.take_ep_stats_by_layer();
    let moe_layers: Vec<usize> = (0..m.cfg.num_layers)
        .filter(|&l| m.cfg.moe_layers[l])
        .collect();
    let mut ect_by_layer = Vec::with_capacity(moe_layers.len());
    let mut ep = occult_core::ep::StepStats::default();
    by_layer.values().for_each(|s| ep.add(s));
    let (mut touched, mut routed) = (0.0, 0.0);
    // Every rank walks every MoE layer (a rank without tokens recorded none).
    for l in moe_layers {
        let s = by_layer.get(&l).cloned().unwrap_or_default();
        let t = m.sum_over_ranks(s.devices_touched as f64)?;
        let r = m.sum_over_ranks(s.tokens as f64)?;
        ect_by_layer.push(if r > 0.0 { t / r } else { 1.0 });
        touched += t;
        routed += r;
    }
    Ok(StepReport {
        loss: m.sum_over_ranks(loss_sum)?,
        targets,
        tokens,
        grad_norm,
        lr,
        ect: if routed > 0.0 { touched / routed } else { 1.0 },
        ect_by_layer,
        ep,
    })
}
