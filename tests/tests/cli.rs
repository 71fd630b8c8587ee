//! End-to-end runs of the `occult` binary: synth -> collab -> place -> collab -> prune ->
//! reproduce, checking the JSON contract of `docs/formats.md` and that the figures agree.

mod common;
use common::{occult_err, occult_ok, Raw};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn synth(dir: &Path, name: &str, extra: &[&str]) {
    let mut args = vec![
        "trace",
        "synth",
        "--experts",
        "16",
        "--top-k",
        "4",
        "--layers",
        "2",
        "--tokens",
        "600",
        "--clusters",
        "4",
        "--strength",
        "3",
        "--seed",
        "3",
        "-o",
        name,
    ];
    args.extend_from_slice(extra);
    occult_ok(dir, &args);
}

#[test]
fn analysis_pipeline_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    synth(d, "t.safetensors", &[]);
    let info = occult_ok(d, &["trace", "info", "t.safetensors"]);
    assert!(info.contains("experts 16, top-4"), "{info}");

    // Contiguous statistics with the JSON contract.
    occult_ok(
        d,
        &[
            "collab",
            "--trace",
            "t.safetensors",
            "--devices",
            "4",
            "--json",
            "c.json",
        ],
    );
    let c = read_json(&d.join("c.json"));
    let layers = c["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2);
    // The oracle: the trace's ids read with the safetensors crate, each token's distinct
    // devices under the contiguous map (16 experts over 4 devices: e / 4), counted here.
    let bytes = std::fs::read(d.join("t.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for l in layers {
        let name = format!("layers.{}.topk_ids", l["layer"].as_u64().unwrap());
        let ids: Vec<i32> = st
            .tensor(&name)
            .unwrap()
            .data()
            .chunks(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let distinct: usize = ids
            .chunks(4)
            .map(|row| {
                let mut dev: Vec<i32> = row.iter().map(|e| e / 4).collect();
                dev.sort_unstable();
                dev.dedup();
                dev.len()
            })
            .sum();
        assert_eq!(
            l["rows_occult"].as_u64().unwrap() as usize,
            distinct,
            "{name}"
        );
        assert!((l["ect"].as_f64().unwrap() - distinct as f64 / 600.0).abs() < 1e-12);
    }
    for l in layers {
        for key in [
            "layer",
            "ect",
            "ect_histogram",
            "intra_ratio",
            "rows_standard",
            "rows_occult",
            "remote_rows_standard",
            "remote_rows_occult",
            "max_load_ratio",
        ] {
            assert!(l.get(key).is_some(), "collab JSON lacks {key}");
        }
        assert_eq!(l["rows_standard"], 600 * 4);
        let ect = l["ect"].as_f64().unwrap();
        assert!((1.0..=4.0).contains(&ect));
    }
    let contiguous = c["mean_ect"].as_f64().unwrap();
    assert!(c["provenance"]["occult_version"].is_string());

    // Each method, then the same statistics through the placement file.
    let mut ect = std::collections::HashMap::new();
    for m in ["contiguous", "greedy", "occult"] {
        let out = format!("p-{m}.json");
        occult_ok(
            d,
            &[
                "place",
                "--trace",
                "t.safetensors",
                "--devices",
                "4",
                "--method",
                m,
                "-o",
                &out,
            ],
        );
        let p = read_json(&d.join(&out));
        assert_eq!(p["format"], "occult.placement.v1");
        assert_eq!(p["method"], m);
        let json = format!("c-{m}.json");
        occult_ok(
            d,
            &[
                "collab",
                "--trace",
                "t.safetensors",
                "--placement",
                &out,
                "--json",
                &json,
            ],
        );
        let mean = read_json(&d.join(&json))["mean_ect"].as_f64().unwrap();
        let stored: f64 = p["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["metrics"]["ect"].as_f64().unwrap())
            .sum::<f64>()
            / 2.0;
        assert!((mean - stored).abs() < 1e-12, "{m}: {mean} vs {stored}");
        ect.insert(m, mean);
    }
    assert!((ect["contiguous"] - contiguous).abs() < 1e-12);
    assert!(ect["occult"] <= ect["greedy"]);
    // Strong clusters of 4 experts on 4 devices: placement has a lot to find.
    assert!(ect["greedy"] < 0.8 * contiguous, "{ect:?}");

    // Pruning, with its JSON contract; the pruned trace agrees with the report.
    occult_ok(
        d,
        &[
            "prune",
            "--trace",
            "t.safetensors",
            "--placement",
            "p-occult.json",
            "--max-devices",
            "1",
            "--rule",
            "similarity",
            "--json",
            "prune.json",
            "-o",
            "pruned.safetensors",
        ],
    );
    let pr = read_json(&d.join("prune.json"));
    assert!((pr["ect_before"].as_f64().unwrap() - ect["occult"]).abs() < 1e-12);
    assert_eq!(pr["ect_after"].as_f64().unwrap(), 1.0);
    let changed = pr["changed_fraction"].as_f64().unwrap();
    assert!(changed > 0.0 && changed < 1.0);
    assert_eq!(pr["layers"].as_array().unwrap().len(), 2);
    occult_ok(
        d,
        &[
            "collab",
            "--trace",
            "pruned.safetensors",
            "--placement",
            "p-occult.json",
            "--json",
            "cp.json",
        ],
    );
    assert_eq!(
        read_json(&d.join("cp.json"))["mean_ect"].as_f64().unwrap(),
        1.0
    );
}

#[test]
fn load_limit_and_bench() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    synth(d, "t.safetensors", &["--skew", "1.0", "--no-logits"]);
    occult_ok(
        d,
        &[
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "4",
            "--method",
            "occult",
            "--max-load-factor",
            "1.05",
            "-o",
            "p.json",
        ],
    );
    let p = read_json(&d.join("p.json"));
    for l in p["layers"].as_array().unwrap() {
        assert!(l["metrics"]["max_load_ratio"].as_f64().unwrap() <= 1.05 + 1e-9);
    }
    let out = occult_ok(
        d,
        &[
            "bench",
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "2,4",
            "--json",
            "b.json",
        ],
    );
    assert!(out.contains("vs greedy"), "{out}");
    let b = read_json(&d.join("b.json"));
    assert_eq!(b["results"].as_array().unwrap().len(), 6);
    // With replicas: Occult under a load cap, and EPLB under both copy rules (16 experts + 2
    // slots fill 2 devices; on 4, the replicas round up to 4).
    occult_ok(
        d,
        &[
            "bench",
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "2,4",
            "--replicas",
            "2",
            "--json",
            "r.json",
        ],
    );
    let r = read_json(&d.join("r.json"));
    let rows = r["results"].as_array().unwrap();
    let row_under = |dev: u64, method: &str, rule: &str| {
        rows.iter()
            .find(|x| x["devices"] == dev && x["method"] == method && x["rule"] == rule)
            .unwrap_or_else(|| panic!("no {method} ({rule}) at D = {dev}"))
    };
    let row = |dev: u64, method: &str| row_under(dev, method, "any");
    for (dev, r) in [(2, 2), (4, 4)] {
        let f = |x: &serde_json::Value, k: &str| x[k].as_f64().unwrap();
        let mut checked = vec![row(dev, "occult")];
        for rule in ["cover", "sglang", "trtllm"] {
            for rival in ["eplb", "trtllm-cooccurrence"] {
                checked.push(row_under(dev, &format!("{rival} R={r}"), rule));
            }
        }
        for x in checked {
            assert!(f(x, "ect") >= 1.0 && f(x, "max_load_ratio") >= 1.0, "{x}");
            // Projected on both default machines: an exchange each way plus the compute, E[C_T]
            // between 1 and min(k, D), and the PCIe box slower than the NVLink node.
            let p = x["projected"].as_array().unwrap();
            assert_eq!(p.len(), 2, "{x}");
            assert_eq!(
                (&p[0]["profile"], &p[1]["profile"]),
                (&"pcie4".into(), &"nvlink-h100".into())
            );
            for m in p {
                let layer = 2.0 * f(m, "exchange_s") + f(m, "compute_s");
                assert!(f(m, "layer_s") > 0.0 && (f(m, "layer_s") - layer).abs() < 1e-12);
                assert!((1.0..=dev.min(4) as f64).contains(&f(m, "ect")), "{m}");
            }
            assert!(f(&p[0], "layer_s") > f(&p[1], "layer_s"), "{x}");
        }
        // A partition counted through the replica maps is the placer's E[C_T].
        let occ = row(dev, "occult");
        let plain = b["results"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["devices"] == dev && x["method"] == "occult")
            .unwrap();
        assert!((f(occ, "ect") - f(plain, "ect")).abs() < 1e-12);
        // Occult's copies under the cover rule lower its partition's E[C_T] here, under its
        // load cap if any; under every rule they keep the cap.
        let copies = row_under(dev, &format!("occult + R={r} copies"), "cover");
        assert!(f(copies, "ect") <= f(occ, "ect") + 1e-12, "{copies}");
        let capped = rows
            .iter()
            .find(|x| x["devices"] == dev && x["method"] == "occult, load cap 1.05");
        if let Some(capped) = capped {
            let name = format!("occult, load cap 1.05 + R={r} copies");
            let more = row_under(dev, &name, "cover");
            assert!(f(more, "ect") <= f(capped, "ect") + 1e-12, "{more}");
            for rule in ["cover", "sglang", "trtllm"] {
                let more = row_under(dev, &name, rule);
                assert!(f(more, "max_load_ratio") <= 1.05 + 1e-9, "{more}");
            }
        }
    }
    // A copy rule without replicas has nothing to pick from.
    let e = occult_err(
        d,
        &[
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "4",
            "--copy-rule",
            "sglang",
            "-o",
            "x.json",
        ],
    );
    assert!(e.contains("give --replicas R"), "{e}");
    assert!(!d.join("x.json").exists());
    // The same placements as files (format v2), placed for each copy rule: collab counts what
    // the bench counted under that rule; no device holds an expert twice.
    for (method, bench_name) in [
        ("occult", "occult + R=4 copies"),
        ("eplb", "eplb R=4"),
        ("trtllm-cooccurrence", "trtllm-cooccurrence R=4"),
    ] {
        let file = format!("{method}-r.json");
        for rule in ["cover", "sglang", "trtllm"] {
            let placed_for = format!("{method}-{rule}-r.json");
            occult_ok(
                d,
                &[
                    "place",
                    "--trace",
                    "t.safetensors",
                    "--devices",
                    "4",
                    "--method",
                    method,
                    "--replicas",
                    "4",
                    "--copy-rule",
                    rule,
                    "-o",
                    &placed_for,
                ],
            );
            let placed = read_json(&d.join(&placed_for));
            assert_eq!(placed["format"], "occult.placement.v2");
            assert_eq!(placed["source"]["copy_rule"], rule);
            for layer in placed["layers"].as_array().unwrap() {
                let slots = layer["slots"].as_array().unwrap();
                assert_eq!(slots.len(), 20);
                for device in slots.chunks(5) {
                    let mut v: Vec<u64> = device.iter().map(|x| x.as_u64().unwrap()).collect();
                    v.sort_unstable();
                    v.dedup();
                    assert_eq!(v.len(), 5, "{method} {rule}: an expert twice on {device:?}");
                }
            }
            let out = format!("c-{method}-{rule}.json");
            occult_ok(
                d,
                &[
                    "collab",
                    "--trace",
                    "t.safetensors",
                    "--placement",
                    &placed_for,
                    "--copy-rule",
                    rule,
                    "--json",
                    &out,
                ],
            );
            let c = read_json(&d.join(&out));
            let want = row_under(4, bench_name, rule);
            let got = c["mean_ect"].as_f64().unwrap();
            assert!(
                (got - want["ect"].as_f64().unwrap()).abs() < 1e-9,
                "{method} {rule}: {got} vs {want}"
            );
            if rule == "cover" {
                std::fs::copy(d.join(&placed_for), d.join(&file)).unwrap();
            }
        }
        // Nodes of 2: E[C_N] after the choice, between 1 and 2 and never above E[C_T].
        let nodes = format!("{file}.nodes.json");
        occult_ok(
            d,
            &[
                "collab",
                "--trace",
                "t.safetensors",
                "--placement",
                &file,
                "--devices-per-node",
                "2",
                "--json",
                &nodes,
            ],
        );
        let c = read_json(&d.join(&nodes));
        let ecn = c["mean_ecn"].as_f64().unwrap();
        assert!((1.0..=2.0).contains(&ecn), "{ecn}");
        assert!(ecn <= c["mean_ect"].as_f64().unwrap(), "{c}");
    }
}

/// A recipe on a tiny built-in model (built from scratch in seconds): every stage runs.

#[test]
fn reproduce_runs_every_stage_on_a_tiny_built_in_model() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("r.toml"), common::TINY_RECIPE).unwrap();
    let run = |more: &[&str]| {
        std::process::Command::new(common::occult_bin())
            .args(["reproduce", "r.toml", "--out", "rep"])
            .args(more)
            .env("OCCULT_CACHE", d.join("cache"))
            .current_dir(d)
            .output()
            .unwrap()
    };
    // Two fine-tuning seeds: every fine-tuning twice, the differences pooled.
    let out = run(&["--seeds", "2"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    assert!(err.contains("building the built-in model"), "{err}");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        stdout.contains("+ our placement") && stdout.contains("## Quality"),
        "{stdout}"
    );
    let r = read_json(&d.join("rep/results.json"));
    let steps = r["ect_table"].as_array().unwrap();
    assert_eq!(steps.len(), 1 + 3 + 4);
    let f = |i: usize, k: &str| steps[i][k].as_f64().unwrap();
    // Dedup never sends more rows than k copies; ours never loses to greedy; one device is 1.
    assert!(f(1, "rows_per_token") <= f(0, "rows_per_token"));
    assert!(f(3, "ect") <= f(2, "ect") + 1e-12);
    assert_eq!(f(7, "ect"), 1.0);
    // Two nodes of 2: each token spans 1 or 2 nodes; standard's rows across them are copies,
    // at least the two-level one row per remote node; pruned to one device, one node (so at
    // most one row across, when that device is in the other node).
    for i in 0..steps.len() {
        assert!((1.0..=2.0).contains(&f(i, "ecn_two_nodes")), "{i}");
        assert!(f(i, "inter_rows_per_token_two_nodes") <= f(0, "inter_rows_per_token_two_nodes"));
    }
    let across = |i| f(i, "inter_rows_per_token_two_nodes");
    assert!(across(1) < across(0) && across(1) > 0.0);
    assert_eq!(f(7, "ecn_two_nodes"), 1.0);
    assert!(across(7) > 0.0 && across(7) < 1.0);
    // Seven fine-tunings (exact, two rules x two device counts, two rules x one node of the
    // two), each with a held-out loss, for seed 0 and then seed 1.
    let ft = r["finetune"].as_array().unwrap();
    assert_eq!(ft.len(), 2 * 7);
    assert!(ft
        .iter()
        .all(|x| x["held_out_loss"].as_f64().unwrap() > 0.0));
    for (seed, runs) in ft.chunks(7).enumerate() {
        assert!(runs.iter().all(|x| x["seed"] == seed), "{runs:?}");
        assert_eq!(runs[4]["mean_ect"].as_f64().unwrap(), 1.0);
        for node in &runs[5..] {
            assert_eq!(node["max_nodes"], 1, "{node}");
            assert!(node["mean_ect"].as_f64().unwrap() <= 2.0, "{node}");
        }
    }
    // The seeds order the data differently: seed 1's first loss is not seed 0's.
    assert_ne!(ft[0]["first_loss"], ft[7]["first_loss"]);
    // Quality: 4 tasks x (start under 7 routings; per seed, standard fine-tuned under 7 and
    // 6 pruned).
    let q = r["quality"].as_array().unwrap();
    assert_eq!(q.len(), 4 * (7 + 2 * 13));
    assert!(q
        .iter()
        .all(|x| (0.0..=1.0).contains(&x["acc"].as_f64().unwrap())));
    assert_eq!(
        q.iter().filter(|x| x["max_nodes"] == 1).count(),
        4 * (2 + 2 * 4)
    );
    assert_eq!(q.iter().filter(|x| x["seed"] == 1).count(), 4 * 13);
    assert!(q
        .iter()
        .all(|x| (x["variant"] == "base") == x.get("seed").is_none()));
    // Each accuracy with its standard error and item count; paired differences for the 6
    // pruned servings of the start and the 6 pruned fine-tunings, each inside its interval.
    for x in q {
        let (acc, se) = (
            x["acc"].as_f64().unwrap(),
            x["acc_stderr"].as_f64().unwrap(),
        );
        let n = x["items"].as_f64().unwrap();
        assert!(
            n > 1.0 && (se - (acc * (1.0 - acc) / (n - 1.0)).sqrt()).abs() < 1e-9,
            "{x}"
        );
    }
    // The generative task, apart: the same 33 evaluations, exact match, its own differences
    // over its one task, and its section in the report.
    let g = r["generative"].as_array().unwrap();
    assert_eq!(g.len(), 7 + 2 * 13);
    assert!(g.iter().all(|x| x["task"] == "builtin_arithmetic_gen"
        && x["metric"].as_str().unwrap().starts_with("exact_match")));
    assert!(q.iter().all(|x| x["metric"] == "acc"));
    let gd = r["generative_differences"].as_array().unwrap();
    assert_eq!(gd.len(), 12);
    assert!(gd.iter().all(|d| d["tasks"] == 1), "{gd:?}");
    assert!(stdout.contains("## Generation (exact match"), "{stdout}");
    let diffs = r["quality_differences"].as_array().unwrap();
    for (what, count) in [("pruned serving", 6), ("pruned fine-tuning", 6)] {
        assert_eq!(
            diffs.iter().filter(|d| d["comparison"] == what).count(),
            count,
            "{what}"
        );
    }
    for d in diffs {
        let f = |k: &str| d[k].as_f64().unwrap();
        assert!(
            f("lo") <= f("diff") + 1e-12 && f("diff") <= f("hi") + 1e-12,
            "{d}"
        );
        assert!(f("stderr") >= 0.0 && d["tasks"] == 4, "{d}");
        // Pruned fine-tunings pool both seeds (the difference is their mean); the start's
        // servings have none.
        let per_seed: Vec<f64> = d["per_seed"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        if d["comparison"] == "pruned fine-tuning" {
            assert_eq!(d["seeds"], serde_json::json!([0, 1]), "{d}");
            assert!(
                (f("diff") - (per_seed[0] + per_seed[1]) / 2.0).abs() < 1e-12,
                "{d}"
            );
            // Two seeds: the interval is at least Student's t (at its degrees of freedom, 12.7
            // at 1) times the standard error either side, where the seeds disagree.
            let sd = f("seed_sd");
            assert!((sd - (per_seed[0] - per_seed[1]).abs() / 2f64.sqrt()).abs() < 1e-12);
            if sd > 0.0 {
                let t = occult_eval::harness::paired::t975(f("df"));
                assert!(f("df") >= 1.0 && t > 1.96, "{d}");
                assert!(f("hi") - f("lo") >= 2.0 * t * f("stderr") - 1e-12, "{d}");
            }
        } else {
            assert_eq!(
                (d["seeds"].as_array().unwrap().len(), per_seed.len()),
                (0, 1)
            );
        }
        // Items asking the same question again are one question of the bootstrap.
        let q = d["questions"].as_u64().unwrap();
        assert!(q >= 4 && q <= d["items"].as_u64().unwrap(), "{d}");
    }
    assert!(stdout.contains("ran 2 seeds"), "{stdout}");
    assert!(stdout.contains("| seeds |"), "{stdout}");
    assert!(
        stdout.contains("Non-inferior to standard fine-tuning by 1 point (over 2 seeds)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("### Differences, paired over the same items"),
        "{stdout}"
    );
    assert!(stdout.contains("## Past one node"), "{stdout}");
    // The placements section: 16 experts on 4 devices, E / 8 = 2 replicas, rounded up to 4
    // (a multiple of the devices); Occult's copies never raise its partition's E[C_T].
    assert!(stdout.contains("## Placements with replicas"), "{stdout}");
    let placed = r["placements_with_replicas"].as_array().unwrap();
    let method = |m: &str| {
        placed
            .iter()
            .find(|x| x["method"] == m)
            .unwrap_or_else(|| panic!("no {m} in {placed:?}"))
    };
    for m in [
        "contiguous",
        "occult",
        "eplb R=4",
        "trtllm-cooccurrence R=4",
    ] {
        assert!(method(m)["ect"].as_f64().unwrap() >= 1.0, "{m}");
    }
    for rule in ["cover", "sglang", "trtllm"] {
        assert!(
            placed
                .iter()
                .any(|x| x["method"] == "occult + R=4 copies" && x["rule"] == rule),
            "no copies under {rule}: {placed:?}"
        );
    }
    assert!(
        method("occult + R=4 copies")["ect"].as_f64() <= method("occult")["ect"].as_f64(),
        "{placed:?}"
    );
    assert!(stdout.contains("pruned to 1 node, router"), "{stdout}");
    assert!(r["collaboration"]["ect_after"].as_f64().unwrap() >= 1.0);
    for key in ["config", "provenance"] {
        assert!(r.get(key).is_some(), "{key}");
    }
    // Speed: every suite, each EP mode measured and projected on 4 ranks; decode at 1 and 3
    // sequences per rank.
    let speed = r["speed"].as_array().unwrap();
    for suite in ["prefill", "layers", "decode", "train"] {
        let rows: Vec<_> = speed.iter().filter(|x| x["suite"] == suite).collect();
        assert!(rows.iter().any(|x| x["mode"] == "occult"), "{suite}");
        assert!(
            rows.iter().all(|x| x["seconds"].as_f64().unwrap() > 0.0),
            "{suite}"
        );
        let occ = rows.iter().find(|x| x["mode"] == "occult").unwrap();
        let std = rows.iter().find(|x| x["mode"] == "standard").unwrap();
        assert!(occ["projected_seconds"].as_f64().unwrap() > 0.0, "{suite}");
        assert!(
            occ["bytes_sent"].as_u64() <= std["bytes_sent"].as_u64(),
            "{suite}"
        );
    }
    // Over shaped links where the machine allows it (root, tc, MPI), else a reason.
    if r["shaped"]["ran"] == true {
        // Prefill: standard, occult, pruned to 2; train: also pruned to 1. On two nodes of 2,
        // also the two-level exchange, and pruning to one node in each exchange.
        let two = "shaped-200mbit-between-2gbit-inside";
        for (suite, modes, link) in [
            ("prefill, shaped", 3, "shaped-200mbit"),
            ("train, shaped", 4, "shaped-200mbit"),
            ("prefill, shaped, nodes of 2", 6, two),
            ("train, shaped, nodes of 2", 7, two),
        ] {
            let rows: Vec<_> = speed.iter().filter(|x| x["suite"] == suite).collect();
            assert_eq!(rows.len(), modes, "{suite}");
            assert!(rows.iter().all(|x| x["seconds"].as_f64().unwrap() > 0.0));
            assert!(rows.iter().all(|x| x["link"] == link));
            assert!(rows
                .iter()
                .all(|x| x["projected_seconds"].as_f64().unwrap() > 0.0));
        }
    } else {
        assert!(
            r["shaped"]["reason"].as_str().unwrap().len() > 5,
            "{}",
            r["shaped"]
        );
    }
    let decode_tokens: Vec<u64> = speed
        .iter()
        .filter(|x| x["suite"] == "decode" && x["mode"] == "occult")
        .map(|x| x["tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(decode_tokens, [4, 12]);
    // The projection: 5 modes (standard, dedup, occult, pruned to 2 and to 1) on 2 machines at
    // D = 4; D = 32 exceeds the 16 experts.
    let proj = &r["projection"];
    let rows = proj["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2 * 5, "{proj}");
    assert!(rows.iter().all(|x| x["devices"] == 4));
    for chunk in rows.chunks(5) {
        assert_eq!(chunk[4]["ect"].as_f64(), Some(1.0));
        assert_eq!(chunk[0]["mode"], "standard");
        assert_eq!(chunk[0]["layer_speedup"].as_f64(), Some(1.0));
        assert!(chunk[1]["layer_speedup"].as_f64().unwrap() >= 1.0);
    }
    assert!(proj["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["devices"] == 32));
    assert!(stdout.contains("Cluster projection"), "{stdout}");
    assert!(d.join("rep/report.md").exists() && d.join("rep/placement-occult.json").exists());
    // The plots are PNG files.
    for png in [
        "ect.png",
        "speedup_vs_tokens.png",
        "quality_vs_ect.png",
        "collaboration.png",
    ] {
        let bytes = std::fs::read(d.join("rep").join(png)).unwrap();
        assert_eq!(&bytes[1..4], b"PNG", "{png}");
    }
    // The second run finds the model in the cache; with the recipe's one seed, one
    // fine-tuning per routing.
    let again = run(&[]);
    assert!(again.status.success());
    assert!(!String::from_utf8_lossy(&again.stderr).contains("building the built-in model"));
    let r = read_json(&d.join("rep/results.json"));
    assert_eq!(r["finetune"].as_array().unwrap().len(), 7);
    assert_eq!(r["quality"].as_array().unwrap().len(), 4 * 20);
    // No seeds is refused with the reason.
    let none = run(&["--seeds", "0"]);
    assert!(!none.status.success());
    assert!(String::from_utf8_lossy(&none.stderr).contains("seeds = 0"));
}

#[test]
fn project_sizes_a_cluster_from_a_trace() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    occult_ok(
        d,
        &[
            "trace",
            "synth",
            "--tokens",
            "2000",
            "--layers",
            "2",
            "-o",
            "t.safetensors",
        ],
    );
    let base = [
        "project",
        "--trace",
        "t.safetensors",
        "--devices",
        "4,16,128",
        "--tokens-per-device",
        "32,512",
        "--link",
        "ib-ndr",
    ];
    // The layer sizes are required, from a model or as flags.
    let err = occult_err(d, &base);
    assert!(err.contains("--hidden and --intermediate"), "{err}");
    let mut args = base.to_vec();
    args.extend([
        "--hidden",
        "1024",
        "--intermediate",
        "512",
        "--json",
        "p.json",
    ]);
    let out = occult_ok(d, &args);
    assert!(
        out.contains("PROJECTED") && out.contains("128, all left out"),
        "{out}"
    );
    let v = read_json(&d.join("p.json"));
    let rows = v["rows"].as_array().unwrap();
    // D = 4 and 16, two token counts, 4 modes each, and at D = 16 (two nodes of 8) the
    // node-aware placement; D = 128 is more devices than experts.
    assert_eq!(rows.len(), 2 * 2 * 4 + 2);
    for r in rows.iter().filter(|r| r["mode"] == "occult, node-aware") {
        assert_eq!(r["devices"], 16);
        assert!(r["ecn"].as_f64().unwrap() >= 1.0 && r["ecn"].as_f64().unwrap() <= 2.0);
    }
    assert!(v["projection"].as_bool().unwrap() && v.get("provenance").is_some());
    let at = |dv: u64, t: u64, mode: &str| {
        rows.iter()
            .find(|r| r["devices"] == dv && r["tokens_per_device"] == t && r["mode"] == mode)
            .unwrap()
    };
    // Two nodes of 8 at D = 16: deduplicated rows cross to each remote node at most once.
    let occ = at(16, 512, "occult");
    assert_eq!(occ["nodes"], 2);
    assert!(occ["inter_rows_per_token"].as_f64().unwrap() <= 1.0);
    assert!(
        at(16, 512, "standard")["inter_rows_per_token"]
            .as_f64()
            .unwrap()
            > 1.0
    );
    for dv in [4, 16] {
        let s = at(dv, 512, "occult, pruned to 2 devices (router)")["layer_speedup"]
            .as_f64()
            .unwrap();
        assert!(s > at(dv, 512, "dedup")["layer_speedup"].as_f64().unwrap() && s > 1.0);
    }
    // A trace without router logits projects without the pruned rows, and says so.
    occult_ok(
        d,
        &[
            "trace",
            "synth",
            "--tokens",
            "500",
            "--layers",
            "1",
            "--no-logits",
            "-o",
            "n.safetensors",
        ],
    );
    let out = occult_ok(
        d,
        &[
            "project",
            "--trace",
            "n.safetensors",
            "--hidden",
            "64",
            "--intermediate",
            "32",
            "--devices",
            "4",
        ],
    );
    assert!(out.contains("needs router logits"), "{out}");
}

#[test]
fn a_trace_written_by_another_tool_is_read() {
    // numpy-style: I32 ids, no weights or logits, only the required metadata.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    common::write_raw(
        &d.join("ext.safetensors"),
        vec![(
            "layers.7.topk_ids",
            Raw::I32(vec![3, 2], vec![0, 1, 2, 3, 1, 3]),
        )],
        &common::meta("4", "2"),
    );
    let out = occult_ok(
        d,
        &["collab", "--trace", "ext.safetensors", "--devices", "2"],
    );
    // Tokens {0,1}, {2,3}, {1,3} on devices {0,1 | 2,3}: C_T = 1, 1, 2.
    assert!(out.contains("mean E[C_T] 1.333"), "{out}");
}

/// `bench layer --renormalize --layer-out FILE` writes the layer for another engine (the
/// DeepSpeed-MoE peer reads it): the weights, every rank's tokens, and an `output` that a plain
/// loop of the renormalised top-k softmax router and SwiGLU experts reproduces.
#[test]
fn bench_layer_writes_its_layer_for_another_engine() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (e, k, h, i, t, ranks) = (16usize, 4usize, 32usize, 16usize, 10usize, 4usize);
    let run = |renorm: bool, file: &str| {
        let (e_s, k_s, h_s, i_s, t_s) = (
            e.to_string(),
            k.to_string(),
            h.to_string(),
            i.to_string(),
            t.to_string(),
        );
        let mut args = vec![
            "bench",
            "layer",
            "--experts",
            &e_s,
            "--top-k",
            &k_s,
            "--hidden",
            &h_s,
            "--intermediate",
            &i_s,
            "--tokens",
            &t_s,
            "--devices",
            "4",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--layer-out",
            file,
        ];
        if renorm {
            args.push("--renormalize");
        }
        occult_ok(d, &args);
        std::fs::read(d.join(file)).unwrap()
    };
    let bytes = run(true, "l.st");
    let (_, md) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let md = md.metadata().clone().unwrap();
    assert_eq!(md["format"], "occult.layer.v1");
    assert_eq!(md["renormalize"], "true");
    assert_eq!(md["ranks"], "4");
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let get = |name: &str, shape: &[usize]| -> Vec<f64> {
        let v = st.tensor(name).unwrap();
        assert_eq!(v.shape(), shape, "{name}");
        v.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect()
    };
    let n = t * ranks;
    let (router, gate, up, down) = (
        get("router", &[e, h]),
        get("gate", &[e, i, h]),
        get("up", &[e, i, h]),
        get("down", &[e, h, i]),
    );
    let (x, y) = (get("tokens", &[n, h]), get("output", &[n, h]));
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f64>();
    for r in 0..n {
        let xr = &x[r * h..(r + 1) * h];
        let logits: Vec<f64> = (0..e)
            .map(|j| dot(&router[j * h..(j + 1) * h], xr))
            .collect();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let top = &order[..k];
        let z: f64 = top.iter().map(|&j| logits[j].exp()).sum();
        let mut want = vec![0f64; h];
        for &j in top {
            let g = logits[j].exp() / z;
            let hid: Vec<f64> = (0..i)
                .map(|q| {
                    let a = dot(&gate[(j * i + q) * h..(j * i + q + 1) * h], xr);
                    let b = dot(&up[(j * i + q) * h..(j * i + q + 1) * h], xr);
                    a / (1.0 + (-a).exp()) * b
                })
                .collect();
            for (c, w) in want.iter_mut().enumerate() {
                *w += g * dot(&down[(j * h + c) * i..(j * h + c + 1) * i], &hid);
            }
        }
        for c in 0..h {
            let got = y[r * h + c];
            assert!(
                (got - want[c]).abs() < 1e-4,
                "token {r} feature {c}: {got} vs {}",
                want[c]
            );
        }
    }
    // The placement: every expert on one rank, E / D on each.
    let map = st.tensor("device_of_expert").unwrap();
    assert_eq!(
        (map.dtype(), map.shape()),
        (safetensors::Dtype::I64, &[e][..])
    );
    let mut per_rank = vec![0; ranks];
    for c in map.data().chunks_exact(8) {
        per_rank[i64::from_le_bytes(c.try_into().unwrap()) as usize] += 1;
    }
    assert_eq!(per_rank, vec![e / ranks; ranks]);
    // The same seed writes the same layer; without --renormalize the file says so.
    let again = run(true, "again.st");
    let again = safetensors::SafeTensors::deserialize(&again).unwrap();
    for name in [
        "router",
        "gate",
        "up",
        "down",
        "tokens",
        "output",
        "device_of_expert",
    ] {
        let same = again.tensor(name).unwrap().data() == st.tensor(name).unwrap().data();
        assert!(same, "{name} differs between two runs of one seed");
    }
    let plain = run(false, "plain.st");
    let (_, md) = safetensors::SafeTensors::read_metadata(&plain).unwrap();
    assert_eq!(md.metadata().clone().unwrap()["renormalize"], "false");
}

#[test]
fn bench_layer_reports_the_contract_and_the_ratio() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = occult_ok(
        d,
        &[
            "bench",
            "layer",
            "--experts",
            "16",
            "--top-k",
            "4",
            "--hidden",
            "32",
            "--intermediate",
            "16",
            "--tokens",
            "40",
            "--devices",
            "4",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--link",
            "pcie4",
            "--json",
            "b.json",
        ],
    );
    assert!(out.contains("occult / standard: rows"), "{out}");
    let b = read_json(&d.join("b.json"));
    assert_eq!(b["projected_with_link_model"], true);
    let results = b["results"].as_array().unwrap();
    let find = |m: &str| {
        results
            .iter()
            .find(|r| r["mode"] == m)
            .unwrap_or_else(|| panic!("no {m}"))
    };
    for r in results {
        for key in [
            "mode",
            "devices",
            "tokens",
            "rows_sent",
            "bytes_sent",
            "ect",
            "seconds",
            "projected_seconds",
            "tokens_per_s",
        ] {
            assert!(r.get(key).is_some(), "bench JSON lacks {key}");
        }
    }
    let (s, o) = (find("standard"), find("occult"));
    assert_eq!(s["tokens"], 160);
    assert_eq!(s["rows_sent"], 160 * 4);
    let ect = o["ect"].as_f64().unwrap();
    assert_eq!(o["rows_sent"].as_f64().unwrap(), (ect * 160.0).round());
    assert!(o["bytes_sent"].as_u64().unwrap() < s["bytes_sent"].as_u64().unwrap());
    assert!(o["projected_seconds"].as_f64().unwrap() < s["projected_seconds"].as_f64().unwrap());
    // Pruning to 2 devices leaves C_T <= 2.
    let p = results
        .iter()
        .find(|r| r["mode"] == "occult, pruned to 2 devices (similarity)")
        .unwrap();
    assert!(p["ect"].as_f64().unwrap() <= 2.0);
    // Each row carries its run's key, whose label is the row's `mode`.
    assert_eq!(p["run"]["mode"], "occult");
    assert_eq!(p["run"]["prune"]["devices"], 2);
    assert_eq!(p["run"]["rule"], "similarity");
    assert_eq!(
        s["run"],
        serde_json::json!({"mode": "standard", "prune": null, "rule": null, "copies": null})
    );
}

/// `bench layer --train` times training steps: the same runs, routing and forward rows as the
/// forward bench, with the backward's exchanges added to the bytes of every EP mode and the
/// setting in the JSON.
#[test]
fn bench_layer_times_training_steps() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = |train: bool, json: &str| {
        let mut args = vec![
            "bench",
            "layer",
            "--experts",
            "16",
            "--top-k",
            "4",
            "--hidden",
            "32",
            "--intermediate",
            "16",
            "--tokens",
            "40",
            "--devices",
            "4",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--renormalize",
            "--json",
            json,
        ];
        if train {
            args.push("--train");
        }
        let out = occult_ok(d, &args);
        assert_eq!(out.contains("training step"), train, "{out}");
        read_json(&d.join(json))
    };
    let (fwd, train) = (run(false, "f.json"), run(true, "t.json"));
    assert_eq!(train["config"]["train"], true);
    assert_eq!(fwd["config"]["train"], false);
    let modes = |b: &serde_json::Value| b["results"].as_array().unwrap().clone();
    let (fm, tm) = (modes(&fwd), modes(&train));
    // Training has no single-device reference row; the EP modes are the forward's.
    assert_eq!(fm[0]["mode"], "reference (1 device)");
    assert_eq!(fm.len(), tm.len() + 1);
    for (f, t) in fm[1..].iter().zip(&tm) {
        assert_eq!(f["mode"], t["mode"]);
        assert_eq!(f["rows_sent"], t["rows_sent"], "{}", f["mode"]);
        assert_eq!(f["ect"], t["ect"], "{}", f["mode"]);
        let (fb, tb) = (
            f["bytes_sent"].as_u64().unwrap(),
            t["bytes_sent"].as_u64().unwrap(),
        );
        // The reverse exchanges send gradients for the rows each forward exchange moved.
        assert!(
            tb > fb + fb / 2 && tb <= 2 * fb,
            "{}: {fb} -> {tb}",
            f["mode"]
        );
        assert!(t["seconds"].as_f64().unwrap() > 0.0);
    }
}

/// Placing for nodes end to end: `place --link` (node size and row weight from the profile)
/// records the level, reports E[C_N] and lowers it against the flat search; `collab
/// --devices-per-node` counts both levels, in agreement with `place`; bad levels are named.
#[test]
fn placing_for_nodes_lowers_nodes_per_token() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    occult_ok(
        d,
        &[
            "trace",
            "synth",
            "--tokens",
            "1500",
            "--layers",
            "2",
            "-o",
            "t.safetensors",
        ],
    );
    let place = |extra: &[&str], out: &str| {
        let mut a = vec![
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "16",
            "-o",
            out,
        ];
        a.extend_from_slice(extra);
        occult_ok(d, &a)
    };
    place(&[], "flat.json");
    let printed = place(&["--link", "ib-ndr"], "nodes.json");
    assert!(
        printed.contains("E[C_N]") && printed.contains("over nodes of 8"),
        "{printed}"
    );
    let p = read_json(&d.join("nodes.json"));
    assert_eq!(p["source"]["nodes"]["devices_per_node"], 8);
    assert_eq!(p["source"]["nodes"]["inter_weight"], 3.75);
    let collab = |placement: &str, json: &str| {
        let out = occult_ok(
            d,
            &[
                "collab",
                "--trace",
                "t.safetensors",
                "--placement",
                placement,
                "--devices-per-node",
                "8",
                "--resplit",
                "--json",
                json,
            ],
        );
        assert!(out.contains("mean E[C_N]"), "{out}");
        read_json(&d.join(json))["nodes"].clone()
    };
    let (flat, nodes) = (
        collab("flat.json", "f.json"),
        collab("nodes.json", "n.json"),
    );
    let ecn = |v: &Value| v["mean_ecn"].as_f64().unwrap();
    let collab_of = |d: &Path, trace: &str, placement: &str| {
        occult_ok(
            d,
            &[
                "collab",
                "--trace",
                trace,
                "--placement",
                placement,
                "--devices-per-node",
                "8",
                "--resplit",
                "--json",
                "c.json",
            ],
        );
        read_json(&d.join("c.json"))["nodes"].clone()
    };
    assert!(
        ecn(&nodes) < ecn(&flat),
        "{} vs {}",
        ecn(&nodes),
        ecn(&flat)
    );
    for l in nodes["layers"].as_array().unwrap() {
        let hist: u64 = l["ecn_histogram"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_u64().unwrap())
            .sum();
        assert_eq!(hist, l["tokens"].as_u64().unwrap());
        assert!(l["two_level"]["inter"].as_u64() <= l["dedup"]["inter"].as_u64());
    }
    // The node size from a profile, in collab too; a size that does not divide D is refused.
    let out = occult_ok(
        d,
        &[
            "collab",
            "--trace",
            "t.safetensors",
            "--devices",
            "16",
            "--link",
            "ib-ndr",
            "--resplit",
        ],
    );
    assert!(out.contains("over 2 nodes of 8 devices"), "{out}");
    // Node-limited pruning: every token on one node of 8 (E[C_N] 1), or on two nodes with
    // one device in each.
    for (nodes, extra, ect) in [
        ("1", vec![], 8.0),
        ("2", vec!["--max-devices-per-node", "1"], 2.0),
    ] {
        let mut a = vec![
            "prune",
            "--trace",
            "t.safetensors",
            "--placement",
            "nodes.json",
            "--rule",
            "router",
            "--devices-per-node",
            "8",
            "--json",
            "pr.json",
            "-o",
            "pruned.safetensors",
            "--max-nodes",
            nodes,
        ];
        a.extend(extra);
        let out = occult_ok(d, &a);
        assert!(out.contains(&format!("at most {nodes} node")), "{out}");
        let r = read_json(&d.join("pr.json"));
        assert!(r["ect_after"].as_f64().unwrap() <= ect, "{r}");
        let pruned = collab_of(d, "pruned.safetensors", "nodes.json");
        assert!(ecn(&pruned) <= nodes.parse::<f64>().unwrap(), "{pruned}");
    }
    let refused = |extra: &[&str]| {
        let mut a = vec!["place", "--trace", "t.safetensors", "--devices", "16"];
        a.extend_from_slice(extra);
        a.extend_from_slice(&["-o", "x.json"]);
        let err = occult_err(d, &a);
        assert!(!d.join("x.json").exists());
        err
    };
    let err = refused(&["--devices-per-node", "3"]);
    assert!(
        err.contains("--devices-per-node 3 must divide the 16 devices"),
        "{err}"
    );
    let err = refused(&["--inter-weight", "2"]);
    assert!(err.contains("needs a node size"), "{err}");
    let err = refused(&["--method", "greedy", "--devices-per-node", "4"]);
    assert!(err.contains("occult method only"), "{err}");
}

/// EPLB's hierarchical policy from `place`: 16 experts in 4 groups on 2 nodes of 2 devices,
/// 4 replicas. Each group's experts, copies included, sit in one node (groups are packed onto
/// nodes before replication), and each node holds two whole groups; --expert-groups outside
/// EPLB with replicas is refused.
#[test]
fn eplb_hierarchical_keeps_each_expert_group_in_one_node() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    synth(d, "t.safetensors", &["--skew", "1.0"]);
    occult_ok(
        d,
        &[
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "4",
            "--method",
            "eplb",
            "--replicas",
            "4",
            "--devices-per-node",
            "2",
            "--expert-groups",
            "4",
            "-o",
            "h.json",
        ],
    );
    let p = read_json(&d.join("h.json"));
    assert_eq!(p["source"]["eplb_groups"], 4);
    assert_eq!(p["source"]["eplb_nodes"], 2);
    for l in p["layers"].as_array().unwrap() {
        let slots: Vec<u64> = l["slots"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(slots.len(), 20);
        // 5 slots per device, 10 per node; expert x in group x / 4.
        let mut node_of_group = [None; 4];
        for (s, &x) in slots.iter().enumerate() {
            let node = s / 10;
            let g = (x / 4) as usize;
            assert_eq!(
                *node_of_group[g].get_or_insert(node),
                node,
                "group {g} on two nodes: {slots:?}"
            );
        }
        for n in 0..2 {
            assert_eq!(node_of_group.iter().filter(|&&x| x == Some(n)).count(), 2);
        }
    }
    let e = occult_err(
        d,
        &[
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "4",
            "--expert-groups",
            "4",
            "--method",
            "contiguous",
            "-o",
            "x.json",
        ],
    );
    assert!(
        e.contains("or is EPLB's hierarchical policy with --method eplb --replicas R"),
        "{e}"
    );
}

/// `occult export sglang` with replicas, as SGLang loads it: the file passes the check and the
/// serve flags name `--ep-num-redundant-experts`; a file SGLang would misload is refused with
/// the reason (an expert twice on one GPU; a redundant count that is not the file's), and so is
/// a placement that would write one, leaving no file behind.
#[test]
fn sglang_files_are_checked_as_sglang_loads_them() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/qwen2_moe");
    let model = model.to_str().unwrap();
    // 8 experts + 4 replicas on 4 devices of 3 slots, the MoE layers 1 and 2 (layer 0 is
    // dense: its row is SGLang's own).
    let placement = |slots: [u32; 12]| {
        let layers: Vec<serde_json::Value> = (1..3)
            .map(|l| serde_json::json!({"layer": l, "device_of_expert": [], "slots": slots}))
            .collect();
        serde_json::json!({"format": "occult.placement.v2", "num_experts": 8,
            "num_devices": 4, "method": "test", "layers": layers})
    };
    let good = placement([0, 1, 4, 2, 3, 5, 4, 5, 0, 6, 7, 1]);
    std::fs::write(d.join("p.json"), good.to_string()).unwrap();
    let export = |p: &str, out: &str| {
        common::occult(
            d,
            &[
                "export",
                "sglang",
                "--model",
                model,
                "--placement",
                p,
                "-o",
                out,
            ],
        )
    };
    let out = export("p.json", "loc.json");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("--ep-size 4 --moe-a2a-backend deepep --ep-num-redundant-experts 4"),
        "{err}"
    );
    let loc = read_json(&d.join("loc.json"));
    assert_eq!(loc["physical_to_logical_map"][1][2], 4);
    let check = ["export", "sglang", "--model", model, "--check", "loc.json"];
    let ok = occult_ok(d, &[&check[..], &["--ep-size", "4"]].concat());
    assert!(ok.contains("--ep-num-redundant-experts 4"), "{ok}");
    let e = occult_err(
        d,
        &[
            &check[..],
            &["--ep-size", "4", "--ep-num-redundant-experts", "0"],
        ]
        .concat(),
    );
    assert!(e.contains("serve with --ep-num-redundant-experts 4"), "{e}");
    // On 3 GPUs the 12 slots are 3 x 4: GPU 1 holds expert 5 twice.
    let e = occult_err(d, &[&check[..], &["--ep-size", "3"]].concat());
    assert!(e.contains("GPU 1 holds expert 5 twice"), "{e}");
    let out = common::occult(d, &check);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--ep-size"));
    // A placement with an expert twice on device 0 writes nothing.
    let twice = placement([0, 1, 0, 2, 3, 5, 4, 5, 6, 6, 7, 1]);
    std::fs::write(d.join("twice.json"), twice.to_string()).unwrap();
    let out = export("twice.json", "bad.json");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds expert 0 twice"));
    assert!(!d.join("bad.json").exists());
}

/// TensorRT-LLM's load-balancer YAML and vLLM's two proposed files: written from a placement
/// (with replicas where the format holds them), checked as the engine reads them, and read back
/// by `place --from` to the same placement; what a format cannot hold is refused before anything
/// is written.
#[test]
fn every_engines_placement_file_reads_back_to_its_placement() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/qwen2_moe");
    let model = model.to_str().unwrap();
    // The fixture's MoE layers are 1 and 2, 8 experts: 4 devices of 3 slots with replicas, and
    // a partition of 2 experts a device.
    let replicas = serde_json::json!({"format": "occult.placement.v2", "num_experts": 8,
        "num_devices": 4, "method": "test", "layers": (1..3).map(|l| serde_json::json!({
            "layer": l, "device_of_expert": [],
            "slots": [0, 1, 4, 2, 3, 5, 4, 5, 0, 6, 7, 1]})).collect::<Vec<_>>()});
    std::fs::write(d.join("r.json"), replicas.to_string()).unwrap();
    let part = serde_json::json!({"format": "occult.placement.v1", "num_experts": 8,
        "num_devices": 4, "method": "test", "layers": [
            {"layer": 1, "device_of_expert": [3, 2, 1, 0, 0, 1, 2, 3]},
            {"layer": 2, "device_of_expert": [0, 0, 1, 1, 2, 2, 3, 3]}]});
    std::fs::write(d.join("p.json"), part.to_string()).unwrap();

    let ok = |args: &[&str]| occult_ok(d, args);
    ok(&[
        "export",
        "trtllm",
        "--placement",
        "r.json",
        "-o",
        "lb.yaml",
        "--model",
        model,
    ]);
    let yaml = std::fs::read_to_string(d.join("lb.yaml")).unwrap();
    assert!(
        yaml.starts_with("initial_global_assignments:\n  1: [0, 1, 4, 2, 3, 5"),
        "{yaml}"
    );
    assert!(
        yaml.ends_with("layer_updates_per_iter: 0\nnum_slots: 12\n"),
        "{yaml}"
    );
    let checked = ok(&[
        "export",
        "trtllm",
        "--check",
        "lb.yaml",
        "--model",
        model,
        "--ep-size",
        "4",
    ]);
    assert!(checked.contains("with replicas"), "{checked}");
    ok(&[
        "place",
        "--from",
        "lb.yaml",
        "--devices",
        "4",
        "-o",
        "back.json",
    ]);
    assert_eq!(
        read_json(&d.join("back.json"))["layers"][1]["slots"],
        replicas["layers"][1]["slots"]
    );
    for (pr, file) in [("49572", "v1.json"), ("34811", "v2.json")] {
        let placement = if pr == "49572" { "r.json" } else { "p.json" };
        let out = common::occult(
            d,
            &[
                "export",
                "vllm",
                "--placement",
                placement,
                "--pr",
                pr,
                "-o",
                file,
            ],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        if pr == "34811" {
            // Two layers placed differently: one map cannot hold them.
            assert!(
                err.contains("--shared-across-layers") && !d.join(file).exists(),
                "{err}"
            );
            continue;
        }
        assert!(
            out.status.success() && err.contains("open pull request"),
            "{err}"
        );
        ok(&[
            "place",
            "--from",
            file,
            "--model",
            model,
            "--devices",
            "4",
            "-o",
            "back2.json",
        ]);
        assert_eq!(
            read_json(&d.join("back2.json"))["layers"],
            read_json(&d.join("back.json"))["layers"]
        );
    }
    // A shared map: #34811's file reads back as every MoE layer's.
    let mut shared = part.clone();
    shared["layers"][1]["device_of_expert"] = shared["layers"][0]["device_of_expert"].clone();
    std::fs::write(d.join("s.json"), shared.to_string()).unwrap();
    ok(&[
        "export",
        "vllm",
        "--placement",
        "s.json",
        "--pr",
        "34811",
        "-o",
        "v2.json",
    ]);
    assert_eq!(
        read_json(&d.join("v2.json")),
        serde_json::json!({"expert_to_ep_rank": [3, 2, 1, 0, 0, 1, 2, 3]})
    );
    ok(&[
        "place",
        "--from",
        "v2.json",
        "--model",
        model,
        "--devices",
        "4",
        "-o",
        "back3.json",
    ]);
    assert_eq!(read_json(&d.join("back3.json"))["layers"], shared["layers"]);
    // Refusals, named: the generator's ep_size key, a vLLM file without the model, ranks that
    // do not fit.
    std::fs::write(d.join("ep.yaml"), format!("{yaml}ep_size: 4\n")).unwrap();
    let e = occult_err(
        d,
        &[
            "export",
            "trtllm",
            "--check",
            "ep.yaml",
            "--model",
            model,
            "--ep-size",
            "4",
        ],
    );
    assert!(e.contains("remove that line"), "{e}");
    let e = occult_err(
        d,
        &[
            "place",
            "--from",
            "v2.json",
            "--devices",
            "4",
            "-o",
            "x.json",
        ],
    );
    assert!(e.contains("needs the model"), "{e}");
    let e = occult_err(
        d,
        &[
            "place",
            "--from",
            "lb.yaml",
            "--devices",
            "3",
            "-o",
            "x.json",
        ],
    );
    // On 3 ranks the 12 slots are 3 x 4: rank 1 holds expert 5 twice.
    assert!(e.contains("rank 1 holds expert 5 twice"), "{e}");
    let e = occult_err(
        d,
        &[
            "place",
            "--from",
            "lb.yaml",
            "--devices",
            "5",
            "-o",
            "x.json",
        ],
    );
    assert!(e.contains("not a multiple of the EP size 5"), "{e}");
    assert!(!d.join("x.json").exists());
}

/// Megatron-Core's router traces, one JSONL file per rank, import as one trace (ranks joined in
/// order, multi-token-prediction records left out), and go on to a placement and to
/// TensorRT-LLM's file: from recorded routing to a file an engine reads, one command each.
#[test]
fn megatron_router_traces_import_and_place() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let record = |step: usize, block: &str, layer: usize, rows: &[[u32; 2]]| {
        serde_json::json!({"step": step, "stage": "pre_dispatch", "block": block,
            "layer": layer, "rank": 0, "num_tokens": rows.len(), "topk": 2,
            "top_indices": rows})
        .to_string()
    };
    let rank0 = [
        record(0, "decoder", 1, &[[0, 1], [2, 3]]),
        record(0, "decoder", 2, &[[4, 5], [6, 7]]),
        record(0, "mtp", 0, &[[0, 7]]),
    ]
    .join("\n");
    let rank1 = [
        record(0, "decoder", 1, &[[0, 2]]),
        record(0, "decoder", 2, &[[1, 3]]),
    ]
    .join("\n");
    std::fs::write(d.join("router_trace_rank0.jsonl"), rank0).unwrap();
    std::fs::write(d.join("router_trace_rank1.jsonl"), rank1).unwrap();
    let out = common::occult(
        d,
        &[
            "trace",
            "import",
            "router_trace_rank0.jsonl",
            "router_trace_rank1.jsonl",
            "--experts",
            "8",
            "-o",
            "t.safetensors",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.contains("1 multi-token-prediction"),
        "{err}"
    );
    let t = occult_core::analysis::trace::Trace::read(&d.join("t.safetensors")).unwrap();
    assert_eq!(t.layer_ids(), vec![1, 2]);
    assert_eq!(t.layers[0].topk_ids, vec![0, 1, 2, 3, 0, 2]);
    occult_ok(
        d,
        &[
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "2",
            "-o",
            "p.json",
        ],
    );
    occult_ok(
        d,
        &["export", "trtllm", "--placement", "p.json", "-o", "lb.yaml"],
    );
    let yaml = std::fs::read_to_string(d.join("lb.yaml")).unwrap();
    assert!(
        yaml.contains("\n  1: [") && yaml.contains("\n  2: ["),
        "{yaml}"
    );
    // A record whose rows disagree with num_tokens is named by file and line.
    std::fs::write(
        d.join("bad.jsonl"),
        "{\"layer\": 1, \"num_tokens\": 3, \"topk\": 1, \"top_indices\": [[1]]}\n",
    )
    .unwrap();
    let e = occult_err(
        d,
        &[
            "trace",
            "import",
            "bad.jsonl",
            "--experts",
            "8",
            "-o",
            "b.safetensors",
        ],
    );
    assert!(
        e.contains("bad.jsonl") && e.contains("line 1: 1 rows"),
        "{e}"
    );
}

/// Routed experts returned with completions import as routing for the model's MoE layers (its
/// dense layer's never-written rows left out): SGLang's base64 int32 beside vLLM's nested
/// lists, one response a line, requests in order; without the model they are refused by name.
#[test]
fn routed_experts_returned_with_completions_import() {
    use base64::Engine;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/qwen2_moe");
    let model = model.to_str().unwrap();
    // 3 hidden layers (layer 0 dense), top-2, 8 experts; SGLang's two tokens, vLLM's one.
    let ids: [i32; 12] = [0, 0, 1, 2, 3, 4, 0, 0, 5, 6, 7, 1];
    let raw: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
    let b64 = base64::engine::general_purpose::STANDARD.encode(raw);
    let lines = [
        serde_json::json!({"text": "..", "meta_info": {"routed_experts": b64}}),
        serde_json::json!({"choices": [{"routed_experts": [[[0, 0], [2, 4], [6, 7]]]}]}),
    ]
    .map(|v| v.to_string())
    .join("\n");
    std::fs::write(d.join("responses.json"), lines).unwrap();
    occult_ok(
        d,
        &[
            "trace",
            "import",
            "responses.json",
            "--model",
            model,
            "-o",
            "t.safetensors",
        ],
    );
    let t = occult_core::analysis::trace::Trace::read(&d.join("t.safetensors")).unwrap();
    assert_eq!(t.layer_ids(), vec![1, 2]);
    assert_eq!(t.layers[0].topk_ids, vec![1, 2, 5, 6, 2, 4]);
    assert_eq!(t.layers[1].topk_ids, vec![3, 4, 7, 1, 6, 7]);
    let e = occult_err(
        d,
        &[
            "trace",
            "import",
            "responses.json",
            "--experts",
            "8",
            "-o",
            "u.safetensors",
        ],
    );
    assert!(e.contains("need the model"), "{e}");
}

/// TensorRT-LLM's expert-statistic dump (the co-occurrence variant's per-token experts) imports
/// as routing and goes on to TensorRT-LLM's own load-balancer file: a TensorRT-LLM deployment's
/// recorded routing to the file it serves, one command each.
#[test]
fn a_tensorrt_llm_statistic_dump_goes_to_its_load_balancer_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let dump = d.join("expert_statistic");
    std::fs::create_dir(&dump).unwrap();
    std::fs::write(
        dump.join("meta_info.json"),
        r#"{"num_experts": 8, "num_experts_per_token": 2}"#,
    )
    .unwrap();
    let write = |name: &str, tensors: &[(&str, Vec<i32>)]| {
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .map(|(key, ids)| {
                let view = safetensors::tensor::TensorView::new(
                    safetensors::Dtype::I32,
                    vec![ids.len() / 2, 2],
                    bytemuck_bytes(ids),
                )
                .unwrap();
                (key.to_string(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dump.join(name)).unwrap();
    };
    fn bytemuck_bytes(ids: &[i32]) -> &[u8] {
        // SAFETY: i32 has no padding; the slice covers exactly the ints' bytes.
        unsafe { std::slice::from_raw_parts(ids.as_ptr().cast(), std::mem::size_of_val(ids)) }
    }
    write(
        "token_selected_experts_rank0.safetensors",
        &[("100_1", vec![0, 1, 2, 3]), ("100_2", vec![4, 5, 6, 7])],
    );
    write(
        "token_selected_experts_rank1.safetensors",
        &[("100_1", vec![1, 2]), ("100_2", vec![3, 4])],
    );
    occult_ok(
        d,
        &[
            "trace",
            "import",
            "expert_statistic",
            "--experts",
            "8",
            "-o",
            "t.safetensors",
        ],
    );
    let t = occult_core::analysis::trace::Trace::read(&d.join("t.safetensors")).unwrap();
    assert_eq!(t.layers[0].topk_ids, vec![0, 1, 2, 3, 1, 2]);
    occult_ok(
        d,
        &[
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "2",
            "-o",
            "p.json",
        ],
    );
    occult_ok(
        d,
        &["export", "trtllm", "--placement", "p.json", "-o", "lb.yaml"],
    );
    let yaml = std::fs::read_to_string(d.join("lb.yaml")).unwrap();
    assert!(
        yaml.contains("\n  1: [") && yaml.ends_with("num_slots: 8\n"),
        "{yaml}"
    );
}

/// TensorRT-LLM's plain statistic dump holds expert counts only: the trace import refuses it
/// and names the load-only route, `place --loads` balances it with EPLB (copies included), and
/// the placement goes to TensorRT-LLM's load-balancer file and reads back.
#[test]
fn a_counts_only_statistic_dump_places_for_load_alone() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let dump = d.join("expert_statistic");
    std::fs::create_dir(&dump).unwrap();
    std::fs::write(
        dump.join("meta_info.json"),
        r#"{"num_experts": 8, "num_experts_per_token": 2}"#,
    )
    .unwrap();
    let write = |name: &str, tensors: &[(&str, [i64; 8])]| {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, c)| c.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((key, _), b)| {
                let v = safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![8], b)
                    .unwrap();
                (key.to_string(), v)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dump.join(name)).unwrap();
    };
    // Experts 0 and 1 are hot in layer 1; 6 and 7 in layer 2.
    write(
        "rank0.safetensors",
        &[
            ("100_1", [40, 30, 5, 5, 5, 5, 5, 5]),
            ("100_2", [5, 5, 5, 5, 5, 5, 40, 30]),
        ],
    );
    write(
        "rank1.safetensors",
        &[("100_1", [40, 30, 5, 5, 5, 5, 5, 5])],
    );
    let err = occult_err(
        d,
        &[
            "trace",
            "import",
            "expert_statistic",
            "--experts",
            "8",
            "-o",
            "t.safetensors",
        ],
    );
    assert!(err.contains("occult place --loads"), "{err}");
    let out = occult_ok(
        d,
        &[
            "place",
            "--loads",
            "expert_statistic",
            "--devices",
            "2",
            "-o",
            "p.json",
        ],
    );
    assert!(
        out.contains("E[C_T] is neither searched nor known"),
        "{out}"
    );
    let p = occult_core::analysis::placement::Placement::read(&d.join("p.json")).unwrap();
    let l1 = &p.layers[0].device_of_expert;
    assert_eq!(p.layers[0].layer, 1);
    assert_ne!(l1[0], l1[1], "the hot experts share a device: {l1:?}");
    occult_ok(
        d,
        &[
            "place",
            "--loads",
            "expert_statistic",
            "--devices",
            "2",
            "--replicas",
            "2",
            "-o",
            "r.json",
        ],
    );
    occult_ok(
        d,
        &["export", "trtllm", "--placement", "r.json", "-o", "lb.yaml"],
    );
    occult_ok(
        d,
        &[
            "place",
            "--from",
            "lb.yaml",
            "--devices",
            "2",
            "-o",
            "back.json",
        ],
    );
    let (r, back) = (
        occult_core::analysis::placement::Placement::read(&d.join("r.json")).unwrap(),
        occult_core::analysis::placement::Placement::read(&d.join("back.json")).unwrap(),
    );
    let slots = |p: &occult_core::analysis::placement::Placement| -> Vec<Option<Vec<u32>>> {
        p.layers.iter().map(|l| l.slots.clone()).collect()
    };
    assert_eq!(slots(&r), slots(&back));
    assert_eq!(r.layers[0].slots.as_ref().unwrap().len(), 10);
    let err = occult_err(
        d,
        &[
            "place",
            "--loads",
            "expert_statistic",
            "--devices",
            "3",
            "-o",
            "x.json",
        ],
    );
    assert!(err.contains("do not fill 3 devices evenly"), "{err}");
    assert!(!d.join("x.json").exists());
}

/// Group-limited models (the DeepSeek-V3 and GLM-4.5 fixtures: 8 experts in 4 groups of 2, 2
/// groups kept per token, MoE layers 1 and 2): `trace synth --groups` routes as they do (top-4
/// from 2 groups: a token's experts are exactly its 2 groups), `place --expert-groups` keeps
/// every group whole in both layouts, and the renumbered checkpoint and SGLang's file take what
/// it wrote.
#[test]
fn group_whole_placements_export_for_a_group_limited_model() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models");
    let synth = "trace synth --experts 8 --top-k 4 --layers 3 --tokens 400 --clusters 2 \
                 --groups 4 --topk-groups 2 -o all.safetensors";
    occult_ok(d, &synth.split_whitespace().collect::<Vec<_>>());
    let mut t = occult_core::analysis::trace::Trace::read(&d.join("all.safetensors")).unwrap();
    for row in t.layers[0].topk_ids.chunks_exact(4) {
        let mut g: Vec<u32> = row.iter().map(|&x| x / 2).collect();
        g.sort_unstable();
        g.dedup();
        assert_eq!(g.len(), 2, "{row:?}");
    }
    // The models' MoE layers are 1 and 2.
    t.layers.remove(0);
    t.write(&d.join("t.safetensors")).unwrap();
    let layouts = [
        ("4", "each group fills whole devices"),
        ("2", "each device holds whole groups"),
    ];
    for (devices, layout) in layouts {
        let place =
            format!("place --trace t.safetensors --devices {devices} --expert-groups 4 -o p.json");
        let out = occult_ok(d, &place.split_whitespace().collect::<Vec<_>>());
        assert!(out.contains(layout), "{out}");
        for arch in ["deepseek_v3", "glm4_moe"] {
            let model = models.join(arch);
            let model = model.to_str().unwrap();
            let _ = std::fs::remove_dir_all(d.join("placed"));
            let ckpt = [
                "export",
                "checkpoint",
                "--model",
                model,
                "--placement",
                "p.json",
                "-o",
                "placed",
            ];
            occult_ok(d, &ckpt);
            let sglang = [
                "export",
                "sglang",
                "--model",
                model,
                "--placement",
                "p.json",
                "-o",
                "loc.json",
            ];
            occult_ok(d, &sglang);
        }
    }
    let bad = "place --trace t.safetensors --devices 2 --expert-groups 3 -o x.json";
    let err = occult_err(d, &bad.split_whitespace().collect::<Vec<_>>());
    assert!(
        err.contains("3 expert groups do not divide the 8 experts"),
        "{err}"
    );
    let bad = "place --trace t.safetensors --devices 2 --expert-groups 4 --method greedy -o x.json";
    let err = occult_err(d, &bad.split_whitespace().collect::<Vec<_>>());
    assert!(
        err.contains("--expert-groups keeps the model's expert groups whole"),
        "{err}"
    );
}
