//! The learning-rate schedule: linear warm-up to the peak over `warmup` steps (step s of the
//! warm-up uses `peak * (s + 1) / warmup`, so no step has a rate of 0), then cosine decay
//! towards `min_ratio * peak`, which it would reach at step `total` (one past the last).

use crate::{Error, Result};

/// A warm-up + cosine schedule over `total` optimiser steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    pub peak: f64,
    pub warmup: u64,
    pub total: u64,
    /// The final learning rate as a fraction of the peak.
    pub min_ratio: f64,
}

impl Schedule {
    /// Checks the settings: a positive finite peak, at least one step, warm-up within the run,
    /// a floor in [0, 1].
    pub fn new(peak: f64, warmup: u64, total: u64, min_ratio: f64) -> Result<Self> {
        if !(peak.is_finite() && peak > 0.0) {
            return Err(Error::Invalid(format!(
                "the learning rate must be a positive number, got {peak}"
            )));
        }
        if total == 0 {
            return Err(Error::Invalid("the run needs at least one step".into()));
        }
        if warmup > total {
            return Err(Error::Invalid(format!(
                "{warmup} warm-up steps are more than the run's {total}"
            )));
        }
        if !(0.0..=1.0).contains(&min_ratio) {
            return Err(Error::Invalid(format!(
                "the final learning-rate ratio must be in [0, 1], got {min_ratio}"
            )));
        }
        Ok(Schedule {
            peak,
            warmup,
            total,
            min_ratio,
        })
    }

    /// The learning rate of step `step` (0-based: the first update is step 0).
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let decay_steps = (self.total - self.warmup).max(1);
        let progress = ((step - self.warmup) as f64 / decay_steps as f64).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.peak * (self.min_ratio + (1.0 - self.min_ratio) * cosine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_up_then_cosine_hand_checked() {
        let s = Schedule::new(1e-3, 4, 14, 0.1).unwrap();
        // Warm-up: 1/4, 2/4, 3/4, 4/4 of the peak.
        assert_eq!(s.lr(0), 0.25e-3);
        assert_eq!(s.lr(3), 1e-3);
        // Step 4 starts the decay at the peak; halfway (step 9) is the mean of peak and floor.
        assert!((s.lr(4) - 1e-3).abs() < 1e-15);
        assert!((s.lr(9) - 0.55e-3).abs() < 1e-15);
        // The last step reaches the floor, and later steps stay there.
        assert!((s.lr(14) - 1e-4).abs() < 1e-15);
        assert!((s.lr(100) - 1e-4).abs() < 1e-15);
        // Monotone after the warm-up.
        assert!((4..14).all(|t| s.lr(t + 1) <= s.lr(t)));
        // No warm-up: the first step is at the peak.
        assert_eq!(Schedule::new(2.0, 0, 10, 0.0).unwrap().lr(0), 2.0);
    }

    #[test]
    fn bad_settings_are_named() {
        for (peak, warmup, total, min) in [
            (0.0, 0, 10, 0.0),
            (f64::NAN, 0, 10, 0.0),
            (1e-3, 0, 0, 0.0),
            (1e-3, 11, 10, 0.0),
            (1e-3, 1, 10, 1.5),
        ] {
            assert!(Schedule::new(peak, warmup, total, min).is_err());
        }
    }
}
