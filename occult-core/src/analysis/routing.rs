//! Router rules: turning one token's router logits into its top-k experts and gate weights,
//! following the rules of the supported model families.
//!
//! | family | scores | selection | weights |
//! |---|---|---|---|
//! | OLMoE, Qwen1.5/2-MoE, DeepSeek-MoE v1 | softmax | top-k | probabilities as they are |
//! | Mixtral, Qwen3-MoE | softmax | top-k | renormalised over the k chosen |
//! | DeepSeek-V2 | softmax | group-limited top-k (group score = max) | optional renormalisation, scaling |
//! | DeepSeek-V3 | sigmoid | group-limited top-k on score + bias (group score = sum of top 2) | renormalised, scaling |
//!
//! Ties are broken deterministically: the lower expert id (or group id) wins.

use crate::{bail, Result};
use serde::{Deserialize, Serialize};

/// How router logits become scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Scoring {
    /// Softmax over all experts.
    #[default]
    Softmax,
    /// Independent sigmoid per expert (DeepSeek-V3).
    Sigmoid,
}

/// How a group of experts is scored when routing is group-limited.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum GroupScore {
    /// The best expert score in the group (DeepSeek-V2 `group_limited_greedy`).
    Max,
    /// The sum of the two best expert scores in the group (DeepSeek-V3 `noaux_tc`).
    Top2Sum,
}

/// Group-limited routing: pick `topk_groups` of `num_groups` expert groups, then the top-k
/// experts inside them. Experts are grouped contiguously: group g holds experts
/// `g * E / num_groups .. (g + 1) * E / num_groups`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupLimit {
    pub num_groups: usize,
    pub topk_groups: usize,
    pub score: GroupScore,
}

/// A complete router rule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterRule {
    pub num_experts: usize,
    pub top_k: usize,
    pub scoring: Scoring,
    /// Divide the k chosen weights by their sum.
    pub renormalize: bool,
    /// Multiplies the final gate weights (DeepSeek's `routed_scaling_factor`; 1 elsewhere).
    pub scaling_factor: f32,
    pub group_limit: Option<GroupLimit>,
    /// Added to the scores for *selection only* (DeepSeek-V3's `e_score_correction_bias`).
    pub selection_bias: Option<Vec<f32>>,
}

/// Each MoE layer's router rule: one rule for every layer, with a layer's own selection bias
/// where the model's routers carry one (`e_score_correction_bias`: DeepSeek-V3, GLM-4.5), which
/// a routing trace does not hold.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerRouters {
    pub rule: RouterRule,
    pub selection_bias: std::collections::BTreeMap<usize, Vec<f32>>,
}

impl LayerRouters {
    /// `rule` for every layer.
    pub fn same(rule: RouterRule) -> Self {
        LayerRouters {
            rule,
            selection_bias: Default::default(),
        }
    }

    /// The rule of model layer `layer`.
    pub fn of(&self, layer: usize) -> std::borrow::Cow<'_, RouterRule> {
        match self.selection_bias.get(&layer) {
            Some(b) => {
                let mut r = self.rule.clone();
                r.selection_bias = Some(b.clone());
                std::borrow::Cow::Owned(r)
            }
            None => std::borrow::Cow::Borrowed(&self.rule),
        }
    }
}

/// One token's routing decision: experts in descending selection score, and their gate weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
}

impl RouterRule {
    /// Plain softmax-then-top-k routing (OLMoE and friends when `renormalize` is false,
    /// Mixtral and Qwen3-MoE when it is true).
    pub fn softmax_topk(num_experts: usize, top_k: usize, renormalize: bool) -> Self {
        RouterRule {
            num_experts,
            top_k,
            scoring: Scoring::Softmax,
            renormalize,
            scaling_factor: 1.0,
            group_limit: None,
            selection_bias: None,
        }
    }

    /// Checks that the rule is internally consistent.
    pub fn validate(&self) -> Result<()> {
        let e = self.num_experts;
        if e == 0 {
            bail!("router rule: num_experts must be at least 1");
        }
        if self.top_k == 0 || self.top_k > e {
            bail!("router rule: top_k = {} must be in 1..={e}", self.top_k);
        }
        if !self.scaling_factor.is_finite() {
            bail!("router rule: scaling factor must be finite");
        }
        if let Some(g) = &self.group_limit {
            if g.num_groups == 0 || !e.is_multiple_of(g.num_groups) {
                bail!(
                    "router rule: {} experts cannot be split into {} equal groups",
                    e,
                    g.num_groups
                );
            }
            if g.topk_groups == 0 || g.topk_groups > g.num_groups {
                bail!(
                    "router rule: topk_groups = {} must be in 1..={}",
                    g.topk_groups,
                    g.num_groups
                );
            }
            let per_group = e / g.num_groups;
            if g.topk_groups * per_group < self.top_k {
                bail!(
                    "router rule: {} groups of {} experts hold fewer than top_k = {} experts",
                    g.topk_groups,
                    per_group,
                    self.top_k
                );
            }
            if g.score == GroupScore::Top2Sum && per_group < 2 {
                bail!("router rule: top-2-sum group scoring needs at least 2 experts per group");
            }
        }
        if let Some(b) = &self.selection_bias {
            if b.len() != e {
                bail!(
                    "router rule: selection bias has {} entries, expected {e}",
                    b.len()
                );
            }
        }
        Ok(())
    }

    /// Gate scores of every expert (probabilities for softmax, sigmoids for sigmoid scoring).
    pub fn scores(&self, logits: &[f32]) -> Vec<f32> {
        match self.scoring {
            Scoring::Softmax => softmax(logits),
            Scoring::Sigmoid => logits.iter().map(|&x| sigmoid(x)).collect(),
        }
    }

    /// Scores used to *choose* experts: the gate scores plus the selection bias, if any.
    pub fn selection_scores(&self, scores: &[f32]) -> Vec<f32> {
        match &self.selection_bias {
            Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
            None => scores.to_vec(),
        }
    }

    /// Routes one token from its router logits.
    pub fn route(&self, logits: &[f32]) -> Selection {
        debug_assert_eq!(logits.len(), self.num_experts);
        let scores = self.scores(logits);
        let choice = self.selection_scores(&scores);
        let allowed = self.group_limit.map(|g| allowed_by_groups(&choice, &g));
        let ids = top_k_ids(&choice, self.top_k, allowed.as_deref());
        let weights = self.gate_weights(&scores, &ids);
        Selection { ids, weights }
    }

    /// Gate weights of a chosen set of experts: each keeps its own score, renormalised over
    /// the set where the model renormalises, then scaled.
    pub fn gate_weights(&self, scores: &[f32], ids: &[u32]) -> Vec<f32> {
        let mut w: Vec<f32> = ids.iter().map(|&i| scores[i as usize]).collect();
        if self.renormalize {
            let sum: f32 = w.iter().sum();
            if sum > 0.0 {
                w.iter_mut().for_each(|x| *x /= sum);
            }
        }
        if self.scaling_factor != 1.0 {
            w.iter_mut().for_each(|x| *x *= self.scaling_factor);
        }
        w
    }
}

/// Numerically stable softmax.
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut out: Vec<f32> = logits.iter().map(|&x| (x - max).exp()).collect();
    let sum: f32 = out.iter().sum();
    out.iter_mut().for_each(|x| *x /= sum);
    out
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Descending order of score, ties to the lower index.
fn by_score_desc(values: &[f32]) -> impl Fn(&u32, &u32) -> std::cmp::Ordering + '_ {
    move |&a, &b| {
        values[b as usize]
            .total_cmp(&values[a as usize])
            .then(a.cmp(&b))
    }
}

/// The `k` largest entries of `values` (among `allowed` ones, if given), best first; equal
/// values go to the lower index. Returns fewer than `k` ids only if fewer are allowed.
pub fn top_k_ids(values: &[f32], k: usize, allowed: Option<&[bool]>) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..values.len() as u32)
        .filter(|&i| allowed.is_none_or(|a| a[i as usize]))
        .collect();
    let cmp = by_score_desc(values);
    if k < ids.len() {
        ids.select_nth_unstable_by(k, &cmp);
        ids.truncate(k);
    }
    ids.sort_unstable_by(&cmp);
    ids
}

/// Sorts expert ids by descending score, ties to the lower id.
pub fn sort_by_score(ids: &mut [u32], scores: &[f32]) {
    ids.sort_unstable_by(by_score_desc(scores));
}

/// Which experts lie in the best `topk_groups` groups.
fn allowed_by_groups(choice: &[f32], g: &GroupLimit) -> Vec<bool> {
    let per = choice.len() / g.num_groups;
    let group_scores: Vec<f32> = choice
        .chunks(per)
        .map(|c| match g.score {
            GroupScore::Max => c.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            GroupScore::Top2Sum => {
                let top = top_k_ids(c, 2, None);
                top.iter().map(|&i| c[i as usize]).sum()
            }
        })
        .collect();
    let groups = top_k_ids(&group_scores, g.topk_groups, None);
    let mut allowed = vec![false; choice.len()];
    for gid in groups {
        let start = gid as usize * per;
        allowed[start..start + per]
            .iter_mut()
            .for_each(|a| *a = true);
    }
    allowed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_go_to_lower_id() {
        let v = [1.0, 3.0, 3.0, 2.0, 3.0];
        assert_eq!(top_k_ids(&v, 2, None), vec![1, 2]);
        assert_eq!(top_k_ids(&v, 5, None), vec![1, 2, 4, 3, 0]);
    }

    #[test]
    fn softmax_topk_without_and_with_renormalisation() {
        let logits = [0.0f32, 2.0, 1.0, -1.0];
        let p = softmax(&logits);
        let plain = RouterRule::softmax_topk(4, 2, false).route(&logits);
        assert_eq!(plain.ids, vec![1, 2]);
        assert!((plain.weights[0] - p[1]).abs() < 1e-7);
        assert!((plain.weights[1] - p[2]).abs() < 1e-7);
        let renorm = RouterRule::softmax_topk(4, 2, true).route(&logits);
        let s = p[1] + p[2];
        assert!((renorm.weights[0] - p[1] / s).abs() < 1e-6);
        assert!((renorm.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn scaling_factor_multiplies_weights() {
        let mut r = RouterRule::softmax_topk(4, 2, true);
        r.scaling_factor = 2.5;
        let s = r.route(&[0.0, 2.0, 1.0, -1.0]);
        assert!((s.weights.iter().sum::<f32>() - 2.5).abs() < 1e-5);
    }

    #[test]
    fn group_limited_max_picks_inside_best_groups() {
        // 8 experts, 4 groups of 2. Group 3 has the single best expert; group 0 the next.
        let logits = [2.0, 1.9, 0.0, 0.1, 0.2, 0.3, 3.0, -5.0];
        let mut r = RouterRule::softmax_topk(8, 3, false);
        r.group_limit = Some(GroupLimit {
            num_groups: 4,
            topk_groups: 2,
            score: GroupScore::Max,
        });
        r.validate().unwrap();
        let s = r.route(&logits);
        // Allowed: groups 3 (6,7) and 0 (0,1). Top-3 among them: 6, 0, 1.
        assert_eq!(s.ids, vec![6, 0, 1]);
    }

    #[test]
    fn group_limited_top2sum_with_bias_selects_on_biased_scores_but_weights_unbiased() {
        let logits = [0.0f32, 0.0, 0.0, 0.0, 1.0, -3.0, 0.5, 0.5];
        let mut r = RouterRule::softmax_topk(8, 2, true);
        r.scoring = Scoring::Sigmoid;
        r.group_limit = Some(GroupLimit {
            num_groups: 4,
            topk_groups: 1,
            score: GroupScore::Top2Sum,
        });
        // Group 2 sums to 0.73 + 0.047; group 3 sums to 2 * 0.62 = 1.24: group 3 wins.
        r.validate().unwrap();
        let s = r.route(&logits);
        assert_eq!(s.ids, vec![6, 7]);
        assert!((s.weights[0] - 0.5).abs() < 1e-6);
        // A bias on expert 0 moves group 0 ahead; weights still come from unbiased scores.
        let mut bias = vec![0.0; 8];
        bias[0] = 2.0;
        r.selection_bias = Some(bias);
        let s = r.route(&logits);
        assert_eq!(s.ids, vec![0, 1]);
        assert!((s.weights[0] - 0.5).abs() < 1e-6);
    }

    #[test]
    fn invalid_rules_are_rejected() {
        assert!(RouterRule::softmax_topk(4, 5, false).validate().is_err());
        assert!(RouterRule::softmax_topk(4, 0, false).validate().is_err());
        let mut r = RouterRule::softmax_topk(6, 2, false);
        r.group_limit = Some(GroupLimit {
            num_groups: 4,
            topk_groups: 1,
            score: GroupScore::Max,
        });
        assert!(r.validate().is_err());
    }
}
