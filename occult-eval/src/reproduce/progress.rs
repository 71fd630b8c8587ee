//! The stage counter on stderr (rank 0's): each stage's clock, kept for the report, and an
//! estimate of the time left. The estimate prices each stage's work (fine-tuning steps,
//! evaluated items, ...) at what it cost on a 2-core machine, scaled by how fast this machine
//! ran the stages behind it (the model stage left out: cached, committed or pre-trained, it
//! says nothing about the rest).

use super::recipe::Recipe;
use super::results::StageTime;
use std::time::Instant;

/// The stages of a run, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Model,
    Profile,
    Placements,
    Speed,
    Shaped,
    Finetune,
    Quality,
    Replicas,
    Projection,
}

impl Stage {
    const ALL: [Stage; 9] = [
        Stage::Model,
        Stage::Profile,
        Stage::Placements,
        Stage::Speed,
        Stage::Shaped,
        Stage::Finetune,
        Stage::Quality,
        Stage::Replicas,
        Stage::Projection,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Stage::Model => "the model",
            Stage::Profile => "routing profile on the calibration text",
            Stage::Placements => "placements and the E[C_T] table",
            Stage::Speed => "speed: prefill, decode and a training step, measured and projected",
            Stage::Shaped => "speed over shaped links (measured)",
            Stage::Finetune => "fine-tuning from the same start, under each routing",
            Stage::Quality => "quality on the tasks",
            Stage::Replicas => "placements with replicas (EPLB and ours)",
            Stage::Projection => "the cluster projection (cost model)",
        }
    }

    /// The short name `results.json` and the report use.
    pub fn key(self) -> &'static str {
        match self {
            Stage::Model => "model",
            Stage::Profile => "profile",
            Stage::Placements => "placements",
            Stage::Speed => "speed",
            Stage::Shaped => "shaped links",
            Stage::Finetune => "fine-tuning",
            Stage::Quality => "quality",
            Stage::Replicas => "replicas",
            Stage::Projection => "projection",
        }
    }

    /// Whether the recipe runs this stage.
    pub fn runs(self, r: &Recipe) -> bool {
        match self {
            Stage::Speed => !r.speed.skip,
            Stage::Shaped => !r.speed.skip && !r.shaped.skip,
            Stage::Finetune => !r.finetune.skip,
            Stage::Projection => !r.projection.skip,
            _ => true,
        }
    }

    /// Seconds the stage took on a 2-core machine at the recipe's sizes (the default recipe's
    /// measured costs, scaled by the work: fine-tuning tokens, evaluated items). The model
    /// stage is not priced.
    pub fn expected_seconds(self, r: &Recipe) -> f64 {
        let routings = super::stages::routings(r).len() as f64;
        let seeds = r.quality.seeds() as f64;
        match self {
            Stage::Model => 0.0,
            Stage::Profile | Stage::Placements => 1.0,
            Stage::Speed => 11.0,
            // Skipped at once without MPI; about a minute where the links are shaped.
            Stage::Shaped => {
                if cfg!(feature = "mpi") {
                    60.0
                } else {
                    0.0
                }
            }
            Stage::Finetune => {
                let tokens = (r.finetune.steps as usize
                    * r.finetune.batch_size
                    * r.finetune.seq_len.unwrap_or(128)) as f64;
                // 15 s for 150 steps of 16 x 128 tokens.
                routings * seeds * tokens * 15.0 / (150.0 * 16.0 * 128.0)
            }
            Stage::Quality => {
                let pruned = routings - 1.0;
                let standard = if r.quality.standard_served_pruned {
                    routings
                } else {
                    1.0
                };
                let finetuned = if r.finetune.skip {
                    0.0
                } else {
                    seeds * (standard + pruned)
                };
                let evaluations = routings + finetuned;
                let items = r.quality.limit.unwrap_or(1000) as f64;
                // 4.5 s for 4 tasks of 1,000 items.
                let tasks = if r.quality.tasks.is_empty() {
                    4.0
                } else {
                    r.quality.tasks.len() as f64
                };
                evaluations * tasks * items * 4.5 / 4000.0
            }
            Stage::Replicas | Stage::Projection => 8.0,
        }
    }
}

/// The stage counter: prints `[i/n] stage (s so far, about s left)` on rank 0.
pub struct Progress {
    pub clock: Instant,
    plan: Vec<(Stage, f64)>,
    current: Option<(Stage, Instant)>,
    done: Vec<StageTime>,
    root: bool,
}

impl Progress {
    pub fn new(r: &Recipe, root: bool) -> Self {
        Progress {
            clock: Instant::now(),
            plan: Stage::ALL
                .into_iter()
                .filter(|s| s.runs(r))
                .map(|s| (s, s.expected_seconds(r)))
                .collect(),
            current: None,
            done: Vec::new(),
            root,
        }
    }

    /// Closes the stage under way and starts `stage`.
    pub fn stage(&mut self, stage: Stage) {
        self.close();
        self.current = Some((stage, Instant::now()));
        if !self.root {
            return;
        }
        let at = self.plan.iter().position(|(s, _)| *s == stage);
        let left = at.map(|i| self.left(i));
        let left = match left {
            Some(s) if s >= 1.0 => format!(", about {} left", seconds_text(s)),
            _ => String::new(),
        };
        eprintln!(
            "[{}/{}] {} ({:.0} s so far{left})",
            at.map_or(self.done.len() + 1, |i| i + 1),
            self.plan.len(),
            stage.label(),
            self.clock.elapsed().as_secs_f64(),
        );
    }

    /// A line within the stage under way: `  what (i of n, about s left)`.
    pub fn item(&self, what: &str, i: usize, n: usize) {
        if !self.root {
            return;
        }
        let Some((stage, since)) = self.current else {
            eprintln!("  {what}");
            return;
        };
        let spent = since.elapsed().as_secs_f64();
        // Items of a stage cost alike: what this one's first items took, else its price.
        let per = if i > 0 {
            spent / i as f64
        } else {
            self.scale() * self.price(stage) / n.max(1) as f64
        };
        let after = self
            .plan
            .iter()
            .position(|(s, _)| *s == stage)
            .map_or(0.0, |at| self.left(at + 1));
        let left = per * (n - i) as f64 + after;
        eprintln!(
            "  {what} ({} of {n}, about {} left)",
            i + 1,
            seconds_text(left)
        );
    }

    /// Closes the last stage; every stage's time.
    pub fn finish(mut self) -> Vec<StageTime> {
        self.close();
        self.done
    }

    fn close(&mut self) {
        if let Some((stage, since)) = self.current.take() {
            self.done.push(StageTime {
                stage: stage.key().into(),
                seconds: since.elapsed().as_secs_f64(),
            });
        }
    }

    fn price(&self, stage: Stage) -> f64 {
        self.plan
            .iter()
            .find(|(s, _)| *s == stage)
            .map_or(0.0, |(_, p)| *p)
    }

    /// This machine's time over the 2-core price, from the priced stages done (1 until they
    /// add up to a few seconds).
    fn scale(&self) -> f64 {
        let (mut spent, mut priced) = (0.0, 0.0);
        for t in &self.done {
            if t.stage == Stage::Model.key() {
                continue;
            }
            if let Some((_, p)) = self.plan.iter().find(|(s, _)| s.key() == t.stage) {
                spent += t.seconds;
                priced += p;
            }
        }
        if priced < 5.0 {
            1.0
        } else {
            (spent / priced).clamp(0.25, 8.0)
        }
    }

    /// The estimate of the stages from the `at`-th of the plan on.
    fn left(&self, at: usize) -> f64 {
        self.scale()
            * self.plan[at.min(self.plan.len())..]
                .iter()
                .map(|(_, p)| p)
                .sum::<f64>()
    }
}

/// `42 s` or `3 min 5 s`.
pub fn seconds_text(s: f64) -> String {
    let s = s.round() as u64;
    if s < 90 {
        format!("{s} s")
    } else {
        format!("{} min {} s", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_recipe_is_priced_by_its_work() {
        let (r, _) = Recipe::load(None).unwrap();
        let base = Stage::Finetune.expected_seconds(&r);
        let mut twice = r.clone();
        twice.finetune.steps *= 2;
        assert!((Stage::Finetune.expected_seconds(&twice) - 2.0 * base).abs() < 1e-9);
        let mut seeds = r.clone();
        seeds.quality.seeds = Some(3);
        assert!(Stage::Quality.expected_seconds(&seeds) > Stage::Quality.expected_seconds(&r));
        let p = Progress::new(&r, false);
        let whole = p.left(0);
        assert!(whole > 0.0 && p.left(p.plan.len()) == 0.0);
        assert_eq!(seconds_text(42.4), "42 s");
        assert_eq!(seconds_text(185.0), "3 min 5 s");
    }
}
