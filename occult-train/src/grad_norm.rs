//! The global gradient norm of a model trained on D ranks, and clipping by it. Replicated
//! tensors hold the same (all-reduced) gradient on every rank and count once; each expert's
//! gradient lives on its owner and counts there (under replicas, on its first copy only). So the norm is that of one device's gradients
//! on the whole batch, and every rank computes the same value.

use crate::Result;
use candle::backprop::GradStore;
use candle::{DType, Tensor};
use occult_core::models::model::Model;

fn sum_of_squares(grads: &GradStore, params: &[(String, Tensor)]) -> Result<f64> {
    let mut total = 0.0;
    for (_, p) in params {
        if let Some(g) = grads.get(p) {
            total += g
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
    }
    Ok(total)
}

/// The global L2 norm of the gradients of `model`'s trainable tensors. Call it after
/// [`Model::all_reduce_grads`]. Collective on D ranks.
pub fn global_norm(model: &Model, grads: &GradStore) -> Result<f64> {
    let trainable = |ps: Vec<(String, Tensor)>| -> Vec<(String, Tensor)> {
        ps.into_iter().filter(|(_, t)| t.is_variable()).collect()
    };
    let replicated = sum_of_squares(grads, &trainable(model.replicated_params()))?;
    let mut experts = 0.0;
    for (p, once) in model.expert_params_once() {
        let Some(g) = grads.get(&p).filter(|_| p.is_variable()) else {
            continue;
        };
        let g = match once {
            Some(slots) => {
                let at = Tensor::from_vec(slots.clone(), slots.len(), g.device())?;
                g.index_select(&at, 0)?
            }
            None => g.clone(),
        };
        experts += g
            .to_dtype(DType::F64)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f64>()?;
    }
    let experts = model.sum_over_ranks(experts)?;
    Ok((replicated + experts).sqrt())
}

/// Scales every gradient by `max_norm / (norm + 1e-6)` when the global norm exceeds
/// `max_norm` (PyTorch's `clip_grad_norm_`). Returns the norm before clipping. Collective.
pub fn clip_global_norm(model: &Model, grads: &mut GradStore, max_norm: f64) -> Result<f64> {
    let norm = global_norm(model, grads)?;
    let scale = max_norm / (norm + 1e-6);
    if scale < 1.0 {
        for (_, p) in model.params() {
            if let Some(g) = grads.get(&p) {
                let clipped = (g * scale)?;
                grads.insert(&p, clipped);
            }
        }
    }
    Ok(norm)
}
