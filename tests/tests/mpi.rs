//! Multi-rank runs under a real `mpirun` (feature `mpi`): EP-layer parity on 2 and 4 ranks with
//! MPI's own all-to-all; whole models data + expert parallel on 2, 3 and 4 processes (logits and
//! gradients of all five fixture families, `occult eval` and `occult profile` equal to one
//! device); and ranks that die or stall making the others fail instead of hanging.
#![cfg(feature = "mpi")]

mod common;

use common::{log_field, occult_bin, occult_ok, read_samples, same_scores};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// `mpirun -np N BIN ARGS` with the flags these machines need (2 cores, root).
fn mpirun_bin(np: usize, bin: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new("mpirun")
        .args([
            "--oversubscribe",
            "--bind-to",
            "none",
            "--mca",
            "btl",
            "self,vader",
        ])
        .args(["-np", &np.to_string()])
        .arg(bin)
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("mpirun must be installed (apt-get install openmpi-bin libopenmpi-dev)")
}

fn mpirun(np: usize, args: &[&str]) -> std::process::Output {
    mpirun_bin(
        np,
        std::path::Path::new(env!("CARGO_BIN_EXE_mpi-parity")),
        args,
    )
}

/// Runs a job that must fail within `within`; returns everything it printed.
fn must_fail(out: impl FnOnce() -> std::process::Output, within: Duration) -> String {
    let start = Instant::now();
    let out = out();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{all}");
    assert!(start.elapsed() < within, "took {:?}", start.elapsed());
    all
}

/// Runs an `mpi-parity` job that must fail, soon; returns everything it printed.
fn failing_run(np: usize, args: &[&str]) -> String {
    must_fail(|| mpirun(np, args), Duration::from_secs(60))
}

fn mpi_model(np: usize, args: &[&str]) -> std::process::Output {
    mpirun_bin(np, Path::new(env!("CARGO_BIN_EXE_mpi-model")), args)
}

/// `mpirun -np N occult ARGS` in `dir`.
fn mpirun_occult(np: usize, dir: &Path, args: &[&str]) -> std::process::Output {
    mpirun_occult_env(np, dir, args, &[])
}

/// [`mpirun_occult`] with environment variables set for every rank.
fn mpirun_occult_env(
    np: usize,
    dir: &Path,
    args: &[&str],
    env: &[(&str, &Path)],
) -> std::process::Output {
    Command::new("mpirun")
        .current_dir(dir)
        .args([
            "--oversubscribe",
            "--bind-to",
            "none",
            "--mca",
            "btl",
            "self,vader",
        ])
        .args(["-np", &np.to_string()])
        .arg(occult_bin())
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .envs(env.iter().copied())
        .output()
        .expect("mpirun must be installed")
}

fn fixture(arch: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/models")
        .join(arch)
        .display()
        .to_string()
}

#[test]
fn whole_models_under_mpirun_match_one_device_on_2_3_and_4_ranks() {
    for np in [2, 3, 4] {
        let out = mpi_model(np, &[]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "np {np}:\n{stdout}\n{stderr}");
        for r in 0..np {
            assert!(
                stdout.contains(&format!("rank {r} of {np}: ok")),
                "np {np}: rank {r} did not report:\n{stdout}\n{stderr}"
            );
        }
    }
}

#[test]
fn a_rank_dying_mid_forward_or_mid_backward_fails_the_job_within_30_s() {
    for at in ["forward", "backward"] {
        let all = must_fail(
            || mpi_model(3, &["--die-rank", "1", "--die-at", at, "--timeout", "10"]),
            Duration::from_secs(30),
        );
        assert!(
            all.contains(&format!("rank 1: exiting on purpose before the {at}")),
            "{all}"
        );
        // mpirun names the lost rank (its process name ends in the rank).
        assert!(
            all.contains("Process name: [[") && all.contains("],1]"),
            "{all}"
        );
    }
}

#[test]
fn eval_and_profile_under_mpirun_equal_one_device() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let model = fixture("qwen3_moe");
    let tasks = "arc_easy,hellaswag,piqa,mmlu,gsm8k";
    let eval_args = |out: &str| {
        vec![
            "eval".to_string(),
            "--model".into(),
            model.clone(),
            "--tasks".into(),
            tasks.into(),
            "--samples".into(),
            // GSM8K's answers within the fixture's 128 positions.
            "--max-gen-toks".into(),
            "24".into(),
            "--output".into(),
            format!("{out}/results.json"),
            "--log-samples".into(),
        ]
    };
    std::fs::create_dir_all(dir.join("one")).unwrap();
    std::fs::create_dir_all(dir.join("four")).unwrap();
    let one = eval_args("one");
    occult_ok(dir, &one.iter().map(String::as_str).collect::<Vec<_>>());
    let mut four = eval_args("four");
    four.extend(["--backend", "mpi", "--devices", "4", "--mode", "occult"].map(String::from));
    let out = mpirun_occult(4, dir, &four.iter().map(String::as_str).collect::<Vec<_>>());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Only rank 0 prints the table (one header line).
    assert_eq!(stdout.matches("| task").count(), 1, "{stdout}");
    let read = |p: PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let (r1, r4) = (
        read(dir.join("one/results.json")),
        read(dir.join("four/results.json")),
    );
    for task in tasks.split(',') {
        for key in ["acc", "acc_norm", "n", "exact_match,strict-match"] {
            assert_eq!(
                r1["results"][task][key], r4["results"][task][key],
                "{task} {key}"
            );
        }
    }
    same_scores(
        &read_samples(&dir.join("one"), tasks),
        &read_samples(&dir.join("four"), tasks),
        "1 device vs mpirun -np 4",
    );

    // profile: the same routing, in the same token order.
    let data = dir.join("calib.txt");
    std::fs::write(
        &data,
        "the cat sat on the mat\nexperts route tokens to devices\na b c d e f g\nhello world\n",
    )
    .unwrap();
    let data = data.display().to_string();
    let profile = |extra: &[&str], out: &str| {
        let mut a = vec![
            "profile",
            "--model",
            &model,
            "--data",
            &data,
            "-o",
            out,
            "--seq-len",
            "4",
        ];
        a.extend(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    occult_ok(
        dir,
        &profile(&[], "one.safetensors")
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let args = profile(
        &["--backend", "mpi", "--devices", "3", "--mode", "occult"],
        "three.safetensors",
    );
    let out = mpirun_occult(3, dir, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info = |f: &str| occult_ok(dir, &["trace", "info", f]).replace(f, "TRACE");
    assert_eq!(info("one.safetensors"), info("three.safetensors"));
    let ids = |f: &str| {
        let bytes = std::fs::read(dir.join(f)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
        names.sort();
        names
            .into_iter()
            .filter(|n| n.ends_with("topk_ids"))
            .map(|n| st.tensor(&n).unwrap().data().to_vec())
            .collect::<Vec<_>>()
    };
    assert_eq!(ids("one.safetensors"), ids("three.safetensors"));
}

#[test]
fn a_device_count_that_disagrees_with_mpirun_is_named() {
    let t = tempfile::tempdir().unwrap();
    let model = fixture("mixtral");
    let out = mpirun_occult(
        2,
        t.path(),
        &[
            "loglik",
            "--model",
            &model,
            "--context",
            "a b",
            "--continuation",
            " c",
            "--backend",
            "mpi",
            "--devices",
            "3",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--devices 3 but mpirun started 2 ranks"),
        "{stderr}"
    );
}

fn parity_on(np: usize, args: &[&str]) -> String {
    let out = mpirun(np, args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "mpirun -np {np} failed:\n{stdout}\n{stderr}"
    );
    for r in 0..np {
        assert!(
            stdout.contains(&format!("rank {r} of {np}: ok")),
            "rank {r} did not report:\n{stdout}\n{stderr}"
        );
    }
    stdout.into_owned()
}

#[test]
fn parity_under_mpirun_with_2_and_4_ranks() {
    parity_on(2, &["10"]);
    let out = parity_on(4, &["10"]);
    // One host: MPI's shared-memory split puts all 4 ranks in one node.
    assert!(out.contains("node size Some(4)"), "{out}");
}

/// The two-level exchange on 2 emulated nodes of 2 ranks: outputs, gradients and the rows to
/// each peer at both levels against the reference and a plain count, on every case.
#[test]
fn two_level_parity_under_mpirun_on_two_emulated_nodes() {
    parity_on(4, &["10", "--nodes", "2"]);
}

/// Every case under a placement with replicas (both copy rules, both flat modes, on 3 ranks):
/// outputs, gradients and the rows to each peer against the reference and the rule's count.
#[test]
fn replica_parity_under_mpirun() {
    parity_on(3, &["10", "--replicas"]);
}

#[test]
fn a_dead_rank_fails_the_job_instead_of_hanging() {
    let all = failing_run(3, &["2", "--die-rank", "1"]);
    assert!(all.contains("rank 1: exiting on purpose"), "{all}");
}

#[test]
fn bench_layer_runs_under_mpirun() {
    let bin = occult_bin();
    let args = [
        "bench",
        "layer",
        "--backend",
        "mpi",
        "--devices",
        "2",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--hidden",
        "32",
        "--intermediate",
        "16",
        "--tokens",
        "24",
        "--steps",
        "1",
        "--warmup",
        "0",
    ];
    let out = mpirun_bin(2, &bin, &args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Only rank 0 prints the table.
    assert_eq!(stdout.matches("occult / standard").count(), 1, "{stdout}");
    assert!(stdout.contains("(mpi backend)"), "{stdout}");
}

#[test]
fn a_stalled_rank_trips_the_watchdog_instead_of_hanging() {
    let all = failing_run(3, &["2", "--stall-rank", "2", "--timeout", "2"]);
    assert!(
        all.contains("a collective did not finish within 2 s"),
        "{all}"
    );
}

/// `mpirun` with one `occult ARGS` per rank (MPMD), so that ranks can be given different inputs.
fn mpirun_per_rank(dir: &Path, per_rank: &[Vec<String>]) -> std::process::Output {
    let mut cmd = Command::new("mpirun");
    cmd.current_dir(dir)
        .args([
            "--oversubscribe",
            "--bind-to",
            "none",
            "--mca",
            "btl",
            "self,vader",
        ])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    for (r, args) in per_rank.iter().enumerate() {
        if r > 0 {
            cmd.arg(":");
        }
        cmd.args(["-np", "1"]).arg(occult_bin()).args(args);
    }
    cmd.output().expect("mpirun must be installed")
}

#[test]
fn ranks_with_different_checkpoints_or_placements_are_named() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let loglik = |model: &str, extra: &[&str]| {
        let mut a: Vec<String> = [
            "loglik",
            "--model",
            model,
            "--context",
            "a b",
            "--continuation",
            " c",
            "--backend",
            "mpi",
            "--devices",
            "2",
            "--mode",
            "occult",
        ]
        .map(String::from)
        .to_vec();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let (olmoe, mixtral) = (fixture("olmoe"), fixture("mixtral"));
    let out = mpirun_per_rank(dir, &[loglik(&olmoe, &[]), loglik(&mixtral, &[])]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("rank(s) [1] differ from rank 0 in the model: rank 0 has olmoe"),
        "{stderr}"
    );
    // The same checkpoint under two placements of its 8 experts on 2 devices.
    let placement = |name: &str, first: [u32; 8]| {
        let layers: Vec<serde_json::Value> = (0..3)
            .map(|l| serde_json::json!({"layer": l, "device_of_expert": first}))
            .collect();
        let v = serde_json::json!({"format": "occult.placement.v1", "num_experts": 8,
            "num_devices": 2, "method": "contiguous", "layers": layers});
        std::fs::write(dir.join(name), v.to_string()).unwrap();
    };
    placement("a.json", [0, 0, 0, 0, 1, 1, 1, 1]);
    placement("b.json", [1, 1, 1, 1, 0, 0, 0, 0]);
    let out = mpirun_per_rank(
        dir,
        &[
            loglik(&olmoe, &["--placement", "a.json"]),
            loglik(&olmoe, &["--placement", "b.json"]),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("differ from rank 0 in the placement"),
        "{stderr}"
    );
}

#[test]
fn a_rank_that_fails_or_reads_other_inputs_ends_the_job_with_its_reason() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let olmoe = fixture("olmoe");
    let generate = |model: &str, prompt: &str| -> Vec<String> {
        [
            "generate",
            "--model",
            model,
            "--prompt",
            prompt,
            "--max-new-tokens",
            "2",
            "--backend",
            "mpi",
            "--devices",
            "2",
            "--mode",
            "occult",
        ]
        .map(String::from)
        .to_vec()
    };
    // Rank 1 cannot load its model: its error is printed and the job ends at once.
    let all = must_fail(
        || {
            mpirun_per_rank(
                dir,
                &[generate(&olmoe, "Rain"), generate("/no/such/model", "Rain")],
            )
        },
        Duration::from_secs(20),
    );
    assert!(all.contains("loading model /no/such/model"), "{all}");
    // Ranks given different prompts say so instead of pairing the wrong results.
    let all = must_fail(
        || mpirun_per_rank(dir, &[generate(&olmoe, "Rain"), generate(&olmoe, "Snow")]),
        Duration::from_secs(20),
    );
    assert!(
        all.contains("rank(s) [1] hold different prompts or sampling flags from rank 0"),
        "{all}"
    );
}

/// Eight Alpaca records ("Add i and 1.") as `a.jsonl` in `dir`.
fn write_add_one_data(dir: &Path) {
    let text: String = (0..8)
        .map(|i| {
            format!(
                "{{\"instruction\": \"Add {i} and 1.\", \"output\": \"{}\"}}\n",
                i + 1
            )
        })
        .collect();
    std::fs::write(dir.join("a.jsonl"), text).unwrap();
}

#[test]
fn training_under_mpirun_takes_the_steps_of_threads() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    write_add_one_data(dir);
    let model = fixture("olmoe");
    let args = |out: &str, mpi: bool| {
        let mut a: Vec<String> = [
            "train",
            "--model",
            &model,
            "--data",
            "a.jsonl",
            "--out",
            out,
            "--steps",
            "3",
            "--batch-size",
            "4",
            "--lr",
            "1e-3",
            "--seq-len",
            "128",
            "--devices",
            "2",
            "--aux-loss",
        ]
        .map(String::from)
        .to_vec();
        if mpi {
            a.extend(["--backend", "mpi"].map(String::from));
        }
        a
    };
    occult_ok(
        dir,
        &args("threads", false)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let out = mpirun_occult(
        2,
        dir,
        &args("mpi", true)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The cross-entropy and the load-balancing loss (expert counts summed over processes).
    let losses = |run: &str| -> Vec<f64> {
        std::fs::read_to_string(dir.join(run).join("log.jsonl"))
            .unwrap()
            .lines()
            .flat_map(|l| {
                let v = serde_json::from_str::<serde_json::Value>(l).unwrap();
                [v["loss"].as_f64().unwrap(), v["aux_loss"].as_f64().unwrap()]
            })
            .collect()
    };
    let (a, b) = (losses("threads"), losses("mpi"));
    assert_eq!(a.len(), 6);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < 1e-6, "{a:?} vs {b:?}");
    }
    // Rank 0 wrote one model, loadable as it is.
    occult_ok(dir, &["model", "check", "--model", "mpi"]);
}

/// `occult train` on the olmoe fixture and `a.jsonl` (2 steps of 4 sequences of 128 tokens at
/// lr 1e-3) into `out`, with `extra` flags.
fn train_args(model: &str, out: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--model",
        model,
        "--data",
        "a.jsonl",
        "--out",
        out,
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--lr",
        "1e-3",
        "--seq-len",
        "128",
    ]
    .map(String::from)
    .to_vec();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn strs(a: &[String]) -> Vec<&str> {
    a.iter().map(String::as_str).collect()
}

/// Every run's two losses within 1e-5 (relative) of `want`'s.
fn same_losses(dir: &Path, want: &str, runs: &[&str]) {
    let base = log_field(dir, want, "loss");
    assert_eq!(base.len(), 2);
    for run in runs {
        let got = log_field(dir, run, "loss");
        for (x, y) in base.iter().zip(&got) {
            assert!(
                (x - y).abs() < 1e-5 * x.abs().max(1.0),
                "{run}: {base:?} vs {got:?}"
            );
        }
    }
}

/// A placement with replicas, end to end under mpirun: profiled, placed with 4 more slots
/// (Occult's copies), fine-tuned on 2 processes with the losses of 2 threads and of one
/// device, and saved as a model that loads.
#[test]
fn replicated_training_under_mpirun_takes_the_steps_of_threads() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    write_add_one_data(dir);
    let text: String = (0..20)
        .map(|i| format!("{{\"text\": \"{} plus one is {}\"}}\n", i, i + 1))
        .collect();
    std::fs::write(dir.join("text.jsonl"), text).unwrap();
    let model = fixture("olmoe");
    occult_ok(
        dir,
        &[
            "profile",
            "--model",
            &model,
            "--data",
            "text.jsonl",
            "--output",
            "t.safetensors",
            "--seq-len",
            "64",
        ],
    );
    occult_ok(
        dir,
        &[
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "2",
            "--replicas",
            "4",
            "-o",
            "p.json",
        ],
    );
    let placed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("p.json")).unwrap()).unwrap();
    assert_eq!(placed["format"], "occult.placement.v2");
    let args = |out: &str, extra: &[&str]| train_args(&model, out, extra);
    let on_two = ["--devices", "2", "--placement", "p.json"];
    occult_ok(dir, &strs(&args("threads", &on_two)));
    occult_ok(dir, &strs(&args("one", &[])));
    let a = args("mpi", &[&on_two[..], &["--backend", "mpi"]].concat());
    let out = mpirun_occult(2, dir, &strs(&a));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    same_losses(dir, "threads", &["mpi", "one"]);
    occult_ok(dir, &["model", "check", "--model", "mpi"]);
}

/// Training in two-level mode on 2 emulated nodes of 2 ranks takes the steps of threads in the
/// same mode, and of the flat exchange (the same sums in another order); under mpirun without
/// `--devices-per-node` the node is MPI's (all 4 ranks of this host), and it still does.
#[test]
fn two_level_training_under_mpirun_takes_the_steps_of_threads() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    write_add_one_data(dir);
    let model = fixture("olmoe");
    let args = |out: &str, extra: &[&str]| {
        train_args(&model, out, &[&["--devices", "4"][..], extra].concat())
    };
    let two = ["--mode", "two-level", "--devices-per-node", "2"];
    occult_ok(dir, &strs(&args("threads", &two)));
    occult_ok(dir, &strs(&args("flat", &["--mode", "occult"])));
    for (run, extra) in [
        ("mpi", [&two[..], &["--backend", "mpi"]].concat()),
        ("mpi-host", vec!["--mode", "two-level", "--backend", "mpi"]),
    ] {
        let a = args(run, &extra);
        let out = mpirun_occult(4, dir, &strs(&a));
        assert!(
            out.status.success(),
            "{}: {}",
            strs(&a).join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    same_losses(dir, "threads", &["mpi", "mpi-host", "flat"]);
}

#[test]
fn a_bench_suite_runs_under_mpirun() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("train.toml"),
        format!(
            "name = 't'\nsuite = 'train'\nmodel = '{}'\ndevices = 2\nbatches = [1]\nseq_len = 8\n\
             repeats = 1\n",
            fixture("olmoe")
        ),
    )
    .unwrap();
    let out = mpirun_occult(
        2,
        d,
        &[
            "bench",
            "suite",
            "train.toml",
            "--backend",
            "mpi",
            "--json",
            "t.json",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("t.json")).unwrap()).unwrap();
    assert_eq!(v["backend"], "mpi");
    let modes = v["points"][0]["results"].as_array().unwrap();
    assert!(modes.iter().any(|r| r["mode"] == "occult"));
    assert!(modes.iter().all(|r| r["seconds"].as_f64().unwrap() > 0.0));
}

/// The recipe's `backend = "mpi"` under `mpirun -np 4`: every stage on four processes, with
/// the analysis, the fine-tuning losses and the start's quality equal to the threads' run.
#[test]
fn reproduce_runs_under_mpirun_as_on_threads() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("local.toml"), common::TINY_RECIPE).unwrap();
    std::fs::write(
        d.join("mpi.toml"),
        common::TINY_RECIPE.replace("devices = 4\n", "devices = 4\nbackend = \"mpi\"\n"),
    )
    .unwrap();
    let cache = d.join("cache");
    let run = |args: &[&str], np: Option<usize>| match np {
        Some(n) => mpirun_occult_env(n, d, args, &[("OCCULT_CACHE", &cache)]),
        None => Command::new(occult_bin())
            .args(args)
            .current_dir(d)
            .env("OCCULT_CACHE", &cache)
            .output()
            .unwrap(),
    };
    let ok = |out: std::process::Output| {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    };
    // Under mpirun the built-in model must already be built; the threads' run builds it.
    let early = run(&["reproduce", "mpi.toml", "--out", "early"], Some(4));
    assert!(!early.status.success());
    assert!(String::from_utf8_lossy(&early.stderr).contains("occult model builtin"));
    ok(run(&["reproduce", "local.toml", "--out", "local"], None));
    let out = ok(run(&["reproduce", "mpi.toml", "--out", "mpi"], Some(4)));
    // One report, from rank 0.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.matches("# occult reproduce").count(), 1, "{stdout}");
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join(f)).unwrap()).unwrap()
    };
    let (a, b) = (read("local/results.json"), read("mpi/results.json"));
    // The same E[C_T] table, but for the placement search's time.
    let table = |v: &serde_json::Value| -> Vec<serde_json::Value> {
        let mut rows = v["ect_table"].as_array().unwrap().clone();
        for r in &mut rows {
            r.as_object_mut().unwrap().remove("seconds");
        }
        rows
    };
    assert_eq!(table(&a), table(&b));
    assert_eq!(b["shaped"]["ran"], false);
    let losses = |v: &serde_json::Value| -> Vec<f64> {
        v["finetune"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["first_loss"].as_f64().unwrap())
            .collect()
    };
    assert_eq!(losses(&a).len(), 7);
    assert_eq!(losses(&a).len(), losses(&b).len());
    for (x, y) in losses(&a).iter().zip(losses(&b)) {
        assert!((x - y).abs() < 1e-3 * x.abs(), "{x} vs {y}");
    }
    let base = |v: &serde_json::Value| -> Vec<(String, f64)> {
        v["quality"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|q| {
                q["variant"] == "base" && q["max_devices"].is_null() && q["max_nodes"].is_null()
            })
            .map(|q| {
                (
                    q["task"].as_str().unwrap().to_string(),
                    q["acc"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(base(&a), base(&b));
    assert_eq!(base(&a).len(), 4);
    assert!(d.join("mpi/collaboration.png").exists());
}

/// A rank of `occult train` under mpirun killed from outside (SIGKILL) mid-forward,
/// mid-backward and mid-checkpoint (`OCCULT_FAULT_PAUSE` holds it at the point, so that its peer
/// is blocked in an exchange or the save's barrier with it): the job exits non-zero within 30 s
/// of the kill, naming rank 1; every file left in the output is whole (the state names a step
/// whose files all load, and not the save rank 1 was held in); and `--resume` ends
/// bit-identical to a run never interrupted.
#[test]
fn a_rank_killed_mid_forward_backward_or_checkpoint_ends_the_job_and_leaves_whole_files() {
    use std::io::{BufRead, BufReader};
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    write_add_one_data(dir);
    let model = fixture("olmoe");
    let args = |out: &str, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "train",
            "--model",
            &model,
            "--data",
            "a.jsonl",
            "--out",
            out,
            "--steps",
            "4",
            "--batch-size",
            "4",
            "--lr",
            "1e-3",
            "--seq-len",
            "128",
            "--devices",
            "2",
            "--save-every",
            "1",
            "--backend",
            "mpi",
        ]
        .map(String::from)
        .to_vec();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run = |a: Vec<String>| {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let out = mpirun_occult(2, dir, &a);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(args("straight", &[]));
    for point in ["forward", "backward", "checkpoint"] {
        let out = format!("killed_{point}");
        run(args(&out, &["--stop-at", "2"]));
        let mut child = Command::new("mpirun")
            .current_dir(dir)
            .args([
                "--oversubscribe",
                "--bind-to",
                "none",
                "--mca",
                "btl",
                "self,vader",
            ])
            .args(["-np", "2"])
            .arg(occult_bin())
            .args(args(&out, &["--resume"]))
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("OCCULT_FAULT_PAUSE", format!("1:{point}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut printed = String::new();
        let pid = loop {
            let line = lines
                .next()
                .unwrap_or_else(|| panic!("{point}: the job ended unpaused:\n{printed}"))
                .unwrap();
            printed.push_str(&line);
            printed.push('\n');
            if let Some(rest) = line.strip_prefix(&format!("rank 1: paused at the {point}")) {
                break rest.rsplit(' ').next().unwrap().to_string();
            }
        };
        if point == "checkpoint" {
            // Time for rank 0 to reach the save's barrier (and, were there none, to put the
            // save in force while rank 1's part may still be on its way).
            std::thread::sleep(Duration::from_millis(1500));
        }
        let killed = Instant::now();
        assert!(Command::new("kill")
            .args(["-KILL", &pid])
            .status()
            .unwrap()
            .success());
        for l in lines {
            printed.push_str(&l.unwrap());
            printed.push('\n');
        }
        let status = child.wait().unwrap();
        let took = killed.elapsed();
        assert!(!status.success(), "{point}: {printed}");
        assert!(took < Duration::from_secs(30), "{point}: {took:?}");
        assert!(
            printed.contains("rank 1") && printed.contains("exited on signal 9"),
            "{point}: the lost rank is not named:\n{printed}"
        );
        // Whole files: the state in force and each of its ranks' files load; so does the model.
        let o = dir.join(&out);
        let state: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(o.join("state/state.json")).unwrap())
                .unwrap();
        assert_eq!(state["step"], 2, "{point}");
        let folder = o.join("state").join(state["folder"].as_str().unwrap());
        for r in 0..2 {
            let bytes = std::fs::read(folder.join(format!("rank{r}.safetensors"))).unwrap();
            safetensors::SafeTensors::deserialize(&bytes).unwrap();
        }
        occult_ok(dir, &["model", "check", "--model", &out]);
        run(args(&out, &["--resume"]));
        assert_eq!(
            std::fs::read(dir.join("straight/model.safetensors")).unwrap(),
            std::fs::read(o.join("model.safetensors")).unwrap(),
            "{point}: resumed after the kill"
        );
    }
}
