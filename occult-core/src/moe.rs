//! The MoE layer: the router on the graph, the plain single-device reference, and the
//! expert-parallel layer (router, optional pruning, plan, dispatch, local experts, combine).
//!
//! Top-k *indices* are chosen on the host (with [`RouterRule`] and, if asked, a [`Pruner`]);
//! gate *weights* are gathered from the router scores on the graph, so the router gets
//! gradients. The EP layer sees only the [`Communicator`] trait.

use crate::comm::{all_to_all_v, Communicator};
use crate::dispatch::{ComputePlan, DispatchMode, ExpertLocations, SendPlan};
use crate::exchange::exchange_rows;
use crate::experts::{sigmoid, SharedExperts, SwigluStack};
use crate::placement::validate_map;
use crate::pruning::{PruneRule, Pruner};
use crate::routing::{RouterRule, Scoring};
use crate::similarity::SimilarityTable;
use crate::{bail, Result};
use candle::{DType, Tensor, D};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// All weights of one MoE layer (every expert).
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// `[E, H]`.
    pub router: Tensor,
    pub experts: SwigluStack,
    pub shared: Option<SharedExperts>,
}

/// Collaboration pruning applied inside the layer.
#[derive(Clone, Debug)]
pub struct PruneSpec {
    pub rule: PruneRule,
    pub max_devices: usize,
    /// Needed by the similarity rule.
    pub similarity: Option<SimilarityTable>,
}

impl PruneSpec {
    /// The pruner for a router rule and a placement on `num_devices` devices.
    pub fn pruner<'a>(
        &'a self,
        rule: &'a RouterRule,
        device_of_expert: &'a [u32],
        num_devices: usize,
    ) -> Result<Pruner<'a>> {
        Pruner::new(
            self.rule,
            rule,
            device_of_expert,
            num_devices,
            self.max_devices,
            self.similarity.as_ref(),
        )
    }
}

/// `h + y` for a residual connection around an EP layer, safe on ranks without tokens.
///
/// On empty tensors candle's `+` returns its left operand and drops the right one from the
/// graph. A rank without tokens would then lose the EP layer from its backward, although its
/// experts processed other ranks' rows, and its peers would wait for its reverse exchanges.
/// For two empty tensors, concatenation along rows is the sum and keeps both on the graph.
pub fn residual_add(h: &Tensor, y: &Tensor) -> Result<Tensor> {
    if h.elem_count() == 0 && y.elem_count() == 0 && h.dims() == y.dims() {
        Ok(Tensor::cat(&[h, y], 0)?)
    } else {
        Ok((h + y)?)
    }
}

/// A routing decision: host ids `[T, k]`, gate weights on the graph `[T, k]`, and the router
/// logits `[T, E]` as the host saw them (f32, row-major).
#[derive(Clone, Debug)]
pub struct Routed {
    pub ids: Vec<u32>,
    pub weights: Tensor,
    pub logits: Vec<f32>,
}

/// Routes tokens `x` `[T, H]` with router weights `[E, H]`; `pruner` rewrites the selection.
pub fn route(
    x: &Tensor,
    router: &Tensor,
    rule: &RouterRule,
    pruner: Option<&Pruner>,
) -> Result<Routed> {
    let logits = x.matmul(&router.t()?)?;
    let t = logits.dims2()?.0;
    let k = rule.top_k;
    if t == 0 {
        // candle cannot reduce over zero rows; there is nothing to route. The (empty) weights
        // are taken from the logits so that they stay on the router's graph: every rank must
        // keep the same exchanges in its backward, tokens or not.
        return Ok(Routed {
            ids: Vec::new(),
            weights: logits.narrow(1, 0, k)?,
            logits: Vec::new(),
        });
    }
    // Routing decisions are taken in f32 whatever the model's dtype; so are the gate weights.
    let logits = logits.to_dtype(DType::F32)?;
    let host = logits.flatten_all()?.to_vec1::<f32>()?;
    let e = rule.num_experts;
    let mut ids = Vec::with_capacity(t * k);
    for row in host.chunks(e) {
        let sel = rule.route(row);
        match pruner {
            Some(p) => ids.extend(p.prune_logits(row, &sel.ids).ids),
            None => ids.extend(sel.ids),
        }
    }
    let scores = match rule.scoring {
        Scoring::Softmax => candle_nn::ops::softmax(&logits, D::Minus1)?,
        Scoring::Sigmoid => sigmoid(&logits)?,
    };
    let idx = Tensor::from_slice(&ids, (t, k), x.device())?;
    let mut w = scores.gather(&idx, 1)?;
    if rule.renormalize {
        w = w.broadcast_div(&w.sum_keepdim(1)?)?;
    }
    if rule.scaling_factor != 1.0 {
        w = w.affine(rule.scaling_factor as f64, 0.0)?;
    }
    Ok(Routed {
        ids,
        weights: w.to_dtype(x.dtype())?,
        logits: host,
    })
}

/// The plain single-device MoE forward: for each expert, its tokens, its MLP, the gate
/// weights, summed back into token order; plus shared experts. The oracle every EP mode is
/// checked against. `prune` (with the placement it refers to) rewrites routing as the EP layer
/// would.
pub fn reference_forward(
    w: &MoeWeights,
    rule: &RouterRule,
    x: &Tensor,
    prune: Option<(&PruneSpec, &[u32], usize)>,
) -> Result<Tensor> {
    Ok(reference_forward_routed(w, rule, x, prune)?.0)
}

/// [`reference_forward`], also returning the routing it used.
pub fn reference_forward_routed(
    w: &MoeWeights,
    rule: &RouterRule,
    x: &Tensor,
    prune: Option<(&PruneSpec, &[u32], usize)>,
) -> Result<(Tensor, Routed)> {
    let pruner = prune
        .map(|(spec, map, d)| spec.pruner(rule, map, d))
        .transpose()?;
    let routed = route(x, &w.router, rule, pruner.as_ref())?;
    let (t, h) = x.dims2()?;
    let k = rule.top_k;
    let flat_w = routed.weights.flatten_all()?;
    // Each expert's (token, slot) pairs, in token order.
    let mut tok = vec![Vec::new(); w.experts.len()];
    let mut pos = vec![Vec::new(); w.experts.len()];
    for (i, &id) in routed.ids.iter().enumerate() {
        tok[id as usize].push((i / k) as u32);
        pos[id as usize].push(i as u32);
    }
    let mut ys = Vec::new();
    let mut dest = Vec::new();
    for e in 0..w.experts.len() {
        if tok[e].is_empty() {
            continue;
        }
        let ti = Tensor::from_slice(&tok[e], tok[e].len(), x.device())?;
        let pi = Tensor::from_slice(&pos[e], pos[e].len(), x.device())?;
        let y = w.experts.expert(e, &x.index_select(&ti, 0)?)?;
        let g = flat_w.index_select(&pi, 0)?.unsqueeze(1)?;
        ys.push(y.broadcast_mul(&g)?);
        dest.push(ti);
    }
    // One scatter of every expert's weighted rows back to their tokens.
    let zeros = Tensor::zeros((t, h), x.dtype(), x.device())?;
    let mut out = if ys.is_empty() {
        zeros
    } else {
        zeros.index_add(&Tensor::cat(&dest, 0)?, &Tensor::cat(&ys, 0)?, 0)?
    };
    if let Some(s) = &w.shared {
        out = (out + s.forward(x)?)?;
    }
    Ok((out, routed))
}

/// Time and traffic of one EP forward on one rank.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct StepStats {
    pub tokens: usize,
    /// Rows this rank sent (to itself included) and those that left it.
    pub rows_sent: usize,
    pub remote_rows_sent: usize,
    /// Rows received for expert compute, and the (row, expert) pairs computed.
    pub rows_received: usize,
    pub pairs: usize,
    /// Sum of C_T over this rank's tokens (under the routing actually used).
    pub devices_touched: usize,
    pub route_s: f64,
    pub plan_s: f64,
    pub dispatch_s: f64,
    pub compute_s: f64,
    pub combine_s: f64,
}

/// A 64-bit FNV-1a digest of what every rank must agree on.
fn layout_signature(
    rule: &RouterRule,
    map: &[u32],
    mode: DispatchMode,
    prune: Option<&PruneSpec>,
) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |v: u64| {
        for b in v.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(rule.num_experts as u64);
    eat(rule.top_k as u64);
    eat(mode as u64);
    map.iter().for_each(|&d| eat(d as u64));
    if let Some(p) = prune {
        eat(p.rule as u64 + 1);
        eat(p.max_devices as u64);
    }
    h
}

/// One rank's part of an expert-parallel MoE layer.
pub struct EpMoe {
    /// `[E, H]`, replicated on every rank.
    pub router: Tensor,
    /// This rank's experts, in slot order (ascending global id).
    pub local: SwigluStack,
    pub shared: Option<SharedExperts>,
    pub rule: RouterRule,
    pub locations: ExpertLocations,
    pub mode: DispatchMode,
    pub prune: Option<PruneSpec>,
    comm: Arc<dyn Communicator>,
}

impl EpMoe {
    /// Builds this rank's layer from the full weights: it keeps its own experts.
    pub fn from_full(
        w: &MoeWeights,
        rule: RouterRule,
        device_of_expert: &[u32],
        comm: Arc<dyn Communicator>,
        mode: DispatchMode,
        prune: Option<PruneSpec>,
    ) -> Result<Self> {
        let locations = ExpertLocations::new(device_of_expert, comm.size());
        let local = w.experts.select(&locations.experts_of[comm.rank()])?;
        Self::new(
            w.router.clone(),
            local,
            w.shared.clone(),
            rule,
            device_of_expert,
            comm,
            mode,
            prune,
        )
    }

    /// Builds the layer from this rank's own experts (`local` in ascending global id order).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        router: Tensor,
        local: SwigluStack,
        shared: Option<SharedExperts>,
        rule: RouterRule,
        device_of_expert: &[u32],
        comm: Arc<dyn Communicator>,
        mode: DispatchMode,
        prune: Option<PruneSpec>,
    ) -> Result<Self> {
        rule.validate()?;
        let d = comm.size();
        validate_map(device_of_expert, rule.num_experts, d)?;
        let locations = ExpertLocations::new(device_of_expert, d);
        let mine = locations.experts_of[comm.rank()].len();
        if local.len() != mine {
            bail!(
                "rank {} holds {} experts, the placement gives it {mine}",
                comm.rank(),
                local.len()
            );
        }
        if router.dims() != [rule.num_experts, local.hidden()] {
            bail!(
                "router weight has shape {:?}, expected [{}, {}]",
                router.dims(),
                rule.num_experts,
                local.hidden()
            );
        }
        if let Some(p) = &prune {
            // Fail early, with the reason, rather than on the first batch.
            p.pruner(&rule, device_of_expert, d)?;
        }
        // Ranks that disagree on the layout would exchange garbage: compare signatures.
        let sig = layout_signature(&rule, device_of_expert, mode, prune.as_ref()).to_le_bytes();
        let all = comm.all_gather_bytes(&sig)?;
        if all.chunks(8).any(|c| c != sig) {
            bail!(
                "rank {}: the ranks disagree on the layer's layout (placement, experts, top-k, \
                 dispatch mode or pruning)",
                comm.rank()
            );
        }
        Ok(EpMoe {
            router,
            local,
            shared,
            rule,
            locations,
            mode,
            prune,
            comm,
        })
    }

    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Forward of this rank's tokens `x` `[T, H]`. Collective: every rank of the group must call
    /// it (a rank with no tokens passes `[0, H]`).
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, StepStats)> {
        let (y, st, _) = self.forward_routed(x)?;
        Ok((y, st))
    }

    /// [`EpMoe::forward`], also returning this rank's routing.
    pub fn forward_routed(&self, x: &Tensor) -> Result<(Tensor, StepStats, Routed)> {
        let mut st = StepStats::default();
        let (t, h) = x.dims2()?;
        let dev = x.device();
        let k = self.rule.top_k;
        st.tokens = t;

        let clock = Instant::now();
        let pruner = self
            .prune
            .as_ref()
            .map(|p| {
                p.pruner(
                    &self.rule,
                    &self.locations.rank_of,
                    self.locations.num_ranks,
                )
            })
            .transpose()?;
        let routed = route(x, &self.router, &self.rule, pruner.as_ref())?;
        st.route_s = clock.elapsed().as_secs_f64();

        let clock = Instant::now();
        let plan = SendPlan::new(&routed.ids, k, &self.locations, self.mode)?;
        let rows = plan.rows();
        let row_idx = Tensor::from_slice(&plan.row_token, rows, dev)?;
        let occult = self.mode == DispatchMode::Occult;
        // Occult rows carry the token's k gate weights (the device pre-reduces); standard rows
        // carry the hidden state only (the source applies the weight after combine). Join the
        // small [T, k] weights to the tokens first, then gather rows: one pass over the rows.
        let payload = if occult {
            Tensor::cat(&[x, &routed.weights], 1)?.index_select(&row_idx, 0)?
        } else {
            x.index_select(&row_idx, 0)?
        };
        let (meta, meta_width) = plan.metadata();
        st.rows_sent = rows;
        st.remote_rows_sent = plan.remote_rows(self.comm.rank());
        st.devices_touched = if occult {
            rows
        } else {
            crate::collab::total_devices(
                &routed.ids,
                k,
                &self.locations.rank_of,
                self.locations.num_ranks,
            ) as usize
        };
        st.plan_s = clock.elapsed().as_secs_f64();

        let clock = Instant::now();
        let (recv_meta, _) =
            all_to_all_v(self.comm.as_ref(), &meta, &plan.send_counts, meta_width)?;
        let (recv, recv_counts) = exchange_rows(&self.comm, &payload, &plan.send_counts)?;
        st.dispatch_s = clock.elapsed().as_secs_f64();

        let clock = Instant::now();
        st.rows_received = recv_counts.iter().sum::<usize>();
        let cplan = ComputePlan::new(
            &recv_meta,
            plan.slots_per_row,
            occult.then_some(k),
            self.local.len(),
        )?;
        st.pairs = cplan.pairs();
        let w_recv = if occult {
            Some(recv.narrow(1, h, k)?.flatten_all()?)
        } else {
            None
        };
        let y_recv = self.local.grouped(&recv, w_recv.as_ref(), &cplan)?;
        st.compute_s = clock.elapsed().as_secs_f64();

        let clock = Instant::now();
        let (mut back, _) = exchange_rows(&self.comm, &y_recv, &recv_counts)?;
        if !occult {
            // Standard rows return unweighted: apply each (token, expert) row's gate weight.
            let widx: Vec<u32> = plan
                .weight_index()
                .into_iter()
                .map(|i| i.unwrap_or(0))
                .collect();
            let widx = Tensor::from_slice(&widx, rows, dev)?;
            let w = routed.weights.flatten_all()?.index_select(&widx, 0)?;
            back = back.broadcast_mul(&w.unsqueeze(1)?)?;
        }
        let mut out = Tensor::zeros((t, h), x.dtype(), dev)?.index_add(&row_idx, &back, 0)?;
        if let Some(sh) = &self.shared {
            out = (out + sh.forward(x)?)?;
        }
        st.combine_s = clock.elapsed().as_secs_f64();
        Ok((out, st, routed))
    }
}
