//! AdamW (Loshchilov and Hutter: Adam with decoupled weight decay), the same update as
//! `candle_nn::AdamW`, with two things it lacks: the learning rate is given per step (from a
//! [`crate::schedule::Schedule`]), and the state (step count and both moments of every tensor)
//! can be taken out and put back, so that a run resumed from a save continues bit-identically.
//!
//! Per tensor θ with gradient g, at step t (from 1), in the tensor's dtype:
//! `m = β1 m + (1 - β1) g`, `v = β2 v + (1 - β2) g²`,
//! `θ = θ (1 - lr λ) - lr (m / (1 - β1^t)) / (sqrt(v / (1 - β2^t)) + ε)`.
//! A tensor without a gradient in a step is left as it is (its moments too).

use crate::{Error, Result};
use candle::backprop::GradStore;
use candle::{Tensor, Var};

/// AdamW's hyper-parameters (the learning rate comes with each step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// PyTorch's and candle's defaults, with Hugging Face's weight decay of 0.
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// The optimiser's state: steps taken, and per tensor (in the order given to
/// [`AdamW::new`]) its first and second moments.
#[derive(Clone, Debug)]
pub struct AdamWState {
    pub step: u64,
    pub moments: Vec<(Tensor, Tensor)>,
}

/// AdamW over a fixed list of trainable tensors.
pub struct AdamW {
    cfg: AdamWConfig,
    vars: Vec<Var>,
    state: AdamWState,
}

impl AdamW {
    /// An optimiser for `params` (each must be a trainable tensor), with zero moments.
    pub fn new(params: &[Tensor], cfg: AdamWConfig) -> Result<Self> {
        let mut vars = Vec::with_capacity(params.len());
        let mut moments = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            if !p.is_variable() {
                return Err(Error::Invalid(format!(
                    "parameter {i} (shape {:?}) is not trainable",
                    p.dims()
                )));
            }
            vars.push(Var::from_tensor(p)?);
            moments.push((p.zeros_like()?, p.zeros_like()?));
        }
        Ok(AdamW {
            cfg,
            vars,
            state: AdamWState { step: 0, moments },
        })
    }

    /// One update with learning rate `lr`.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        self.state.step += 1;
        let t = self.state.step as i32;
        let c = self.cfg;
        let scale_m = 1.0 / (1.0 - c.beta1.powi(t));
        let scale_v = 1.0 / (1.0 - c.beta2.powi(t));
        for (var, (m, v)) in self.vars.iter().zip(self.state.moments.iter_mut()) {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let g = g.detach();
            let next_m = ((&*m * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
            let next_v = ((&*v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let decayed = (var.as_tensor().detach() * (1.0 - lr * c.weight_decay))?;
            let update = (m_hat / (v_hat.sqrt()? + c.eps)?)?;
            var.set(&(decayed - (update * lr)?)?)?;
            *m = next_m;
            *v = next_v;
        }
        Ok(())
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.state.step
    }

    /// A copy of the state (to save).
    pub fn state(&self) -> AdamWState {
        self.state.clone()
    }

    /// Restores a saved state; the moments must match the tensors' shapes and dtypes.
    pub fn load_state(&mut self, state: AdamWState) -> Result<()> {
        if state.moments.len() != self.vars.len() {
            return Err(Error::Invalid(format!(
                "the saved optimiser state holds {} tensors, the model trains {}",
                state.moments.len(),
                self.vars.len()
            )));
        }
        for (i, (var, (m, v))) in self.vars.iter().zip(&state.moments).enumerate() {
            let want = (var.dims(), var.dtype());
            if (m.dims(), m.dtype()) != want || (v.dims(), v.dtype()) != want {
                return Err(Error::Invalid(format!(
                    "the saved moments of tensor {i} have shape {:?} ({:?}), the tensor {:?} \
                     ({:?})",
                    m.dims(),
                    m.dtype(),
                    var.dims(),
                    var.dtype()
                )));
            }
        }
        self.state = state;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::{DType, Device};
    use candle_nn::Optimizer;

    fn params(seed: u64) -> Vec<Tensor> {
        use rand::{Rng, SeedableRng};
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        [(3usize, 4usize), (5, 1)]
            .iter()
            .map(|&(a, b)| {
                let data: Vec<f32> = (0..a * b).map(|_| r.random_range(-1.0..1.0)).collect();
                let t = Tensor::from_vec(data, (a, b), &Device::Cpu).unwrap();
                Var::from_tensor(&t).unwrap().as_tensor().clone()
            })
            .collect()
    }

    /// A loss whose gradients differ per tensor and per step.
    fn grads(ps: &[Tensor], step: usize) -> GradStore {
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
        for (i, p) in ps.iter().enumerate() {
            let w = (p.sqr().unwrap() * (0.5 + i as f64 + step as f64)).unwrap();
            loss = (loss + (w.sum_all().unwrap() + p.sum_all().unwrap()).unwrap()).unwrap();
        }
        loss.backward().unwrap()
    }

    fn values(ps: &[Tensor]) -> Vec<Vec<f32>> {
        ps.iter()
            .map(|p| p.flatten_all().unwrap().to_vec1().unwrap())
            .collect()
    }

    #[test]
    fn matches_candle_nn_adamw() {
        let cfg = AdamWConfig {
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let ours = params(1);
        let theirs = params(1);
        let mut a = AdamW::new(&ours, cfg).unwrap();
        let vars: Vec<Var> = theirs
            .iter()
            .map(|t| Var::from_tensor(t).unwrap())
            .collect();
        let mut b = candle_nn::AdamW::new(
            vars,
            candle_nn::ParamsAdamW {
                lr: 0.05,
                beta1: cfg.beta1,
                beta2: cfg.beta2,
                eps: cfg.eps,
                weight_decay: cfg.weight_decay,
            },
        )
        .unwrap();
        for step in 0..4 {
            a.step(&grads(&ours, step), 0.05).unwrap();
            b.step(&grads(&theirs, step)).unwrap();
        }
        for (x, y) in values(&ours).iter().zip(values(&theirs)) {
            for (p, q) in x.iter().zip(&y) {
                assert!((p - q).abs() <= 1e-6, "{p} vs {q}");
            }
        }
        assert_ne!(values(&ours), values(&params(1)), "the parameters moved");
    }

    #[test]
    fn a_restored_state_continues_bit_identically() {
        let cfg = AdamWConfig::default();
        let straight = params(2);
        let mut a = AdamW::new(&straight, cfg).unwrap();
        for step in 0..3 {
            a.step(&grads(&straight, step), 0.01).unwrap();
        }
        let resumed = params(2);
        let mut b = AdamW::new(&resumed, cfg).unwrap();
        for step in 0..2 {
            b.step(&grads(&resumed, step), 0.01).unwrap();
        }
        // A fresh optimiser over the same tensors, given the saved state, takes step 3.
        let saved = b.state();
        let mut c = AdamW::new(&resumed, cfg).unwrap();
        c.load_state(saved).unwrap();
        c.step(&grads(&resumed, 2), 0.01).unwrap();
        assert_eq!(c.steps(), 3);
        assert_eq!(values(&straight), values(&resumed));
        // A state for other tensors is refused.
        let other = AdamW::new(&params(3)[..1], cfg).unwrap().state();
        assert!(c.load_state(other).is_err());
    }

    #[test]
    fn frozen_tensors_are_refused() {
        let t = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
        assert!(AdamW::new(&[t], AdamWConfig::default()).is_err());
    }
}
