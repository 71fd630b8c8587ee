//! Comparing tensors in the tests: the largest difference, and the scale to judge it against;
//! and the next-token loss the gradient tests differentiate.

use candle::{Tensor, D};

/// Mean negative log-likelihood of `targets` `[T]` (u32) under `logits` `[T, V]`, through the
/// unfused log-softmax (candle's fused softmax has no backward).
pub fn next_token_loss(logits: &Tensor, targets: &Tensor) -> Tensor {
    candle_nn::ops::log_softmax(logits, D::Minus1)
        .unwrap()
        .gather(&targets.unsqueeze(1).unwrap(), 1)
        .unwrap()
        .mean_all()
        .unwrap()
        .neg()
        .unwrap()
}

/// The largest absolute difference between `a` and `b` (f32, same device).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    scale(&(a - b).unwrap())
}

/// The mean absolute difference between `a` and `b` (f32, same device).
pub fn mean_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .mean_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The largest absolute value in `a` (f32).
pub fn scale(a: &Tensor) -> f32 {
    a.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}
