//! lm-evaluation-harness's multiple-choice metrics: `acc` (the highest log-likelihood is the
//! gold one, first index on ties), `acc_norm` (the same after dividing each log-likelihood by
//! its choice's length in characters), their mean over items with the sample standard error,
//! and the pooled aggregate of a group of subtasks (MMLU).

use super::task::Metric;
use serde::Serialize;

/// The first index of the largest value (numpy's `argmax`).
pub fn argmax_first(v: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// `(acc, acc_norm)` of one item.
pub fn item_metrics(lls: &[f64], chars: &[usize], gold: usize) -> (f64, f64) {
    let acc = (argmax_first(lls) == gold) as u8 as f64;
    let norm: Vec<f64> = lls
        .iter()
        .zip(chars)
        .map(|(l, &c)| l / c.max(1) as f64)
        .collect();
    let acc_norm = (argmax_first(&norm) == gold) as u8 as f64;
    (acc, acc_norm)
}

/// One item's value of every metric.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ItemScores {
    pub acc: f64,
    pub acc_norm: f64,
}

impl ItemScores {
    /// The scores of an item from its choices' log-likelihoods and lengths in characters.
    pub fn of(lls: &[f64], chars: &[usize], gold: usize) -> Self {
        let (acc, acc_norm) = item_metrics(lls, chars, gold);
        ItemScores { acc, acc_norm }
    }

    /// The item's value of metric `m`.
    pub fn get(self, m: Metric) -> f64 {
        match m {
            Metric::Acc => self.acc,
            Metric::AccNorm => self.acc_norm,
        }
    }
}

/// A metric's value over items.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Estimate {
    pub value: f64,
    /// `None` for a single item.
    pub stderr: Option<f64>,
    pub n: usize,
}

/// The mean and its standard error (sample standard deviation with n - 1, over sqrt(n)).
pub fn mean_stderr(xs: &[f64]) -> Estimate {
    let n = xs.len();
    let mean = xs.iter().sum::<f64>() / n.max(1) as f64;
    let stderr = (n > 1).then(|| {
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        (var / n as f64).sqrt()
    });
    Estimate {
        value: mean,
        stderr,
        n,
    }
}

/// A group's aggregate, weighted by size (the micro-average), with the harness's pooled
/// standard error `sqrt(sum_i (n_i - 1) n_i se_i^2 / (N - k) / N)`.
pub fn pooled(parts: &[Estimate]) -> Estimate {
    let n: usize = parts.iter().map(|p| p.n).sum();
    let k = parts.len();
    let value = parts.iter().map(|p| p.value * p.n as f64).sum::<f64>() / n.max(1) as f64;
    // The harness reports a group's stderr as N/A if any member's is.
    let stderr = (n > k && parts.iter().all(|p| p.stderr.is_some())).then(|| {
        let s: f64 = parts
            .iter()
            .map(|p| (p.n as f64 - 1.0) * p.n as f64 * p.stderr.unwrap_or(0.0).powi(2))
            .sum();
        (s / (n - k) as f64 / n as f64).sqrt()
    });
    Estimate { value, stderr, n }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acc_norm_divides_by_characters() {
        // Choice 1 has the higher total; per character, -6/12 = -0.5 beats -5/4 = -1.25.
        let lls = [-6.0, -5.0];
        assert_eq!(item_metrics(&lls, &[12, 4], 0), (0.0, 1.0));
        assert_eq!(item_metrics(&lls, &[12, 4], 1), (1.0, 0.0));
        // -6/2 = -3 loses to -5/10 = -0.5: both metrics pick choice 1.
        assert_eq!(item_metrics(&lls, &[2, 10], 1), (1.0, 1.0));
        // Ties go to the first index.
        assert_eq!(item_metrics(&[-1.0, -1.0], &[1, 1], 0), (1.0, 1.0));
        let s = ItemScores::of(&lls, &[12, 4], 0);
        assert_eq!((s.get(Metric::Acc), s.get(Metric::AccNorm)), (0.0, 1.0));
    }

    #[test]
    fn stderr_and_pooling_hand_checked() {
        let e = mean_stderr(&[1.0, 0.0, 1.0, 1.0]);
        assert_eq!(e.value, 0.75);
        // sqrt(p(1-p)/(n-1)) for 0/1 scores.
        assert!((e.stderr.unwrap() - (0.75f64 * 0.25 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(mean_stderr(&[1.0]).stderr, None);
        let a = mean_stderr(&[1.0, 0.0]);
        let b = mean_stderr(&[1.0, 1.0, 1.0, 0.0]);
        let p = pooled(&[a, b]);
        assert_eq!(p.n, 6);
        assert!((p.value - 4.0 / 6.0).abs() < 1e-12);
        let want = ((1.0 * 2.0 * a.stderr.unwrap().powi(2)
            + 3.0 * 4.0 * b.stderr.unwrap().powi(2))
            / 4.0
            / 6.0)
            .sqrt();
        assert!((p.stderr.unwrap() - want).abs() < 1e-12);
    }
}
