//! `occult export checkpoint`: for every family's committed fixture, in every expert layout the
//! loader reads, and random placements on 2, 4 and 8 devices, the exported checkpoint
//! - holds what an independent oracle says (per-expert tensors under their new ids, fused
//!   expert tensors and router rows permuted, everything else unchanged) in the input's shards,
//!   names, shapes and dtypes;
//! - gives the original's logits on one device;
//! - served by the EP engine under *contiguous* placement gives the outputs, per-layer counts
//!   (rows, pairs, C_T) and per-link rows the original gives under the placement;
//! - records a trace that, mapped back, is the original's trace.
//!
//! And it refuses what it cannot do right, saying why.

use candle::{DType, Device, Tensor};
use occult_core::analysis::placement::{contiguous, LayerPlacement, Placement, PLACEMENT_FORMAT};
use occult_core::analysis::run_key::DispatchMode;
use occult_core::analysis::trace::Trace;
use occult_core::ep::comm::local::run_local_with_timeout;
use occult_core::ep::comm::{Communicator, PeerStats};
use occult_core::ep::StepStats;
use occult_core::interop::checkpoint::export::shard_tensors;
use occult_core::interop::checkpoint::export::ExpertLayout;
use occult_core::interop::checkpoint::{export_checkpoint, Renumbering, RENUMBERING_FILE};
use occult_core::models::loader::Checkpoint;
use occult_core::models::model::{DenseParts, Logits, Model, MoeSetup, RoutingRecorder};
use occult_tests::data_parallel::{sequences, ARCHS};
use occult_tests::placements::{random_group_whole_maps, random_maps};
use occult_tests::storage::{relayout, ExpertStorage};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(30);

fn fixture(arch: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/models")
        .join(arch)
}

fn open(dir: &Path) -> Checkpoint {
    Checkpoint::open(dir.to_str().unwrap(), None, DType::F32).unwrap()
}

fn placement(maps: &BTreeMap<usize, Vec<u32>>, d: usize) -> Placement {
    Placement {
        format: PLACEMENT_FORMAT.into(),
        num_experts: maps.values().next().unwrap().len(),
        num_devices: d,
        method: "random".into(),
        source: Default::default(),
        layers: maps
            .iter()
            .map(|(&layer, m)| LayerPlacement {
                layer,
                device_of_expert: m.clone(),
                metrics: None,
                slots: None,
                expert_load: None,
            })
            .collect(),
    }
}

fn all_tensors(dir: &Path) -> HashMap<String, Tensor> {
    let files = occult_core::models::checkpoint::from_folder(dir).unwrap();
    let mut all = HashMap::new();
    for f in &files.weights {
        all.extend(candle::safetensors::load(f, &Device::Cpu).unwrap());
    }
    all
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The oracle: what each exported tensor must hold, read from the source by name, by rules
/// written here independently of the exporter.
fn check_tensors(
    label: &str,
    src: &Path,
    out: &Path,
    ren: &Renumbering,
    [block, router]: [&str; 2],
) {
    let (a, b) = (all_tensors(src), all_tensors(out));
    let mut names: Vec<&String> = b.keys().collect();
    names.sort();
    assert_eq!(
        a.keys().collect::<std::collections::BTreeSet<_>>(),
        b.keys().collect(),
        "{label}: the same tensor names"
    );
    let (mut moved, mut rows) = (0, 0);
    for name in names {
        let parts: Vec<&str> = name.split('.').collect();
        let layer = (parts.len() > 3 && parts[1] == "layers")
            .then(|| parts[2].parse::<usize>().ok())
            .flatten()
            .and_then(|l| ren.layer(l));
        let want = match layer {
            Some(lr) if parts[3] == block && parts[4] == "experts" => {
                match parts[5].parse::<usize>() {
                    Ok(j) => {
                        let mut p = parts.clone();
                        let orig = lr.new_to_original[j].to_string();
                        p[5] = &orig;
                        moved += 1;
                        a[&p.join(".")].clone()
                    }
                    Err(_) => {
                        rows += 1;
                        let idx = Tensor::new(lr.new_to_original.as_slice(), &Device::Cpu).unwrap();
                        a[name].index_select(&idx, 0).unwrap()
                    }
                }
            }
            Some(lr) if parts[3] == block && parts[4] == router => {
                rows += 1;
                let idx = Tensor::new(lr.new_to_original.as_slice(), &Device::Cpu).unwrap();
                a[name].index_select(&idx, 0).unwrap()
            }
            _ => a[name].clone(),
        };
        assert_eq!(b[name].dims(), want.dims(), "{label}: {name}'s shape");
        assert_eq!(b[name].dtype(), want.dtype(), "{label}: {name}'s dtype");
        assert!(
            values(&b[name]) == values(&want),
            "{label}: {name}'s values"
        );
    }
    assert!(moved + rows > 0, "{label}: the oracle saw the experts");
}

/// One forward per rank (rank r runs sequence r) under EP with `maps`: each rank's logits,
/// per-layer counts and per-peer traffic.
type RankRun = (Vec<f32>, BTreeMap<usize, StepStats>, Vec<PeerStats>);

fn ep_run(ck: &Checkpoint, maps: BTreeMap<usize, Vec<u32>>, d: usize) -> Vec<RankRun> {
    let seqs = sequences(&vec![6; d], ck.cfg.vocab_size, 5);
    let out = run_local_with_timeout(d, TIMEOUT, |comm: &Arc<dyn Communicator>| {
        let dense = DenseParts::load(&ck.weights, &ck.cfg)?;
        let setup = MoeSetup {
            mode: Some(DispatchMode::Occult),
            maps: maps.clone(),
            num_devices: d,
            prune: BTreeMap::new(),
            devices_per_node: None,
            replicas: BTreeMap::new(),
        };
        let m = Model::assemble(dense, &ck.weights, &setup, Some(comm.clone()))?;
        let s = &seqs[comm.rank()];
        let ids = Tensor::from_slice(s, (1, s.len()), &Device::Cpu)?;
        let logits = m.forward(&ids, None, None, Logits::All)?;
        let stats = m.take_ep_stats_by_layer();
        m.finish()?;
        Ok((values(&logits), stats, comm.stats().peers))
    });
    out.into_iter().map(|r| r.unwrap()).collect()
}

fn counts(s: &StepStats) -> [usize; 6] {
    [
        s.tokens,
        s.rows_sent,
        s.remote_rows_sent,
        s.rows_received,
        s.pairs,
        s.devices_touched,
    ]
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

/// The routing of one sequence on one device, as a trace.
fn trace_of(ck: &Checkpoint) -> Trace {
    let m = Model::load_reference(&ck.weights, &ck.cfg).unwrap();
    let s = &sequences(&[12], ck.cfg.vocab_size, 9)[0];
    let ids = Tensor::from_slice(s, (1, s.len()), &Device::Cpu).unwrap();
    let mut rec = RoutingRecorder::default();
    m.forward(&ids, None, Some(&mut rec), Logits::Last).unwrap();
    occult_eval::jobs::profile::trace_of(rec, &ck.cfg, "model", "random", true)
}

fn one_device_logits(ck: &Checkpoint) -> Vec<f32> {
    let m = Model::load_reference(&ck.weights, &ck.cfg).unwrap();
    let s = &sequences(&[10], ck.cfg.vocab_size, 3)[0];
    let ids = Tensor::from_slice(s, (1, s.len()), &Device::Cpu).unwrap();
    values(&m.forward(&ids, None, None, Logits::All).unwrap())
}

fn export_and_check(arch: &str, storage: Option<ExpertStorage>, d: usize, seed: u64) {
    let label = format!("{arch} {storage:?} D={d}");
    let t = tempfile::tempdir().unwrap();
    let src = match storage {
        None => fixture(arch),
        Some(s) => {
            let p = t.path().join("source");
            relayout(arch, s, &p);
            p
        }
    };
    let ck = open(&src);
    // Group-limited models' groups kept whole (a renumbering that broke one would route
    // otherwise, and is refused).
    let maps = random_group_whole_maps(&ck.cfg, d, seed);
    let p = placement(&maps, d);
    let groups = ExpertLayout::read(&src).unwrap().groups;
    assert_eq!(
        groups.is_some(),
        ck.cfg.moe.router.group_limit.is_some(),
        "{label}"
    );
    let ren = Renumbering::from_placement(&p, groups).unwrap();
    let out = t.path().join("exported");
    let summary = export_checkpoint(&src, &out, &ren, false, &|_, _| {}).unwrap();
    assert!(summary.renamed + summary.permuted > 0, "{label}");

    // The same shards, names and shapes; the index file unchanged; the renumbering beside.
    assert_eq!(
        shard_tensors(&src).unwrap(),
        shard_tensors(&out).unwrap(),
        "{label}"
    );
    let index = "model.safetensors.index.json";
    if src.join(index).exists() {
        assert_eq!(
            std::fs::read(src.join(index)).unwrap(),
            std::fs::read(out.join(index)).unwrap()
        );
    }
    let written = Renumbering::read(&out.join(RENUMBERING_FILE)).unwrap();
    assert_eq!(written.layers, ren.layers, "{label}");
    let names = ck.cfg.family.names;
    check_tensors(&label, &src, &out, &ren, [names.block, names.router]);

    let exported = open(&out);
    let (a, b) = (one_device_logits(&ck), one_device_logits(&exported));
    let scale = a.iter().fold(1f32, |m, x| m.max(x.abs()));
    assert!(
        max_diff(&a, &b) <= 1e-5 * scale,
        "{label}: one-device logits"
    );

    // The engine: the original under the placement, the export under contiguous placement.
    let flat: BTreeMap<usize, Vec<u32>> = maps
        .keys()
        .map(|&l| (l, contiguous(ck.cfg.moe.num_experts, d)))
        .collect();
    let (placed, plain) = (ep_run(&ck, maps.clone(), d), ep_run(&exported, flat, d));
    for (r, (x, y)) in placed.iter().zip(&plain).enumerate() {
        let scale = x.0.iter().fold(1f32, |m, v| m.max(v.abs()));
        assert!(
            max_diff(&x.0, &y.0) <= 1e-5 * scale,
            "{label} rank {r}: logits"
        );
        let (cx, cy): (Vec<_>, Vec<_>) = (
            x.1.iter().map(|(l, s)| (*l, counts(s))).collect(),
            y.1.iter().map(|(l, s)| (*l, counts(s))).collect(),
        );
        assert_eq!(cx, cy, "{label} rank {r}: rows, pairs and C_T per layer");
        assert_eq!(x.2, y.2, "{label} rank {r}: rows and bytes per link");
    }

    // A trace recorded on the export maps back to the original's.
    let (want, got) = (trace_of(&ck), trace_of(&exported));
    let back = ren.to_original(&got).unwrap();
    for (w, g) in want.layers.iter().zip(&back.layers) {
        assert_eq!(w.topk_ids, g.topk_ids, "{label} layer {}: ids", w.layer);
        let (wl, gl) = (
            w.router_logits.as_ref().unwrap(),
            g.router_logits.as_ref().unwrap(),
        );
        assert!(
            max_diff(wl, gl) <= 1e-5,
            "{label} layer {}: router logits",
            w.layer
        );
    }
    assert_eq!(
        ren.to_exported(&want).unwrap().layers[0].topk_ids,
        got.layers[0].topk_ids
    );
}

#[test]
fn every_family_in_every_layout_exports_exactly() {
    for (a, arch) in ARCHS.iter().enumerate() {
        for (s, storage) in [
            None,
            Some(ExpertStorage::PerExpert),
            Some(ExpertStorage::Fused),
            Some(ExpertStorage::Transposed),
        ]
        .into_iter()
        .enumerate()
        {
            // gpt-oss stores its experts one way only (fused, interleaved, with biases; or as
            // MXFP4 blocks): exported as stored.
            if storage.is_some() && arch.starts_with("gpt_oss") {
                continue;
            }
            for d in [2, 4, 8] {
                export_and_check(arch, storage, d, (100 * a + 10 * s + d) as u64);
            }
        }
    }
}

#[test]
fn an_export_of_an_export_composes_and_exports_refuse_what_they_cannot_do() {
    let t = tempfile::tempdir().unwrap();
    // A copy: the refusals below try to export over the source, and an exporter that failed
    // to refuse must not overwrite the repository's fixture.
    let src = t.path().join("olmoe");
    std::fs::create_dir(&src).unwrap();
    for f in std::fs::read_dir(fixture("olmoe")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, src.join(f.file_name().unwrap())).unwrap();
    }
    let ck = open(&src);
    let p = |seed| placement(&random_maps(&ck.cfg, 4, seed), 4);
    let (p1, p2) = (p(1), p(2));
    let r1 = Renumbering::from_placement(&p1, None).unwrap();
    let r2 = Renumbering::from_placement(&p2, None).unwrap();
    let (o1, o2) = (t.path().join("one"), t.path().join("two"));
    export_checkpoint(&src, &o1, &r1, false, &|_, _| {}).unwrap();
    export_checkpoint(&o1, &o2, &r2, false, &|_, _| {}).unwrap();
    // o2's new id j holds o1's expert r2[j], which is the original r1[r2[j]].
    let composed = Renumbering::read(&o2.join(RENUMBERING_FILE)).unwrap();
    for (c, (a, b)) in composed.layers.iter().zip(r1.layers.iter().zip(&r2.layers)) {
        let want: Vec<u32> = b
            .new_to_original
            .iter()
            .map(|&x| a.new_to_original[x as usize])
            .collect();
        assert_eq!(c.new_to_original, want);
    }
    let direct = Renumbering {
        layers: composed.layers.clone(),
        ..r1.clone()
    };
    check_tensors("composed", &src, &o2, &direct, ["mlp", "gate"]);

    let fail = |src: &Path, out: &Path, ren: &Renumbering, overwrite: bool| {
        export_checkpoint(src, out, ren, overwrite, &|_, _| {})
            .unwrap_err()
            .to_string()
    };
    assert!(fail(&src, &src, &r1, true).contains("overlaps the input"));
    assert!(fail(&src, &src.join("x"), &r1, false).contains("overlaps the input"));
    assert!(fail(&src, &o1, &r1, false).contains("--overwrite"));
    export_checkpoint(&src, &o1, &r2, true, &|_, _| {}).unwrap();
    let plain = t.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    assert!(fail(&src, &plain, &r1, true).contains("not an earlier export"));
    let mut missing = p1.clone();
    missing.layers.pop();
    let e = fail(
        &src,
        &t.path().join("m"),
        &Renumbering::from_placement(&missing, None).unwrap(),
        false,
    );
    assert!(e.contains("no entry for MoE layer"), "{e}");
    let mut extra = r1.clone();
    let mut seven = extra.layers[0].clone();
    seven.layer = 7;
    extra.layers.push(seven);
    assert!(fail(&src, &t.path().join("x"), &extra, false).contains("not an MoE layer"));
    let wrong_e = Renumbering::from_placement(
        &placement(&BTreeMap::from([(0, contiguous(4, 2))]), 2),
        None,
    )
    .unwrap();
    assert!(fail(&src, &t.path().join("y"), &wrong_e, false).contains("4 experts"));
    // Nothing half-written is left beside the outputs.
    let leftovers: Vec<_> = std::fs::read_dir(t.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".occult"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// SHA-256 over a checkpoint's tensors, each its name, a NUL and its bytes, in name order (as
/// scripts/make_export_fixtures.py computes it).
fn digest(dir: &Path) -> String {
    use sha2::{Digest, Sha256};
    let files = occult_core::models::checkpoint::from_folder(dir).unwrap();
    let maps: Vec<Vec<u8>> = files
        .weights
        .iter()
        .map(|f| std::fs::read(f).unwrap())
        .collect();
    let mut all: BTreeMap<String, &[u8]> = BTreeMap::new();
    for m in &maps {
        let st = safetensors::SafeTensors::deserialize(m).unwrap();
        for (name, view) in st.tensors() {
            all.insert(name, view.data());
        }
    }
    let mut h = Sha256::new();
    for (name, bytes) in all {
        h.update(name.as_bytes());
        h.update([0u8]);
        h.update(bytes);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A copy of a per-expert checkpoint (of any model type) with each MoE layer's experts fused
/// as `gate_up_proj` `[E, 2I, H]` and `down_proj` `[E, H, I]`.
fn fuse_any(src: &Path, dst: &Path) {
    let layout = occult_core::interop::checkpoint::ExpertLayout::read(src).unwrap();
    let mut all = all_tensors(src);
    for &l in &layout.moe_layers {
        let p = format!("model.layers.{l}.{}.experts", layout.block);
        let take = |all: &mut HashMap<String, Tensor>, j: usize, w: &str| {
            all.remove(&format!("{p}.{j}.{w}.weight")).unwrap()
        };
        let (mut gu, mut down) = (Vec::new(), Vec::new());
        for j in 0..layout.num_experts {
            let (g, u) = (take(&mut all, j, "gate_proj"), take(&mut all, j, "up_proj"));
            gu.push(Tensor::cat(&[g, u], 0).unwrap());
            down.push(take(&mut all, j, "down_proj"));
        }
        all.insert(format!("{p}.gate_up_proj"), Tensor::stack(&gu, 0).unwrap());
        all.insert(format!("{p}.down_proj"), Tensor::stack(&down, 0).unwrap());
    }
    std::fs::create_dir_all(dst).unwrap();
    candle::safetensors::save(&all, dst.join("model.safetensors")).unwrap();
    std::fs::copy(src.join("config.json"), dst.join("config.json")).unwrap();
}

/// The exports of the placements in tests/fixtures/export/cases.json are, byte for byte, the
/// checkpoints scripts/make_export_fixtures.py renumbered with its own code and ran under
/// transformers with the original's logits (every family, a DeepSeek-V3 and a GLM-4.5 with a
/// sigmoid router, a selection bias and expert groups, a DeepSeek-V2 with softmax groups, and a gpt-oss with a router bias and
/// fused experts with biases; per-expert and fused; 2, 4 and 8 devices).
#[test]
fn exports_are_the_checkpoints_transformers_ran_with_the_original_logits() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/export/cases.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(
        cases.len(),
        51,
        "8 models x 2 layouts x 3 device counts, and gpt-oss fused x 3"
    );
    for c in cases {
        let (arch, layout, d) = (
            c["model"].as_str().unwrap(),
            c["layout"].as_str().unwrap(),
            c["devices"].as_u64().unwrap() as usize,
        );
        let label = format!("{arch} {layout} D={d}");
        assert!(c["max_logit_gap"].as_f64().unwrap() < 1e-5, "{label}");
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("source");
        match (arch, layout) {
            ("deepseek_v3" | "glm4_moe", "per_expert") | ("gpt_oss", "fused") => {
                std::fs::create_dir(&src).unwrap();
                for f in ["config.json", "model.safetensors"] {
                    std::fs::copy(fixture(arch).join(f), src.join(f)).unwrap();
                }
            }
            ("deepseek_v3" | "glm4_moe", "fused") => fuse_any(&fixture(arch), &src),
            (_, "per_expert") => relayout(arch, ExpertStorage::PerExpert, &src),
            (_, "fused") => relayout(arch, ExpertStorage::Fused, &src),
            _ => panic!("{label}: unknown layout"),
        }
        let maps: BTreeMap<usize, Vec<u32>> = c["placement"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(l, m)| {
                (
                    l.parse().unwrap(),
                    serde_json::from_value(m.clone()).unwrap(),
                )
            })
            .collect();
        let layout_of = occult_core::interop::checkpoint::ExpertLayout::read(&src).unwrap();
        let ren = Renumbering::from_placement(&placement(&maps, d), layout_of.groups).unwrap();
        let out = t.path().join("exported");
        export_checkpoint(&src, &out, &ren, false, &|_, _| {}).unwrap();
        assert_eq!(digest(&out), c["sha256"].as_str().unwrap(), "{label}");
    }
}

/// DeepSeek-V3's group-limited routing: a placement that would mix two groups' experts in one
/// run of new ids is refused, naming the layer and the groups.
#[test]
fn a_placement_that_breaks_deepseek_v3s_expert_groups_is_refused() {
    let src = fixture("deepseek_v3");
    let layout = occult_core::interop::checkpoint::ExpertLayout::read(&src).unwrap();
    assert_eq!(layout.moe_layers, vec![1, 2]);
    let groups = layout.groups.expect("n_group 4");
    assert_eq!((groups.n_group, groups.topk_group), (4, 2));
    // Groups {0,1} {2,3} {4,5} {6,7}; device 0 takes 0, 2, 4, 6: every group is split.
    let split = vec![0, 1, 0, 1, 0, 1, 0, 1];
    let maps = BTreeMap::from([(1, split.clone()), (2, contiguous(8, 2))]);
    let e = Renumbering::from_placement(&placement(&maps, 2), layout.groups)
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer 1") && e.contains("n_group = 4"), "{e}");
    // Built without the groups, the exporter itself still refuses it.
    let ren = Renumbering::from_placement(&placement(&maps, 2), None).unwrap();
    let t = tempfile::tempdir().unwrap();
    let e = export_checkpoint(&src, &t.path().join("o"), &ren, false, &|_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "layer 1: new ids 0..2 mix experts of several groups; the model routes by groups of \
             2 (n_group = 4)"
        ),
        "{e}"
    );
}

/// DeepSeek's `config.json` read at its bounds: the most layers and one past, one group (no
/// group-limited routing) and groups that do not divide the experts.
#[test]
fn deepseek_configs_are_read_at_their_bounds() {
    use occult_core::interop::checkpoint::ExpertLayout;
    use occult_core::models::config::MAX_LAYERS;
    let text = std::fs::read_to_string(fixture("deepseek_v3").join("config.json")).unwrap();
    let base: serde_json::Value = serde_json::from_str(&text).unwrap();
    let read = |edits: &[(&str, serde_json::Value)]| {
        let mut v = base.clone();
        for (k, x) in edits {
            v[*k] = x.clone();
        }
        ExpertLayout::from_config(&v, "c.json").map_err(|e| e.to_string())
    };
    let most = read(&[("num_hidden_layers", MAX_LAYERS.into())]).unwrap();
    assert_eq!(most.num_layers, MAX_LAYERS);
    let e = read(&[("num_hidden_layers", (MAX_LAYERS + 1).into())]).unwrap_err();
    assert!(
        e.contains("num_hidden_layers") && e.contains(&format!("at most {MAX_LAYERS}")),
        "{e}"
    );
    let one = read(&[("n_group", 1.into()), ("topk_group", 1.into())]).unwrap();
    assert!(one.groups.is_none());
    for n_group in [0, 3] {
        let e = read(&[("n_group", n_group.into())]).unwrap_err();
        assert!(
            e.contains("n_group") && e.contains("a divisor of the 8 experts"),
            "{n_group}: {e}"
        );
    }
}

/// An export builds in a temporary folder beside its output and renames it into place (here
/// the output is on /dev/shm where there is one, off the working directory's filesystem, so a
/// folder built anywhere else would not rename), and reports progress up to every tensor's
/// bytes.
#[test]
fn an_export_builds_beside_its_output_and_reports_every_byte() {
    let src = fixture("deepseek_v3");
    let layout = occult_core::interop::checkpoint::ExpertLayout::read(&src).unwrap();
    let maps = BTreeMap::from([(1, contiguous(8, 2)), (2, contiguous(8, 2))]);
    let ren = Renumbering::from_placement(&placement(&maps, 2), layout.groups).unwrap();
    let shm = Path::new("/dev/shm");
    let t = if shm.is_dir() {
        tempfile::tempdir_in(shm)
    } else {
        tempfile::tempdir()
    }
    .unwrap();
    let out = t.path().join("exported");
    let seen = std::sync::Mutex::new(Vec::new());
    let progress = |done, total| seen.lock().unwrap().push((done, total));
    let summary = export_checkpoint(&src, &out, &ren, false, &progress).unwrap();
    let weights = std::fs::read(src.join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&weights)
        .unwrap()
        .tensors();
    let bytes: u64 = tensors.iter().map(|(_, v)| v.data().len() as u64).sum();
    // Per-expert tensors of MoE layers are renamed, their routers' rows permuted, the rest
    // copied unchanged.
    let mut want = (0, 0, 0);
    for (name, _) in &tensors {
        let moe = layout
            .moe_layers
            .iter()
            .any(|l| name.starts_with(&format!("model.layers.{l}.")));
        let per_expert = name
            .split(".mlp.experts.")
            .nth(1)
            .is_some_and(|t| t.split('.').next().unwrap().parse::<usize>().is_ok());
        match (moe, per_expert, name.contains(".mlp.gate.")) {
            (true, true, _) => want.0 += 1,
            (true, false, true) => want.1 += 1,
            _ => want.2 += 1,
        }
    }
    assert!(want.0 > 0 && want.1 > 0 && want.2 > 0, "{want:?}");
    let got = (summary.renamed, summary.permuted, summary.unchanged);
    assert_eq!(got, want);
    assert_eq!(summary.bytes, bytes);
    let seen = seen.into_inner().unwrap();
    assert!(
        seen.iter().all(|&(_, total)| total == bytes),
        "{seen:?} of {bytes}"
    );
    assert_eq!(seen.last().map(|s| s.0), Some(bytes));
    assert!(out.join("model.safetensors").is_file() || out.read_dir().unwrap().count() > 1);
}
