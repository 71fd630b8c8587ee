//! Occult's placement with replicas: from a partition (one slot per expert), R more slots, the
//! same number on every device, chosen under the copy rule they will be served with
//! ([`CopyRule`]: Occult's cover, SGLang's static table or TensorRT-LLM's uniform choice).
//! Where the partition is over the load cap, copies of the over-cap devices' experts first bring
//! it under (each the copy that lowers the pairs over the cap most); then each slot left takes
//! the copy that lowers the layer's exact sum of C_T the most under the rule, among copies that
//! keep the busiest device within the cap. Where no copy lowers it, the slot takes the copy that
//! raises it least (ties: the lower max/mean load, the hotter expert), still within the cap. A
//! device never holds two copies of one expert, and the result is recounted from the finished
//! map: refused, with the figures, if it breaks the cap. Every candidate is scored by a full
//! recount of the layer under the rule, so the figure it reports is the one the analysis, the
//! dispatch and the export count.
//!
//! Candidates per step: for each device with a free slot, the experts not on it whose tokens
//! most often also use an expert on it (those a copy there can save a device for), the best
//! few of them, and the hottest few not on it.

use super::replicas::{CopyRule, ReplicaMap};
use super::sglang_dispatch::SglangState;
use crate::{bail, Result};

/// Co-used candidates scored exactly per device and step.
const CANDIDATES_PER_DEVICE: usize = 8;
/// Hottest experts also scored per device and step.
const HOT_PER_DEVICE: usize = 3;
/// Coldest experts also scored per device and step (a copy that moves little load).
const COLD_PER_DEVICE: usize = 3;

/// A candidate map's figures under the rule on the layer's routing.
#[derive(Clone, Debug)]
struct Scored {
    ect: f64,
    /// Max/mean device load.
    ratio: f64,
    /// Pairs over the load cap, summed over devices (0 without a cap).
    excess: f64,
    /// Each device's (token, expert) pairs.
    pairs: Vec<f64>,
}

/// How a slot's candidate ranks: (over the cap, then E[C_T] within it or max/mean over it, the
/// other of the two, the candidate's rank); the least wins.
type FillKey = (bool, f64, f64, usize);

/// What [`replicate`] found.
#[derive(Clone, Debug)]
pub struct ReplicaOutcome {
    pub map: ReplicaMap,
    /// E[C_T] and max/mean load of the start (the partition) and of the result, under the
    /// rule, the result recounted from `map`.
    pub start: (f64, f64),
    pub result: (f64, f64),
}

/// One layer's routing and the rule its copies are served with.
#[derive(Clone, Copy, Debug)]
pub struct LayerRouting<'a> {
    /// `[tokens, k]` expert ids.
    pub ids: &'a [u32],
    pub k: usize,
    /// Each token's device.
    pub source: &'a [u32],
    pub rule: CopyRule,
    /// SGLang's generators before this layer (its table depends on the layers before).
    pub sglang: &'a SglangState,
}

impl LayerRouting<'_> {
    /// `slots` (per device, equal or not) as a map: devices short of the widest are padded
    /// with their own first expert, which changes no rule's choice (copies on one device serve
    /// as one); only maps being scored are padded, never a finished one.
    fn map(&self, slots: &[Vec<u32>], e_n: usize, loads: &[f64]) -> Result<ReplicaMap> {
        let width = slots.iter().map(Vec::len).max().unwrap_or(0);
        let padded: Vec<u32> = slots
            .iter()
            .flat_map(|s| {
                let mut s = s.clone();
                while s.len() < width {
                    s.push(s[0]);
                }
                s
            })
            .collect();
        let mut map = ReplicaMap::new(padded, e_n, slots.len(), Some(loads))?;
        if self.rule == CopyRule::Sglang {
            map.set_sglang_state(&mut self.sglang.clone());
        }
        Ok(map)
    }
}

/// Adds `replicas` copies to the partition `device_of_expert` (E and R each a multiple of the
/// devices) for the layer's routing, keeping the max/mean device load under `routing.rule`
/// within `max_load_factor` where given. A start over the cap is first balanced: copies of the
/// over-cap devices' experts go where they lower the pairs over the cap most (refused, with the
/// figures, if R copies cannot bring it under); then no copy that breaks the cap is taken. The
/// experts' token counts order the cover rule's ties.
pub fn replicate(
    routing: LayerRouting,
    device_of_expert: &[u32],
    num_devices: usize,
    replicas: usize,
    max_load_factor: Option<f64>,
) -> Result<ReplicaOutcome> {
    let e_n = device_of_expert.len();
    if num_devices == 0 || !e_n.is_multiple_of(num_devices) || !replicas.is_multiple_of(num_devices)
    {
        bail!(
            "{e_n} experts and {replicas} replicas must each divide evenly over {num_devices} \
             devices"
        );
    }
    let per_device = (e_n + replicas) / num_devices;
    if per_device > e_n {
        bail!(
            "{per_device} slots per device for {e_n} experts: a device would hold an expert \
             twice; give at most {} replicas",
            e_n * (num_devices - 1)
        );
    }
    let LayerRouting { ids, k, source, .. } = routing;
    let loads: Vec<f64> = super::eplb::expert_loads(ids, e_n)
        .into_iter()
        .map(f64::from)
        .collect();
    let mut slots: Vec<Vec<u32>> = super::experts_by_device(device_of_expert, num_devices);
    // The most pairs a device may hold under the cap, and the pairs over it, summed.
    let limit = |pairs: &[f64]| {
        let total: f64 = pairs.iter().sum();
        max_load_factor.unwrap_or(f64::INFINITY) * total / num_devices as f64
    };
    let excess = |pairs: &[f64]| -> f64 {
        let at = limit(pairs);
        pairs.iter().map(|&p| (p - at).max(0.0)).sum()
    };
    let score = |slots: &[Vec<u32>]| -> Result<Scored> {
        let st = routing
            .map(slots, e_n, &loads)?
            .stats(ids, k, source, routing.rule, None)?;
        Ok(Scored {
            ect: st.ect(),
            ratio: st.max_load_ratio(),
            excess: excess(&st.pairs),
            pairs: st.pairs,
        })
    };
    let over = |s: &Scored| max_load_factor.is_some_and(|f| s.ratio > f + 1e-12);
    let start = score(&slots)?;
    let mut best = start.clone();
    let mut left = replicas;
    // Balance first: while devices are over the cap, copy an expert of an over-cap device to
    // a device with a free slot, the copy that lowers the pairs over the cap most (then
    // max/mean load, then the sum of C_T).
    let key = |s: &Scored| (s.excess, s.ratio, s.ect);
    let lower =
        |a: (f64, f64, f64), b: (f64, f64, f64)| a.partial_cmp(&b).is_some_and(|o| o.is_lt());
    while over(&best) && left > 0 {
        let at = limit(&best.pairs);
        let mut moves = Vec::new();
        for b in (0..num_devices).filter(|&b| best.pairs[b] > at) {
            for &e in &slots[b] {
                for d in (0..num_devices).filter(|&d| d != b && slots[d].len() < per_device) {
                    if !slots[d].contains(&e) {
                        moves.push((d, e));
                    }
                }
            }
        }
        let scored = score_all(&moves, |&(d, e)| {
            let mut trial = slots.clone();
            trial[d].push(e);
            score(&trial)
        })?;
        let mut step: Option<(Scored, usize, u32)> = None;
        for (s, &(d, e)) in scored.into_iter().zip(&moves) {
            let better = s.excess < best.excess - 1e-9
                || (s.excess <= best.excess + 1e-9 && s.ratio < best.ratio - 1e-12);
            if better && step.as_ref().is_none_or(|(t, ..)| lower(key(&s), key(t))) {
                step = Some((s, d, e));
            }
        }
        let Some((s, d, e)) = step else {
            break;
        };
        slots[d].push(e);
        best = s;
        left -= 1;
    }
    // Then every slot left: the copy that lowers the sum most, else raises it least, within
    // the cap where any candidate keeps it.
    for _ in 0..left {
        let mut moves = Vec::new();
        for d in (0..num_devices).filter(|&d| slots[d].len() < per_device) {
            for (rank, e) in candidates(ids, k, &slots, d, &loads)
                .into_iter()
                .enumerate()
            {
                moves.push((d, e, rank));
            }
        }
        let scored = score_all(&moves, |&(d, e, _)| {
            let mut trial = slots.clone();
            trial[d].push(e);
            score(&trial)
        })?;
        // (over the cap, E[C_T] within it or max/mean over it, the other, candidate rank): the
        // least wins.
        let mut step: Option<(FillKey, Scored, usize, u32)> = None;
        for (s, &(d, e, rank)) in scored.into_iter().zip(&moves) {
            let key = if over(&s) {
                (true, s.ratio, s.ect, rank)
            } else {
                (false, s.ect, s.ratio, rank)
            };
            if step
                .as_ref()
                .is_none_or(|(t, ..)| key.partial_cmp(t).is_some_and(|o| o.is_lt()))
            {
                step = Some((key, s, d, e));
            }
        }
        let (_, s, d, e) = step.expect("a device with a free slot has an expert it lacks");
        slots[d].push(e);
        best = s;
    }
    debug_assert!(slots.iter().all(|s| s.len() == per_device));
    // Over the cap still (the last slots had no copy within it): swap one copy for another
    // expert on its device, the swap that lowers the pairs over the cap most (then max/mean
    // load, then the sum of C_T), while one does.
    let starts: Vec<usize> = super::experts_by_device(device_of_expert, num_devices)
        .iter()
        .map(Vec::len)
        .collect();
    while over(&best) {
        let mut moves = Vec::new();
        for d in 0..num_devices {
            for i in starts[d]..per_device {
                for x in (0..e_n as u32).filter(|x| !slots[d].contains(x)) {
                    moves.push((d, i, x));
                }
            }
        }
        let scored = score_all(&moves, |&(d, i, x)| {
            let mut trial = slots.clone();
            trial[d][i] = x;
            score(&trial)
        })?;
        let mut step: Option<(Scored, usize, usize, u32)> = None;
        for (s, &(d, i, x)) in scored.into_iter().zip(&moves) {
            let better = s.excess < best.excess - 1e-9
                || (s.excess <= best.excess + 1e-9 && s.ratio < best.ratio - 1e-12);
            if better && step.as_ref().is_none_or(|(t, ..)| lower(key(&s), key(t))) {
                step = Some((s, d, i, x));
            }
        }
        let Some((s, d, i, x)) = step else {
            break;
        };
        slots[d][i] = x;
        best = s;
    }
    refine(&mut slots, &starts, &mut best, &score, &over)?;
    // The finished map, recounted.
    let mut map = ReplicaMap::new(slots.concat(), e_n, num_devices, Some(&loads))?;
    if routing.rule == CopyRule::Sglang {
        map.set_sglang_state(&mut routing.sglang.clone());
    }
    map.check_servable()?;
    let st = map.stats(ids, k, source, routing.rule, None)?;
    let result = (st.ect(), st.max_load_ratio());
    if let Some(f) = max_load_factor.filter(|&f| result.1 > f + 1e-9) {
        bail!(
            "the copies leave the max/mean load at {:.3} under the {} rule, over the cap {f} \
             (E[C_T] {:.3}; from {:.3}): give a higher --max-load-factor or fewer --replicas",
            result.1,
            routing.rule.name(),
            result.0,
            start.ratio
        );
    }
    debug_assert!((result.0 - best.ect).abs() < 1e-9);
    Ok(ReplicaOutcome {
        map,
        start: (start.ect, start.ratio),
        result,
    })
}

/// Passes of [`refine`] at most.
const REFINE_PASSES: usize = 2;
/// Passes of [`refine`] at most while the map is over the cap.
const BALANCE_PASSES: usize = 12;

/// Scores every move, in parallel, in the moves' order.
fn score_all<M: Sync>(
    moves: &[M],
    score: impl Fn(&M) -> Result<Scored> + Sync + Send,
) -> Result<Vec<Scored>> {
    use rayon::prelude::*;
    moves.par_iter().map(score).collect()
}

/// Swaps each copy (a slot past device d's `starts[d]` partition slots) with a slot of another
/// device (neither then holding an expert twice), the swap that lowers the sum of C_T under the
/// rule most while keeping the load within the cap (or, over the cap, lowers the pairs over it
/// most), copy after copy, pass after pass, until a pass finds none or [`REFINE_PASSES`] have
/// run.
fn refine(
    slots: &mut [Vec<u32>],
    starts: &[usize],
    best: &mut Scored,
    score: &(dyn Fn(&[Vec<u32>]) -> Result<Scored> + Sync),
    over: &(dyn Fn(&Scored) -> bool + Sync),
) -> Result<()> {
    let d_n = slots.len();
    let per = slots[0].len();
    let copies: Vec<(usize, usize)> = (0..d_n)
        .flat_map(|d| (starts[d]..per).map(move |i| (d, i)))
        .collect();
    // Over the cap, passes go on while they lower the pairs over it.
    for pass in 0.. {
        if pass >= REFINE_PASSES && !(over(best) && pass < BALANCE_PASSES) {
            break;
        }
        let mut improved = false;
        for &(da, ia) in &copies {
            let x = slots[da][ia];
            let partners: Vec<(usize, usize)> = (0..d_n)
                .filter(|&db| db != da)
                .flat_map(|db| (0..per).map(move |ib| (db, ib)))
                .filter(|&(db, ib)| {
                    let y = slots[db][ib];
                    x != y && !slots[da].contains(&y) && !slots[db].contains(&x)
                })
                .collect();
            let scored = score_all(&partners, |&(db, ib)| {
                let mut trial = slots.to_vec();
                trial[da][ia] = trial[db][ib];
                trial[db][ib] = x;
                score(&trial)
            })?;
            let was_over = over(best);
            let mut step: Option<(f64, Scored, usize, usize)> = None;
            for (s, &(db, ib)) in scored.into_iter().zip(&partners) {
                let gain = if was_over {
                    best.excess - s.excess
                } else if over(&s) {
                    continue;
                } else {
                    best.ect - s.ect
                };
                if gain > 1e-9 && step.as_ref().is_none_or(|(g, ..)| gain > *g) {
                    step = Some((gain, s, db, ib));
                }
            }
            if let Some((_, s, db, ib)) = step {
                slots[da][ia] = slots[db][ib];
                slots[db][ib] = x;
                *best = s;
                improved = true;
            }
        }
        if !improved {
            break;
        }
    }
    Ok(())
}

/// The experts a copy on device `d` could help most: not on `d`, ranked by the tokens that use
/// them together with an expert on `d` (the best few), then the hottest few and the coldest
/// few not yet listed (a cold copy moves little load).
fn candidates(ids: &[u32], k: usize, slots: &[Vec<u32>], d: usize, loads: &[f64]) -> Vec<u32> {
    let e_n = loads.len();
    let mut on_d = vec![false; e_n];
    for &e in &slots[d] {
        on_d[e as usize] = true;
    }
    let mut gain = vec![0u64; e_n];
    for chosen in ids.chunks_exact(k) {
        if chosen.iter().any(|&e| on_d[e as usize]) {
            for &e in chosen.iter().filter(|&&e| !on_d[e as usize]) {
                gain[e as usize] += 1;
            }
        }
    }
    let mut order: Vec<u32> = (0..e_n as u32).filter(|&e| !on_d[e as usize]).collect();
    order.sort_by(|&a, &b| gain[b as usize].cmp(&gain[a as usize]).then(a.cmp(&b)));
    let mut by_load = order.clone();
    by_load.sort_by(|&a, &b| {
        loads[b as usize]
            .total_cmp(&loads[a as usize])
            .then(a.cmp(&b))
    });
    order.truncate(CANDIDATES_PER_DEVICE);
    let hot: Vec<u32> = by_load.iter().copied().take(HOT_PER_DEVICE).collect();
    let cold: Vec<u32> = by_load
        .iter()
        .rev()
        .copied()
        .take(COLD_PER_DEVICE)
        .collect();
    for e in hot.into_iter().chain(cold) {
        if !order.contains(&e) {
            order.push(e);
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cover<'a>(
        ids: &'a [u32],
        k: usize,
        source: &'a [u32],
        st: &'a SglangState,
    ) -> LayerRouting<'a> {
        LayerRouting {
            ids,
            k,
            source,
            rule: CopyRule::Cover,
            sglang: st,
        }
    }

    /// Two devices; tokens pair expert 0 (device 0) with expert 2 (device 1): one copy of 2 on
    /// device 0 (or of 0 on device 1) brings every such token to one device.
    #[test]
    fn a_copy_beside_its_partner_brings_tokens_to_one_device() {
        let map = [0, 0, 1, 1];
        let ids: Vec<u32> = (0..10).flat_map(|_| [0u32, 2]).collect();
        let source = vec![0u32; 10];
        let st0 = SglangState::start(2, None);
        let out = replicate(cover(&ids, 2, &source, &st0), &map, 2, 2, None).unwrap();
        assert_eq!(out.start.0, 2.0);
        assert_eq!(out.result.0, 1.0);
        assert_eq!(out.map.slots_per_device(), 3);
        // Recounted from the map itself.
        let st = out
            .map
            .stats(&ids, 2, &source, CopyRule::Cover, None)
            .unwrap();
        assert_eq!(st.ect(), 1.0);
        assert!(replicate(cover(&ids, 2, &source, &st0), &map, 2, 1, None).is_err());
    }

    /// Every token uses expert 0 (device 0), half of them from each device: the start's
    /// max/mean load is 2. A copy of 0 on device 1 serves the tokens that start there, which
    /// brings it to 1; a cap one copy cannot reach is refused with the figures.
    #[test]
    fn a_start_over_the_cap_is_balanced_by_copies_of_the_busiest_devices_experts() {
        let map = [0, 0, 1, 1];
        let ids = vec![0u32; 10];
        let source: Vec<u32> = (0..10).map(|t| t / 5).collect();
        let st0 = SglangState::start(2, None);
        let out = replicate(cover(&ids, 1, &source, &st0), &map, 2, 2, Some(1.05)).unwrap();
        assert_eq!(out.start.1, 2.0);
        assert_eq!(out.result.1, 1.0);
        assert!(out.map.devices_of(0).contains(&1));
        let st = out
            .map
            .stats(&ids, 1, &source, CopyRule::Cover, None)
            .unwrap();
        assert_eq!(st.pairs, vec![5.0, 5.0]);
        // All tokens from device 0: no copy moves load, so the cap is out of reach.
        let e = replicate(cover(&ids, 1, &[0; 10], &st0), &map, 2, 2, Some(1.05)).unwrap_err();
        assert!(e.to_string().contains("over the cap"), "{e}");
    }

    /// On clustered routing, under each rule, with and without a cap: the figures reported are
    /// a recount of the map returned, under the rule it was placed for (SGLang's table from the
    /// state given); the cap holds; no device holds an expert twice; every slot is filled.
    #[test]
    fn the_reported_result_is_a_recount_of_the_map_under_its_rule() {
        use crate::analysis::synth::{synth_trace, SynthConfig};
        let cfg = SynthConfig {
            num_experts: 16,
            top_k: 4,
            layers: 1,
            ..SynthConfig::olmoe_like(800, 11)
        };
        let trace = synth_trace(&cfg, &|| ()).unwrap();
        let ids = &trace.layers[0].topk_ids;
        let d = 4;
        let source: Vec<u32> = (0..800).map(|t| (t * d / 800) as u32).collect();
        let co = crate::analysis::collab::CoActivation::from_ids(ids, 4, 16);
        let part = crate::analysis::placement::search(ids, 4, &co, d, &Default::default())
            .unwrap()
            .map;
        // A generator state past one earlier layer, as a second layer's search sees it.
        let mut st = SglangState::start(d, None);
        st.next_layer(&crate::analysis::placement::contiguous(16, d), 16);
        for rule in CopyRule::ALL {
            for cap in [None, Some(1.3)] {
                let routing = LayerRouting {
                    ids,
                    k: 4,
                    source: &source,
                    rule,
                    sglang: &st,
                };
                let out = match replicate(routing, &part, d, 4, cap) {
                    Ok(out) => out,
                    // A cap the copies cannot reach is refused with its figures.
                    Err(e) => {
                        assert!(cap.is_some() && e.to_string().contains("cap"), "{e}");
                        continue;
                    }
                };
                let mut map = out.map.clone();
                map.set_sglang_state(&mut st.clone());
                map.check_servable().unwrap();
                assert_eq!(map.slots_per_device(), 5);
                let recount = map.stats(ids, 4, &source, rule, None).unwrap();
                assert_eq!(
                    out.result,
                    (recount.ect(), recount.max_load_ratio()),
                    "{rule:?}"
                );
                if let Some(f) = cap {
                    assert!(out.result.1 <= f + 1e-9, "{rule:?}: {:?}", out.result);
                }
            }
        }
    }
}
