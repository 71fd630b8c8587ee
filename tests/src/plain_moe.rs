//! An independent single-device MoE forward, written from the models' definition in plain f64
//! loops over the raw weights: softmax router, top-k (ties to the lower id), collaboration
//! pruning by either rule, gate weights (renormalised, scaled), SwiGLU experts
//! `down(silu(gate x) * up x)`, and shared experts with Qwen's sigmoid gate. It calls nothing
//! of occult-core's router, pruner or expert math, and is the oracle that the candle reference
//! (and through it every EP mode, backend and placement) is held to.

use occult_core::analysis::pruning::{PruneLimit, PruneRule};

/// One MoE layer's weights, row-major, as plain slices.
pub struct PlainMoe<'a> {
    pub hidden: usize,
    pub intermediate: usize,
    pub experts: usize,
    pub top_k: usize,
    pub renormalize: bool,
    pub scaling_factor: f64,
    /// `[E, H]`.
    pub router: &'a [f32],
    /// `[E, I, H]`, `[E, I, H]`, `[E, H, I]`.
    pub gate: &'a [f32],
    pub up: &'a [f32],
    pub down: &'a [f32],
    /// Shared MLP `[S, H]`, `[S, H]`, `[H, S]`, and the optional sigmoid gate `[H]`.
    pub shared: Option<PlainShared<'a>>,
    /// Collaboration pruning: rule, device limit, placement `[E]`, and the similarity table
    /// `[E, E]` (the similarity rule's input).
    pub prune: Option<PlainPrune<'a>>,
}

pub struct PlainShared<'a> {
    pub width: usize,
    pub gate_proj: &'a [f32],
    pub up_proj: &'a [f32],
    pub down_proj: &'a [f32],
    pub gate: Option<&'a [f32]>,
}

pub struct PlainPrune<'a> {
    pub rule: PruneRule,
    pub limit: PruneLimit,
    pub device_of_expert: &'a [u32],
    pub similarity: &'a [f32],
}

/// The layer's output `[T, H]` and, per token, whether its routing is ambiguous: two router
/// logits that decide it lie closer than float rounding can separate (1e-5), so that an f32
/// implementation may legitimately choose otherwise. Callers skip such tokens.
pub struct PlainOutput {
    pub out: Vec<f32>,
    pub ambiguous: Vec<bool>,
}

const TIE: f64 = 1e-5;

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

fn silu(z: f64) -> f64 {
    z / (1.0 + (-z).exp())
}

/// `down(silu(gate x) * up x)` with `gate`, `up` `[n, H]` and `down` `[H, n]`.
fn swiglu(x: &[f32], gate: &[f32], up: &[f32], down: &[f32], n: usize) -> Vec<f64> {
    let h = x.len();
    let act: Vec<f64> = (0..n)
        .map(|j| silu(dot(x, &gate[j * h..(j + 1) * h])) * dot(x, &up[j * h..(j + 1) * h]))
        .collect();
    (0..h)
        .map(|o| (0..n).map(|j| down[o * n + j] as f64 * act[j]).sum())
        .collect()
}

/// Experts in descending `score` order among `allowed`, ties to the lower id; the first `k`.
fn best(score: &[f64], k: usize, allowed: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..score.len()).filter(|&e| allowed(e)).collect();
    ids.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
    ids.truncate(k);
    ids
}

impl PlainMoe<'_> {
    /// The forward of tokens `x` `[T, H]`.
    pub fn forward(&self, x: &[f32]) -> PlainOutput {
        let (h, e, k) = (self.hidden, self.experts, self.top_k);
        let tokens = x.len() / h;
        let mut out = Vec::with_capacity(tokens * h);
        let mut ambiguous = Vec::with_capacity(tokens);
        for t in 0..tokens {
            let xt = &x[t * h..(t + 1) * h];
            let logits: Vec<f64> = (0..e)
                .map(|j| dot(xt, &self.router[j * h..(j + 1) * h]))
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let total: f64 = exps.iter().sum();
            let probs: Vec<f64> = exps.iter().map(|p| p / total).collect();

            let ranked = best(&logits, k, |_| true);
            let chosen = match &self.prune {
                None => ranked.clone(),
                Some(p) => self.pruned(p, &ranked, &logits, &probs),
            };
            // Unpruned, only the k-th against the (k+1)-th logit decides; pruned, the order
            // of all of them may.
            let mut sorted = logits.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let close = |i: usize| i + 1 < e && sorted[i] - sorted[i + 1] < TIE;
            // Under a node limit, the sums that rank nodes and devices may tie as closely.
            let groups_close = match &self.prune {
                Some(p) => group_scores_close(p, &probs),
                None => false,
            };
            ambiguous.push(match self.prune {
                None => close(k - 1),
                Some(_) => (0..e).any(close) || groups_close,
            });

            let mut weights: Vec<f64> = chosen.iter().map(|&j| probs[j]).collect();
            if self.renormalize {
                let sum: f64 = weights.iter().sum();
                weights.iter_mut().for_each(|w| *w /= sum);
            }
            weights.iter_mut().for_each(|w| *w *= self.scaling_factor);

            let mut y = vec![0.0f64; h];
            let i = self.intermediate;
            for (&j, &w) in chosen.iter().zip(&weights) {
                let ye = swiglu(
                    xt,
                    &self.gate[j * i * h..(j + 1) * i * h],
                    &self.up[j * i * h..(j + 1) * i * h],
                    &self.down[j * h * i..(j + 1) * h * i],
                    i,
                );
                y.iter_mut().zip(ye).for_each(|(a, b)| *a += w * b);
            }
            if let Some(s) = &self.shared {
                let ys = swiglu(xt, s.gate_proj, s.up_proj, s.down_proj, s.width);
                let scale = s.gate.map_or(1.0, |g| 1.0 / (1.0 + (-dot(xt, g)).exp()));
                y.iter_mut().zip(ys).for_each(|(a, b)| *a += scale * b);
            }
            out.extend(y.iter().map(|&v| v as f32));
        }
        PlainOutput { out, ambiguous }
    }

    /// Collaboration pruning of one token's top-k (`ranked`, best first), from the rules'
    /// definitions. Under a device limit N the allowed devices are the first N distinct devices
    /// met walking the top-k best first; a token on no more devices keeps its choice. Under a
    /// node limit M (nodes of G), a token on at most M nodes (and at most N devices in each,
    /// when N is given) keeps its choice; otherwise the allowed nodes are the M whose two best
    /// experts' probabilities sum highest (ties: lower node), and in each the N devices whose
    /// two best do (ties: lower device). The router rule re-picks the top-k among experts on
    /// allowed devices; the similarity rule keeps the allowed choices and replaces each other
    /// one, best first, by the most similar (ties: lower id) allowed expert not yet chosen.
    fn pruned(
        &self,
        p: &PlainPrune,
        ranked: &[usize],
        logits: &[f64],
        probs: &[f64],
    ) -> Vec<usize> {
        let dev = |j: usize| p.device_of_expert[j];
        let mut devices: Vec<u32> = Vec::new();
        for &j in ranked {
            if !devices.contains(&dev(j)) {
                devices.push(dev(j));
            }
        }
        let allowed: Vec<u32> = match p.limit {
            PruneLimit::Devices(n) => {
                if devices.len() <= n {
                    return ranked.to_vec();
                }
                devices.truncate(n);
                devices
            }
            PruneLimit::Nodes {
                devices_per_node: g,
                max_nodes,
                devices_in_node,
            } => {
                let node = |d: u32| d as usize / g;
                let mut nodes: Vec<usize> = devices.iter().map(|&d| node(d)).collect();
                nodes.sort_unstable();
                nodes.dedup();
                let crowded = nodes.iter().any(|&n| {
                    let here = devices.iter().filter(|&&d| node(d) == n).count();
                    devices_in_node.is_some_and(|cap| here > cap)
                });
                if nodes.len() <= max_nodes && !crowded {
                    return ranked.to_vec();
                }
                let (node_score, device_score) = group_scores(p, probs);
                let mut by_node: Vec<usize> = (0..node_score.len()).collect();
                by_node.sort_by(|&a, &b| node_score[b].total_cmp(&node_score[a]).then(a.cmp(&b)));
                let mut allowed = Vec::new();
                for &n in by_node.iter().take(max_nodes) {
                    let mut in_node: Vec<u32> = ((n * g) as u32..((n + 1) * g) as u32).collect();
                    in_node.sort_by(|&a, &b| {
                        device_score[b as usize]
                            .total_cmp(&device_score[a as usize])
                            .then(a.cmp(&b))
                    });
                    allowed.extend(in_node.into_iter().take(devices_in_node.unwrap_or(g)));
                }
                allowed
            }
        };
        let ok = |j: usize| allowed.contains(&dev(j));
        match p.rule {
            PruneRule::Router => best(logits, self.top_k, ok),
            PruneRule::Similarity => {
                let e = self.experts;
                let mut chosen: Vec<usize> = ranked.iter().copied().filter(|&j| ok(j)).collect();
                for &x in ranked.iter().filter(|&&j| !ok(j)) {
                    let mut sub: Option<usize> = None;
                    for y in (0..e).filter(|&y| ok(y) && !chosen.contains(&y)) {
                        if sub.is_none_or(|s| p.similarity[x * e + y] > p.similarity[x * e + s]) {
                            sub = Some(y);
                        }
                    }
                    chosen.push(sub.expect("allowed devices hold at least k experts"));
                }
                chosen
            }
        }
    }
}

/// The cosine table of router-logit columns over tokens `x` `[T, H]`, in f64:
/// `S[a][b] = <l_a, l_b> / (|l_a| |l_b|)`, 0 where a column is all zero.
pub fn plain_similarity(x: &[f32], router: &[f32], hidden: usize, experts: usize) -> Vec<f64> {
    let tokens = x.len() / hidden;
    let logit = |t: usize, j: usize| {
        dot(
            &x[t * hidden..(t + 1) * hidden],
            &router[j * hidden..(j + 1) * hidden],
        )
    };
    let cols: Vec<Vec<f64>> = (0..experts)
        .map(|j| (0..tokens).map(|t| logit(t, j)).collect())
        .collect();
    let inner = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let mut s = vec![0.0; experts * experts];
    for a in 0..experts {
        for b in 0..experts {
            let n = (inner(&cols[a], &cols[a]) * inner(&cols[b], &cols[b])).sqrt();
            s[a * experts + b] = if n > 0.0 {
                inner(&cols[a], &cols[b]) / n
            } else {
                0.0
            };
        }
    }
    s
}

/// The sum of the two best probabilities of each node's and each device's experts (a node
/// limit's ranking); empty under a device limit.
fn group_scores(p: &PlainPrune, probs: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let PruneLimit::Nodes {
        devices_per_node: g,
        ..
    } = p.limit
    else {
        return (Vec::new(), Vec::new());
    };
    let devices = p
        .device_of_expert
        .iter()
        .map(|&d| d as usize + 1)
        .max()
        .unwrap_or(0);
    let top2 = |members: Vec<f64>| {
        let mut m = members;
        m.sort_by(|a, b| b.total_cmp(a));
        m.iter().take(2).sum::<f64>()
    };
    let of = |keep: &dyn Fn(usize) -> bool| {
        top2(
            (0..probs.len())
                .filter(|&j| keep(p.device_of_expert[j] as usize))
                .map(|j| probs[j])
                .collect(),
        )
    };
    let device_score = (0..devices).map(|d| of(&|x| x == d)).collect();
    let node_score = (0..devices.div_ceil(g))
        .map(|n| of(&|x| x / g == n))
        .collect();
    (node_score, device_score)
}

/// Whether two node (or device) scores lie closer than float rounding can separate.
fn group_scores_close(p: &PlainPrune, probs: &[f64]) -> bool {
    let (nodes, devices) = group_scores(p, probs);
    let close = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(|a, b| b.total_cmp(a));
        s.windows(2).any(|w| w[0] - w[1] < TIE)
    };
    close(&nodes) || close(&devices)
}
