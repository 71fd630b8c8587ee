//! AdamW (Loshchilov and Hutter: Adam with decoupled weight decay), the same update as
//! `candle_nn::AdamW`, with two things it lacks: the learning rate is given per step (from a
//! [`crate::schedule::Schedule`]), and the state (step count and both moments of every tensor)
//! can be taken out and put back, so that a run resumed from a save continues bit-identically.
//!
//! Per tensor θ with gradient g, at step t (from 1), in f32 (f64 for f64 tensors):
//! `m = β1 m + (1 - β1) g`, `v = β2 v + (1 - β2) g²`,
//! `θ = θ (1 - lr λ) - lr (m / (1 - β1^t)) / (sqrt(v / (1 - β2^t)) + ε)`.
//! A tensor without a gradient in a step is left as it is (its moments too).
//!
//! A bf16 or f16 tensor trains on an f32 master copy that the optimiser keeps: the update is
//! applied to the master and the tensor receives it rounded. So small updates accumulate
//! instead of vanishing in the rounding (a bf16 weight near 1 cannot move by less than 2^-8),
//! as mixed-precision training does. The moments are f32 too.

use crate::{Error, Result};
use candle::backprop::GradStore;
use candle::{DType, Tensor, Var};

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
/// [`AdamW::new`]) its value in the optimiser's precision (the f32 master of a bf16 or f16
/// tensor, else the tensor) and its first and second moments.
#[derive(Clone, Debug)]
pub struct AdamWState {
    pub step: u64,
    pub values: Vec<Tensor>,
    pub moments: Vec<(Tensor, Tensor)>,
}

/// AdamW over a fixed list of trainable tensors.
pub struct AdamW {
    cfg: AdamWConfig,
    vars: Vec<Var>,
    /// The f32 master copy of each bf16 or f16 tensor.
    masters: Vec<Option<Tensor>>,
    step: u64,
    moments: Vec<(Tensor, Tensor)>,
}

/// The dtype the optimiser works in for a tensor of dtype `d`.
fn work_dtype(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

impl AdamW {
    /// An optimiser for `params` (each must be a trainable tensor), with zero moments.
    pub fn new(params: &[Tensor], cfg: AdamWConfig) -> Result<Self> {
        let mut vars = Vec::with_capacity(params.len());
        let mut masters = Vec::with_capacity(params.len());
        let mut moments = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            if !p.is_variable() {
                return Err(Error::Invalid(format!(
                    "parameter {i} (shape {:?}) is not trainable",
                    p.dims()
                )));
            }
            vars.push(Var::from_tensor(p)?);
            let work = work_dtype(p.dtype());
            masters.push(if p.dtype() == work {
                None
            } else {
                Some(p.detach().to_dtype(work)?)
            });
            let zeros = Tensor::zeros(p.dims(), work, p.device())?;
            moments.push((zeros.clone(), zeros));
        }
        Ok(AdamW {
            cfg,
            vars,
            masters,
            step: 0,
            moments,
        })
    }

    /// One update with learning rate `lr`.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        self.step += 1;
        let t = self.step as i32;
        let c = self.cfg;
        let scale_m = 1.0 / (1.0 - c.beta1.powi(t));
        let scale_v = 1.0 / (1.0 - c.beta2.powi(t));
        let tensors = self.vars.iter().zip(&mut self.masters);
        for ((var, master), (m, v)) in tensors.zip(self.moments.iter_mut()) {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let g = g.detach().to_dtype(m.dtype())?;
            let next_m = ((&*m * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
            let next_v = ((&*v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let theta = match master {
                Some(w) => w.clone(),
                None => var.as_tensor().detach(),
            };
            let decayed = (theta * (1.0 - lr * c.weight_decay))?;
            let update = (m_hat / (v_hat.sqrt()? + c.eps)?)?;
            let next = (decayed - (update * lr)?)?;
            match master {
                Some(w) => {
                    var.set(&next.to_dtype(var.dtype())?)?;
                    *w = next;
                }
                None => var.set(&next)?,
            }
            *m = next_m;
            *v = next_v;
        }
        Ok(())
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// A copy of the state (to save; later steps do not change it).
    pub fn state(&self) -> Result<AdamWState> {
        let values = self
            .vars
            .iter()
            .zip(&self.masters)
            .map(|(var, master)| match master {
                Some(w) => Ok(w.clone()),
                // The variable's storage changes with each step: copy it.
                None => var.as_tensor().detach().copy(),
            })
            .collect::<candle::Result<_>>()?;
        Ok(AdamWState {
            step: self.step,
            values,
            moments: self.moments.clone(),
        })
    }

    /// Restores a saved state, tensors included; its values and moments must match the
    /// tensors' shapes and the optimiser's precision.
    pub fn load_state(&mut self, state: AdamWState) -> Result<()> {
        let n = self.vars.len();
        if state.moments.len() != n || state.values.len() != n {
            return Err(Error::Invalid(format!(
                "the saved optimiser state holds {} tensors, the model trains {n}",
                state.moments.len(),
            )));
        }
        let saved = state.values.iter().zip(&state.moments);
        for (i, (var, (x, (m, v)))) in self.vars.iter().zip(saved).enumerate() {
            let want = (var.dims(), work_dtype(var.dtype()));
            for t in [x, m, v] {
                if (t.dims(), t.dtype()) != want {
                    return Err(Error::Invalid(format!(
                        "the saved state of tensor {i} has shape {:?} ({:?}), the optimiser \
                         works on {:?} ({:?})",
                        t.dims(),
                        t.dtype(),
                        want.0,
                        want.1
                    )));
                }
            }
        }
        // A saved state is read onto the CPU: each tensor goes to its variable's device.
        for ((var, master), x) in self.vars.iter().zip(&mut self.masters).zip(&state.values) {
            let x = x.to_device(var.device())?;
            var.set(&x.to_dtype(var.dtype())?)?;
            if master.is_some() {
                *master = Some(x);
            }
        }
        self.step = state.step;
        self.moments = state
            .moments
            .into_iter()
            .zip(&self.vars)
            .map(|((m, v), var)| Ok((m.to_device(var.device())?, v.to_device(var.device())?)))
            .collect::<candle::Result<_>>()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::Device;
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
        let saved = b.state().unwrap();
        let mut c = AdamW::new(&resumed, cfg).unwrap();
        c.load_state(saved).unwrap();
        c.step(&grads(&resumed, 2), 0.01).unwrap();
        assert_eq!(c.steps(), 3);
        assert_eq!(values(&straight), values(&resumed));
        // A state for other tensors is refused, and so is one whose values or moments alone
        // miss a tensor.
        let other = AdamW::new(&params(3)[..1], cfg).unwrap().state().unwrap();
        assert!(c.load_state(other).is_err());
        for drop_values in [true, false] {
            let mut short = c.state().unwrap();
            if drop_values {
                short.values.pop();
            } else {
                short.moments.pop();
            }
            let e = c.load_state(short).unwrap_err().to_string();
            assert!(e.contains("the model trains 2"), "{e}");
        }
    }

    #[test]
    fn bf16_tensors_train_on_f32_masters() {
        // A loss whose gradient is the same in every dtype (all ones): the bf16 run's masters
        // take exactly the f32 run's steps, and the bf16 tensors are those masters rounded,
        // though each update (1e-4) is far below bf16's resolution near 1.
        let f32s = params(4);
        let bf16s: Vec<Tensor> = f32s
            .iter()
            .map(|t| {
                let t = t
                    .detach()
                    .to_dtype(DType::BF16)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap();
                Var::from_tensor(&t.to_dtype(DType::BF16).unwrap())
                    .unwrap()
                    .as_tensor()
                    .clone()
            })
            .collect();
        for (a, b) in f32s.iter().zip(&bf16s) {
            Var::from_tensor(a)
                .unwrap()
                .set(&b.to_dtype(DType::F32).unwrap())
                .unwrap();
        }
        let sum = |ps: &[Tensor]| {
            let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
            for p in ps {
                let s = p.sum_all().unwrap().to_dtype(DType::F32).unwrap();
                loss = (loss + s).unwrap();
            }
            loss.backward().unwrap()
        };
        let mut a = AdamW::new(&f32s, AdamWConfig::default()).unwrap();
        let mut b = AdamW::new(&bf16s, AdamWConfig::default()).unwrap();
        for _ in 0..10 {
            a.step(&sum(&f32s), 1e-4).unwrap();
            b.step(&sum(&bf16s), 1e-4).unwrap();
        }
        let (sa, sb) = (a.state().unwrap(), b.state().unwrap());
        assert_eq!(values(&sa.values), values(&sb.values), "masters = f32 run");
        assert!(sb
            .moments
            .iter()
            .all(|(m, v)| m.dtype() == DType::F32 && v.dtype() == DType::F32));
        for (master, t) in sb.values.iter().zip(&bf16s) {
            let rounded = master
                .to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            assert_eq!(
                values(&[rounded]),
                values(&[t.to_dtype(DType::F32).unwrap()])
            );
        }
        // 10 updates of 1e-4 moved the masters by 1e-3; the f32 run agrees with them.
        let moved = (&sa.values[0] - &params(4)[0]).unwrap();
        let moved: Vec<f32> = moved
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(moved.iter().any(|&x| x > 5e-4));
        // A restored state brings the masters back.
        let mut c = AdamW::new(&bf16s, AdamWConfig::default()).unwrap();
        c.load_state(sb.clone()).unwrap();
        assert_eq!(values(&c.state().unwrap().values), values(&sb.values));
    }

    #[test]
    fn frozen_tensors_are_refused() {
        let t = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
        assert!(AdamW::new(&[t], AdamWConfig::default()).is_err());
    }
}
