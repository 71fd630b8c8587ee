//! Helpers shared by the unit tests.

use candle::{DType, Tensor};

/// Every element of `t`, in row-major order, as f64.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .expect("a tensor of numbers")
}
