//! Paired differences between two models scored on the same items: the difference of their
//! mean accuracy over tasks (each task's mean, then the mean of the tasks, as the quality
//! tables average), its standard error, and a percentile bootstrap 95% interval that resamples
//! the items of each task with replacement, the same draws for both models (so what the two
//! share, the items' difficulty, cancels).

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// Bootstrap resamples by default: the 2.5% and 97.5% quantiles then move by about a tenth of
/// a standard error from one seed to another.
pub const RESAMPLES: usize = 2000;

/// `a` minus `b` over the same items.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PairedDiff {
    /// Mean over tasks of (task mean of a) - (task mean of b).
    pub diff: f64,
    /// Its standard error from the items' paired differences (each task's sample variance of
    /// the per-item difference over its items, summed over tasks, over the tasks squared).
    pub stderr: f64,
    /// The bootstrap's 2.5% and 97.5% quantiles of the difference.
    pub lo: f64,
    pub hi: f64,
    pub tasks: usize,
    /// Items over all tasks.
    pub items: usize,
}

impl PairedDiff {
    /// Whether the 95% interval leaves out 0.
    pub fn excludes_zero(&self) -> bool {
        self.lo > 0.0 || self.hi < 0.0
    }
}

/// The paired difference of `a` and `b`: per task, the two models' per-item scores on the same
/// items in the same order. `resamples` bootstrap draws from `seed`.
pub fn paired_difference(
    a: &[Vec<f64>],
    b: &[Vec<f64>],
    resamples: usize,
    seed: u64,
) -> Result<PairedDiff> {
    if a.len() != b.len() || a.is_empty() {
        bail!(
            "paired scores need the same tasks on both sides ({} and {})",
            a.len(),
            b.len()
        );
    }
    let mut diffs: Vec<Vec<f64>> = Vec::with_capacity(a.len());
    for (t, (x, y)) in a.iter().zip(b).enumerate() {
        if x.len() != y.len() || x.is_empty() {
            bail!(
                "task {t}: {} and {} items; paired scores need the same items on both sides",
                x.len(),
                y.len()
            );
        }
        if x.iter().chain(y).any(|v| !v.is_finite()) {
            bail!("task {t}: a score is not finite");
        }
        diffs.push(x.iter().zip(y).map(|(p, q)| p - q).collect());
    }
    let tasks = diffs.len() as f64;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let diff = diffs.iter().map(|d| mean(d)).sum::<f64>() / tasks;
    let var_sum: f64 = diffs
        .iter()
        .map(|d| {
            let n = d.len() as f64;
            if d.len() < 2 {
                return 0.0;
            }
            let m = mean(d);
            d.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0) / n
        })
        .sum();
    let stderr = var_sum.sqrt() / tasks;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut draws: Vec<f64> = (0..resamples.max(1))
        .map(|_| {
            diffs
                .iter()
                .map(|d| {
                    let n = d.len();
                    (0..n).map(|_| d[rng.random_range(0..n)]).sum::<f64>() / n as f64
                })
                .sum::<f64>()
                / tasks
        })
        .collect();
    draws.sort_by(f64::total_cmp);
    let quantile = |q: f64| {
        let at = q * (draws.len() - 1) as f64;
        let (i, f) = (at.floor() as usize, at - at.floor());
        let next = draws[(i + 1).min(draws.len() - 1)];
        draws[i] + f * (next - draws[i])
    };
    Ok(PairedDiff {
        diff,
        stderr,
        lo: quantile(0.025),
        hi: quantile(0.975),
        tasks: diffs.len(),
        items: diffs.iter().map(Vec::len).sum(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-checked: one model right where the other is wrong on every item moves the
    /// difference by one, with no spread; the same scores differ by exactly zero.
    #[test]
    fn differences_without_spread_are_exact() {
        let ones = vec![vec![1.0; 5], vec![1.0; 3]];
        let zeros = vec![vec![0.0; 5], vec![0.0; 3]];
        let d = paired_difference(&ones, &zeros, 200, 1).unwrap();
        assert_eq!((d.diff, d.stderr, d.lo, d.hi), (1.0, 0.0, 1.0, 1.0));
        assert_eq!((d.tasks, d.items), (2, 8));
        let same = paired_difference(&ones, &ones, 200, 1).unwrap();
        assert_eq!((same.diff, same.lo, same.hi), (0.0, 0.0, 0.0));
        assert!(!same.excludes_zero() && d.excludes_zero());
    }

    /// Tasks count equally whatever their item counts: task 0 gains 1 on 1 item of 2 (0.5),
    /// task 1 nothing on 10 items: the difference is 0.25, and its standard error is that of
    /// task 0's two differences (sd 0.707 over sqrt 2) over the 2 tasks.
    #[test]
    fn tasks_count_equally_and_the_standard_error_is_hand_checked() {
        let a = vec![vec![1.0, 0.0], vec![1.0; 10]];
        let b = vec![vec![0.0, 0.0], vec![1.0; 10]];
        let d = paired_difference(&a, &b, 500, 2).unwrap();
        assert!((d.diff - 0.25).abs() < 1e-12);
        assert!((d.stderr - 0.25).abs() < 1e-12, "{}", d.stderr);
        assert!(d.lo >= 0.0 && d.hi <= 0.5 && d.lo <= d.diff && d.diff <= d.hi);
    }

    /// On many items the bootstrap interval is the normal one, diff -/+ 1.96 standard errors,
    /// to within a tenth of a standard error; and pairing cancels what both share (a shared
    /// item effect much larger than the difference leaves the interval narrow).
    #[test]
    fn the_bootstrap_agrees_with_the_normal_interval_and_pairing_helps() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..4 {
            let (mut x, mut y) = (Vec::new(), Vec::new());
            for _ in 0..1000 {
                let easy = rng.random_bool(0.5);
                x.push(f64::from(easy || rng.random_bool(0.1)));
                y.push(f64::from(easy && !rng.random_bool(0.1)));
            }
            a.push(x);
            b.push(y);
        }
        let d = paired_difference(&a, &b, RESAMPLES, 4).unwrap();
        for (got, want) in [
            (d.lo, d.diff - 1.96 * d.stderr),
            (d.hi, d.diff + 1.96 * d.stderr),
        ] {
            assert!(
                (got - want).abs() < 0.1 * d.stderr,
                "{got} vs {want}: {d:?}"
            );
        }
        // Unpaired, the two accuracies' own standard errors would give about 0.011 for the
        // difference; paired it is the spread of the few items where they disagree.
        assert!(d.stderr < 0.006, "{d:?}");
    }

    #[test]
    fn mismatched_items_are_refused() {
        assert!(paired_difference(&[vec![1.0]], &[vec![1.0, 0.0]], 10, 0).is_err());
        assert!(paired_difference(&[vec![1.0]], &[], 10, 0).is_err());
        assert!(paired_difference(&[vec![f64::NAN]], &[vec![1.0]], 10, 0).is_err());
    }
}
