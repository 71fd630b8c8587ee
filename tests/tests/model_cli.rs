//! The model commands end to end (`generate`, `loglik`, `profile`, `model synth/info`) on the
//! fixtures and synthetic checkpoints, and every bad model input of issue 4: each a clear
//! error, exit code 1, no panic.

mod common;

use common::{occult_err, occult_ok};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixture(arch: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/models")
        .join(arch)
        .display()
        .to_string()
}

/// A checkpoint's tensors as (name, shape, bytes).
type RawTensors = Vec<(String, Vec<usize>, Vec<u8>)>;

fn contains_all(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "expected {p:?} in:\n{msg}");
    }
}

/// A copy of a fixture folder to break.
fn copy_fixture(arch: &str, to: &Path) -> PathBuf {
    let dst = to.join(arch);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(fixture(arch)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

#[test]
fn loglik_prints_the_harness_json_and_is_the_same_on_four_ranks() {
    let t = tempfile::tempdir().unwrap();
    let m = fixture("qwen2_moe");
    let args = [
        "loglik",
        "--model",
        &m,
        "--context",
        "The weather today is",
        "--continuation",
        " sunny and warm",
    ];
    let one: Value = serde_json::from_str(&occult_ok(t.path(), &args)).unwrap();
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(&m).join("reference.json")).unwrap(),
    )
    .unwrap();
    let want = &reference["loglik"][0];
    assert_eq!(want["context"], "The weather today is");
    assert!(
        (one["loglikelihood"].as_f64().unwrap() - want["loglikelihood"].as_f64().unwrap()).abs()
            < 1e-3
    );
    assert_eq!(one["tokens"], want["tokens"]);
    assert_eq!(one["is_greedy"], want["is_greedy"]);
    let mut four = args.to_vec();
    four.extend(["--devices", "4", "--mode", "standard"]);
    let four: Value = serde_json::from_str(&occult_ok(t.path(), &four)).unwrap();
    assert!(
        (four["loglikelihood"].as_f64().unwrap() - one["loglikelihood"].as_f64().unwrap()).abs()
            < 1e-4
    );
}

#[test]
fn generate_is_greedy_by_default_and_matches_transformers() {
    let t = tempfile::tempdir().unwrap();
    let m = fixture("olmoe");
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(&m).join("reference.json")).unwrap(),
    )
    .unwrap();
    let prompt = reference["prompt"].as_str().unwrap();
    let out = occult_ok(
        t.path(),
        &[
            "generate",
            "--model",
            &m,
            "--prompt",
            prompt,
            "--max-new-tokens",
            "8",
            "--json",
            "--devices",
            "2",
        ],
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["prompt_ids"], reference["input_ids"]);
    // Generation stops early only at an end-of-sequence token.
    let want = reference["greedy"]["ids"].as_array().unwrap();
    let got = v["new_ids"].as_array().unwrap();
    assert_eq!(got[..], want[..got.len()]);
    // Sampling is seeded: the same seed gives the same text.
    let sample = |seed: &str| {
        occult_ok(
            t.path(),
            &[
                "generate",
                "--model",
                &m,
                "--prompt",
                "Rain",
                "--temperature",
                "1.0",
                "--seed",
                seed,
            ],
        )
    };
    assert_eq!(sample("3"), sample("3"));
}

#[test]
fn generate_spreads_a_prompts_file_over_ranks_with_the_results_of_one_device() {
    let t = tempfile::tempdir().unwrap();
    let m = fixture("qwen2_moe");
    // Five prompts of different lengths on three ranks: shares of 2, 2 and 1, each decoding
    // a different number of steps until the ranks meet in `finish`.
    std::fs::write(
        t.path().join("prompts.txt"),
        "Rain\nThe cat sat\n\nOnce upon a time there\nA\nexperts and devices\n",
    )
    .unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            &m,
            "--prompts",
            "prompts.txt",
            "--max-new-tokens",
            "6",
            "--json",
            "--temperature",
            "0.8",
        ];
        args.extend(extra);
        let v: Value = serde_json::from_str(&occult_ok(t.path(), &args)).unwrap();
        v
    };
    let one = run(&[]);
    let three = run(&["--devices", "3", "--mode", "standard"]);
    assert_eq!(one.as_array().unwrap().len(), 5);
    for (a, b) in one
        .as_array()
        .unwrap()
        .iter()
        .zip(three.as_array().unwrap())
    {
        assert_eq!(a["prompt"], b["prompt"]);
        assert_eq!(a["new_ids"], b["new_ids"], "{}", a["prompt"]);
    }
}

#[test]
fn profile_writes_a_trace_the_analysis_commands_read() {
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("cal.jsonl");
    std::fs::write(
        &data,
        "{\"text\": \"The cake was baked in a hot oven until it rose.\"}\n\
         {\"text\": \"Clouds gather over the hills before the rain.\"}\n",
    )
    .unwrap();
    let m = fixture("deepseek");
    occult_ok(
        t.path(),
        &[
            "profile",
            "--model",
            &m,
            "--data",
            "cal.jsonl",
            "-o",
            "t.safetensors",
            "--seq-len",
            "7",
        ],
    );
    let info = occult_ok(t.path(), &["trace", "info", "t.safetensors"]);
    // DeepSeek's layer 0 is dense: the trace holds layers 1 and 2.
    contains_all(&info, &["deepseek"]);
    let collab = occult_ok(
        t.path(),
        &[
            "collab",
            "--trace",
            "t.safetensors",
            "--devices",
            "2",
            "--json",
            "c.json",
        ],
    );
    assert!(!collab.is_empty());
    let c: Value =
        serde_json::from_str(&std::fs::read_to_string(t.path().join("c.json")).unwrap()).unwrap();
    let layers: Vec<u64> = c["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["layer"].as_u64().unwrap())
        .collect();
    assert_eq!(layers, vec![1, 2]);
    // The trace's logits drive similarity pruning of the model itself.
    occult_ok(
        t.path(),
        &[
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "4",
            "--method",
            "occult",
            "-o",
            "p.json",
        ],
    );
    let pruned = occult_ok(
        t.path(),
        &[
            "loglik",
            "--model",
            &m,
            "--context",
            "The cake",
            "--continuation",
            " was baked",
            "--devices",
            "4",
            "--placement",
            "p.json",
            "--max-devices",
            "1",
            "--prune-rule",
            "similarity",
            "--calibration",
            "t.safetensors",
        ],
    );
    let v: Value = serde_json::from_str(&pruned).unwrap();
    assert!(v["loglikelihood"].as_f64().unwrap() < 0.0);
}

#[test]
fn synthetic_checkpoints_load_in_every_dtype_and_layout() {
    let t = tempfile::tempdir().unwrap();
    for (family, extra) in [
        ("mixtral", vec!["--fused"]),
        ("qwen3_moe", vec!["--dtype", "bf16"]),
        ("deepseek", vec!["--dense-layers", "1"]),
    ] {
        let mut args = vec![
            "model", "synth", "--family", family, "--hidden", "32", "--vocab", "64", "-o", family,
        ];
        args.extend(extra);
        occult_ok(t.path(), &args);
        let info: Value =
            serde_json::from_str(&occult_ok(t.path(), &["model", "info", "--model", family]))
                .unwrap();
        assert_eq!(info["num_experts"], 8);
    }
    let info: Value = serde_json::from_str(&occult_ok(
        t.path(),
        &["model", "info", "--model", "deepseek"],
    ))
    .unwrap();
    assert_eq!(info["moe_layers"], serde_json::json!([1]));
}

#[test]
fn bad_model_inputs_are_named() {
    let t = tempfile::tempdir().unwrap();
    let ll = |m: &Path, extra: &[&str]| {
        let m = m.display().to_string();
        let mut a = vec![
            "loglik",
            "--model",
            m.as_str(),
            "--context",
            "a",
            "--continuation",
            " b",
        ];
        a.extend(extra);
        occult_err(t.path(), &a)
    };
    // A missing config field.
    let d = copy_fixture("mixtral", t.path());
    let cfg = d.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("num_local_experts");
    std::fs::write(&cfg, v.to_string()).unwrap();
    contains_all(
        &ll(&d, &[]),
        &["config.json", "missing field `num_local_experts`"],
    );
    // An unknown model_type.
    v["num_local_experts"] = 8.into();
    v["model_type"] = "gpt2".into();
    std::fs::write(&cfg, v.to_string()).unwrap();
    contains_all(&ll(&d, &[]), &["\"gpt2\" is not supported"]);

    // Impossible values, and a config that explains only part of the checkpoint.
    for (key, value, want) in [
        (
            "rms_norm_eps",
            serde_json::json!(-1.0),
            "`rms_norm_eps` = -1.0 is not a finite number >= 0",
        ),
        (
            "rope_theta",
            serde_json::json!(0.0),
            "rope_theta = 0 is not a positive number",
        ),
        (
            "num_hidden_layers",
            serde_json::json!(1),
            "tensor(s) this configuration does not use",
        ),
    ] {
        let d = copy_fixture("qwen3_moe", &t.path().join(key));
        let cfg = d.join("config.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
        v[key] = value;
        if key == "rope_theta" {
            v.as_object_mut().unwrap().remove("rope_parameters");
        }
        std::fs::write(&cfg, v.to_string()).unwrap();
        contains_all(&ll(&d, &[]), &[want]);
    }
    let d = copy_fixture("olmoe", &t.path().join("clip"));
    let cfg = d.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["clip_qkv"] = serde_json::json!(-1.0);
    std::fs::write(&cfg, v.to_string()).unwrap();
    contains_all(
        &ll(&d, &[]),
        &["`clip_qkv` = -1.0 is not a positive number"],
    );
    // A whitespace-only context encodes to nothing.
    let m = fixture("olmoe");
    contains_all(
        &occult_err(
            t.path(),
            &[
                "loglik",
                "--model",
                &m,
                "--context",
                "   ",
                "--continuation",
                "sat",
            ],
        ),
        &["encodes to no tokens"],
    );

    // A missing tensor, and a misshapen one (name, expected and actual shape).
    let d = t.path().join("synth");
    occult_ok(
        t.path(),
        &[
            "model", "synth", "--family", "olmoe", "--hidden", "32", "--vocab", "64", "-o", "synth",
        ],
    );
    let st = d.join("model.safetensors");
    let rewrite = |f: &dyn Fn(&mut RawTensors)| {
        let bytes = std::fs::read(&st).unwrap();
        let s = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut ts: RawTensors = s
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
            .collect();
        f(&mut ts);
        let views: Vec<(String, safetensors::tensor::TensorView)> = ts
            .iter()
            .map(|(n, sh, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, sh.clone(), b)
                        .unwrap(),
                )
            })
            .collect();
        std::fs::write(&st, safetensors::serialize(views, None).unwrap()).unwrap();
    };
    let tokenizer = PathBuf::from(fixture("olmoe")).join("tokenizer.json");
    let original = std::fs::read(&st).unwrap();
    let profile = || {
        occult_err(
            t.path(),
            &[
                "profile",
                "--model",
                "synth",
                "--data",
                "d.txt",
                "-o",
                "o.safetensors",
            ],
        )
    };
    std::fs::write(t.path().join("d.txt"), "hello there\n").unwrap();
    // No tokenizer (synth writes one: taken away): named. A broken one, and one with more
    // tokens than the model's vocabulary.
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    std::fs::remove_file(d.join("tokenizer_config.json")).unwrap();
    contains_all(&profile(), &["no tokenizer.json"]);
    std::fs::write(d.join("tokenizer.json"), b"{}").unwrap();
    contains_all(&profile(), &["tokenizer.json", "not a readable tokenizer"]);
    std::fs::copy(&tokenizer, d.join("tokenizer.json")).unwrap();
    contains_all(
        &profile(),
        &["tokenizer does not match the model", "vocabulary has 64"],
    );
    assert!(!t.path().join("o.safetensors").exists());
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    std::fs::write(&st, &original).unwrap();
    rewrite(&|ts| ts.retain(|(n, _, _)| n != "model.layers.1.mlp.experts.5.up_proj.weight"));
    contains_all(
        &occult_err(t.path(), &["model", "check", "--model", "synth"]),
        &["model.layers.1.mlp.experts.5.up_proj.weight is missing"],
    );
    std::fs::write(&st, &original).unwrap();
    rewrite(&|ts| {
        for (n, sh, _) in ts.iter_mut() {
            if n == "model.layers.0.self_attn.k_proj.weight" {
                sh.swap(0, 1);
            }
        }
    });
    contains_all(
        &occult_err(t.path(), &["model", "check", "--model", "synth"]),
        &["model.layers.0.self_attn.k_proj.weight has shape [32, 16], expected [16, 32]"],
    );
    // A truncated file.
    std::fs::write(&st, &original[..original.len() - 100]).unwrap();
    contains_all(
        &occult_err(t.path(), &["model", "check", "--model", "synth"]),
        &["model.safetensors", "not a readable safetensors file"],
    );
    std::fs::write(&st, &original).unwrap();
    occult_ok(t.path(), &["model", "check", "--model", "synth"]);

    // A placement for a different expert count, and for a different device count.
    let placement = |e: usize, d: usize| {
        let map: Vec<u32> = (0..e).map(|x| (x * d / e) as u32).collect();
        let layers: Vec<Value> = (0..3)
            .map(|l| serde_json::json!({"layer": l, "device_of_expert": map}))
            .collect();
        serde_json::json!({"format": "occult.placement.v1", "num_experts": e, "num_devices": d,
            "method": "test", "layers": layers})
        .to_string()
    };
    std::fs::write(t.path().join("p16.json"), placement(16, 2)).unwrap();
    let m = fixture("olmoe");
    contains_all(
        &ll(
            Path::new(&m),
            &["--devices", "2", "--placement", "p16.json"],
        ),
        &["p16.json", "placement is for 16 experts, the model has 8"],
    );
    std::fs::write(t.path().join("p8.json"), placement(8, 4)).unwrap();
    contains_all(
        &ll(Path::new(&m), &["--devices", "2", "--placement", "p8.json"]),
        &["placement is for 4 devices", "--devices 2"],
    );
    contains_all(
        &ll(Path::new(&m), &["--devices", "2", "--mode", "reference"]),
        &["reference runs on one device"],
    );
    contains_all(
        &ll(
            Path::new(&m),
            &[
                "--max-devices",
                "1",
                "--prune-rule",
                "similarity",
                "--devices",
                "2",
            ],
        ),
        &["--calibration"],
    );
    contains_all(
        &ll(Path::new("/nonexistent/model"), &[]),
        &["/nonexistent/model"],
    );
}

#[test]
fn a_hub_id_resolves_offline_in_the_cache_at_a_revision() {
    let t = tempfile::tempdir().unwrap();
    let cache = t.path().join("hub");
    let repo = cache.join("models--tiny-org--tiny-mixtral");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    copy_fixture("mixtral", &repo.join("snapshots"));
    std::fs::rename(
        repo.join("snapshots/mixtral"),
        repo.join("snapshots").join(commit),
    )
    .unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(common::occult_bin())
            .args(args)
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .current_dir(t.path())
            .output()
            .unwrap()
    };
    let args = |rev: Option<&'static str>| {
        let mut a = vec![
            "loglik",
            "--model",
            "tiny-org/tiny-mixtral",
            "--context",
            "The weather today is",
            "--continuation",
            " sunny and warm",
        ];
        if let Some(r) = rev {
            a.extend(["--revision", r]);
        }
        a
    };
    let by_ref = run(&args(None));
    assert!(
        by_ref.status.success(),
        "{}",
        String::from_utf8_lossy(&by_ref.stderr)
    );
    let by_commit = run(&args(Some(commit)));
    assert!(by_commit.status.success());
    assert_eq!(by_ref.stdout, by_commit.stdout);
    let v: Value = serde_json::from_slice(&by_ref.stdout).unwrap();
    assert_eq!(v["tokens"], 8);
    let missing = run(&args(Some("v2")));
    assert_eq!(missing.status.code(), Some(1));
    contains_all(
        &String::from_utf8_lossy(&missing.stderr),
        &[
            "tiny-org/tiny-mixtral is in the Hugging Face cache",
            "\"v2\"",
        ],
    );
}

#[test]
fn special_tokens_follow_the_tokenizer_config_and_generation_config() {
    let t = tempfile::tempdir().unwrap();
    let d = copy_fixture("mixtral", t.path());
    let open = || {
        occult_core::models::loader::Checkpoint::open(d.to_str().unwrap(), None, candle::DType::F32)
    };
    let ck = open().unwrap();
    let tok = ck.tokenizer().unwrap();
    assert_eq!((tok.bos, tok.eos.clone()), (Some(0), vec![0]));
    // The tokenizer has no BOS; generation also stops at id 5.
    std::fs::write(
        d.join("tokenizer_config.json"),
        r#"{"bos_token": null, "eos_token": {"content": "<|endoftext|>"}}"#,
    )
    .unwrap();
    std::fs::write(
        d.join("generation_config.json"),
        r#"{"eos_token_id": [0, 5]}"#,
    )
    .unwrap();
    let ck = open().unwrap();
    let tok = ck.tokenizer().unwrap();
    assert_eq!((tok.bos, tok.eos.clone()), (None, vec![0, 5]));
    assert_eq!(tok.prefix_token(), Some(0));
    std::fs::write(
        d.join("tokenizer_config.json"),
        r#"{"eos_token": "<nope>"}"#,
    )
    .unwrap();
    let e = open().err().unwrap().to_string();
    assert!(
        e.contains("\"<nope>\" is not in tokenizer.json's vocabulary"),
        "{e}"
    );
}

#[test]
fn bench_model_compares_the_expert_parallel_modes_on_the_same_prompts() {
    let t = tempfile::tempdir().unwrap();
    let m = fixture("olmoe");
    occult_ok(
        t.path(),
        &[
            "bench",
            "model",
            "--model",
            &m,
            "--devices",
            "4",
            "--prompt-len",
            "12",
            "--decode-tokens",
            "2",
            "--repeats",
            "1",
            "--link",
            "pcie4",
            "--json",
            "b.json",
        ],
    );
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(t.path().join("b.json")).unwrap()).unwrap();
    let r = v["results"].as_array().unwrap();
    let modes: Vec<&str> = r.iter().map(|x| x["mode"].as_str().unwrap()).collect();
    assert_eq!(
        modes,
        [
            "reference (1 device)",
            "standard",
            "occult",
            "occult, pruned to 2 devices (router)"
        ]
    );
    let get = |i: usize, k: &str| r[i][k].as_f64().unwrap();
    // 4 ranks x 12 tokens x top-2 x 3 MoE layers: standard sends k rows per token and layer.
    assert_eq!(get(1, "rows_sent"), (4 * 12 * 2 * 3) as f64);
    // Occult sends one row per (token, device): sum C_T = E[C_T] x tokens x layers.
    assert!((get(2, "rows_sent") - get(2, "ect") * (4 * 12 * 3) as f64).abs() < 0.5);
    assert!(get(2, "bytes_sent") < get(1, "bytes_sent"));
    assert!(get(3, "ect") <= 2.0 && get(3, "rows_sent") <= get(2, "rows_sent"));
    assert!(r[1]["projected_seconds"].as_f64().unwrap() > 0.0);
    // A node limit runs as one more mode: on 2 nodes of 2, one node per token (olmoe has 8
    // experts, 2 a device), so at most 2 devices and nothing crosses to the other node.
    occult_ok(
        t.path(),
        &[
            "bench",
            "model",
            "--model",
            &m,
            "--devices",
            "4",
            "--prompt-len",
            "12",
            "--decode-tokens",
            "0",
            "--repeats",
            "1",
            "--link",
            "pcie4",
            "--max-nodes",
            "1",
            "--devices-per-node",
            "2",
            "--json",
            "n.json",
        ],
    );
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(t.path().join("n.json")).unwrap()).unwrap();
    let r = v["results"].as_array().unwrap();
    let mode = |name: &str| {
        r.iter()
            .find(|x| x["mode"] == name)
            .unwrap_or_else(|| panic!("no mode {name} in {r:?}"))
    };
    // With the node size, the two-level exchange runs too, and the node limit in each exchange:
    // the same tokens and routing as the flat modes, one row per (token, node) across.
    for name in [
        "occult, pruned to 1 node (router)",
        "two-level, pruned to 1 node (router)",
    ] {
        let node = mode(name);
        assert!(node["ect"].as_f64().unwrap() <= 2.0, "{node}");
        assert_eq!(node["ecn"].as_f64(), Some(1.0), "{node}");
    }
    let (flat, two) = (mode("occult"), mode("two-level"));
    assert_eq!(flat["ect"], two["ect"]);
    assert_eq!(flat["ecn"], two["ecn"]);
    let across = |x: &Value| x["inter_node_rows"].as_u64().unwrap();
    assert!(
        across(two) <= across(flat) && across(two) > 0,
        "{two} vs {flat}"
    );
    // One row per (token, remote node) in each of the 3 MoE layers: fewer than E[C_N] (which
    // counts the source's own node too) per token and layer.
    let token_layers = two["tokens"].as_f64().unwrap() * 3.0;
    assert!((across(two) as f64) < two["ecn"].as_f64().unwrap() * token_layers);
    // The first leg sends one row per (token, node), the second the flat exchange's one per
    // (token, device): two-level sends E[C_N] rows per token and layer more (a mode that fell
    // back to the flat exchange would not).
    let rows = |x: &Value| x["rows_sent"].as_f64().unwrap();
    let first_leg = two["ecn"].as_f64().unwrap() * token_layers;
    assert!(
        (rows(two) - rows(flat) - first_leg).abs() < 1e-6,
        "{two} vs {flat}"
    );
}

#[test]
fn profile_on_three_ranks_records_the_routing_of_one_device_in_its_order() {
    let t = tempfile::tempdir().unwrap();
    let m = fixture("qwen2_moe");
    std::fs::write(
        t.path().join("calib.txt"),
        "the cat sat on the mat\nexperts route tokens\na b c d e f g h\nhello\n",
    )
    .unwrap();
    let profile = |out: &str, extra: &[&str]| {
        let mut a = vec![
            "profile",
            "--model",
            &m,
            "--data",
            "calib.txt",
            "-o",
            out,
            "--seq-len",
            "5",
        ];
        a.extend(extra);
        occult_ok(t.path(), &a);
        let bytes = std::fs::read(t.path().join(out)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
        names.sort();
        names
            .into_iter()
            .filter(|n| n.ends_with("topk_ids"))
            .map(|n| st.tensor(&n).unwrap().data().to_vec())
            .collect::<Vec<_>>()
    };
    let one = profile("one.safetensors", &[]);
    let three = profile(
        "three.safetensors",
        &["--devices", "3", "--mode", "standard"],
    );
    assert!(!one.is_empty() && one.iter().all(|ids| !ids.is_empty()));
    assert_eq!(one, three);
}

/// A prefill suite on a synthetic OLMoE-shaped model, and what a broken suite file says.
#[test]
fn bench_suites_run_from_their_files_and_record_where_they_ran() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    occult_ok(
        d,
        &[
            "model",
            "synth",
            "--family",
            "olmoe",
            "--hidden",
            "32",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--intermediate",
            "16",
            "-o",
            "m",
        ],
    );
    std::fs::write(
        d.join("prefill.toml"),
        "name = 'p'\nsuite = 'prefill'\nmodel = 'm'\ndevices = 2\ntokens = [32, 128]\n\
         seq_len = 16\nrepeats = 1\n",
    )
    .unwrap();
    let out = occult_ok(d, &["bench", "suite", "prefill.toml", "--json", "p.json"]);
    assert!(out.contains("Prefill on 2 ranks"), "{out}");
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("p.json")).unwrap()).unwrap();
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    // 128 tokens on 2 ranks: 4 sequences of 16 each.
    assert_eq!(
        (points[1]["tokens"].as_u64(), points[1]["batch"].as_u64()),
        (Some(128), Some(4))
    );
    for p in points {
        let modes: Vec<&str> = p["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["mode"].as_str().unwrap())
            .collect();
        assert_eq!(modes, ["reference (1 device)", "standard", "occult"]);
        let r = &p["results"][2];
        assert_eq!(r["tokens"].as_u64(), p["tokens"].as_u64());
        assert!(r["projected_seconds"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(v["config"]["suite"], "prefill");
    assert!(v["provenance"]["host"].is_string() && v["provenance"].get("git_commit").is_some());
    // A decode suite: one token per sequence per step.
    std::fs::write(
        d.join("decode.toml"),
        "name = 'd'\nsuite = 'decode'\nmodel = 'm'\ndevices = 2\nbatches = [1, 3]\nseq_len = 4\n\
         decode_tokens = 2\nrepeats = 1\n",
    )
    .unwrap();
    let out = occult_ok(d, &["bench", "suite", "decode.toml"]);
    assert!(
        out.contains("Decode on 2 ranks") && out.contains("| 6 "),
        "{out}"
    );
    // Broken suites name what is wrong.
    for (text, needle) in [
        (
            "name = 'p'\nsuite = 'prefill'\nmodel = 'm'\ntokens = [100]\nseq_len = 16\n",
            "not a multiple",
        ),
        (
            "name = 'p'\nsuite = 'decode'\nmodel = 'm'\n",
            "needs `batches`",
        ),
        (
            "name = 'p'\nsuite = 'warp'\nmodel = 'm'\n",
            "unknown variant",
        ),
        (
            "name = 'p'\nsuite = 'train'\nmodel = 'm'\nbatches = [1]\nlink = 'nope'\n",
            "no link profile",
        ),
        (
            "name = 'p'\nsuite = 'train'\nmodel = 'm'\nbatches = [1]\ndevices = 1\n",
            "2 or more",
        ),
    ] {
        std::fs::write(d.join("bad.toml"), text).unwrap();
        let err = occult_err(d, &["bench", "suite", "bad.toml"]);
        assert!(
            err.contains(needle) && err.contains("bad.toml"),
            "{needle}: {err}"
        );
    }
}

/// A checkpoint larger than this machine's memory (an OLMoE-shaped model of about 1 TiB in
/// f32, as a sparse file: the header is real, the data a hole) is refused by eval, bench and
/// train before any weight is read, with the estimate; `--max-memory` caps any model; `model
/// info` reports the estimate and reads no weights. The estimate is checked against the
/// tensor sizes counted here from the header.
#[test]
fn a_model_larger_than_memory_is_refused_with_an_estimate_before_loading() {
    use occult_core::models::config::ModelConfig;
    use occult_core::models::family::family;
    use occult_core::models::synth::SynthModel;
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let big = d.join("big");
    std::fs::create_dir(&big).unwrap();
    let mut s = SynthModel::tiny(family("olmoe").unwrap());
    (s.vocab, s.hidden, s.layers, s.heads, s.kv_heads) = (50304, 8192, 16, 64, 64);
    (s.experts, s.top_k, s.expert_intermediate) = (256, 8, 4096);
    let config = s.config_json().unwrap();
    std::fs::write(big.join("config.json"), config.to_string()).unwrap();
    let cfg = ModelConfig::from_json(&config, "test").unwrap();
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (name, shape) in occult_core::models::layout::tensors(&cfg, false) {
        let bytes = 4 * shape.iter().map(|&n| n as u64).product::<u64>();
        header.insert(
            name,
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + bytes]}),
        );
        at += bytes;
    }
    assert!(at > 1 << 40, "{at} bytes");
    let mut h = serde_json::to_vec(&header).unwrap();
    h.resize(h.len().div_ceil(8) * 8, b' ');
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(&h);
    let f = big.join("model.safetensors");
    std::fs::write(&f, &bytes).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(bytes.len() as u64 + at)
        .unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/tokenizer.json"),
        big.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(d.join("d.jsonl"), "{\"text\": \"hello world\"}\n").unwrap();

    let gib = |e: &str| -> f64 {
        let n = e.split("needs about ").nth(1).unwrap();
        let (v, unit) = n.split_at(n.find(' ').unwrap());
        let v: f64 = v.parse().unwrap();
        v * match &unit[1..4] {
            "TiB" => 1024.0,
            "GiB" => 1.0,
            other => panic!("{other} in {e}"),
        }
    };
    let weights = at as f64 / (1u64 << 30) as f64;
    for args in [
        &["eval", "--model", "big", "--tasks", "arc_easy", "--samples"][..],
        &["bench", "model", "--model", "big"],
        &[
            "train", "--model", "big", "--data", "d.jsonl", "--out", "o", "--steps", "1",
        ],
    ] {
        let e = occult_err(d, args);
        assert!(
            e.contains("more than the memory available"),
            "{args:?}: {e}"
        );
        let need = gib(&e);
        // Training adds gradients and two moments in f32: 4x the weights.
        let want = if args[0] == "train" {
            4.0 * weights
        } else {
            weights
        };
        assert!(
            (need - want).abs() / want < 0.01,
            "{args:?}: {need} GiB, want {want}: {e}"
        );
    }
    assert!(!d.join("o").exists(), "train left an output folder");
    // bf16 halves the weights.
    let e = occult_err(
        d,
        &[
            "eval",
            "--model",
            "big",
            "--tasks",
            "arc_easy",
            "--samples",
            "--dtype",
            "bf16",
        ],
    );
    assert!((gib(&e) - weights / 2.0).abs() / weights < 0.01, "{e}");
    // Under mpirun each rank holds the dense weights and its share of the experts.
    let info: Value = serde_json::from_str(&occult_ok(
        d,
        &["model", "info", "--model", "big", "--devices", "8"],
    ))
    .unwrap();
    let est = &info["memory_estimate"];
    assert_eq!(est["weights_bytes"].as_u64().unwrap(), at);
    let per_rank = est["per_rank_bytes_under_mpirun"]["bytes"]
        .as_u64()
        .unwrap();
    let experts = 4 * 3 * (s.layers * s.experts * s.hidden * s.expert_intermediate) as u64;
    assert_eq!(per_rank, at - experts + experts / 8);
    // --max-memory caps a model that fits the machine.
    let m = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/olmoe");
    let m = m.display().to_string();
    let e = occult_err(
        d,
        &[
            "eval",
            "--model",
            &m,
            "--tasks",
            "arc_easy",
            "--samples",
            "--max-memory",
            "100K",
        ],
    );
    assert!(e.contains("more than --max-memory (100.0 KiB)"), "{e}");
    occult_ok(
        d,
        &[
            "eval",
            "--model",
            &m,
            "--tasks",
            "arc_easy",
            "--samples",
            "--max-memory",
            "1G",
        ],
    );
    // A size that is not one is a usage error (exit 2), named.
    let out = common::occult(
        d,
        &[
            "eval",
            "--model",
            &m,
            "--tasks",
            "arc_easy",
            "--samples",
            "--max-memory",
            "lots",
        ],
    );
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{e}");
    assert!(
        e.contains("--max-memory") && e.contains("is not a size"),
        "{e}"
    );
}

/// `--cuda` and `--backend nccl` in a build without them say what to rebuild with, for model
/// commands and the layer bench alike.
#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_options_in_a_build_without_them_are_named() {
    let t = tempfile::tempdir().unwrap();
    let d = copy_fixture("mixtral", t.path());
    let m = d.display().to_string();
    let loglik = |extra: &[&'static str]| {
        let mut args = vec!["loglik", "--model", m.as_str(), "--context", "a"];
        args.extend(["--continuation", " b"]);
        args.extend(extra);
        args
    };
    let cuda = [
        "--cuda 0",
        "built without CUDA",
        "--features occult-eval/cuda",
    ];
    let nccl = ["--backend nccl", "built without CUDA", "occult-eval/nccl"];
    let layer = vec!["bench", "layer", "--backend", "nccl", "--devices", "1"];
    for (args, want) in [
        (loglik(&["--cuda", "0"]), &cuda),
        (loglik(&["--mode", "occult", "--backend", "nccl"]), &nccl),
        (layer, &nccl),
    ] {
        contains_all(&occult_err(t.path(), &args), want);
    }
}

/// GLM-4.5 (grouped sigmoid routing, partial rotary) and DeepSeek-V3 (latent attention, YaRN)
/// through every model command on their transformers fixtures: loglik and generate as
/// transformers computes them, on one device and on 4 ranks in 2 nodes; eval the same on 1 and 4
/// ranks; profile, then a placement that keeps the expert groups whole, which the model runs
/// with one device's results and both exports take; and bench model.
#[test]
fn the_families_of_2026_run_through_every_model_command() {
    for arch in [
        "glm4_moe",
        "deepseek_v3",
        "deepseek_v2",
        "gpt_oss",
        "gpt_oss_mxfp4",
    ] {
        every_model_command(arch);
    }
}

fn every_model_command(arch: &str) {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let m = fixture(arch);
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(&m).join("reference.json")).unwrap(),
    )
    .unwrap();
    let want = &reference["loglik"][0];
    let loglik = |extra: &[&str]| -> Value {
        let mut a = vec![
            "loglik",
            "--model",
            &m,
            "--context",
            want["context"].as_str().unwrap(),
            "--continuation",
            want["continuation"].as_str().unwrap(),
        ];
        a.extend(extra);
        serde_json::from_str(&occult_ok(d, &a)).unwrap()
    };
    let two_level = [
        "--devices",
        "4",
        "--mode",
        "two-level",
        "--devices-per-node",
        "2",
    ];
    for extra in [&[][..], &two_level[..]] {
        let got = loglik(extra);
        let gap = (got["loglikelihood"].as_f64().unwrap()
            - want["loglikelihood"].as_f64().unwrap())
        .abs();
        assert!(gap < 1e-4, "{arch} {extra:?}: {got} vs {want}");
        assert_eq!(got["is_greedy"], want["is_greedy"], "{arch} {extra:?}");
    }
    let mut gen = vec![
        "generate",
        "--model",
        &m,
        "--prompt",
        reference["prompt"].as_str().unwrap(),
        "--max-new-tokens",
        "8",
        "--json",
    ];
    gen.extend(two_level);
    let v: Value = serde_json::from_str(&occult_ok(d, &gen)).unwrap();
    assert_eq!(v["new_ids"], reference["greedy"]["ids"], "{arch}");

    let eval = |tag: &str, extra: &[&str]| -> Value {
        let out = format!("{tag}.json");
        let mut a = vec![
            "eval",
            "--model",
            &m,
            "--tasks",
            "piqa,copa",
            "--samples",
            "--output",
            &out,
        ];
        a.extend(extra);
        occult_ok(d, &a);
        serde_json::from_str(&std::fs::read_to_string(d.join(&out)).unwrap()).unwrap()
    };
    let (one, four) = (eval("one", &[]), eval("four", &two_level));
    for task in ["piqa", "copa"] {
        assert_eq!(
            one["results"][task]["acc,none"], four["results"][task]["acc,none"],
            "{arch} {task}"
        );
    }

    std::fs::write(
        d.join("cal.jsonl"),
        "{\"text\": \"The cake was baked in a hot oven until it rose.\"}\n\
         {\"text\": \"Clouds gather over the hills before the rain.\"}\n",
    )
    .unwrap();
    occult_ok(
        d,
        &[
            "profile",
            "--model",
            &m,
            "--data",
            "cal.jsonl",
            "-o",
            "t.safetensors",
        ],
    );
    // 4 groups of 2 on 4 devices: each device holds one whole group.
    occult_ok(
        d,
        &[
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "4",
            "--expert-groups",
            "4",
            "-o",
            "p.json",
        ],
    );
    // Pruning the recorded trace with the model's own rule (each layer's selection bias
    // included) re-picks, at the first MoE layer, exactly what the model pruned on 4 ranks
    // picks (later layers see the pruned model's other hidden states).
    occult_ok(
        d,
        &[
            "prune",
            "--trace",
            "t.safetensors",
            "--placement",
            "p.json",
            "--rule",
            "router",
            "--max-devices",
            "1",
            "--model",
            &m,
            "-o",
            "pruned.safetensors",
        ],
    );
    occult_ok(
        d,
        &[
            "profile",
            "--model",
            &m,
            "--data",
            "cal.jsonl",
            "--devices",
            "4",
            "--placement",
            "p.json",
            "--max-devices",
            "1",
            "--prune-rule",
            "router",
            "-o",
            "tp.safetensors",
        ],
    );
    let read = |f: &str| occult_core::analysis::trace::Trace::read(&d.join(f)).unwrap();
    let (offline, served, before) = (
        read("pruned.safetensors"),
        read("tp.safetensors"),
        read("t.safetensors"),
    );
    let first = before.layers[0].layer;
    let ids = |t: &occult_core::analysis::trace::Trace| t.layer(first).unwrap().topk_ids.clone();
    assert_eq!(ids(&offline), ids(&served), "{arch} layer {first}");
    assert_ne!(
        ids(&offline),
        ids(&before),
        "{arch}: pruning to 1 device changed nothing"
    );
    let placed = loglik(&["--devices", "4", "--placement", "p.json"]);
    assert!(
        (placed["loglikelihood"].as_f64().unwrap() - want["loglikelihood"].as_f64().unwrap()).abs()
            < 1e-4
    );
    occult_ok(
        d,
        &[
            "export",
            "checkpoint",
            "--model",
            &m,
            "--placement",
            "p.json",
            "-o",
            "renumbered",
        ],
    );
    let exported = d.join("renumbered").display().to_string();
    let mut again = vec![
        "loglik",
        "--model",
        &exported,
        "--context",
        want["context"].as_str().unwrap(),
        "--continuation",
        want["continuation"].as_str().unwrap(),
    ];
    again.extend(["--devices", "4"]);
    let v: Value = serde_json::from_str(&occult_ok(d, &again)).unwrap();
    assert!(
        (v["loglikelihood"].as_f64().unwrap() - want["loglikelihood"].as_f64().unwrap()).abs()
            < 1e-4
    );
    occult_ok(
        d,
        &[
            "export",
            "sglang",
            "--model",
            &m,
            "--placement",
            "p.json",
            "-o",
            "sglang.json",
        ],
    );
    occult_ok(
        d,
        &[
            "bench",
            "model",
            "--model",
            &m,
            "--devices",
            "4",
            "--prompt-len",
            "12",
            "--decode-tokens",
            "2",
            "--repeats",
            "1",
            "--json",
            "b.json",
        ],
    );
}
