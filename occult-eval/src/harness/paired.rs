//! Paired differences between two models scored on the same items: the difference of their
//! mean accuracy over tasks (each task's mean, then the mean of the tasks, as the quality
//! tables average), its standard error, and a percentile bootstrap 95% interval that resamples
//! the items of each task with replacement, the same draws for both models (so what the two
//! share, the items' difficulty, cancels). Over several seeds (fine-tuning runs scored on the
//! same items) the difference is pooled: the seeds' mean, with the seeds drawn too.

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// Bootstrap resamples by default: the 2.5% and 97.5% quantiles then move by about a tenth of
/// a standard error from one seed to another.
pub const RESAMPLES: usize = 2000;

/// `a` minus `b` over the same items, pooled over one or more seeds (fine-tuning runs).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PairedDiff {
    /// Mean over seeds of: the mean over tasks of (task mean of a) - (task mean of b).
    pub diff: f64,
    /// Its standard error. The items' part: per task, the cluster-robust variance of the mean
    /// per-item difference (averaged over seeds), items asking the same question forming one
    /// cluster (each item its own when all differ: the sample variance over the items), summed
    /// over tasks, over the tasks squared. With several seeds, plus the seeds' part: the
    /// variance of the seeds' differences over the seed count (which counts the items' noise
    /// twice where it differs from seed to seed, so it errs wide).
    pub stderr: f64,
    /// The 95% interval: the bootstrap's 2.5% and 97.5% quantiles; with several seeds widened,
    /// where it is narrower, to diff -/+ t x stderr (Student's t at `df`).
    pub lo: f64,
    pub hi: f64,
    /// The bootstrap's own 2.5% and 97.5% quantiles, before any widening.
    pub bootstrap: (f64, f64),
    pub tasks: usize,
    /// Items over all tasks.
    pub items: usize,
    /// Distinct questions over all tasks (the clusters the bootstrap draws).
    pub questions: usize,
    /// Each seed's difference, in seed order (one entry for one seed).
    pub per_seed: Vec<f64>,
    /// The sample standard deviation of `per_seed` (with two seeds or more).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed_sd: Option<f64>,
    /// The Welch-Satterthwaite degrees of freedom of `stderr` with several seeds (the items'
    /// part counted as exact, the seeds' with seeds - 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub df: Option<f64>,
}

impl PairedDiff {
    /// Whether the 95% interval leaves out 0.
    pub fn excludes_zero(&self) -> bool {
        self.lo > 0.0 || self.hi < 0.0
    }
}

/// Per task, per-item scores; one such set per model.
pub type TaskScores = [Vec<f64>];

/// The paired difference of `a` and `b`: per task, the two models' per-item scores on the same
/// items in the same order, each item its own question. `resamples` bootstrap draws from
/// `seed`.
pub fn paired_difference(
    a: &TaskScores,
    b: &TaskScores,
    resamples: usize,
    seed: u64,
) -> Result<PairedDiff> {
    pooled_difference(&[(a, b)], None, resamples, seed)
}

/// Which question each item of a task asks, as indices 0..count in first-seen order, and
/// how many items ask each.
struct Clusters {
    of_item: Vec<usize>,
    size: Vec<f64>,
}

impl Clusters {
    fn of(keys: Option<&[u64]>, n: usize) -> Self {
        let of_item: Vec<usize> = match keys {
            None => (0..n).collect(),
            Some(keys) => {
                let mut index: std::collections::HashMap<u64, usize> = Default::default();
                keys.iter()
                    .map(|k| {
                        let next = index.len();
                        *index.entry(*k).or_insert(next)
                    })
                    .collect()
            }
        };
        let mut size = vec![0.0; of_item.iter().max().map_or(0, |&c| c + 1)];
        for &c in &of_item {
            size[c] += 1.0;
        }
        Clusters { of_item, size }
    }

    fn count(&self) -> usize {
        self.size.len()
    }

    /// Per cluster, the sum of `values` over its items.
    fn sums(&self, values: &[f64]) -> Vec<f64> {
        let mut sum = vec![0.0; self.count()];
        for (&c, v) in self.of_item.iter().zip(values) {
            sum[c] += v;
        }
        sum
    }
}

/// The mean and the sample standard deviation of `v` (0 for one value).
pub fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, var.sqrt())
}

/// Student's t quantile at 0.975 with `df` degrees of freedom (the normal's past 1e6).
pub fn t975(df: f64) -> f64 {
    use statrs::distribution::{ContinuousCDF, Normal, StudentsT};
    if !df.is_finite() || df > 1e6 {
        return Normal::standard().inverse_cdf(0.975);
    }
    StudentsT::new(0.0, 1.0, df.max(1.0))
        .expect("positive degrees of freedom")
        .inverse_cdf(0.975)
}

/// A standard error with an exact part `items_se` and, with several seeds, a part from the
/// `per_seed` values (their variance over their count): the standard error and, with several
/// seeds, the Welch-Satterthwaite degrees of freedom (infinite where the seeds agree) with the
/// 95% half-width (Student's t at those degrees of freedom).
fn seeded_error(items_se: f64, per_seed: &[f64]) -> (f64, Option<(f64, f64)>) {
    let s = per_seed.len() as f64;
    if per_seed.len() < 2 {
        return (items_se, None);
    }
    let seeds_var = mean_sd(per_seed).1.powi(2) / s;
    let se = items_se.hypot(seeds_var.sqrt());
    let total = items_se * items_se + seeds_var;
    let df = if seeds_var > 0.0 {
        total * total / (seeds_var * seeds_var / (s - 1.0))
    } else {
        f64::INFINITY
    };
    (se, Some((df, t975(df) * se)))
}

/// The `q` quantile of sorted values, interpolated linearly between neighbours (numpy's
/// default).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let at = q * (sorted.len() - 1) as f64;
    let (i, f) = (at.floor() as usize, at - at.floor());
    let next = sorted[(i + 1).min(sorted.len() - 1)];
    sorted[i] + f * (next - sorted[i])
}

/// The paired difference pooled over seeds: `runs` holds, for each seed, the two models'
/// scores on the same items (the same items for every seed); the figures of
/// [`pooled_mean`] of their item-by-item differences.
pub fn pooled_difference(
    runs: &[(&TaskScores, &TaskScores)],
    questions: Option<&[Vec<u64>]>,
    resamples: usize,
    seed: u64,
) -> Result<PairedDiff> {
    let mut diffs: Vec<Vec<Vec<f64>>> = Vec::with_capacity(runs.len());
    for (s, (a, b)) in runs.iter().enumerate() {
        diffs.push(item_differences(a, b).with_context(|| format!("seed {s}"))?);
    }
    let of_seeds: Vec<&TaskScores> = diffs.iter().map(Vec::as_slice).collect();
    pooled_mean(&of_seeds, questions, resamples, seed)
}

/// The mean over tasks of per-item values (a model's scores, or two models' differences),
/// pooled over seeds: `runs` holds each seed's values by task, on the same items. `questions`
/// gives, per task, a key per item: items with the same key ask the same question (asked
/// again with other wrong answers, say) and are drawn together; `None`, every item its own.
/// The figure (`diff`) is the seeds' mean; the bootstrap draws the seeds with replacement and,
/// per task, the questions with replacement (the same for every seed drawn). With one seed it
/// is the plain bootstrap; with several, a bootstrap of a few seeds understates their spread,
/// so the interval is widened, where narrower, to Student's t times the standard error.
pub fn pooled_mean(
    runs: &[&TaskScores],
    questions: Option<&[Vec<u64>]>,
    resamples: usize,
    seed: u64,
) -> Result<PairedDiff> {
    let Some(first) = runs.first() else {
        bail!("pooled figures need at least one seed");
    };
    let shape: Vec<usize> = first.iter().map(Vec::len).collect();
    if shape.is_empty() || shape.contains(&0) {
        bail!("pooled figures need tasks with items ({shape:?} items per task)");
    }
    if let Some(s) = runs
        .iter()
        .position(|d| d.iter().map(Vec::len).collect::<Vec<_>>() != shape)
    {
        bail!(
            "seed {s} scores other items than seed 0 (items per task {:?} and {shape:?}); \
             pooled figures need the same items for every seed",
            runs[s].iter().map(Vec::len).collect::<Vec<_>>()
        );
    }
    if let Some((s, t)) = runs.iter().enumerate().find_map(|(s, d)| {
        d.iter()
            .position(|t| t.iter().any(|v| !v.is_finite()))
            .map(|t| (s, t))
    }) {
        bail!("seed {s}, task {t}: a score is not finite");
    }
    if let Some(q) = questions {
        let given: Vec<usize> = q.iter().map(Vec::len).collect();
        if given != shape {
            bail!("question keys for {given:?} items per task, scores for {shape:?}");
        }
    }
    let clusters: Vec<Clusters> = (0..shape.len())
        .map(|t| Clusters::of(questions.map(|q| q[t].as_slice()), shape[t]))
        .collect();
    let (seeds, tasks) = (runs.len(), shape.len() as f64);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let per_seed: Vec<f64> = runs
        .iter()
        .map(|d| d.iter().map(|t| mean(t)).sum::<f64>() / tasks)
        .collect();
    let (diff, sd) = mean_sd(&per_seed);
    // The items' part, from the seeds' mean value on each item, cluster-robust by question.
    let items_sum: f64 = clusters
        .iter()
        .enumerate()
        .map(|(t, c)| {
            let (n, g) = (shape[t] as f64, c.count() as f64);
            if c.count() < 2 {
                return 0.0;
            }
            let d: Vec<f64> = (0..shape[t])
                .map(|i| runs.iter().map(|s| s[t][i]).sum::<f64>() / seeds as f64)
                .collect();
            let m = mean(&d);
            let spread: f64 = c
                .sums(&d)
                .iter()
                .zip(&c.size)
                .map(|(s, k)| (s - k * m).powi(2))
                .sum();
            spread * g / (g - 1.0) / (n * n)
        })
        .sum();
    let (stderr, students) = seeded_error(items_sum.sqrt() / tasks, &per_seed);
    // Per task and seed, each question's sum of values.
    let sums: Vec<Vec<Vec<f64>>> = clusters
        .iter()
        .enumerate()
        .map(|(t, c)| runs.iter().map(|d| c.sums(&d[t])).collect())
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut on_items = vec![0.0; seeds];
    let mut tot = vec![0.0; seeds];
    let mut draws: Vec<f64> = (0..resamples.max(1))
        .map(|_| {
            // Each seed's figure on one draw of the questions, then a draw of the seeds.
            on_items.fill(0.0);
            for (t, c) in clusters.iter().enumerate() {
                tot.fill(0.0);
                let mut n = 0.0;
                for _ in 0..c.count() {
                    let q = rng.random_range(0..c.count());
                    n += c.size[q];
                    for (x, sum) in tot.iter_mut().zip(&sums[t]) {
                        *x += sum[q];
                    }
                }
                for (on, x) in on_items.iter_mut().zip(&tot) {
                    *on += x / n;
                }
            }
            (0..seeds)
                .map(|_| {
                    on_items[if seeds > 1 {
                        rng.random_range(0..seeds)
                    } else {
                        0
                    }]
                })
                .sum::<f64>()
                / (seeds as f64 * tasks)
        })
        .collect();
    draws.sort_by(f64::total_cmp);
    let bootstrap = (quantile(&draws, 0.025), quantile(&draws, 0.975));
    let (mut lo, mut hi) = bootstrap;
    if let Some((_, half)) = students {
        lo = lo.min(diff - half);
        hi = hi.max(diff + half);
    }
    Ok(PairedDiff {
        diff,
        stderr,
        lo,
        hi,
        bootstrap,
        tasks: shape.len(),
        items: shape.iter().sum(),
        questions: clusters.iter().map(Clusters::count).sum(),
        per_seed,
        seed_sd: (seeds > 1).then_some(sd),
        df: students.map(|(df, _)| df),
    })
}

/// Per task, `a - b` item by item, refusing unequal items.
fn item_differences(a: &TaskScores, b: &TaskScores) -> Result<Vec<Vec<f64>>> {
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
        diffs.push(x.iter().zip(y).map(|(p, q)| p - q).collect());
    }
    Ok(diffs)
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
        assert_eq!((d.per_seed.clone(), d.seed_sd), (vec![1.0], None));
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

    /// Values of one seed on `tasks` tasks of `questions` questions each, asked 1 to 5 times
    /// (unequal clusters), with each question's items sharing a question effect; and the keys.
    fn clustered(seed: u64, tasks: usize, questions: usize) -> (Vec<Vec<f64>>, Vec<Vec<u64>>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (mut values, mut keys) = (Vec::new(), Vec::new());
        for _ in 0..tasks {
            let (mut v, mut k) = (Vec::new(), Vec::new());
            for q in 0..questions {
                let effect: f64 = rng.random_range(-0.5..0.5);
                for _ in 0..rng.random_range(1..=5) {
                    v.push(effect + rng.random_range(-0.2..0.2));
                    k.push(q as u64);
                }
            }
            values.push(v);
            keys.push(k);
        }
        (values, keys)
    }

    /// On unequal clusters (questions asked 1 to 5 times, each with its own effect) the
    /// bootstrap, which draws whole questions, spreads as the cluster-robust standard error
    /// says: its quantiles are diff -/+ 1.96 standard errors to within a tenth of one. Drawing
    /// items instead of questions would narrow it to about half.
    #[test]
    fn the_bootstrap_on_unequal_clusters_agrees_with_the_cluster_robust_error() {
        let (values, keys) = clustered(11, 3, 300);
        let d = pooled_mean(&[&values], Some(&keys), 20_000, 12).unwrap();
        let (lo, hi) = d.bootstrap;
        for (got, want) in [
            (lo, d.diff - 1.96 * d.stderr),
            (hi, d.diff + 1.96 * d.stderr),
        ] {
            assert!(
                (got - want).abs() < 0.1 * d.stderr,
                "{got} vs {want}: {d:?}"
            );
        }
    }

    /// Several identical seeds are one seed: the questions are drawn once for all seeds, so
    /// the bootstrap's quantiles (before any widening) are the one seed's to within a tenth of
    /// a standard error. Drawing the questions anew for each seed would narrow them by about
    /// the square root of the seed count.
    #[test]
    fn identical_seeds_give_the_one_seed_bootstrap() {
        let (values, keys) = clustered(13, 2, 200);
        let one = pooled_mean(&[&values], Some(&keys), 20_000, 14).unwrap();
        let three = pooled_mean(&[&values, &values, &values], Some(&keys), 20_000, 14).unwrap();
        assert_eq!((three.diff, three.stderr), (one.diff, one.stderr));
        for (a, b) in [
            (one.bootstrap.0, three.bootstrap.0),
            (one.bootstrap.1, three.bootstrap.1),
        ] {
            assert!(
                (a - b).abs() < 0.1 * one.stderr,
                "{a} vs {b}: {one:?} {three:?}"
            );
        }
    }

    /// Pooled over seeds: seeds that agree give the one seed's difference and no spread;
    /// seeds that disagree (one loses 0.2, the other nothing) give their mean,
    /// the seeds' sd, and an interval that spans both (the seed draws alone give 0, -0.1 or
    /// -0.2), which one seed's interval would not.
    #[test]
    fn pooling_over_seeds_carries_the_spread_between_runs() {
        let a = vec![vec![1.0, 0.0, 1.0, 1.0, 0.0], vec![1.0; 5]];
        let b = vec![vec![0.0, 0.0, 1.0, 1.0, 0.0], vec![1.0; 5]];
        let one = paired_difference(&a, &b, 500, 5).unwrap();
        let two = pooled_difference(&[(&a, &b), (&a, &b)], None, 500, 5).unwrap();
        assert_eq!((two.diff, two.stderr), (one.diff, one.stderr));
        assert_eq!(two.seed_sd, Some(0.0));
        let plus = vec![vec![1.0; 5]];
        let gain = vec![vec![1.0, 1.0, 1.0, 1.0, 0.0]];
        let p = pooled_difference(&[(&gain, &plus), (&plus, &plus)], None, 2000, 6).unwrap();
        assert!((p.diff + 0.1).abs() < 1e-12, "{p:?}");
        assert_eq!(p.per_seed.len(), 2);
        let sd = p.seed_sd.unwrap();
        assert!((sd - 0.2 / 2f64.sqrt()).abs() < 1e-12, "{sd}");
        assert!(p.lo <= -0.2 + 1e-12 && p.hi >= -1e-12, "{p:?}");
        // The seeds' part is in the standard error: at least sd / sqrt(2).
        assert!(p.stderr >= sd / 2f64.sqrt() - 1e-12, "{p:?}");
        // Seeds must score the same items.
        let short = vec![vec![1.0; 4], vec![1.0; 5]];
        assert!(pooled_difference(&[(&a, &b), (&short, &short)], None, 10, 0).is_err());
        assert!(pooled_difference(&[], None, 10, 0).is_err());
    }

    /// Items that ask the same question again are drawn together: five questions each asked
    /// twice (scored alike both times) give a standard error about sqrt 2 larger than ten
    /// distinct items with the same scores would; keys that all differ change nothing.
    #[test]
    fn repeated_questions_are_one_cluster() {
        let a = vec![vec![1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]];
        let b = vec![vec![0.0; 10]];
        let plain = paired_difference(&a, &b, 2000, 7).unwrap();
        let distinct: Vec<Vec<u64>> = vec![(0..10).collect()];
        let same = pooled_difference(&[(&a, &b)], Some(&distinct), 2000, 7).unwrap();
        assert_eq!(plain, same);
        let twice: Vec<Vec<u64>> = vec![vec![0, 0, 1, 1, 2, 2, 3, 3, 4, 4]];
        let c = pooled_difference(&[(&a, &b)], Some(&twice), 2000, 7).unwrap();
        assert_eq!((c.diff, c.questions, c.items), (plain.diff, 5, 10));
        // Cluster-robust: 5/4 * sum over questions of (2 d_q - 2 m)^2 / 10^2, with d_q 1 on 3
        // of 5 questions and m = 0.6: 5/4 * 4 * (3 * 0.16 + 2 * 0.36) / 100 = 0.06.
        assert!((c.stderr - 0.06f64.sqrt()).abs() < 1e-12, "{c:?}");
        assert!(c.stderr > 1.3 * plain.stderr, "{c:?} {plain:?}");
        assert!(c.hi - c.lo > plain.hi - plain.lo);
        let short: Vec<Vec<u64>> = vec![vec![0; 9]];
        assert!(pooled_difference(&[(&a, &b)], Some(&short), 10, 0).is_err());
    }

    /// Three seeds that disagree (-0.1, 0, +0.1 on every item, no noise between items): the
    /// interval holds at least Student's t with 2 degrees of freedom times sd / sqrt 3 (a
    /// bootstrap of three seeds alone would give about +/-0.1).
    #[test]
    fn a_few_seeds_widen_the_interval_to_students_t() {
        let base = vec![vec![0.0; 10]];
        let run = |x: f64| vec![vec![x; 10]];
        let (lo, mid, hi) = (run(-0.1), run(0.0), run(0.1));
        let p =
            pooled_difference(&[(&lo, &base), (&mid, &base), (&hi, &base)], None, 2000, 8).unwrap();
        let t = t975(2.0);
        assert!((t - 4.302653).abs() < 1e-5, "{t}");
        assert_eq!(p.df, Some(2.0));
        let half = t * 0.1 / 3f64.sqrt();
        assert!(p.diff.abs() < 1e-12 && (p.stderr - 0.1 / 3f64.sqrt()).abs() < 1e-12);
        assert!(p.lo <= -half + 1e-12 && p.hi >= half - 1e-12, "{p:?}");
        assert!(!p.excludes_zero());
        // One seed's interval is the bootstrap's: 1.96 is the normal quantile.
        assert!((t975(f64::INFINITY) - 1.959964).abs() < 1e-5);
    }

    /// A model's own mean over tasks, hand-checked: task means 0.75 and 2/3 give 0.7083; the
    /// standard error is sqrt(0.25 / 4 + (1/3) / 3) / 2 = 0.2083.
    #[test]
    fn a_mean_of_scores_is_hand_checked() {
        let a = vec![vec![1.0, 0.0, 1.0, 1.0], vec![0.0, 1.0, 1.0]];
        let m = pooled_mean(&[&a], None, 500, 3).unwrap();
        assert!((m.diff - (0.75 + 2.0 / 3.0) / 2.0).abs() < 1e-12, "{m:?}");
        assert!((m.stderr - 0.25f64.mul_add(0.25, 1.0 / 9.0).sqrt() / 2.0).abs() < 1e-12);
        assert!(m.lo <= m.diff && m.diff <= m.hi && m.lo >= 0.0 && m.hi <= 1.0);
        assert!(pooled_mean(&[&[vec![f64::INFINITY]]], None, 10, 0).is_err());
    }

    #[test]
    fn mismatched_items_are_refused() {
        assert!(paired_difference(&[vec![1.0]], &[vec![1.0, 0.0]], 10, 0).is_err());
        assert!(paired_difference(&[vec![1.0]], &[], 10, 0).is_err());
        assert!(paired_difference(&[vec![f64::NAN]], &[vec![1.0]], 10, 0).is_err());
        // A task without items on both sides; no tasks; a task without items; no seeds.
        assert!(paired_difference(&[vec![]], &[vec![]], 10, 0).is_err());
        let none: Vec<Vec<f64>> = Vec::new();
        assert!(pooled_mean(&[&none], None, 10, 0).is_err());
        let empty = vec![vec![1.0], vec![]];
        assert!(pooled_mean(&[&empty], None, 10, 0).is_err());
        assert!(pooled_mean(&[], None, 10, 0).is_err());
    }

    /// Student's t at 0.975: 12.706 at 1 degree of freedom, the normal's past 1e6 (and for
    /// infinite ones; statrs gives 1.95985 for 1.95996), and still Student's at 1e6.
    #[test]
    fn students_t_is_the_normal_only_past_a_million() {
        let normal = t975(f64::INFINITY);
        assert!((normal - 1.959_964).abs() < 2e-4, "{normal}");
        assert!((t975(1.0) - 12.706_2).abs() < 1e-3, "{}", t975(1.0));
        assert_eq!(t975(2e6), normal);
        assert!(t975(1e6) != normal && (t975(1e6) - normal).abs() < 1e-3);
    }

    /// Quantiles as numpy's default: linear between neighbours, the ends exact.
    #[test]
    fn quantiles_interpolate_as_numpy() {
        let v = [0.0, 1.0, 2.0, 3.0, 10.0];
        for (q, want) in [
            (0.0, 0.0),
            (0.025, 0.1),
            (0.5, 2.0),
            (0.875, 6.5),
            (1.0, 10.0),
        ] {
            assert!(
                (quantile(&v, q) - want).abs() < 1e-12,
                "{q}: {}",
                quantile(&v, q)
            );
        }
        assert_eq!(quantile(&[4.0], 0.975), 4.0);
    }

    /// Two seeds, hand-checked. Seed A scores [1, 0, 1, 0] (mean 0.5), seed B nothing: the
    /// items' part is over the seeds' mean per item, [0.5, 0, 0.5, 0], whose variance of the
    /// mean (sample variance 1/12 over 4) is 1/48; the seeds' part is their variance (1/8) over
    /// 2, 1/16. So the standard error is sqrt(1/48 + 1/16) = sqrt(1/12), the degrees of freedom
    /// (1/12)^2 / ((1/16)^2 / 1) = 16/9, and the interval diff -/+ t(16/9) x stderr, wider
    /// than the bootstrap. The bootstrap draws both seeds each time: a draw of 1 needs A twice
    /// and all of A's items drawn as 1 (1/64 of draws), 0.75 or more 5/64, so its 97.5%
    /// quantile is 0.75; drawing seed A alone would make it 1. Identical seeds have infinite
    /// degrees of freedom; one seed has none.
    #[test]
    fn two_seeds_hand_checked() {
        let a = vec![vec![1.0, 0.0, 1.0, 0.0]];
        let b = vec![vec![0.0; 4]];
        let d = pooled_mean(&[&a, &b], None, 4000, 21).unwrap();
        assert!((d.diff - 0.25).abs() < 1e-12);
        assert!((d.stderr - (1.0f64 / 12.0).sqrt()).abs() < 1e-12, "{d:?}");
        let df = d.df.unwrap();
        assert!((df - 16.0 / 9.0).abs() < 1e-12, "{df}");
        let half = t975(16.0 / 9.0) * (1.0f64 / 12.0).sqrt();
        assert!((d.lo - (0.25 - half)).abs() < 1e-12 && (d.hi - (0.25 + half)).abs() < 1e-12);
        assert_eq!(d.bootstrap, (0.0, 0.75), "{d:?}");
        let same = pooled_mean(&[&a, &a], None, 200, 21).unwrap();
        assert_eq!(same.df, Some(f64::INFINITY));
        // Seeds that agree on items that agree: no spread anywhere, still infinite.
        let flat = pooled_mean(&[&b, &b], None, 200, 21).unwrap();
        assert_eq!((flat.stderr, flat.df), (0.0, Some(f64::INFINITY)));
        assert_eq!(pooled_mean(&[&a], None, 200, 21).unwrap().df, None);
    }
}
