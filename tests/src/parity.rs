//! The EP-layer parity check shared by the local-backend tests and the `mpi-parity` binary:
//! a deterministic fixture (weights, inputs, loss weights, placement) built from a [`Case`],
//! the single-device reference (held to [`crate::plain_moe`], the layer in plain loops), one
//! rank's EP forward and backward, and the comparisons.

use crate::plain_moe::{plain_similarity, PlainMoe, PlainPrune, PlainShared};
use candle::{Device, Tensor, Var};
use occult_core::analysis::placement::replicas::{CopyRule, ReplicaMap};
use occult_core::analysis::placement::{contiguous, random_balanced};
use occult_core::analysis::pruning::{PruneLimit, PruneRule};
use occult_core::analysis::routing::RouterRule;
use occult_core::analysis::run_key::DispatchMode;
use occult_core::analysis::similarity::SimilarityTable;
use occult_core::ep::comm::{CommStats, Communicator};
use occult_core::ep::experts::{SharedExperts, SwigluStack};
use occult_core::ep::{
    reference_forward, EpMoe, EpSettings, MoeWeights, PruneSpec, Replicas, StepStats,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

pub const H: usize = 32;
pub const I: usize = 16;

/// One configuration to check.
#[derive(Clone, Debug)]
pub struct Case {
    pub d: usize,
    pub e: usize,
    pub k: usize,
    pub random_placement: bool,
    pub shared: bool,
    pub renormalize: bool,
    /// Tokens of each rank (length d).
    pub tokens: Vec<usize>,
    pub mode: DispatchMode,
    pub prune: Option<(PruneRule, PruneLimit)>,
    pub seed: u64,
    /// The input is not trained (only router and experts get gradients).
    pub frozen_input: bool,
    /// Devices per node (two-level mode needs it; in any mode rows are then counted within and
    /// across nodes).
    pub devices_per_node: Option<usize>,
    /// A placement with replicas: this many slots per device beyond `ceil(e / d)`, copies
    /// of random experts (two on one device now and then, as EPLB packs them), chosen by
    /// the rule.
    pub replicas: Option<(usize, CopyRule)>,
}

impl Case {
    /// A random case (sizes from the grid).
    pub fn random(rng: &mut ChaCha8Rng, seed: u64) -> Case {
        let d = [1, 2, 3, 4, 8][rng.random_range(0..5)];
        let e = [8, 16, 64][rng.random_range(0..3)];
        Case::random_with(rng, seed, d, e)
    }

    /// A random case on `d` ranks with `e` experts.
    pub fn random_with(rng: &mut ChaCha8Rng, seed: u64, d: usize, e: usize) -> Case {
        let k = [1, 2, 4, 8][rng.random_range(0..4)].min(e);
        let mut tokens: Vec<usize> = (0..d).map(|_| rng.random_range(0..12)).collect();
        if d > 1 && rng.random_bool(0.3) {
            tokens[rng.random_range(0..d)] = 0;
        }
        let mode = match rng.random_range(0..3) {
            0 => DispatchMode::Occult,
            1 => DispatchMode::Standard,
            _ => DispatchMode::TwoLevel,
        };
        // Nodes of any size up to d (a short last node when it does not divide d); two-level
        // mode needs one, the others count rows by level with one half the time.
        let devices_per_node = (mode == DispatchMode::TwoLevel || rng.random_bool(0.5))
            .then(|| rng.random_range(1..=d));
        let min_cap = e / d;
        let prune = (d > 1 && rng.random_bool(0.3)).then(|| {
            let n = (1..=d).find(|n| n * min_cap >= k).unwrap_or(d);
            let rule = if rng.random_bool(0.5) {
                PruneRule::Router
            } else {
                PruneRule::Similarity
            };
            // On an even number of ranks, sometimes nodes of 2: at most M of them, and maybe
            // one device in each, as few as keep k experts.
            if d >= 4 && d.is_multiple_of(2) && rng.random_bool(0.5) {
                let nodes = d / 2;
                let one = rng.random_bool(0.5) && nodes * min_cap >= k;
                let per_node = if one { min_cap } else { 2 * min_cap };
                let m = (1..=nodes).find(|m| m * per_node >= k).unwrap_or(nodes);
                let limit = PruneLimit::Nodes {
                    devices_per_node: 2,
                    max_nodes: m,
                    devices_in_node: one.then_some(1),
                };
                return (rule, limit);
            }
            (rule, PruneLimit::Devices(n))
        });
        // Replicas from a generator of their own, so that the other draws stay as they were.
        let mut own = ChaCha8Rng::seed_from_u64(seed ^ 0x7265_706c);
        let replicas = (mode != DispatchMode::TwoLevel && prune.is_none() && own.random_bool(0.4))
            .then(|| {
                let rule = [CopyRule::Cover, CopyRule::Sglang][own.random_range(0..2)];
                (own.random_range(1..=2), rule)
            });
        Case {
            d,
            e,
            k,
            random_placement: rng.random_bool(0.5),
            shared: rng.random_bool(0.5),
            renormalize: rng.random_bool(0.5),
            tokens,
            mode,
            prune,
            seed,
            frozen_input: rng.random_bool(0.2),
            devices_per_node,
            replicas,
        }
    }

    pub fn total(&self) -> usize {
        self.tokens.iter().sum()
    }

    /// First token of each rank.
    pub fn starts(&self) -> Vec<usize> {
        self.tokens
            .iter()
            .scan(0, |s, &n| {
                let at = *s;
                *s += n;
                Some(at)
            })
            .collect()
    }
}

/// Everything a case needs, identical on every rank (built from the seed).
pub struct Fixture {
    pub case: Case,
    pub vars: Vec<Var>,
    pub w: MoeWeights,
    pub x: Vec<f32>,
    pub g: Vec<f32>,
    pub map: Vec<u32>,
    pub rule: RouterRule,
    pub prune: Option<PruneSpec>,
    /// The placement with replicas, when the case has them (`map` is then unused).
    pub replica: Option<ReplicaMap>,
}

fn randn(rng: &mut ChaCha8Rng, shape: &[usize], scale: f32) -> Var {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect();
    Var::from_vec(v, shape, &Device::Cpu).expect("cpu tensor")
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .and_then(|t| t.to_vec1())
        .expect("f32 tensor")
}

impl Fixture {
    pub fn new(case: &Case) -> Fixture {
        let c = case;
        let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
        let router = randn(&mut rng, &[c.e, H], 0.5);
        let gate = randn(&mut rng, &[c.e, I, H], 0.3);
        let up = randn(&mut rng, &[c.e, I, H], 0.3);
        let down = randn(&mut rng, &[c.e, H, I], 0.3);
        let mut vars = vec![router.clone(), gate.clone(), up.clone(), down.clone()];
        let shared = c.shared.then(|| {
            let s = [
                randn(&mut rng, &[2 * I, H], 0.3),
                randn(&mut rng, &[2 * I, H], 0.3),
                randn(&mut rng, &[H, 2 * I], 0.3),
            ];
            let g = c
                .seed
                .is_multiple_of(2)
                .then(|| randn(&mut rng, &[1, H], 0.5));
            vars.extend(s.iter().cloned());
            vars.extend(g.iter().cloned());
            SharedExperts {
                gate_proj: s[0].as_tensor().clone(),
                up_proj: s[1].as_tensor().clone(),
                down_proj: s[2].as_tensor().clone(),
                gate: g.map(|g| g.as_tensor().clone()),
            }
        });
        let experts = SwigluStack::new(
            gate.as_tensor().clone(),
            up.as_tensor().clone(),
            down.as_tensor().clone(),
        )
        .expect("shapes");
        let w = MoeWeights {
            router: router.as_tensor().clone(),
            router_bias: None,
            experts,
            shared,
        };
        let total = c.total();
        let x: Vec<f32> = (0..total * H)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let g: Vec<f32> = (0..total * H)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let map = if c.random_placement {
            random_balanced(c.e, c.d, &mut rng)
        } else {
            contiguous(c.e, c.d)
        };
        let mut rule = RouterRule::softmax_topk(c.e, c.k, c.renormalize);
        rule.scaling_factor = if c.seed.is_multiple_of(3) { 2.5 } else { 1.0 };
        let prune = c.prune.map(|(rule_kind, limit)| {
            // The similarity table comes from the router logits of the batch itself.
            let xt = Tensor::from_slice(&x, (total, H), &Device::Cpu).expect("cpu tensor");
            let logits = xt.matmul(&w.router.t().expect("2-d")).expect("matmul");
            PruneSpec {
                rule: rule_kind,
                limit,
                similarity: Some(SimilarityTable::from_logits(&flat(&logits), c.e).expect("table")),
            }
        });
        let replica = c
            .replicas
            .map(|(extra, _)| random_replicas(&mut rng, c.e, c.d, extra));
        Fixture {
            case: c.clone(),
            vars,
            w,
            x,
            g,
            map,
            rule,
            prune,
            replica,
        }
    }

    /// Outputs and gradients of a run, flattened.
    fn outcome(
        &self,
        out: &Tensor,
        x: &Var,
        grads: &candle::backprop::GradStore,
        stats: StepStats,
        comm: CommStats,
    ) -> Outcome {
        Outcome {
            out: flat(out),
            gx: grads.get(x.as_tensor()).map(flat),
            gparams: self
                .vars
                .iter()
                .map(|v| grads.get(v.as_tensor()).map(flat))
                .collect(),
            stats,
            comm,
        }
    }

    /// The single-device reference on all tokens.
    pub fn reference(&self) -> Outcome {
        let c = &self.case;
        let x = Var::from_slice(&self.x, (c.total(), H), &Device::Cpu).expect("cpu tensor");
        let prune = self.prune.as_ref().map(|p| (p, self.map.as_slice(), c.d));
        let out = reference_forward(&self.w, &self.rule, x.as_tensor(), prune).expect("reference");
        let g = Tensor::from_slice(&self.g, (c.total(), H), &Device::Cpu).expect("cpu tensor");
        let grads = (out.clone() * g)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
            .expect("reference backward");
        let outcome = self.outcome(&out, &x, &grads, StepStats::default(), CommStats::default());
        if let Err(e) = self.check_plain(&outcome.out) {
            panic!("the candle reference departs from the plain definition: {e}");
        }
        outcome
    }

    /// Holds a single-device output to [`PlainMoe`], the layer written from its definition in
    /// plain loops (tokens whose routing is a float tie are skipped). Also holds the
    /// similarity table, the similarity rule's input, to its definition.
    pub fn check_plain(&self, out: &[f32]) -> Result<(), String> {
        let c = &self.case;
        let router = flat(&self.w.router);
        let [gate, up, down] = [
            &self.w.experts.gate,
            &self.w.experts.up,
            &self.w.experts.down,
        ]
        .map(flat);
        let shared = self.w.shared.as_ref().map(|s| {
            (
                flat(&s.gate_proj),
                flat(&s.up_proj),
                flat(&s.down_proj),
                s.gate.as_ref().map(flat),
            )
        });
        let mut similarity = Vec::new();
        if let Some(table) = self.prune.as_ref().and_then(|p| p.similarity.as_ref()) {
            let plain = plain_similarity(&self.x, &router, H, c.e);
            for a in 0..c.e {
                for b in 0..c.e {
                    let (got, want) = (table.get(a, b) as f64, plain[a * c.e + b]);
                    if (got - want).abs() > 1e-5 {
                        return Err(format!("similarity [{a}][{b}] {got}, defined {want}"));
                    }
                    similarity.push(got as f32);
                }
            }
        }
        let plain = PlainMoe {
            hidden: H,
            intermediate: I,
            experts: c.e,
            top_k: c.k,
            renormalize: c.renormalize,
            scaling_factor: self.rule.scaling_factor as f64,
            router: &router,
            gate: &gate,
            up: &up,
            down: &down,
            shared: shared.as_ref().map(|(g, u, d, sg)| PlainShared {
                width: 2 * I,
                gate_proj: g,
                up_proj: u,
                down_proj: d,
                gate: sg.as_deref(),
            }),
            prune: self.prune.as_ref().map(|p| PlainPrune {
                rule: p.rule,
                limit: p.limit,
                device_of_expert: &self.map,
                similarity: &similarity,
            }),
        }
        .forward(&self.x);
        let (mut ours, mut want) = (Vec::new(), Vec::new());
        for t in (0..c.total()).filter(|&t| !plain.ambiguous[t]) {
            ours.extend_from_slice(&out[t * H..(t + 1) * H]);
            want.extend_from_slice(&plain.out[t * H..(t + 1) * H]);
        }
        close("output", &ours, &want, 1e-6)
    }

    /// The layer's settings on every rank.
    pub fn settings(&self) -> EpSettings {
        let c = &self.case;
        EpSettings {
            rule: self.rule.clone(),
            device_of_expert: self.map.clone(),
            mode: c.mode,
            prune: self.prune.clone(),
            devices_per_node: c.devices_per_node,
            replicas: self
                .replica
                .clone()
                .zip(c.replicas)
                .map(|(map, (_, rule))| Replicas { map, rule }),
        }
    }

    /// This rank's EP forward and backward on its own tokens.
    pub fn run_rank(&self, comm: &Arc<dyn Communicator>) -> occult_core::Result<Outcome> {
        let c = &self.case;
        let r = comm.rank();
        let (at, n) = (self.case.starts()[r], c.tokens[r]);
        let settings = self.settings();
        let layer = EpMoe::from_full(&self.w, settings, comm.clone())?;
        // Count only the step's exchanges (a communicator may serve several cases).
        comm.reset_stats();
        let x = Var::from_slice(&self.x[at * H..(at + n) * H], (n, H), &Device::Cpu)?;
        // A frozen input (the hidden states of frozen layers) is a plain tensor.
        let input = if c.frozen_input {
            x.as_tensor().detach()
        } else {
            x.as_tensor().clone()
        };
        let (out, stats) = layer.forward(&input)?;
        let g = Tensor::from_slice(&self.g[at * H..(at + n) * H], (n, H), &Device::Cpu)?;
        let grads = (out.clone() * g)?.sum_all()?.backward()?;
        Ok(self.outcome(&out, &x, &grads, stats, comm.stats()))
    }

    /// Checks one rank's outputs, input gradients and row counts against the reference.
    pub fn check_rank(
        &self,
        reference: &Outcome,
        rank: usize,
        got: &Outcome,
    ) -> Result<(), String> {
        let c = &self.case;
        let (at, n) = (c.starts()[rank], c.tokens[rank]);
        close(
            "output",
            &got.out,
            &reference.out[at * H..(at + n) * H],
            1e-6,
        )?;
        if c.frozen_input {
            if got.gx.is_some() {
                return Err(format!("rank {rank}: a frozen input got a gradient"));
            }
        } else {
            let gx_ref = reference
                .gx
                .as_ref()
                .map_or(&[][..], |g| &g[at * H..(at + n) * H]);
            let gx = got.gx.clone().unwrap_or_else(|| vec![0.0; n * H]);
            close("input gradient", &gx, gx_ref, 1e-6)?;
        }
        let st = &got.stats;
        // Rows counted here from the inputs alone (a plain top-k of the router logits and the
        // placement), not from anything the layer reports.
        let touched = self.devices_per_token(at, n);
        let unpruned: usize = touched.iter().sum();
        match (c.mode, c.prune) {
            (DispatchMode::Standard, _) if st.rows_sent != n * c.k => {
                return Err(format!(
                    "rank {rank}: {} rows sent, expected {} (tokens x k)",
                    st.rows_sent,
                    n * c.k
                ));
            }
            (DispatchMode::Occult, None) if st.rows_sent != unpruned => {
                return Err(format!(
                    "rank {rank}: {} rows sent, expected {unpruned} (distinct devices per token)",
                    st.rows_sent
                ));
            }
            // Pruned: each token keeps at least one device and at most the limit's; under a
            // device limit never more than it had (its devices are a subset of its own; the
            // nodes kept by a node limit may hold more of them).
            (DispatchMode::Occult, Some((_, limit))) => {
                let most: usize = match limit {
                    PruneLimit::Devices(n) => touched.iter().map(|&t| t.min(n)).sum(),
                    PruneLimit::Nodes {
                        devices_per_node: g,
                        max_nodes,
                        devices_in_node,
                    } => touched.len() * (max_nodes * devices_in_node.unwrap_or(g)).min(c.d),
                };
                if st.rows_sent < n || st.rows_sent > most {
                    return Err(format!(
                        "rank {rank}: {} rows sent, expected between {n} and {most}",
                        st.rows_sent
                    ));
                }
            }
            _ => {}
        }
        if c.prune.is_none() {
            self.check_levels(rank, got)?;
        }
        // Exchanges: slot metadata, payload, combine, then the backward ones (two-level: the
        // ids and payload across nodes, then the forwarded metadata and payload). Occult rows
        // carry the token's k gate weights; standard rows only the hidden state.
        let row_bytes = match c.mode {
            DispatchMode::Standard => (H * 4) as u64,
            DispatchMode::Occult | DispatchMode::TwoLevel => ((H + c.k) * 4) as u64,
        };
        let payloads: &[usize] = match c.mode {
            DispatchMode::TwoLevel => &[1, 3],
            _ => &[1],
        };
        let (mut sent, mut remote) = (0u64, 0u64);
        for &j in payloads {
            let payload = &got.comm.exchanges[j].bytes_to;
            sent += payload.iter().sum::<u64>();
            remote += payload
                .iter()
                .enumerate()
                .filter(|(p, _)| *p != rank)
                .map(|(_, b)| b)
                .sum::<u64>();
        }
        if sent != st.rows_sent as u64 * row_bytes
            || remote != st.remote_rows_sent as u64 * row_bytes
        {
            return Err(format!(
                "rank {rank}: the communicator counted {sent} bytes ({remote} remote), the layer \
                 {} rows ({} remote) of {row_bytes} bytes",
                st.rows_sent, st.remote_rows_sent
            ));
        }
        Ok(())
    }

    /// Unpruned cases with a node size: the rows this rank sent to each peer (per exchange, as
    /// the communicator counted them) and within and across nodes (as the layer reports them),
    /// against a count from every rank's plain top-k and the placement. Two-level: one row per
    /// (token, node) to the node's proxy (the device with the source's local index there), and
    /// from each proxy one row per device of its node that needs it.
    fn check_levels(&self, rank: usize, got: &Outcome) -> Result<(), String> {
        let c = &self.case;
        let Some(g) = c.devices_per_node else {
            return Ok(());
        };
        let node = |d: usize| d / g;
        // The proxy of `source` in `n`: the same local index, folded into a short last node.
        let proxy = |source: usize, n: usize| {
            let first = n * g;
            first + (source % g) % g.min(c.d - first)
        };
        let source_of = |t: usize| self.source_of(t);
        let hidden_rows = |j: usize| -> Vec<u64> {
            let width = match c.mode {
                DispatchMode::Standard => H,
                _ => H + c.k,
            };
            got.comm.exchanges[j]
                .bytes_to
                .iter()
                .map(|b| b / (width * 4) as u64)
                .collect()
        };
        // Rows to each peer: the first (or only) payload, and the forwarded one.
        let mut first = vec![0u64; c.d];
        let mut forwarded = vec![0u64; c.d];
        let (mut nodes_touched, mut intra, mut inter) = (0usize, 0usize, 0usize);
        for t in 0..c.total() {
            let devices = self.token_devices(t);
            let mut nodes: Vec<usize> = devices.iter().map(|&d| node(d)).collect();
            nodes.dedup();
            let s = source_of(t);
            if s == rank {
                nodes_touched += nodes.len();
            }
            match c.mode {
                DispatchMode::TwoLevel => {
                    for &n in &nodes {
                        let q = proxy(s, n);
                        if s == rank {
                            first[q] += 1;
                            inter += usize::from(q != rank);
                        }
                        if q == rank {
                            for &d in devices.iter().filter(|&&d| node(d) == n) {
                                forwarded[d] += 1;
                                intra += usize::from(d != rank);
                            }
                        }
                    }
                }
                mode if s == rank => {
                    for &d in &devices {
                        let rows = if mode == DispatchMode::Standard {
                            self.experts_on(t, d)
                        } else {
                            1
                        };
                        first[d] += rows as u64;
                        if d != rank && node(d) == node(rank) {
                            intra += rows;
                        } else if d != rank {
                            inter += rows;
                        }
                    }
                }
                _ => {}
            }
        }
        let st = &got.stats;
        let counted = (
            st.nodes_touched,
            st.intra_node_rows_sent,
            st.inter_node_rows_sent,
        );
        if counted != (nodes_touched, intra, inter) {
            return Err(format!(
                "rank {rank}: (nodes touched, rows within, rows across nodes) {counted:?}, \
                 counted from the inputs {:?}",
                (nodes_touched, intra, inter)
            ));
        }
        if hidden_rows(1) != first {
            return Err(format!(
                "rank {rank}: rows to each peer {:?}, counted from the inputs {first:?}",
                hidden_rows(1)
            ));
        }
        if c.mode == DispatchMode::TwoLevel && hidden_rows(3) != forwarded {
            return Err(format!(
                "rank {rank}: forwarded rows to each peer {:?}, counted from the inputs \
                 {forwarded:?}",
                hidden_rows(3)
            ));
        }
        Ok(())
    }

    /// Token `t`'s experts, unpruned: the top-k of its router logits in plain loops.
    fn token_experts(&self, t: usize) -> Vec<usize> {
        let c = &self.case;
        let router = flat(&self.w.router);
        let x = &self.x[t * H..(t + 1) * H];
        let mut logits: Vec<(f32, usize)> = (0..c.e)
            .map(|e| {
                let w = &router[e * H..(e + 1) * H];
                (x.iter().zip(w).map(|(a, b)| a * b).sum(), e)
            })
            .collect();
        logits.sort_by(|a, b| b.0.total_cmp(&a.0));
        logits[..c.k].iter().map(|&(_, e)| e).collect()
    }

    /// The rank token `t` starts on.
    fn source_of(&self, t: usize) -> usize {
        let starts = self.case.starts();
        (0..self.case.d)
            .rev()
            .find(|&r| starts[r] <= t)
            .unwrap_or(0)
    }

    /// The device each of token `t`'s experts is computed on, unpruned: the placement's, or
    /// under replicas the copy the case's rule picks for a token on its rank.
    fn expert_devices(&self, t: usize) -> Vec<usize> {
        let experts = self.token_experts(t);
        match (&self.replica, self.case.replicas) {
            (Some(map), Some((_, rule))) => {
                let ids: Vec<u32> = experts.iter().map(|&e| e as u32).collect();
                let mut chosen = Vec::new();
                map.choose(&ids, self.source_of(t) as u32, rule, &mut chosen);
                chosen.into_iter().map(|d| d as usize).collect()
            }
            _ => experts.iter().map(|&e| self.map[e] as usize).collect(),
        }
    }

    /// The distinct devices of token `t`'s experts, ascending.
    fn token_devices(&self, t: usize) -> Vec<usize> {
        let mut devices = self.expert_devices(t);
        devices.sort_unstable();
        devices.dedup();
        devices
    }

    /// How many of token `t`'s experts are on device `d`.
    fn experts_on(&self, t: usize, d: usize) -> usize {
        self.expert_devices(t)
            .into_iter()
            .filter(|&x| x == d)
            .count()
    }

    /// Distinct devices each of tokens `at..at + n` routes to, unpruned.
    fn devices_per_token(&self, at: usize, n: usize) -> Vec<usize> {
        (at..at + n).map(|t| self.token_devices(t).len()).collect()
    }

    /// Checks parameter gradients summed over ranks against the reference. A gradient that
    /// vanishes mathematically (the router's under k = 1 with renormalisation) is float noise on
    /// both sides, hence the floor on the scale.
    pub fn check_params(
        &self,
        reference: &Outcome,
        summed: &[Option<Vec<f32>>],
    ) -> Result<(), String> {
        // With k = 1 renormalised the gate weight is p / p = 1: the router's gradient is zero
        // only up to the rounding of terms of order one that cancel, so it is held to that
        // order, not to its own (zero) scale.
        let floor = if self.case.k == 1 && self.case.renormalize {
            1.0
        } else {
            1e-2
        };
        for (i, (r, s)) in reference.gparams.iter().zip(summed).enumerate() {
            match (r, s) {
                (Some(r), Some(s)) => close(&format!("gradient of parameter {i}"), s, r, floor)?,
                (Some(_), None) if self.case.total() > 0 => {
                    return Err(format!("parameter {i} got no gradient on any rank"))
                }
                // Without tokens the reference has no graph to the parameter, while EP keeps
                // empty paths on it (for the reverse exchanges): that gradient must be zero.
                (None, Some(s)) if s.iter().any(|&v| v != 0.0) => {
                    return Err(format!("parameter {i}: a non-zero gradient only under EP"))
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// A random placement with replicas of `e` experts on `d` devices, `ceil(e / d) + extra`
/// slots each: expert x first on device x % d, the rest copies of random experts (now and
/// then a second copy on a device that has one); random expert loads half the time.
pub fn random_replicas(rng: &mut ChaCha8Rng, e: usize, d: usize, extra: usize) -> ReplicaMap {
    let per = e.div_ceil(d) + extra;
    let mut slots: Vec<Vec<u32>> = vec![Vec::new(); d];
    for x in 0..e as u32 {
        slots[x as usize % d].push(x);
    }
    for dev in slots.iter_mut() {
        while dev.len() < per {
            let x = rng.random_range(0..e as u32);
            if !dev.contains(&x) || rng.random_bool(0.1) {
                dev.push(x);
            }
        }
    }
    let loads: Option<Vec<f64>> = rng
        .random_bool(0.5)
        .then(|| (0..e).map(|_| rng.random_range(0..20) as f64).collect());
    ReplicaMap::new(slots.concat(), e, d, loads.as_deref()).expect("a valid replica map")
}

/// Outputs, gradients and statistics of one run (reference or one rank).
pub struct Outcome {
    pub out: Vec<f32>,
    pub gx: Option<Vec<f32>>,
    pub gparams: Vec<Option<Vec<f32>>>,
    pub stats: StepStats,
    pub comm: CommStats,
}

/// Max abs error within 1e-5 of the reference's scale (bounded below by `floor`).
pub fn close(name: &str, ours: &[f32], reference: &[f32], floor: f32) -> Result<(), String> {
    close_within(name, ours, reference, floor, 1e-5)
}

/// [`close`] within `tol` of the scale.
pub fn close_within(
    name: &str,
    ours: &[f32],
    reference: &[f32],
    floor: f32,
    tol: f32,
) -> Result<(), String> {
    if ours.len() != reference.len() {
        return Err(format!(
            "{name}: {} values, reference {}",
            ours.len(),
            reference.len()
        ));
    }
    let scale = reference.iter().fold(floor, |m, x| m.max(x.abs()));
    let err = ours
        .iter()
        .zip(reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    if err / scale > tol {
        return Err(format!("{name}: max error {err} at scale {scale}"));
    }
    Ok(())
}

/// How far a bf16 run of the layer may be from the f32 reference, (largest, mean) relative to
/// the reference's scale. The mean is the check: measured on the CPU at 0.3-5e-3 over every
/// quantity of [`device_cases`]. The largest difference is loose because bf16 router logits
/// can flip a near-tie in the top-k, which changes a token's output by one expert's share
/// (measured 0.29 of the scale once).
pub const BF16_LAYER_BOUNDS: (f32, f32) = (0.5, 0.02);

/// The one-rank cases the device runs check (on the CPU in `ep_layer.rs`, on a GPU in
/// `gpu.rs`): both modes, shared experts with and without their gate, renormalised or not.
pub fn device_cases() -> Vec<Case> {
    (0..4)
        .map(|seed| Case {
            d: 1,
            e: 16,
            k: 4,
            random_placement: false,
            shared: seed < 2,
            renormalize: seed % 2 == 1,
            tokens: vec![40],
            mode: if seed % 2 == 0 {
                DispatchMode::Occult
            } else {
                DispatchMode::Standard
            },
            prune: None,
            seed,
            frozen_input: false,
            devices_per_node: None,
            replicas: None,
        })
        .collect()
}

/// A one-rank run of a fixture's layer on some device and dtype, and how far it is from the
/// f32 CPU reference: each quantity's largest and mean absolute difference, relative to the
/// reference's largest |value|.
#[derive(Debug)]
pub struct DeviceRun {
    /// (what, largest, mean): the output, the input's gradient, then each parameter's.
    pub errors: Vec<(String, f32, f32)>,
    pub stats: StepStats,
}

impl DeviceRun {
    /// Panics, naming the quantity, where one is further than `(largest, mean)` from the
    /// reference or a gradient is missing; prints every error.
    pub fn check(&self, fixture: &Fixture, (max_bound, mean_bound): (f32, f32), label: &str) {
        for (what, max, mean) in &self.errors {
            eprintln!("{label} {what}: max {max:.2e}, mean {mean:.2e} of scale");
            assert!(
                *max <= max_bound && *mean <= mean_bound,
                "{label} {what}: {max:.2e} / {mean:.2e} of scale"
            );
        }
        assert_eq!(
            self.errors.len(),
            2 + fixture.vars.len(),
            "{label}: a gradient is missing"
        );
        assert!(self.stats.pairs > 0, "{label}: no expert work");
    }
}

impl Fixture {
    /// The layer on one rank (`comm` a group of one; the case has `d == 1`) with every
    /// weight and the input on `device` in `dtype`, forward and backward, against
    /// [`Fixture::reference`].
    pub fn run_on(
        &self,
        device: &Device,
        dtype: candle::DType,
        comm: Arc<dyn Communicator>,
    ) -> occult_core::Result<DeviceRun> {
        let c = &self.case;
        assert_eq!((c.d, comm.size()), (1, 1), "run_on runs one rank");
        let moved = |t: &Tensor| -> candle::Result<Var> {
            Var::from_tensor(&t.to_dtype(dtype)?.to_device(device)?)
        };
        let vars = self
            .vars
            .iter()
            .map(|v| moved(v.as_tensor()))
            .collect::<candle::Result<Vec<Var>>>()?;
        let t = |i: usize| vars[i].as_tensor().clone();
        let w = MoeWeights {
            router: t(0),
            router_bias: None,
            experts: SwigluStack::new(t(1), t(2), t(3))?,
            shared: self.w.shared.as_ref().map(|s| SharedExperts {
                gate_proj: t(4),
                up_proj: t(5),
                down_proj: t(6),
                gate: s.gate.as_ref().map(|_| t(7)),
            }),
        };
        let layer = EpMoe::from_full(&w, self.settings(), comm)?;
        let n = c.total();
        let x = moved(&Tensor::from_slice(&self.x, (n, H), &Device::Cpu)?)?;
        let (out, stats) = layer.forward(x.as_tensor())?;
        let g = Tensor::from_slice(&self.g, (n, H), device)?;
        let grads = (out.to_dtype(candle::DType::F32)? * g)?
            .sum_all()?
            .backward()?;
        let on_cpu = |t: &Tensor| -> candle::Result<Vec<f32>> {
            t.to_dtype(candle::DType::F32)?
                .to_device(&Device::Cpu)?
                .flatten_all()?
                .to_vec1()
        };
        let reference = self.reference();
        let mut errors = vec![("output".to_string(), on_cpu(&out)?, reference.out)];
        let got = grads.get(x.as_tensor()).map(on_cpu).transpose()?;
        if let (Some(got), Some(want)) = (got, reference.gx) {
            errors.push(("input gradient".into(), got, want));
        }
        for (i, (v, want)) in vars.iter().zip(reference.gparams).enumerate() {
            let got = grads.get(v.as_tensor()).map(on_cpu).transpose()?;
            match (got, want) {
                (Some(got), Some(want)) => errors.push((format!("parameter {i}"), got, want)),
                (None, None) => {}
                (got, want) => {
                    return Err(occult_core::Error::invalid(format!(
                        "parameter {i}: gradient on the device {}, in the reference {}",
                        got.is_some(),
                        want.is_some()
                    )))
                }
            }
        }
        let errors = errors
            .into_iter()
            .map(|(what, got, want)| {
                if got.len() != want.len() {
                    return (what, f32::INFINITY, f32::INFINITY);
                }
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
                let diffs = got.iter().zip(&want).map(|(a, b)| (a - b).abs());
                let max = diffs.clone().fold(0f32, f32::max);
                let mean = diffs.sum::<f32>() / want.len().max(1) as f32;
                (what, max / scale, mean / scale)
            })
            .collect();
        Ok(DeviceRun { errors, stats })
    }
}
