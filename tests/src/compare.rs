//! Comparing tensors in the tests: the largest difference, and the scale to judge it against.

use candle::Tensor;

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
