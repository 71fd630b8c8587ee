//! `occult train` end to end on a fixture model: it writes the model, log.jsonl and a
//! resumable state; a run stopped at a save and resumed ends bit-identical to one never
//! stopped; another run's folder is refused; bad settings are named.

mod common;

use common::{log_field, occult_err, occult_ok};
use std::path::{Path, PathBuf};

fn model() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/models/qwen2_moe")
        .display()
        .to_string()
}

fn write_data(dir: &Path) {
    let mut text = String::new();
    for i in 0..10 {
        text.push_str(&format!(
            "{{\"instruction\": \"Add {i} and {}.\", \"input\": \"\", \"output\": \"{}\"}}\n",
            i + 1,
            2 * i + 1
        ));
    }
    std::fs::write(dir.join("a.jsonl"), text).unwrap();
}

/// The flags of a small run on 2 ranks.
fn base<'a>(m: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--model",
        m,
        "--data",
        "a.jsonl",
        "--out",
        out,
        "--steps",
        "6",
        "--batch-size",
        "4",
        "--lr",
        "1e-3",
        "--seq-len",
        "128",
        "--devices",
        "2",
    ]
}

/// The base flags with `extra`: a flag the base has gets the new value, others are added.
fn with<'a>(mut args: Vec<&'a str>, extra: &[&'a str]) -> Vec<&'a str> {
    let mut rest = extra.iter().peekable();
    while let Some(&flag) = rest.next() {
        let value = rest.next_if(|v| !v.starts_with("--")).copied();
        match (args.iter().position(|a| *a == flag), value) {
            (Some(i), Some(v)) => args[i + 1] = v,
            (_, v) => {
                args.push(flag);
                args.extend(v);
            }
        }
    }
    args
}

fn train(dir: &Path, out: &str, extra: &[&str]) -> String {
    let m = model();
    occult_ok(dir, &with(base(&m, out), extra))
}

#[test]
fn a_stopped_and_resumed_run_ends_bit_identical_to_an_uninterrupted_one() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    train(d, "straight", &[]);
    train(d, "resumed", &["--stop-at", "2"]);
    train(d, "resumed", &["--resume", "--stop-at", "4"]);
    train(d, "resumed", &["--resume"]);
    let read = |p: &str| std::fs::read(d.join(p)).unwrap();
    assert_eq!(
        read("straight/model.safetensors"),
        read("resumed/model.safetensors"),
        "the models are bit-identical"
    );
    // The log has one line per step, the resumed run's as the straight one's (times aside).
    let steps = |p: &str| -> Vec<(u64, f64)> {
        String::from_utf8(read(p))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
            })
            .collect()
    };
    let (a, b) = (steps("straight/log.jsonl"), steps("resumed/log.jsonl"));
    assert_eq!(a.len(), 6);
    assert_eq!(a, b);
    assert!(a[5].1 < a[0].1, "the loss falls: {a:?}");
    // The saved model loads with every command, and tokenizer and config came along.
    let out = occult_ok(
        d,
        &[
            "loglik",
            "--model",
            "straight",
            "--context",
            "Add 1 and 2.",
            "--continuation",
            " 3",
        ],
    );
    assert!(out.contains("loglikelihood"));
}

/// The tensors of a saved model, by name, as f32.
fn tensors(dir: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32, "{name}");
            let vals = v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, vals)
        })
        .collect()
}

#[test]
fn train_moe_leaves_the_rest_bit_identical_and_train_all_moves_every_tensor() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    let source = tensors(Path::new(&model()));
    train(d, "moe", &["--steps", "3", "--lr", "1e-2"]);
    train(
        d,
        "all",
        &["--steps", "3", "--lr", "1e-2", "--train", "all"],
    );
    let (moe, all) = (tensors(&d.join("moe")), tensors(&d.join("all")));
    assert_eq!(
        moe.keys().collect::<Vec<_>>(),
        source.keys().collect::<Vec<_>>()
    );
    assert_eq!(
        all.keys().collect::<Vec<_>>(),
        source.keys().collect::<Vec<_>>()
    );
    for (name, before) in &source {
        let in_moe =
            name.starts_with("model.layers.1.mlp.") || name.starts_with("model.layers.2.mlp.");
        // Under --train moe, what is outside the MoE blocks is written back bit for bit.
        assert_eq!(moe[name] != *before, in_moe, "--train moe: {name}");
        // Under --train all, every tensor moves (a padding row of the embedding aside).
        assert_ne!(all[name], *before, "--train all: {name}");
    }
    // Both load, and the resumed-run settings know what trained.
    occult_ok(d, &["model", "check", "--model", "all"]);
    let m = model();
    let e = occult_err(d, &with(base(&m, "all"), &["--steps", "3", "--resume"]));
    assert!(e.contains("the saved run used other settings"), "{e}");
}

#[test]
fn a_bf16_run_resumes_bit_identically_on_its_f32_masters() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    let bf16 = ["--dtype", "bf16", "--steps", "4", "--lr", "1e-4"];
    train(d, "straight", &bf16);
    train(d, "resumed", &[&bf16[..], &["--stop-at", "2"]].concat());
    train(d, "resumed", &[&bf16[..], &["--resume"]].concat());
    let read = |p: &str| std::fs::read(d.join(p)).unwrap();
    assert_eq!(
        read("straight/model.safetensors"),
        read("resumed/model.safetensors")
    );
    // The state holds f32 masters, and the model is written in the source's dtype (f32).
    let state = std::fs::read_dir(d.join("straight/state")).unwrap();
    let step = state.flatten().find(|e| e.path().is_dir()).unwrap().path();
    let bytes = std::fs::read(step.join("rank0.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(
        st.tensor("0.param").unwrap().dtype(),
        safetensors::Dtype::F32
    );
    let saved = tensors(&d.join("straight"));
    let source = tensors(Path::new(&model()));
    // Updates of 1e-4 moved the routers: bf16 alone would round most of them away.
    let router = "model.layers.1.mlp.gate.weight";
    assert_ne!(saved[router], source[router]);
}

#[test]
fn held_out_loss_is_the_training_loss_before_a_step_on_any_number_of_ranks() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    let m = model();
    let loss = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "loss",
            "--model",
            &m,
            "--data",
            "a.jsonl",
            "--seq-len",
            "128",
        ];
        args.extend(extra);
        serde_json::from_str(&occult_ok(d, &args)).unwrap()
    };
    let one = loss(&["--batch-size", "3"]);
    let two = loss(&["--devices", "2", "--mode", "occult"]);
    let pruned = loss(&["--devices", "4", "--max-devices", "1"]);
    let l = one["loss"].as_f64().unwrap();
    assert!(
        (l - two["loss"].as_f64().unwrap()).abs() < 1e-5,
        "{one} vs {two}"
    );
    assert_eq!(one["targets"], two["targets"]);
    assert_eq!(pruned["mean_ect"].as_f64().unwrap(), 1.0);
    assert!(two["mean_ect"].as_f64().unwrap() > 1.0);
    // Step 0 of a run on the whole data in one batch scores the same examples before any update;
    // held-out data is scored at --eval-every steps and at the end.
    train(
        d,
        "run",
        &[
            "--batch-size",
            "10",
            "--steps",
            "4",
            "--eval-data",
            "a.jsonl",
            "--eval-every",
            "3",
        ],
    );
    let log = std::fs::read_to_string(d.join("run/log.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!((lines[0]["loss"].as_f64().unwrap() - l).abs() < 1e-5);
    let evals: Vec<u64> = lines
        .iter()
        .filter(|v| v.get("eval_loss").is_some())
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, vec![2, 3]);
    assert!(
        lines[3]["eval_loss"].as_f64().unwrap() < l,
        "the held-out loss fell"
    );
    let e = occult_err(d, &["loss", "--model", &m, "--data", "missing.jsonl"]);
    assert!(e.contains("missing.jsonl"), "{e}");
}

#[test]
fn another_runs_folder_and_bad_settings_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    train(d, "run", &["--stop-at", "1"]);
    let m = model();
    let err = |extra: &[&str]| occult_err(d, &with(base(&m, "run"), extra));
    assert!(err(&[]).contains("holds another run"));
    // Resuming with other settings names them.
    let e = err(&["--seed", "9", "--resume"]);
    assert!(e.contains("the saved run used other settings"), "{e}");
    assert!(err(&["--lr", "0", "--overwrite"]).contains("learning rate must be a positive"));
    assert!(err(&["--steps", "0", "--overwrite"]).contains("at least one step"));
    assert!(err(&["--seq-len", "100000", "--overwrite"]).contains("--seq-len 100000"));
    std::fs::write(d.join("bad.jsonl"), "{\"instruction\": \"x\"}\n").unwrap();
    let e = err(&["--data", "bad.jsonl", "--overwrite"]);
    assert!(e.contains("bad.jsonl row 0: no `output`"), "{e}");
    // The run's files are untouched by the refused commands.
    assert!(d.join("run/state/state.json").exists());
}

#[test]
fn pruned_training_keeps_every_token_on_its_allowed_devices() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    // 8 experts on 4 ranks, top-2: pruned to one device, every token's experts share it.
    for (n, most) in [("1", 1.0), ("2", 2.0)] {
        let out = format!("p{n}");
        train(
            d,
            &out,
            &[
                "--devices",
                "4",
                "--max-devices",
                n,
                "--steps",
                "3",
                "--overwrite",
            ],
        );
        let log = std::fs::read_to_string(d.join(&out).join("log.jsonl")).unwrap();
        for l in log.lines() {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let ect = v["mean_ect"].as_f64().unwrap();
            assert!(ect >= 1.0 && ect <= most, "pruned to {n}: E[C_T] {ect}");
            // Per MoE layer too (qwen2_moe's layers 1 and 2).
            let layers = v["ect"].as_array().unwrap();
            assert_eq!(layers.len(), 2);
            assert!(layers
                .iter()
                .all(|x| (1.0..=most).contains(&x.as_f64().unwrap())));
            if n == "1" {
                assert_eq!(ect, 1.0);
            }
        }
    }
}

#[test]
fn the_load_balancing_loss_is_logged_and_belongs_to_the_run() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    train(d, "aux", &["--steps", "3", "--stop-at", "2", "--aux-loss"]);
    let log = std::fs::read_to_string(d.join("aux/log.jsonl")).unwrap();
    for l in log.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        // qwen2_moe's own router_aux_loss_coef is 0.001; the loss is about 1 times that.
        let aux = v["aux_loss"].as_f64().unwrap();
        assert!(aux > 0.0005 && aux < 0.005, "{aux}");
    }
    let m = model();
    let e = occult_err(d, &with(base(&m, "aux"), &["--steps", "3", "--resume"]));
    assert!(e.contains("the saved run used other settings"), "{e}");
    train(d, "aux", &["--steps", "3", "--resume", "--aux-loss"]);
}

#[test]
fn gradient_accumulation_takes_the_same_steps() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    train(d, "one", &["--steps", "3"]);
    train(d, "two", &["--steps", "3", "--grad-accum", "2"]);
    let (a, b) = (log_field(d, "one", "loss"), log_field(d, "two", "loss"));
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
    }
}

#[test]
fn resuming_under_another_placement_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    // The same expert counts per device, other experts: moments would land on the wrong ones.
    let placement = |name: &str, first: [u32; 8]| {
        let layers: Vec<serde_json::Value> = (0..3)
            .map(|l| serde_json::json!({"layer": l, "device_of_expert": first}))
            .collect();
        let v = serde_json::json!({"format": "occult.placement.v1", "num_experts": 8,
            "num_devices": 2, "method": "contiguous", "layers": layers});
        std::fs::write(d.join(name), v.to_string()).unwrap();
    };
    placement("a.json", [0, 0, 0, 0, 1, 1, 1, 1]);
    placement("b.json", [1, 1, 1, 1, 0, 0, 0, 0]);
    train(d, "run", &["--placement", "a.json", "--stop-at", "1"]);
    let m = model();
    let e = occult_err(
        d,
        &with(base(&m, "run"), &["--placement", "b.json", "--resume"]),
    );
    assert!(e.contains("the saved run used other settings"), "{e}");
    // With the same placement it resumes; the state of step 1 gives way to the final one.
    train(d, "run", &["--placement", "a.json", "--resume"]);
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("run/state/state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], 6);
    assert!(d.join("run/state/step-6").is_dir());
    assert!(!d.join("run/state/step-1").exists());
}

#[test]
fn bench_train_compares_the_modes_on_the_same_steps() {
    let t = tempfile::tempdir().unwrap();
    let m = model();
    occult_ok(
        t.path(),
        &[
            "bench",
            "train",
            "--model",
            &m,
            "--devices",
            "4",
            "--seq-len",
            "10",
            "--batch-size",
            "1",
            "--warmup",
            "0",
            "--steps",
            "1",
            "--link",
            "pcie4",
            "--json",
            "b.json",
        ],
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(t.path().join("b.json")).unwrap()).unwrap();
    let r = v["results"].as_array().unwrap();
    let modes: Vec<&str> = r.iter().map(|x| x["mode"].as_str().unwrap()).collect();
    assert_eq!(
        modes,
        [
            "standard",
            "occult",
            "occult, pruned to 2 devices (router)",
            "occult, pruned to 1 device (router)"
        ]
    );
    let get = |i: usize, k: &str| r[i][k].as_f64().unwrap();
    // 4 ranks x 9 input positions x top-2 x 2 MoE layers (qwen2_moe's layers 1 and 2).
    assert_eq!(get(0, "rows_sent"), (4 * 9 * 2 * 2) as f64);
    assert!(get(1, "bytes_sent") < get(0, "bytes_sent"));
    assert_eq!(get(3, "ect"), 1.0);
    assert!(get(1, "projected_seconds") < get(0, "projected_seconds"));
}

/// Training killed 10 times at random points, by a signal it cannot handle (SIGKILL) or one it
/// does not (SIGTERM), outside its control: a point is a random step (from the log) and a
/// random moment within that step, which lands mid-step, mid-save or mid-log. Each time it is
/// started again, with `--resume` once it has saved a state (and `--overwrite`, as the error
/// says, when it was killed before its first save). It ends bit-identical to a run never
/// interrupted, its log one line per step with the same losses.
#[test]
fn training_killed_at_random_points_resumes_bit_identical() {
    use rand::{Rng, SeedableRng};
    use std::time::{Duration, Instant};
    const STEPS: usize = 10;
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    let m = model();
    let flags = |out: &'static str| with(base(&m, out), &["--steps", "10", "--save-every", "1"]);
    let started = Instant::now();
    occult_ok(d, &flags("straight"));
    let step_time = started.elapsed() / STEPS as u32;
    let logged =
        || std::fs::read_to_string(d.join("killed/log.jsonl")).map_or(0, |l| l.lines().count());

    let read = |p: &str| std::fs::read(d.join(p)).unwrap();
    let losses = |p: &str, kills: &[String]| -> Vec<(u64, String)> {
        String::from_utf8(read(p))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("{p}: a broken line {l:?} ({e}); kills {kills:?}"));
                (v["step"].as_u64().unwrap(), v["loss"].to_string())
            })
            .collect()
    };
    // After every start: the log holds steps 0, 1, 2, ... with none skipped or repeated, and
    // the saved state is at most one step from it (a kill can land between logging a step
    // and saving it).
    let check_saved = |kills: &[String]| {
        let Ok(log) = std::fs::read_to_string(d.join("killed/log.jsonl")) else {
            return;
        };
        let steps: Vec<u64> = log
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .map(|v| v["step"].as_u64().unwrap())
            .collect();
        let expected: Vec<u64> = (0..steps.len() as u64).collect();
        assert_eq!(
            steps, expected,
            "the log skips or repeats steps; kills {kills:?}"
        );
        if let Ok(state) = std::fs::read_to_string(d.join("killed/state/state.json")) {
            let v: serde_json::Value = serde_json::from_str(&state).unwrap();
            let saved = v["step"].as_u64().unwrap();
            assert!(
                saved.abs_diff(steps.len() as u64) <= 1,
                "state.json is at step {saved}, the log has {} steps; kills {kills:?}",
                steps.len()
            );
        }
    };
    // A run that reached the end through resumes must equal the straight run.
    let compare = |kills: &[String]| {
        assert_eq!(
            read("straight/model.safetensors"),
            read("killed/model.safetensors"),
            "bit-identical after kills: {kills:?}"
        );
        assert_eq!(
            losses("straight/log.jsonl", kills),
            losses("killed/log.jsonl", kills),
            "kills: {kills:?}"
        );
    };

    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
    let mut kills = Vec::new();
    // Resumes in the run now in `killed`, and in the runs that reached the end and were
    // compared: a resume whose run is thrown away proves nothing.
    let (mut resumes, mut resumes_compared, mut finished_first) = (0, 0, 0);
    while kills.len() < 10 {
        let mut args = flags("killed");
        if d.join("killed/state/state.json").exists() {
            args.push("--resume");
            resumes += 1;
        } else if d.join("killed/log.jsonl").exists() || d.join("killed/state").exists() {
            let e = occult_err(d, &args);
            assert!(e.contains("saved no state"), "{e}");
            args.push("--overwrite");
            resumes = 0;
        }
        let at_step = (logged() + rng.random_range(0..3)).min(STEPS - 1);
        let within = step_time.mul_f64(rng.random_range(0.0..1.0));
        let term = rng.random_bool(0.3);
        let mut child = std::process::Command::new(common::occult_bin())
            .args(&args)
            .current_dir(d)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait for the step to be logged (or the run to end), then into the next one.
        while logged() < at_step && child.try_wait().unwrap().is_none() {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(within);
        if term {
            let pid = child.id().to_string();
            let sent = std::process::Command::new("kill")
                .args(["-TERM", &pid])
                .status();
            assert!(sent.is_ok());
        } else {
            let _ = child.kill();
        }
        let finished = child.wait().unwrap().success();
        check_saved(&kills);
        if finished {
            // It finished before the signal. After resumes, it is a whole run made of killed
            // parts: it must equal the straight run. Either way, start over so that every kill
            // lands in a live run.
            if resumes > 0 {
                compare(&kills);
                resumes_compared += resumes;
            } else {
                finished_first += 1;
                assert!(finished_first < 20, "runs keep finishing before the kill");
            }
            resumes = 0;
            std::fs::remove_dir_all(d.join("killed")).unwrap();
            continue;
        }
        kills.push(format!(
            "{} after step {at_step} + {:.0}%",
            if term { "TERM" } else { "KILL" },
            100.0 * within.as_secs_f64() / step_time.as_secs_f64()
        ));
    }
    // The last start runs to the end.
    let mut args = flags("killed");
    if d.join("killed/state/state.json").exists() {
        args.push("--resume");
        resumes += 1;
    } else {
        args.push("--overwrite");
        resumes = 0;
    }
    occult_ok(d, &args);
    check_saved(&kills);
    compare(&kills);
    resumes_compared += resumes;
    assert!(
        resumes_compared >= 5,
        "only {resumes_compared} resumes in runs that reached the end: {kills:?}"
    );
}

/// Pruned training in either dispatch on 4 ranks takes the steps of the single-device reference
/// pruned as the same placement would prune it: the same losses and weights, and the logged
/// E[C_T] of the pruned routing (exactly 1 when each token keeps one device).
#[test]
fn pruned_training_in_either_dispatch_is_the_pruned_reference() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    let m = model();
    let text: String = (0..40)
        .map(|i| format!("Add {i} and {}.\n", i + 3))
        .collect();
    std::fs::write(d.join("c.txt"), text).unwrap();
    occult_ok(
        d,
        &[
            "profile",
            "--model",
            &m,
            "--data",
            "c.txt",
            "-o",
            "t.safetensors",
            "--no-logits",
        ],
    );
    occult_ok(
        d,
        &[
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "4",
            "--method",
            "greedy",
            "-o",
            "p.json",
        ],
    );
    let pruned = ["--placement", "p.json", "--max-devices", "1"];
    let log = |out: &str| -> Vec<(f64, f64)> {
        std::fs::read_to_string(d.join(out).join("log.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["loss"].as_f64().unwrap(), v["mean_ect"].as_f64().unwrap())
            })
            .collect()
    };
    train(d, "reference", &[&["--devices", "1"][..], &pruned].concat());
    let reference = log("reference");
    let weights = tensors(&d.join("reference"));
    for mode in ["standard", "occult"] {
        train(
            d,
            mode,
            &[&["--devices", "4", "--mode", mode][..], &pruned].concat(),
        );
        let run = log(mode);
        assert_eq!(run.len(), reference.len());
        for (step, (a, b)) in reference.iter().zip(&run).enumerate() {
            assert!(
                (a.0 - b.0).abs() < 1e-5,
                "{mode} step {step}: loss {} vs {}",
                a.0,
                b.0
            );
            assert_eq!(b.1, 1.0, "{mode} step {step}: E[C_T] of the pruned routing");
            assert_eq!(a.1, 1.0, "the reference, step {step}");
        }
        for (name, v) in tensors(&d.join(mode)) {
            let err = v
                .iter()
                .zip(&weights[&name])
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            // As the unpruned comparison: Adam turns float noise into updates of up to lr.
            assert!(err < 1e-4, "{mode} {name}: {err}");
        }
    }
}

/// On one rank, rank 0 alone saves and puts the save in force: `state.json` names the last
/// step and its folder holds rank 0's part (a mutation that let only the other ranks write
/// `state.json` passed every multi-rank test).
#[test]
fn a_one_rank_run_saves_a_state_to_resume_from() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    let m = model();
    occult_ok(
        d,
        &with(
            base(&m, "one"),
            &["--devices", "1", "--steps", "2", "--save-every", "1"],
        ),
    );
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("one/state/state.json")).unwrap()).unwrap();
    assert_eq!(state["step"], 2);
    let folder = state["folder"].as_str().unwrap();
    assert!(d
        .join("one/state")
        .join(folder)
        .join("rank0.safetensors")
        .is_file());
}

/// `--weight-decay w` reaches the optimiser as AdamW's decoupled decay: after one step from the
/// same start, each trained weight differs from the run without decay by `-lr * w * theta`
/// (the logged learning rate, the source's weight), and untrained ones not at all.
#[test]
fn weight_decay_shrinks_each_trained_weight_by_lr_times_decay() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write_data(d);
    let w = 0.5f32;
    train(d, "plain", &["--steps", "1", "--weight-decay", "0"]);
    train(d, "decayed", &["--steps", "1", "--weight-decay", "0.5"]);
    let log = std::fs::read_to_string(d.join("decayed/log.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
    let lr = first["lr"].as_f64().unwrap() as f32;
    assert!(lr > 0.0, "{first}");
    let (source, plain, decayed) = (
        tensors(Path::new(&model())),
        tensors(&d.join("plain")),
        tensors(&d.join("decayed")),
    );
    let mut trained = 0;
    for (name, theta) in &source {
        let (p, q) = (&plain[name], &decayed[name]);
        if p == theta {
            assert_eq!(q, theta, "{name}: untrained, yet decayed");
            continue;
        }
        trained += 1;
        for ((&th, &a), &b) in theta.iter().zip(p).zip(q) {
            let want = a - lr * w * th;
            let tol = 4.0 * f32::EPSILON * (th.abs() + a.abs()) + 1e-12;
            assert!((b - want).abs() <= tol, "{name}: {b} against {want}");
        }
        let moved = theta
            .iter()
            .zip(q)
            .zip(p)
            .any(|((&th, &b), &a)| (b - a).abs() > 1e3 * f32::EPSILON * th.abs() && th != 0.0);
        assert!(moved, "{name}: the decay is too small to see");
    }
    assert!(trained > 0, "no tensor trained");
}
