//! The expert-parallel MoE layer: one rank's part of a layer whose experts are spread over the
//! ranks of a [`Communicator`] group.
//!
//! [`EpMoe::forward`] runs five named stages, as Megatron-Core's `MoELayer.forward` names
//! router, dispatch, experts and combine, and as DeepEP separates the layout from the
//! exchange:
//!
//! ```text
//! route     x [T, H] -> ids [T, k] (host), gate weights [T, k] (graph)     router.rs
//! plan      ids + placement -> SendPlan: rows per rank, their slots        dispatch.rs
//! dispatch  gather rows, exchange metadata and rows -> received rows
//!           + DispatchHandle (plan, row tokens, receive counts,
//!             compute plan)                                                exchange.rs
//! compute   received rows -> grouped experts -> one output per row         experts.rs
//! combine   DispatchHandle + outputs -> reverse exchange -> [T, H]
//!           (+ gate weights in standard mode, + shared experts)
//! ```
//!
//! In two-level mode ([`DispatchMode::TwoLevel`]) dispatch sends one row per (token, node) to
//! the node's proxy, which forwards it inside its node, and combine runs in reverse: each
//! device pre-reduces its experts' outputs, the proxy sums its node's rows of a token, and
//! one row per (token, node) crosses back ([`EpMoe::cross_nodes`] and combine).
//!
//! A new stage is one private method here, one line in [`EpMoe::forward_routed`] and, if it is
//! timed apart, a field of [`StepStats`]. The single-device oracle is [`super::reference`]; it
//! shares the router and the expert weights with this layer, not the exchange or grouping.

use super::comm::{all_to_all_v, Communicator};
use super::dispatch::{ComputePlan, ExpertLocations, NodePlan, SendPlan};
use super::exchange::exchange_rows;
use super::experts::MoeWeights;
use super::router::{route_biased, PruneSpec, Routed};
use crate::analysis::collab::total_devices;
use crate::analysis::cost::cluster::Cluster;
use crate::analysis::placement::devices_and_nodes;
use crate::analysis::placement::replicas::{CopyRule, ReplicaMap};
use crate::analysis::placement::validate_map;
use crate::analysis::pruning::PruneLimit;
use crate::analysis::routing::RouterRule;
use crate::analysis::run_key::DispatchMode;
use crate::{bail, Result};
use candle::{DType, Device, Tensor};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// `h + y` for a residual connection (around attention, a dense MLP or an EP layer), safe on
/// ranks without tokens.
///
/// On empty tensors candle's `+` returns its left operand and drops the right one from the
/// graph. A rank without tokens would then lose the EP layer from its backward, although its
/// experts processed other ranks' rows, and its peers would wait for its reverse exchanges.
/// For two empty tensors, concatenation along rows is the sum and keeps both on the graph.
///
/// bf16 on CPU is added in f32 and rounded once: the same bits as candle's bf16 add, whose
/// CPU path converts through a function call per eight values and measured 10% of a bf16
/// prefill of a one-layer OLMoE-shaped model.
pub fn residual_add(h: &Tensor, y: &Tensor) -> Result<Tensor> {
    if h.elem_count() == 0 && y.elem_count() == 0 && h.dims() == y.dims() {
        Ok(Tensor::cat(&[h, y], 0)?)
    } else if h.dtype() == DType::BF16 && y.dtype() == DType::BF16 && h.device().is_cpu() {
        let sum = (h.to_dtype(DType::F32)? + y.to_dtype(DType::F32)?)?;
        Ok(sum.to_dtype(DType::BF16)?)
    } else {
        Ok((h + y)?)
    }
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
    /// With a node size: sum of C_N (distinct nodes) over this rank's tokens, and the rows
    /// this rank's dispatch sent over links within its node and across nodes (the first leg's
    /// and the forwarded rows in two-level mode; 0 without a node size).
    #[serde(default)]
    pub nodes_touched: usize,
    #[serde(default)]
    pub intra_node_rows_sent: usize,
    #[serde(default)]
    pub inter_node_rows_sent: usize,
    /// Seconds in each stage.
    pub route_s: f64,
    pub plan_s: f64,
    pub dispatch_s: f64,
    pub compute_s: f64,
    pub combine_s: f64,
}

impl StepStats {
    /// Adds another step's counts and times (for example every MoE layer of a forward).
    pub fn add(&mut self, o: &StepStats) {
        self.tokens += o.tokens;
        self.rows_sent += o.rows_sent;
        self.remote_rows_sent += o.remote_rows_sent;
        self.rows_received += o.rows_received;
        self.pairs += o.pairs;
        self.devices_touched += o.devices_touched;
        self.nodes_touched += o.nodes_touched;
        self.intra_node_rows_sent += o.intra_node_rows_sent;
        self.inter_node_rows_sent += o.inter_node_rows_sent;
        self.route_s += o.route_s;
        self.plan_s += o.plan_s;
        self.dispatch_s += o.dispatch_s;
        self.compute_s += o.compute_s;
        self.combine_s += o.combine_s;
    }
}

/// What every rank of the group must agree on (checked when the layer is built).
#[derive(Clone, Debug)]
pub struct EpSettings {
    pub rule: RouterRule,
    /// `[E]`: the rank of each expert.
    pub device_of_expert: Vec<u32>,
    pub mode: DispatchMode,
    /// Collaboration pruning, if on.
    pub prune: Option<PruneSpec>,
    /// Devices per node (rank r in node r / G): needed by two-level mode; in any mode it
    /// counts rows within and across nodes.
    pub devices_per_node: Option<usize>,
    /// A placement with replicas (then `device_of_expert` is not used): the layer's slots and
    /// the rule that picks a token's copies.
    pub replicas: Option<Replicas>,
}

/// The layer's experts in E + R slots, some on several ranks, and the copy rule.
#[derive(Clone, Debug)]
pub struct Replicas {
    pub map: ReplicaMap,
    pub rule: CopyRule,
}

impl EpSettings {
    /// Where each expert (each slot, under replicas) lives on `ranks` ranks.
    pub fn locations(&self, ranks: usize) -> ExpertLocations {
        match &self.replicas {
            Some(r) => ExpertLocations::replicated(&r.map),
            None => ExpertLocations::new(&self.device_of_expert, ranks),
        }
    }

    /// Checks the layout against `ranks` ranks: a balanced map, or a replica map for this
    /// group, in a mode and with options that run it.
    fn check_layout(&self, ranks: usize) -> Result<()> {
        let Some(r) = &self.replicas else {
            return validate_map(&self.device_of_expert, self.rule.num_experts, ranks);
        };
        if r.map.num_experts != self.rule.num_experts || r.map.num_devices != ranks {
            bail!(
                "a placement with replicas for {} experts on {} devices; the layer has {} \
                 experts on {ranks} ranks",
                r.map.num_experts,
                r.map.num_devices,
                self.rule.num_experts
            );
        }
        if self.prune.is_some() {
            bail!(
                "collaboration pruning does not run on placements with replicas yet (which copy \
                 a pruned token may use is not defined): place without --replicas to prune"
            );
        }
        if self.mode == DispatchMode::TwoLevel {
            bail!(
                "two-level dispatch does not run placements with replicas yet: use --mode \
                 occult or standard"
            );
        }
        Ok(())
    }
}

impl EpSettings {
    /// A 64-bit FNV-1a digest of everything in the settings that changes what ranks exchange.
    fn signature(&self) -> u64 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |v: u64| {
            for b in v.to_le_bytes() {
                hash = (hash ^ b as u64).wrapping_mul(0x0100_0000_01b3);
            }
        };
        eat(self.rule.num_experts as u64);
        eat(self.rule.top_k as u64);
        eat(self.mode as u64);
        self.device_of_expert.iter().for_each(|&d| eat(d as u64));
        eat(self.devices_per_node.map_or(0, |g| g as u64));
        if let Some(r) = &self.replicas {
            eat(r.rule as u64 + 1);
            r.map.slot_expert.iter().for_each(|&e| eat(e as u64));
            for &x in r.map.expert_load().unwrap_or(&[]) {
                eat(x.to_bits());
            }
        }
        if let Some(p) = &self.prune {
            eat(p.rule as u64 + 1);
            match p.limit {
                PruneLimit::Devices(n) => eat(n as u64),
                PruneLimit::Nodes {
                    devices_per_node,
                    max_nodes,
                    devices_in_node,
                } => {
                    eat(u64::MAX);
                    eat(devices_per_node as u64);
                    eat(max_nodes as u64);
                    eat(devices_in_node.map_or(0, |n| n as u64 + 1));
                }
            }
        }
        hash
    }
}

/// What [`EpMoe::dispatch`] hands to [`EpMoe::combine`] (DeepEP's handle): how to send the
/// expert outputs back and where they land.
struct DispatchHandle {
    /// The rows sent to the expert devices (in two-level mode, those the proxy forwarded).
    plan: SendPlan,
    /// `[rows]`: the local token of each sent row (two-level: the row received across nodes
    /// it forwards), on the device.
    row_token: Tensor,
    /// Rows received from each source rank: combine sends this many back to each.
    recv_counts: Vec<usize>,
    /// The received rows grouped by local expert.
    compute: ComputePlan,
    /// Two-level mode: the leg across nodes, which combine reverses last.
    across: Option<Leg>,
}

/// One leg of a two-level exchange as combine needs it: where its returned rows land and how
/// many rows to send back to each peer.
struct Leg {
    /// `[rows]`: the local token of each row sent across.
    row_token: Tensor,
    recv_counts: Vec<usize>,
}

/// What the plan stage hands to dispatch.
enum Planned {
    /// Standard and occult modes: one exchange to the expert devices.
    Direct(SendPlan),
    /// Two-level mode: the first leg; the proxy plans the second from what it receives.
    Nodes(NodePlan),
}

/// One rank's part of an expert-parallel MoE layer.
pub struct EpMoe {
    /// The router, this rank's experts in slot order (ascending global id), shared experts.
    pub weights: MoeWeights,
    pub settings: EpSettings,
    /// Where each expert lives, from `settings.device_of_expert`.
    pub locations: ExpertLocations,
    comm: Arc<dyn Communicator>,
    /// An empty trainable tensor joined to every exchanged buffer when training, so that every
    /// rank runs every reverse exchange (see [`EpMoe::anchor_reverse_exchanges`]).
    anchor: Option<Tensor>,
}

/// Runs `stage`; returns its result and its wall time in seconds. On a GPU, whose kernels run
/// after their launch returns, the stage's work on `device` is waited for first, so that each
/// stage's time is its own (at the cost of the overlap between stages).
fn timed<T>(device: &Device, stage: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    let clock = Instant::now();
    let out = stage()?;
    if !device.is_cpu() {
        device.synchronize()?;
    }
    Ok((out, clock.elapsed().as_secs_f64()))
}

impl EpMoe {
    /// Builds this rank's layer from the full weights (every expert): it keeps its own.
    pub fn from_full(
        full: &MoeWeights,
        settings: EpSettings,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let locations = settings.locations(comm.size());
        let weights = MoeWeights {
            router: full.router.clone(),
            router_bias: full.router_bias.clone(),
            experts: full.experts.select(&locations.experts_of[comm.rank()])?,
            shared: full.shared.clone(),
        };
        Self::new(weights, settings, comm)
    }

    /// Builds the layer from this rank's weights (`weights.experts` in ascending global id
    /// order). Collective: the ranks compare their settings and all fail if they differ.
    pub fn new(
        weights: MoeWeights,
        settings: EpSettings,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let rule = &settings.rule;
        rule.validate()?;
        let ranks = comm.size();
        settings.check_layout(ranks)?;
        let locations = settings.locations(ranks);
        let mine = locations.experts_of[comm.rank()].len();
        if weights.experts.len() != mine {
            bail!(
                "rank {} holds {} experts, the placement gives it {mine} slots",
                comm.rank(),
                weights.experts.len()
            );
        }
        let hidden = weights.experts.hidden();
        if weights.router.dims() != [rule.num_experts, hidden] {
            bail!(
                "router weight has shape {:?}, expected [{}, {hidden}]",
                weights.router.dims(),
                rule.num_experts,
            );
        }
        if let Some(b) = &weights.router_bias {
            if b.dims() != [rule.num_experts] {
                bail!(
                    "router bias has shape {:?}, expected [{}]",
                    b.dims(),
                    rule.num_experts
                );
            }
        }
        match settings.devices_per_node {
            Some(g) if g == 0 || g > ranks => bail!(
                "{g} devices per node for a group of {ranks} ranks: give between 1 and {ranks}"
            ),
            None if settings.mode == DispatchMode::TwoLevel => bail!(
                "two-level dispatch needs the node size: give --devices-per-node G, or run \
                 under mpirun (--backend mpi), whose ranks on one host form a node"
            ),
            _ => {}
        }
        if let Some(p) = &settings.prune {
            // Fail early, with the reason, rather than on the first batch.
            p.pruner(rule, &settings.device_of_expert, ranks)?;
        }
        // Ranks that disagree on the layout would exchange garbage: compare signatures.
        let sig = settings.signature().to_le_bytes();
        let all = comm.all_gather_bytes(&sig)?;
        if all.chunks(8).any(|c| c != sig) {
            bail!(
                "rank {}: the ranks disagree on the layer's layout (placement, experts, top-k, \
                 dispatch mode or pruning)",
                comm.rank()
            );
        }
        Ok(EpMoe {
            weights,
            settings,
            locations,
            comm,
            anchor: None,
        })
    }

    /// Makes every exchange of this layer take part in the backward pass on every rank.
    ///
    /// candle's backward visits only ops between a trainable tensor and the loss. Whether a
    /// rank's dispatched rows lie on such a path depends on what it computed before: a rank
    /// with tokens reaches them through its embeddings and attention, a rank without tokens
    /// does not, and ranks that disagree on which reverse exchanges to run wait for each other
    /// forever. Joining an empty trainable tensor to every buffer this layer sends puts every
    /// exchange on such a path on every rank. Costs a copy of each buffer, so it is for
    /// training only.
    pub fn anchor_reverse_exchanges(&mut self) -> Result<()> {
        let width = self.weights.experts.hidden() + self.settings.rule.top_k;
        let router = &self.weights.router;
        let anchor = candle::Var::zeros((0, width), router.dtype(), router.device())?;
        self.anchor = Some(anchor.as_tensor().clone());
        Ok(())
    }

    /// `rows` `[n, W]`, joined to the anchor when training.
    fn anchored(&self, rows: Tensor) -> Result<Tensor> {
        match &self.anchor {
            Some(a) => {
                let width = rows.dims2()?.1;
                Ok(Tensor::cat(&[&rows, &a.narrow(1, 0, width)?], 0)?)
            }
            None => Ok(rows),
        }
    }

    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Rows carry gate weights and come back pre-reduced (occult and two-level modes).
    fn occult(&self) -> bool {
        self.settings.mode.pre_reduces()
    }

    /// The nodes of the group, when the settings give a node size.
    fn cluster(&self) -> Option<Cluster> {
        self.settings.devices_per_node.map(|g| Cluster {
            devices: self.locations.num_ranks,
            per_node: g,
        })
    }

    /// Forward of this rank's tokens `x` `[T, H]`. Collective: every rank of the group must call
    /// it (a rank with no tokens passes `[0, H]`).
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, StepStats)> {
        let (y, stats, _) = self.forward_routed(x)?;
        Ok((y, stats))
    }

    /// [`EpMoe::forward`], also returning this rank's routing.
    pub fn forward_routed(&self, x: &Tensor) -> Result<(Tensor, StepStats, Routed)> {
        let mut st = StepStats {
            tokens: x.dims2()?.0,
            ..StepStats::default()
        };
        let dev = x.device();
        let (routed, route_s) = timed(dev, || self.route(x))?;
        let (plan, plan_s) = timed(dev, || self.plan(&routed, &mut st))?;
        let ((received, handle), dispatch_s) =
            timed(dev, || self.dispatch(x, &routed, plan, &mut st))?;
        let (outputs, compute_s) = timed(dev, || self.compute(&received, &handle))?;
        let (y, combine_s) = timed(dev, || self.combine(x, outputs, &routed, handle))?;
        st.route_s = route_s;
        st.plan_s = plan_s;
        st.dispatch_s = dispatch_s;
        st.compute_s = compute_s;
        st.combine_s = combine_s;
        Ok((y, st, routed))
    }

    /// Route: top-k ids on the host (pruned if asked), gate weights on the graph.
    fn route(&self, x: &Tensor) -> Result<Routed> {
        let s = &self.settings;
        let pruner = s
            .prune
            .as_ref()
            .map(|p| p.pruner(&s.rule, &self.locations.rank_of, self.locations.num_ranks))
            .transpose()?;
        let w = &self.weights;
        route_biased(
            x,
            &w.router,
            w.router_bias.as_ref(),
            &s.rule,
            pruner.as_ref(),
        )
    }

    /// Plan: which rows go to which rank, carrying which slots. Counts the traffic.
    fn plan(&self, routed: &Routed, st: &mut StepStats) -> Result<Planned> {
        let k = self.settings.rule.top_k;
        let loc = &self.locations;
        let me = self.comm.rank();
        if let Some(r) = &self.settings.replicas {
            // The copies the rule picks, counted as the analysis counts them.
            let mode = self.settings.mode;
            let plan = SendPlan::replicated(&routed.ids, k, &r.map, r.rule, me as u32, mode)?;
            let sources = vec![me as u32; st.tokens];
            let g = self.settings.devices_per_node;
            let counted = r.map.stats(&routed.ids, k, &sources, r.rule, g)?;
            st.devices_touched = counted.devices_touched as usize;
            st.nodes_touched = counted.nodes_touched as usize;
            st.rows_sent = plan.rows();
            st.remote_rows_sent = plan.remote_rows(me);
            if let Some(c) = self.cluster() {
                count_levels(&plan.send_counts, me, &c, st);
            }
            return Ok(Planned::Direct(plan));
        }
        // Sums of C_T and C_N as the analysis counts them.
        match self.settings.devices_per_node {
            Some(g) => {
                let (c_t, c_n) = devices_and_nodes(&routed.ids, k, &loc.rank_of, loc.num_ranks, g);
                (st.devices_touched, st.nodes_touched) = (c_t as usize, c_n as usize);
            }
            None => {
                st.devices_touched =
                    total_devices(&routed.ids, k, &loc.rank_of, loc.num_ranks) as usize;
            }
        }
        let plan = match self.settings.mode {
            DispatchMode::TwoLevel => {
                let c = self.cluster().expect("checked when the layer was built");
                let plan = NodePlan::new(&routed.ids, k, loc, &c, me)?;
                st.rows_sent = plan.rows();
                st.remote_rows_sent = plan.rows() - plan.send_counts[me];
                st.inter_node_rows_sent = st.remote_rows_sent;
                Planned::Nodes(plan)
            }
            mode => {
                let plan = SendPlan::new(&routed.ids, k, loc, mode)?;
                st.rows_sent = plan.rows();
                st.remote_rows_sent = plan.remote_rows(me);
                if let Some(c) = self.cluster() {
                    count_levels(&plan.send_counts, me, &c, st);
                }
                Planned::Direct(plan)
            }
        };
        Ok(plan)
    }

    /// Dispatch: gather the rows of the plan and exchange them, with their metadata. Occult rows
    /// carry the token's k gate weights as extra columns (the receiver pre-reduces); standard
    /// rows carry the hidden state only (the source applies the weight after combine). In
    /// two-level mode the rows cross to each node's proxy first, which forwards them.
    fn dispatch(
        &self,
        x: &Tensor,
        routed: &Routed,
        planned: Planned,
        st: &mut StepStats,
    ) -> Result<(Tensor, DispatchHandle)> {
        // Join the small [T, k] weights to the tokens first, then gather rows: one pass over
        // the rows.
        let rows = if self.occult() {
            Tensor::cat(&[x, &routed.weights], 1)?
        } else {
            x.clone()
        };
        match planned {
            Planned::Direct(plan) => self.send_to_experts(&rows, plan, None, st),
            Planned::Nodes(plan) => {
                let (at_proxy, across, plan) = self.cross_nodes(&rows, plan)?;
                let me = self.comm.rank();
                st.rows_sent += plan.rows();
                st.remote_rows_sent += plan.remote_rows(me);
                st.intra_node_rows_sent = plan.remote_rows(me);
                self.send_to_experts(&at_proxy, plan, Some(across), st)
            }
        }
    }

    /// Two-level mode's leg across nodes: sends the rows of `plan` (gathered from `rows`,
    /// `[T, H + k]`) and their expert ids to each node's proxy. Returns the rows this rank
    /// received as a proxy, the leg for combine, and the plan that forwards them inside this
    /// rank's node.
    fn cross_nodes(&self, rows: &Tensor, plan: NodePlan) -> Result<(Tensor, Leg, SendPlan)> {
        let row_token = Tensor::from_slice(&plan.row_token, plan.rows(), rows.device())?;
        let payload = self.anchored(rows.index_select(&row_token, 0)?)?;
        let k = plan.top_k;
        let (ids, _) = all_to_all_v(self.comm.as_ref(), &plan.row_ids, &plan.send_counts, k)?;
        let (received, recv_counts) = exchange_rows(&self.comm, &payload, &plan.send_counts)?;
        let arrived: usize = recv_counts.iter().sum();
        if ids.len() != arrived * k {
            bail!(
                "rank {}: {arrived} rows arrived across nodes with {} expert ids",
                self.comm.rank(),
                ids.len()
            );
        }
        let cluster = self.cluster().expect("checked when the layer was built");
        let node = cluster.node(self.comm.rank());
        let forward = SendPlan::forwarded(&ids, k, &self.locations, &cluster, node)?;
        let leg = Leg {
            row_token,
            recv_counts,
        };
        Ok((received, leg, forward))
    }

    /// Sends the rows of `plan` (gathered from `rows`, `[n, W]`) and their metadata to the
    /// expert devices, and groups what arrives by local expert.
    fn send_to_experts(
        &self,
        rows: &Tensor,
        plan: SendPlan,
        across: Option<Leg>,
        st: &mut StepStats,
    ) -> Result<(Tensor, DispatchHandle)> {
        let row_token = Tensor::from_slice(&plan.row_token, plan.rows(), rows.device())?;
        let payload = self.anchored(rows.index_select(&row_token, 0)?)?;
        let comm = self.comm.as_ref();
        let (meta, meta_width) = plan.metadata();
        let (recv_meta, _) = all_to_all_v(comm, &meta, &plan.send_counts, meta_width)?;
        let (received, recv_counts) = exchange_rows(&self.comm, &payload, &plan.send_counts)?;
        let k = self.settings.rule.top_k;
        let compute = ComputePlan::new(
            &recv_meta,
            plan.slots_per_row,
            self.occult().then_some(k),
            self.weights.experts.len(),
        )?;
        st.rows_received = recv_counts.iter().sum();
        st.pairs = compute.pairs();
        let handle = DispatchHandle {
            plan,
            row_token,
            recv_counts,
            compute,
            across,
        };
        Ok((received, handle))
    }

    /// Compute: every received (row, local expert) pair through its expert, grouped by expert;
    /// in Occult mode gate-weighted and summed per row (the pre-reduction). `[rows, H]`.
    fn compute(&self, received: &Tensor, handle: &DispatchHandle) -> Result<Tensor> {
        let gate_weights = if self.occult() {
            let hidden = self.weights.experts.hidden();
            let k = self.settings.rule.top_k;
            Some(received.narrow(1, hidden, k)?.flatten_all()?)
        } else {
            None
        };
        self.weights
            .experts
            .grouped(received, gate_weights.as_ref(), &handle.compute)
    }

    /// Combine: send each row's output back to its source, weight standard rows by their gate
    /// weights, sum into token order (two-level: sum a node's rows of a token at the proxy and
    /// send that one row back across), and add the shared experts. `[T, H]`.
    fn combine(
        &self,
        x: &Tensor,
        outputs: Tensor,
        routed: &Routed,
        handle: DispatchHandle,
    ) -> Result<Tensor> {
        let outputs = self.anchored(outputs)?;
        let (mut back, _) = exchange_rows(&self.comm, &outputs, &handle.recv_counts)?;
        if !self.occult() {
            // Standard rows return unweighted: apply each (token, expert) row's gate weight.
            let weight_at: Vec<u32> = handle
                .plan
                .weight_index()
                .into_iter()
                .map(|i| i.unwrap_or(0))
                .collect();
            let weight_at = Tensor::from_slice(&weight_at, handle.plan.rows(), x.device())?;
            let gate = routed.weights.flatten_all()?.index_select(&weight_at, 0)?;
            back = back.broadcast_mul(&gate.unsqueeze(1)?)?;
        }
        let (tokens, hidden) = x.dims2()?;
        let sum_into = |rows: usize, at: &Tensor, back: &Tensor| -> Result<Tensor> {
            let zeros = Tensor::zeros((rows, hidden), x.dtype(), x.device())?;
            Ok(zeros.index_add(at, back, 0)?)
        };
        let mut out = match &handle.across {
            None => sum_into(tokens, &handle.row_token, &back)?,
            Some(leg) => {
                let received: usize = leg.recv_counts.iter().sum();
                let at_proxy = self.anchored(sum_into(received, &handle.row_token, &back)?)?;
                let (back, _) = exchange_rows(&self.comm, &at_proxy, &leg.recv_counts)?;
                sum_into(tokens, &leg.row_token, &back)?
            }
        };
        if let Some(shared) = &self.weights.shared {
            out = (out + shared.forward(x)?)?;
        }
        Ok(out)
    }
}

/// Adds rows sent straight to each rank (`send_counts`) to the rows within and across nodes.
fn count_levels(send_counts: &[usize], me: usize, cluster: &Cluster, st: &mut StepStats) {
    for (peer, &rows) in send_counts.iter().enumerate().filter(|&(p, _)| p != me) {
        if cluster.node(peer) == cluster.node(me) {
            st.intra_node_rows_sent += rows;
        } else {
            st.inter_node_rows_sent += rows;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::Device;

    /// The bf16 shortcut gives candle's own bf16 sum, bit for bit (lengths off its 8-value
    /// chunks included), and the empty case keeps both operands.
    #[test]
    fn residual_add_matches_candles_add() {
        let dev = Device::Cpu;
        for n in [1, 7, 8, 33, 1000] {
            let h = Tensor::randn(0f32, 3.0, (n, 5), &dev).unwrap();
            let y = Tensor::randn(0f32, 0.01, (n, 5), &dev).unwrap();
            for dtype in [DType::BF16, DType::F32] {
                let (h, y) = (h.to_dtype(dtype).unwrap(), y.to_dtype(dtype).unwrap());
                let bits = |t: Tensor| -> Vec<u32> {
                    t.to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                        .into_iter()
                        .map(f32::to_bits)
                        .collect()
                };
                let got = residual_add(&h, &y).unwrap();
                assert_eq!(got.dtype(), dtype);
                assert_eq!(bits(got), bits((&h + &y).unwrap()), "{dtype:?} n={n}");
            }
        }
        let empty = Tensor::zeros((0, 5), DType::BF16, &dev).unwrap();
        assert_eq!(residual_add(&empty, &empty).unwrap().dims(), [0, 5]);
    }
}
