//! `occult bench layer`: one OLMoE-shaped MoE layer on D ranks, every mode in one run on the
//! same tokens: the single-device reference, standard dispatch, Occult dispatch, and Occult with
//! pruning. Per mode: per-phase times (critical path over ranks), exact rows and bytes, E[C_T],
//! tokens/s, and, with a link profile, the projected time on that hardware.
//!
//! The router is given cluster structure (tokens near one of C centroids, experts aligned to
//! one centroid each) so that routing has the locality real MoE routers show; experts are
//! placed from a calibration batch routed by the same router.

use super::modes::{ep_dispatch, reference, summarise, Exchanges, ModeSummary, RankRun};
use crate::context::Backend;
use crate::table::Table;
use anyhow::{bail, Result};
use candle::{DType, Device, Tensor, Var};
use occult_core::analysis::cost::links::{swiglu_flops, LinkProfile};
use occult_core::analysis::placement::{self, Method, SearchConfig};
use occult_core::analysis::pruning::PruneRule;
use occult_core::analysis::routing::RouterRule;
use occult_core::analysis::run_key::{runs, DispatchMode, MoeMode, RunKey, RunPlan};
use occult_core::analysis::similarity::SimilarityTable;
use occult_core::ep::comm::Communicator;
use occult_core::ep::experts::SwigluStack;
use occult_core::ep::{
    reference_forward, route, EpMoe, EpSettings, MoeWeights, PruneSpec, StepStats,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;

/// What to benchmark.
#[derive(Clone, Debug, Serialize)]
pub struct LayerBench {
    pub experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub intermediate: usize,
    /// Tokens per rank.
    pub tokens: usize,
    pub devices: usize,
    pub steps: usize,
    pub warmup: usize,
    pub seed: u64,
    /// Latent clusters of the router (0 = unstructured random router).
    pub clusters: usize,
    pub placement: Method,
    /// Devices per token in the pruned run (0 = no pruned run).
    pub max_devices: usize,
    /// Devices per node: with fewer than `devices`, the two-level exchange runs as one more
    /// mode, and rows are counted within and across nodes.
    pub devices_per_node: Option<usize>,
    pub prune_rule: PruneRule,
    /// Renormalise the top-k gate weights over the chosen experts (DeepSpeed-MoE's TopKGate,
    /// Qwen3-MoE and Mixtral); OLMoE's softmax without it by default.
    pub renormalize: bool,
    /// Write the layer, its tokens and its reference output here ([`super::layer_file`]).
    pub layer_out: Option<std::path::PathBuf>,
    /// Time training steps (forward, then the backward of the outputs' sum) instead of
    /// forwards.
    pub train: bool,
    /// Where the layer runs (`cpu` or `cuda:N`), and its dtype (f32, bf16 or f16).
    pub device_name: String,
    pub dtype: String,
    #[serde(skip)]
    pub device: Device,
}

/// One run's measurements on one rank.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankRecord {
    pub key: RunKey,
    pub run: RankRun,
}

/// The layer's weights, tokens and calibration batch, identical on every rank.
pub struct Setup {
    pub weights: MoeWeights,
    pub rule: RouterRule,
    pub x: Vec<f32>,
    pub map: Vec<u32>,
    pub similarity: SimilarityTable,
}

fn normal(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.sample::<f32, _>(StandardNormal) * scale)
        .collect()
}

impl LayerBench {
    pub fn validate(&self) -> Result<()> {
        self.compute_dtype()?;
        occult_core::analysis::trace::check_experts_top_k(self.experts, self.top_k)
            .map_err(anyhow::Error::msg)?;
        placement::check_sizes(self.experts, self.devices)?;
        if self.hidden == 0 || self.intermediate == 0 || self.steps == 0 || self.tokens == 0 {
            bail!("--hidden, --intermediate, --tokens and --steps must be at least 1");
        }
        // Every buffer the bench allocates, in elements, checked before any is made (and
        // without overflow): at most 2^30 each (4 GiB of f32).
        let product = |xs: &[usize]| xs.iter().try_fold(1usize, |n, &x| n.checked_mul(x));
        for (what, dims) in [
            (
                "--tokens x --devices x --hidden",
                vec![self.tokens, self.devices, self.hidden],
            ),
            (
                "--experts x --hidden x --intermediate x 3 (the experts' weights)",
                vec![self.experts, self.hidden, self.intermediate, 3],
            ),
            (
                "--tokens x --devices x --top-k x --intermediate (the experts' activations)",
                vec![self.tokens, self.devices, self.top_k, self.intermediate],
            ),
        ] {
            if product(&dims).is_none_or(|n| n > 1 << 30) {
                bail!("{what} is too large for this benchmark (at most 2^30 values)");
            }
        }
        Ok(())
    }

    /// Builds the weights and tokens from the seed, and places experts from a calibration
    /// batch of the same distribution.
    pub fn setup(&self) -> Result<Setup> {
        let (e, h, i) = (self.experts, self.hidden, self.intermediate);
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let c = self.clusters.max(1);
        let centroids: Vec<Vec<f32>> = (0..c).map(|_| normal(&mut rng, h, 1.0)).collect();
        let mut cluster_of: Vec<usize> = (0..e).map(|x| x * c / e).collect();
        cluster_of.shuffle(&mut rng);
        // Router rows: 2 * centroid / H plus noise of variance 1 / (2H). A token near centroid
        // c (x = mu_c + z) then has logits of about 2 for its cluster's experts, 0 for the
        // others, plus N(0, 1): the clustered routing of `occult trace synth`.
        let mut router = Vec::with_capacity(e * h);
        for &cl in &cluster_of {
            let noise = normal(&mut rng, h, (0.5 / h as f32).sqrt());
            for (j, n) in noise.into_iter().enumerate() {
                let aligned = if self.clusters > 0 {
                    2.0 * centroids[cl][j] / h as f32
                } else {
                    0.0
                };
                router.push(aligned + n);
            }
        }
        let tokens_of = |rng: &mut ChaCha8Rng, n: usize| -> Vec<f32> {
            let mut x = Vec::with_capacity(n * h);
            for _ in 0..n {
                let cl = rng.random_range(0..c);
                for &mu in &centroids[cl] {
                    let z: f32 = rng.sample(StandardNormal);
                    let base = if self.clusters > 0 { mu } else { 0.0 };
                    x.push(base + z);
                }
            }
            x
        };
        let total = self.tokens * self.devices;
        let x = tokens_of(&mut rng, total);
        let calib = tokens_of(&mut rng, 4096.max(total));
        let dev = Device::Cpu;
        let s = 1.0 / (h as f32).sqrt();
        let t = |v: Vec<f32>, shape: &[usize]| Tensor::from_vec(v, shape, &dev);
        let experts = SwigluStack::new(
            t(normal(&mut rng, e * i * h, s), &[e, i, h])?,
            t(normal(&mut rng, e * i * h, s), &[e, i, h])?,
            t(
                normal(&mut rng, e * h * i, 1.0 / (i as f32).sqrt()),
                &[e, h, i],
            )?,
        )?;
        let weights = MoeWeights {
            router: t(router, &[e, h])?,
            router_bias: None,
            experts,
            shared: None,
        };
        let rule = RouterRule::softmax_topk(e, self.top_k, self.renormalize);
        // Calibration: route, then place and build the similarity table from it.
        let calib_t = t(calib, &[4096.max(total), h])?;
        let routed = route(&calib_t, &weights.router, &rule, None)?;
        let logits = calib_t
            .matmul(&weights.router.t()?)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let similarity = SimilarityTable::from_logits(&logits, e)?;
        let (map, _) = self.placement.place(
            &routed.ids,
            self.top_k,
            e,
            self.devices,
            &SearchConfig::default(),
            &|| {},
        )?;
        Ok(Setup {
            weights,
            rule,
            x,
            map,
            similarity,
        })
    }

    /// The runs: standard, Occult, the two-level exchange across nodes and Occult pruned to
    /// `max_devices` (the layer runs no replicas).
    pub fn runs(&self) -> Vec<RunKey> {
        runs(&RunPlan {
            devices: self.devices,
            devices_per_node: self.devices_per_node,
            prune_devices: (self.max_devices > 0)
                .then_some(self.max_devices)
                .into_iter()
                .collect(),
            node_limit: None,
            rule: self.prune_rule,
            replicas: false,
        })
    }

    /// The EP layer's dispatch and pruning of run `key`.
    fn settings_of(&self, key: &RunKey, setup: &Setup) -> (DispatchMode, Option<PruneSpec>) {
        let prune = key.prune.map(|limit| PruneSpec {
            rule: key.rule.unwrap_or(self.prune_rule),
            limit,
            similarity: Some(setup.similarity.clone()),
        });
        (ep_dispatch(key), prune)
    }

    /// Runs every EP mode on this rank (collective: every rank must call it).
    pub fn run_rank(&self, setup: &Setup, comm: &Arc<dyn Communicator>) -> Result<Vec<RankRecord>> {
        let r = comm.rank();
        let h = self.hidden;
        let x = self.on_device(Tensor::from_slice(
            &setup.x[r * self.tokens * h..(r + 1) * self.tokens * h],
            (self.tokens, h),
            &Device::Cpu,
        )?)?;
        let full = self.weights_on_device(&setup.weights)?;
        let mut out = Vec::new();
        for key in self.runs() {
            let (mode, prune) = self.settings_of(&key, setup);
            let settings = EpSettings {
                rule: setup.rule.clone(),
                device_of_expert: setup.map.clone(),
                mode,
                prune,
                devices_per_node: self.devices_per_node,
                replicas: None,
            };
            let mut layer = EpMoe::from_full(&full, settings, comm.clone())?;
            if self.train {
                layer.weights = trainable(&layer.weights)?;
                layer.anchor_reverse_exchanges()?;
            }
            let step = || -> Result<StepStats> {
                if !self.train {
                    return Ok(layer.forward(&x)?.1);
                }
                let xv = Var::from_tensor(&x)?;
                let (y, st) = layer.forward(xv.as_tensor())?;
                y.sum_all()?.backward()?;
                Ok(st)
            };
            for _ in 0..self.warmup {
                step()?;
            }
            let mut seconds = 0.0;
            let mut last = None;
            for _ in 0..self.steps {
                comm.barrier()?;
                comm.reset_stats();
                let start = Instant::now();
                let st = step()?;
                seconds += start.elapsed().as_secs_f64();
                last = Some(st);
            }
            let stats = last.expect("steps >= 1");
            let flops = swiglu_flops(stats.pairs, h, self.intermediate);
            out.push(RankRecord {
                key,
                run: RankRun {
                    rank: r,
                    seconds: seconds / self.steps as f64,
                    stats,
                    exchanges: comm.stats().exchanges,
                    flops,
                    ..RankRun::default()
                },
            });
        }
        Ok(out)
    }

    /// The reference on all tokens, on one device: seconds per forward; `None` when timing
    /// training steps (the reference is the plain per-expert loop, whose backward writes a
    /// gradient the size of the whole stack for every expert: a yardstick for forwards only).
    pub fn run_reference(&self, setup: &Setup) -> Result<Option<f64>> {
        if self.train {
            return Ok(None);
        }
        let x = self.on_device(Tensor::from_slice(
            &setup.x,
            (self.tokens * self.devices, self.hidden),
            &Device::Cpu,
        )?)?;
        let weights = self.weights_on_device(&setup.weights)?;
        let step = || -> Result<()> {
            reference_forward(&weights, &setup.rule, &x, None)?;
            // A GPU runs kernels after their launch returns: wait for them.
            Ok(self.device.synchronize()?)
        };
        for _ in 0..self.warmup {
            step()?;
        }
        let start = Instant::now();
        for _ in 0..self.steps {
            step()?;
        }
        Ok(Some(start.elapsed().as_secs_f64() / self.steps as f64))
    }

    /// The dtype of the layer's weights and tokens.
    pub fn compute_dtype(&self) -> Result<DType> {
        Ok(occult_core::models::loader::parse_dtype(&self.dtype)?)
    }

    /// `t` (made on the CPU in f32) on the bench's device, in its dtype.
    fn on_device(&self, t: Tensor) -> Result<Tensor> {
        Ok(t.to_dtype(self.compute_dtype()?)?.to_device(&self.device)?)
    }

    /// The layer's weights on the bench's device, in its dtype.
    fn weights_on_device(&self, w: &MoeWeights) -> Result<MoeWeights> {
        let e = &w.experts;
        Ok(MoeWeights {
            router: self.on_device(w.router.clone())?,
            router_bias: None,
            experts: SwigluStack::new(
                self.on_device(e.gate.clone())?,
                self.on_device(e.up.clone())?,
                self.on_device(e.down.clone())?,
            )?,
            shared: None,
        })
    }

    /// Combines every rank's records into one summary per run.
    pub fn combine(&self, records: &[RankRecord], link: Option<&LinkProfile>) -> Vec<ModeSummary> {
        let mut keys: Vec<RunKey> = Vec::new();
        for r in records {
            if !keys.contains(&r.key) {
                keys.push(r.key);
            }
        }
        keys.into_iter()
            .map(|key| {
                let runs: Vec<RankRun> = records
                    .iter()
                    .filter(|r| r.key == key)
                    .map(|r| r.run.clone())
                    .collect();
                let tokens = runs.iter().map(|r| r.stats.tokens).sum();
                let dispatch = ep_dispatch(&key);
                summarise(
                    key,
                    self.devices,
                    tokens,
                    &runs,
                    link,
                    Exchanges::layer(dispatch),
                )
            })
            .collect()
    }
}

/// `w` with its router and experts as trainable variables (copies), for training steps.
fn trainable(w: &MoeWeights) -> Result<MoeWeights> {
    let var = |t: &Tensor| -> Result<Tensor> { Ok(Var::from_tensor(t)?.as_tensor().clone()) };
    let e = &w.experts;
    Ok(MoeWeights {
        router: var(&w.router)?,
        router_bias: w.router_bias.clone(),
        experts: SwigluStack::new(var(&e.gate)?, var(&e.up)?, var(&e.down)?)?,
        shared: w.shared.clone(),
    })
}

/// Runs `bench` on its ranks (`backend`), prints the table on rank 0, and writes it as JSON
/// to `json`, projected onto `link` when given.
pub fn run(
    bench: &LayerBench,
    backend: Backend,
    link: Option<&LinkProfile>,
    json: Option<&std::path::Path>,
) -> Result<()> {
    let (records, is_root) = match backend {
        Backend::Local => {
            bench.validate()?;
            let setup = bench.setup()?;
            eprintln!("running {} local ranks", bench.devices);
            let per_rank = occult_core::ep::comm::local::run_local(bench.devices, |comm| {
                bench
                    .run_rank(&setup, comm)
                    .map_err(|e| occult_core::Error::invalid(e.to_string()))
            });
            let mut records = Vec::new();
            for r in per_rank {
                records.extend(r?);
            }
            (Some((records, bench.run_reference(&setup)?)), true)
        }
        Backend::Mpi | Backend::Nccl => process_layer(bench, backend)?,
    };
    if !is_root {
        return Ok(());
    }
    let (records, reference_s) = records.expect("root has the records");
    if let Some(path) = &bench.layer_out {
        // The setup is the seed's on every rank: made again here, on the root.
        super::layer_file::write(bench, &bench.setup()?, path)?;
        eprintln!("the layer, its tokens and its output -> {}", path.display());
    }
    let mut results: Vec<ModeSummary> = bench.combine(&records, link);
    if let Some(reference_s) = reference_s {
        let total = bench.tokens * bench.devices;
        let reference_flops = swiglu_flops(total * bench.top_k, bench.hidden, bench.intermediate);
        let reference = reference(total, reference_s, None, Some(reference_flops));
        results.insert(0, reference);
    }
    print!("{}", render(bench, &results, link, backend));
    if let Some(out) = json {
        super::report::write_modes(out, "layer", None, backend, bench, link, &results)?;
    }
    Ok(())
}

type LayerRecords = (Option<(Vec<RankRecord>, Option<f64>)>, bool);

/// The bench on this process's rank of `backend`'s group (one process per rank); rank 0
/// gathers the records.
fn process_layer(bench: &LayerBench, backend: Backend) -> Result<LayerRecords> {
    let timeout = occult_core::ep::comm::DEFAULT_TIMEOUT;
    let comm = backend.world(bench.devices, &bench.device, timeout)?;
    bench.validate()?;
    let setup = bench.setup()?;
    let mine = bench.run_rank(&setup, &comm)?;
    // Every rank sends its records to rank 0.
    let bytes = serde_json::to_vec(&mine)?;
    let mut counts = vec![0; comm.size()];
    counts[0] = bytes.len();
    let (all, from) = comm.all_to_all_v_bytes(&bytes, &counts, 1)?;
    if comm.rank() != 0 {
        return Ok((None, false));
    }
    let mut records = Vec::new();
    let mut at = 0;
    for n in from {
        let part: Vec<RankRecord> = serde_json::from_slice(&all[at..at + n])?;
        records.extend(part);
        at += n;
    }
    Ok((Some((records, bench.run_reference(&setup)?)), true))
}

fn render(
    bench: &LayerBench,
    results: &[ModeSummary],
    link: Option<&LinkProfile>,
    backend: Backend,
) -> String {
    let ms = |s: f64| format!("{:.2}", s * 1e3);
    let mut header = vec![
        "mode",
        "E[C_T]",
        "rows sent",
        "remote rows",
        "remote MB",
        "step ms",
        "route",
        "plan",
        "dispatch",
        "compute",
        "combine",
        "tokens/s",
        "expert TFLOP/s",
    ];
    if link.is_some() {
        header.extend(["proj. ms", "proj. compute", "proj. comm"]);
    }
    let mut t = Table::new(&header);
    for r in results {
        let mut row = vec![
            r.mode.clone(),
            format!("{:.3}", r.ect),
            crate::table::count(r.rows_sent as u64),
            crate::table::count(r.remote_rows_sent as u64),
            format!("{:.2}", r.bytes_sent as f64 / 1e6),
            ms(r.seconds),
            ms(r.route_s),
            ms(r.plan_s),
            ms(r.dispatch_s),
            ms(r.compute_s),
            ms(r.combine_s),
            format!("{:.0}", r.tokens_per_s),
            format!(
                "{:.3}",
                r.expert.as_ref().map_or(0.0, |e| e.expert_flops_per_s) / 1e12
            ),
        ];
        if link.is_some() {
            match &r.projected {
                Some(p) => row.extend([
                    format!("{:.4}", p.total_s * 1e3),
                    format!("{:.4}", p.compute_s * 1e3),
                    format!("{:.4}", p.comm_s * 1e3),
                ]),
                None => row.extend(["-".into(), "-".into(), "-".into()]),
            }
        }
        t.row(row);
    }
    let mut out = format!(
        "layer: {} experts, top-{}, hidden {}, intermediate {}, {} on {}; {} ranks x {} tokens ({} backend);\n  placement {}.\n  expert TFLOP/s: the slowest rank's expert FLOPs over its compute stage.\n  step ms: the slowest rank's mean {}; phase columns: each phase's slowest rank in the forward \
         (phases include waiting for peers, so they need not add up to step ms)\n\n{}",
        bench.experts,
        bench.top_k,
        bench.hidden,
        bench.intermediate,
        bench.dtype,
        bench.device_name,
        bench.devices,
        bench.tokens,
        backend.name(),
        bench.placement.name(),
        if bench.train {
            "training step (forward, then the backward of the outputs' sum; no single-device \
             reference row)"
        } else {
            "forward time"
        },
        t.render()
    );
    if let Some(l) = link {
        out.push_str(&format!(
            "\nprojected on link profile {} ({}): expert FLOPs / {:.2e} FLOP/s + bytes / bandwidth \
             + latency per message, slowest rank\n",
            l.name, l.description, l.device_flops
        ));
    }
    let find = |m: MoeMode| results.iter().find(|r| r.key == RunKey::exact(m));
    if let (Some(s), Some(o)) = (find(MoeMode::Standard), find(MoeMode::Occult)) {
        let ratio = |a: f64, b: f64| {
            if b > 0.0 {
                format!("{:.3}", a / b)
            } else {
                "-".into()
            }
        };
        out.push_str(&format!(
            "\noccult / standard: rows {}, remote rows {}, remote bytes {}, measured time {}{}\n",
            ratio(o.rows_sent as f64, s.rows_sent as f64),
            ratio(o.remote_rows_sent as f64, s.remote_rows_sent as f64),
            ratio(o.bytes_sent as f64, s.bytes_sent as f64),
            ratio(o.seconds, s.seconds),
            match (o.projected_seconds, s.projected_seconds) {
                (Some(a), Some(b)) => format!(", projected time {}", ratio(a, b)),
                _ => String::new(),
            }
        ));
    }
    out
}
