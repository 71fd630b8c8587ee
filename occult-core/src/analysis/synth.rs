//! Synthetic routing traces for tests and demos.
//!
//! Each layer hides its experts in latent clusters (a random partition, different per layer, so
//! that no placement is right by accident). A token belongs to one cluster and its router logits
//! are `z_e + b_e + strength * [e in the token's cluster]`, with `z_e ~ N(0, 1)` per token and
//! `b_e ~ N(0, skew)` a fixed popularity bias per expert. The logits are routed with the
//! softmax-then-top-k rule. `strength = 0` and `skew = 0` give uniform-random routing: every
//! k-subset of experts is equally likely (the null case for placement).

use crate::analysis::routing::{GroupLimit, RouterRule};
use crate::analysis::trace::{LayerTrace, Trace, TraceMeta};
use crate::{bail, Result};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal, StandardNormal};
use rayon::prelude::*;

/// Everything that determines a synthetic trace.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub layers: usize,
    pub tokens: usize,
    pub seed: u64,
    /// Number of latent expert clusters per layer.
    pub clusters: usize,
    /// How much a token prefers the experts of its cluster (logit offset); 0 = no structure.
    pub strength: f32,
    /// Standard deviation of the per-expert popularity bias; 0 = equal popularity.
    pub skew: f32,
    /// Renormalise the top-k gate weights (Mixtral-style) or not (OLMoE-style).
    pub renormalize: bool,
    /// Store router logits (needed by pruning and similarity tables).
    pub with_logits: bool,
    /// Route group-limited as DeepSeek-V3 does (each token's experts from its best groups,
    /// groups scored by their two best experts); `None`: plain top-k.
    pub group_limit: Option<GroupLimit>,
}

impl SynthConfig {
    /// OLMoE-shaped defaults: 64 experts, top-8, 16 layers, clustered routing.
    pub fn olmoe_like(tokens: usize, seed: u64) -> Self {
        SynthConfig {
            num_experts: 64,
            top_k: 8,
            layers: 16,
            tokens,
            seed,
            clusters: 8,
            strength: 2.0,
            skew: 0.3,
            renormalize: false,
            with_logits: true,
            group_limit: None,
        }
    }

    /// The null case: uniform-random routing.
    pub fn uniform(mut self) -> Self {
        self.strength = 0.0;
        self.skew = 0.0;
        self
    }

    pub fn validate(&self) -> Result<()> {
        crate::analysis::trace::check_experts_top_k(self.num_experts, self.top_k)
            .map_err(|m| crate::Error::invalid(format!("synthetic trace: {m}")))?;
        let values = self
            .tokens
            .saturating_mul(self.layers)
            .saturating_mul(if self.with_logits {
                self.num_experts
            } else {
                self.top_k
            });
        if values > 1 << 31 {
            bail!(
                "synthetic trace: {} layers x {} tokens is too large to hold in memory{}",
                self.layers,
                self.tokens,
                if self.with_logits {
                    " with router logits (try --no-logits)"
                } else {
                    ""
                }
            );
        }
        if self.layers == 0 {
            bail!("synthetic trace: --layers must be at least 1");
        }
        if self.clusters == 0 || self.clusters > self.num_experts {
            bail!(
                "synthetic trace: --clusters = {} must be in 1..={}",
                self.clusters,
                self.num_experts
            );
        }
        if !(self.strength.is_finite() && self.strength >= 0.0) {
            bail!("synthetic trace: --strength must be a finite number >= 0");
        }
        if !(self.skew.is_finite() && self.skew >= 0.0) {
            bail!("synthetic trace: --skew must be a finite number >= 0");
        }
        if self.group_limit.is_some() {
            let rule = RouterRule {
                group_limit: self.group_limit,
                ..RouterRule::softmax_topk(self.num_experts, self.top_k, self.renormalize)
            };
            rule.validate()
                .map_err(|e| crate::Error::invalid(format!("synthetic trace: {e}")))?;
        }
        Ok(())
    }
}

/// Generates the trace; `on_layer` is called once per finished layer (for progress bars).
pub fn synth_trace(cfg: &SynthConfig, on_layer: &(dyn Fn() + Sync)) -> Result<Trace> {
    cfg.validate()?;
    let layers: Vec<LayerTrace> = (0..cfg.layers)
        .into_par_iter()
        .map(|layer| {
            let l = synth_layer(cfg, layer);
            on_layer();
            l
        })
        .collect();
    let mut extra = std::collections::BTreeMap::new();
    extra.insert(
        "synth".into(),
        format!(
            "clusters={} strength={} skew={} seed={} renormalize={}{}",
            cfg.clusters,
            cfg.strength,
            cfg.skew,
            cfg.seed,
            cfg.renormalize,
            cfg.group_limit.map_or(String::new(), |g| format!(
                " groups={} topk_groups={}",
                g.num_groups, g.topk_groups
            ))
        ),
    );
    Ok(Trace {
        meta: TraceMeta {
            num_experts: cfg.num_experts,
            top_k: cfg.top_k,
            model: Some("synthetic".into()),
            data: None,
            num_ranks: None,
            extra,
        },
        layers,
    })
}

/// The latent cluster of each expert in one layer: a random partition into near-equal parts.
pub fn latent_clusters(num_experts: usize, clusters: usize, rng: &mut impl Rng) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..num_experts).collect();
    perm.shuffle(rng);
    let mut cluster_of = vec![0; num_experts];
    for (i, &e) in perm.iter().enumerate() {
        cluster_of[e] = i * clusters / num_experts;
    }
    cluster_of
}

/// The random stream of one layer: independent per layer, so that layers can be generated in
/// parallel reproducibly. Its first use is [`latent_clusters`], so tests can recover the
/// planted partition of a layer.
pub fn layer_rng(seed: u64, layer: usize) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed ^ (layer as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn synth_layer(cfg: &SynthConfig, layer: usize) -> LayerTrace {
    let e = cfg.num_experts;
    let mut rng = layer_rng(cfg.seed, layer);
    let cluster_of = latent_clusters(e, cfg.clusters, &mut rng);
    let bias: Vec<f32> = if cfg.skew > 0.0 {
        let d = Normal::new(0.0f32, cfg.skew).expect("skew validated");
        (0..e).map(|_| d.sample(&mut rng)).collect()
    } else {
        vec![0.0; e]
    };
    let rule = RouterRule {
        group_limit: cfg.group_limit,
        ..RouterRule::softmax_topk(e, cfg.top_k, cfg.renormalize)
    };
    let mut ids = Vec::with_capacity(cfg.tokens * cfg.top_k);
    let mut weights = Vec::with_capacity(cfg.tokens * cfg.top_k);
    let mut logits_all = Vec::with_capacity(if cfg.with_logits { cfg.tokens * e } else { 0 });
    let mut logits = vec![0.0f32; e];
    for _ in 0..cfg.tokens {
        let c = rng.random_range(0..cfg.clusters);
        for (x, (&b, &ce)) in logits.iter_mut().zip(bias.iter().zip(&cluster_of)) {
            let z: f32 = StandardNormal.sample(&mut rng);
            *x = z + b + if ce == c { cfg.strength } else { 0.0 };
        }
        let s = rule.route(&logits);
        ids.extend_from_slice(&s.ids);
        weights.extend_from_slice(&s.weights);
        if cfg.with_logits {
            logits_all.extend_from_slice(&logits);
        }
    }
    LayerTrace {
        layer,
        tokens: cfg.tokens,
        topk_ids: ids,
        topk_weights: Some(weights),
        router_logits: cfg.with_logits.then_some(logits_all),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(seed: u64) -> SynthConfig {
        SynthConfig {
            num_experts: 16,
            top_k: 4,
            layers: 2,
            tokens: 300,
            seed,
            clusters: 4,
            strength: 3.0,
            skew: 0.2,
            renormalize: false,
            with_logits: true,
            group_limit: None,
        }
    }

    #[test]
    fn same_seed_same_trace_and_valid() {
        let a = synth_trace(&small(7), &|| {}).unwrap();
        let b = synth_trace(&small(7), &|| {}).unwrap();
        let c = synth_trace(&small(8), &|| {}).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        a.validate("synth").unwrap();
    }

    #[test]
    fn strong_clusters_keep_tokens_inside_one_cluster() {
        let mut cfg = small(1);
        cfg.strength = 8.0;
        let t = synth_trace(&cfg, &|| {}).unwrap();
        // With a huge offset, each token's k experts all come from one 4-expert cluster; so the
        // co-activation graph splits into 4 cliques: every expert co-occurs with exactly 3 others.
        let l = &t.layers[0];
        let mut co = vec![[false; 16]; 16];
        for tk in 0..l.tokens {
            let ids = l.ids(tk, 4);
            for &a in ids {
                for &b in ids {
                    co[a as usize][b as usize] = a != b;
                }
            }
        }
        for row in &co {
            assert_eq!(row.iter().filter(|&&x| x).count(), 3);
        }
    }
}
