//! One optimiser step of a model on D ranks: each rank's share of the global batch forward,
//! the loss (next-token cross-entropy on the target positions, summed and divided by the
//! global batch's target count), backward through the exchanges, replicated gradients summed
//! over ranks, clipping by the global norm, and the AdamW update. D ranks on the union of their
//! shares take the step one device takes on the whole batch (in the exact modes, to float
//! tolerance). A rank with no examples in a step still takes part. Each rank must hold its own
//! copy of the replicated trainable tensors (load them per rank): the update is applied to
//! each copy.

use crate::aux_loss::aux_loss_share;
use crate::batches::pad;
use crate::examples::Example;
use crate::grad_norm::clip_global_norm;
use crate::optim::AdamW;
use crate::{Error, Result};
use candle::{DType, Device, Tensor, D};
use occult_core::models::config::AuxLoss;
use occult_core::models::model::{Logits, Model};

/// What one step did: the same on every rank, but for `ep`.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Mean loss per target position over the global batch (cross-entropy only).
    pub loss: f64,
    /// The load-balancing loss (with its coefficient), when the step added it.
    pub aux_loss: Option<f64>,
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
    /// Wall time of the step on this rank (forward, backward, reduction and update).
    pub seconds: f64,
}

/// This rank's loss for `examples` (padded into one batch), divided by `global_targets`: the
/// summed cross-entropy of every target position. With `aux`, also this rank's share of the
/// load-balancing loss of the same forward (collective: every rank asks for it or none).
pub fn share_loss(
    m: &Model,
    examples: &[&Example],
    global_targets: usize,
    aux: Option<AuxLoss>,
) -> Result<ShareLoss> {
    if examples.is_empty() {
        let ce = m.forward_empty()?;
        if let Some(a) = aux {
            aux_loss_share(m, a, &[], &[], 0)?;
        }
        return Ok(ShareLoss { ce, aux: None });
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
    m.tap_routers(aux.is_some());
    let logits = m.forward(&input.narrow(1, 0, t - 1)?, None, None, Logits::All);
    let taps = m.take_router_taps();
    m.tap_routers(false);
    let logits = logits?;
    // Targets and mask where the logits are (a GPU's, with --cuda).
    let dev = logits.device();
    let v = logits.dims3()?.2;
    let logp = candle_nn_log_softmax(&logits.reshape((b * (t - 1), v))?.to_dtype(DType::F32)?)?;
    let next = input.narrow(1, 1, t - 1)?.reshape((b * (t - 1), 1))?;
    let picked = logp
        .gather(&next.contiguous()?.to_device(dev)?, 1)?
        .squeeze(1)?;
    let weights = Tensor::from_slice(&mask, (b, t), dev)?
        .narrow(1, 1, t - 1)?
        .reshape(b * (t - 1))?;
    let summed = (picked * weights)?.sum_all()?.neg()?;
    let ce = (summed / global_targets.max(1) as f64)?;
    let aux = match aux {
        // The positions that predict a token of their own sequence: the same tokens whatever
        // the padding, so whatever the number of ranks.
        Some(a) => {
            let seqs: Vec<_> = examples
                .iter()
                .enumerate()
                .map(|(i, e)| i * (t - 1)..i * (t - 1) + e.ids.len().saturating_sub(1))
                .collect();
            aux_loss_share(m, a, &taps, &seqs, b * (t - 1))?
        }
        None => None,
    };
    Ok(ShareLoss { ce, aux })
}

/// A rank's part of one forward's losses (scalars on the graph).
pub struct ShareLoss {
    /// Cross-entropy over the global batch's targets.
    pub ce: Tensor,
    /// The load-balancing loss, when asked for and this rank had tokens.
    pub aux: Option<Tensor>,
}

/// `log_softmax` from differentiable primitives (candle's fused softmax has no backward).
fn candle_nn_log_softmax(x: &Tensor) -> candle::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&lse)
}

/// How a step runs.
#[derive(Clone, Copy, Debug)]
pub struct StepSettings {
    pub lr: f64,
    /// Clip gradients to this global norm.
    pub max_norm: Option<f64>,
    /// The share runs as this many consecutive micro-batches whose gradients add up (gradient
    /// accumulation: the same step in less memory). Every rank runs `micro` forwards (an empty
    /// micro-batch takes part through [`Model::forward_empty`]).
    pub micro: usize,
    /// Add the model's load-balancing loss. Its expert counts are taken per micro-batch (over
    /// all ranks), so with `micro` > 1 it is the mean of the micro-batches' losses, as
    /// transformers computes it under gradient accumulation.
    pub aux: Option<AuxLoss>,
}

impl StepSettings {
    /// Learning rate `lr`; no clipping, one micro-batch, no auxiliary loss.
    pub fn new(lr: f64) -> Self {
        StepSettings {
            lr,
            max_norm: None,
            micro: 1,
            aux: None,
        }
    }
}

/// One optimiser step on this rank's `share` of the global batch. Collective on D ranks.
pub fn train_step(
    m: &Model,
    opt: &mut AdamW,
    share: &[&Example],
    s: &StepSettings,
) -> Result<StepReport> {
    let clock = std::time::Instant::now();
    let micro = s.micro.max(1);
    let aux = s.aux.map(|a| AuxLoss {
        coef: a.coef / micro as f64,
        ..a
    });
    let local_targets: usize = share.iter().map(|e| e.targets()).sum();
    let targets = m.global_count(local_targets)?;
    let tokens = m.global_count(share.iter().map(|e| e.ids.len()).sum())?;
    m.take_ep_stats();
    let params = m.trainable_params();
    let split = occult_core::analysis::ranks::RankSplit::new(share.len(), micro);
    let mut grads: Option<candle::backprop::GradStore> = None;
    let (mut loss_sum, mut aux_sum) = (0.0, 0.0);
    for k in 0..micro {
        let part = &share[split.range(k)];
        occult_core::fault::pause_point("forward", m.rank_and_size().0);
        let ShareLoss { ce, aux } = share_loss(m, part, targets, aux)?;
        loss_sum += ce.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let loss = match aux {
            Some(a) => {
                aux_sum += a.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                (ce + a)?
            }
            None => ce,
        };
        occult_core::fault::pause_point("backward", m.rank_and_size().0);
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
    let grad_norm = match s.max_norm {
        Some(n) => clip_global_norm(m, &mut grads, n)?,
        None => crate::grad_norm::global_norm(m, &grads)?,
    };
    // Every rank sees the same global loss and norm, so all refuse together, before a step
    // that would write non-finite values into the weights.
    let loss = m.sum_over_ranks(loss_sum)?;
    if !(loss.is_finite() && grad_norm.is_finite()) {
        return Err(Error::Invalid(format!(
            "the loss is {loss} and the gradient norm {grad_norm}: the model's outputs are not \
             finite (no step was taken)"
        )));
    }
    opt.step(&grads, s.lr)?;
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
        let (t, r) = touched_over_ranks(m, &s)?;
        ect_by_layer.push(ect_of(t, r));
        touched += t;
        routed += r;
    }
    Ok(StepReport {
        loss,
        aux_loss: match s.aux {
            Some(_) => Some(m.sum_over_ranks(aux_sum)?),
            None => None,
        },
        targets,
        tokens,
        grad_norm,
        lr: s.lr,
        ect: ect_of(touched, routed),
        ect_by_layer,
        ep,
        seconds: clock.elapsed().as_secs_f64(),
    })
}

/// Devices touched and tokens routed in `s`, summed over the ranks (collective).
pub(crate) fn touched_over_ranks(m: &Model, s: &occult_core::ep::StepStats) -> Result<(f64, f64)> {
    Ok((
        m.sum_over_ranks(s.devices_touched as f64)?,
        m.sum_over_ranks(s.tokens as f64)?,
    ))
}

/// E[C_T] of `touched` devices over `routed` tokens (1 when nothing was routed, as on one
/// device in the reference mode).
pub(crate) fn ect_of(touched: f64, routed: f64) -> f64 {
    if routed > 0.0 {
        touched / routed
    } else {
        1.0
    }
}
