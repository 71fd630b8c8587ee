//! `occult bench model --against transformers|llama.cpp`, our side of it: the peer process's
//! protocol (a ready line, then one answer a prompt), the report built from its answers, and a
//! clear error for every way the peer can fail (no interpreter, a missing module, a peer that
//! dies, an answer without its fields). The peer here is a shell script standing in for
//! Python, so that the tests need no Python; the real scripts are run by hand
//! (`docs/kernels.md`, "Against transformers and llama.cpp, at every level").

mod common;

use common::{occult, occult_err, occult_ok};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// A tiny synthetic checkpoint in `dir/m` (vocabulary 64).
fn model(dir: &Path) -> String {
    occult_ok(
        dir,
        &[
            "model",
            "synth",
            "--family",
            "qwen3_moe",
            "--hidden",
            "32",
            "--vocab",
            "64",
            "-o",
            "m",
        ],
    );
    "m".into()
}

/// An executable script `dir/name` standing in for `$OCCULT_PYTHON`: `-c CODE` (the module
/// probe) exits with `probe`; otherwise it is run as `PY SCRIPT MODEL --dtype D --threads N
/// [...]` and does `body` (bash).
fn fake_python(dir: &Path, name: &str, probe: i32, body: &str) -> PathBuf {
    let path = dir.join(name);
    let text = format!(
        "#!/bin/bash\nif [ \"$1\" = -c ]; then echo 'ModuleNotFoundError: No module named \
         llama_cpp' >&2; exit {probe}; fi\n{body}\n"
    );
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn bench(dir: &Path, python: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "bench",
        "model",
        "--model",
        "m",
        "--prompt-len",
        "5",
        "--decode-tokens",
        "2",
        "--repeats",
        "3",
    ];
    args.extend_from_slice(extra);
    std::process::Command::new(common::occult_bin())
        .args(&args)
        .env("OCCULT_PYTHON", python)
        .current_dir(dir)
        .output()
        .unwrap()
}

/// Answers every request with fixed times and 64 zero logits, after a ready line naming
/// llama.cpp's AVX2 build; records its arguments.
const ANSWERING: &str = r#"echo "$@" > args.txt
echo '{"ready": true, "llama_cpp_python": "9.9", "isa": "CPU : AVX = 1 | AVX2 = 1 | FMA = 1 | AVX512 = 0 |"}'
logits=$(printf '0,%.0s' $(seq 63))0
while read -r line; do
  echo "{\"prefill_s\": 0.5, \"decode_s_per_token\": 0.25, \"logits\": [$logits]}"
done"#;

#[test]
fn a_peers_answers_make_the_report() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    model(dir);
    let py = fake_python(dir, "py", 0, ANSWERING);
    let out = bench(
        dir,
        &py,
        &[
            "--against",
            "llama.cpp",
            "--dtype",
            "bf16",
            "--gguf",
            "m.gguf",
            "--json",
            "r.json",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("llama.cpp (llama-cpp-python 9.9, avx2)"),
        "{stdout}"
    );
    // The peer got the checkpoint, dtype, threads and the GGUF cache.
    let args = std::fs::read_to_string(dir.join("args.txt")).unwrap();
    assert!(args.contains(" m --dtype bf16 --threads "), "{args}");
    assert!(args.ends_with("--gguf m.gguf\n"), "{args}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("r.json")).unwrap()).unwrap();
    let theirs = &r["results"][1];
    assert_eq!(theirs["prefill_s"], 0.5);
    assert_eq!(theirs["prefill_tokens_per_s"], 10.0);
    assert_eq!(theirs["decode_ms_per_token"], 250.0);
    // Ours against the peer's 0.5 s, repeat by repeat: the median ratio is at most the one
    // of our best repeat.
    let ours = &r["results"][0];
    let prefill = r["speed_ratio"]["prefill"].as_f64().unwrap();
    assert!(prefill > 0.0 && prefill <= 0.5 / ours["prefill_s"].as_f64().unwrap() * 1.001);
    assert!(r["max_abs_logit_diff"].as_f64().unwrap() > 0.0);
    assert_eq!(r["dtype"], "bf16");
    assert!(r["kernel_level"].is_string());
    // The decode's bytes: the step at the middle context (5 + 2 / 2 positions cached), read
    // by the peer in 0.25 s, against the read rate measured after each of the 3 rounds.
    let reads = &r["decode_reads"];
    let f = |v: &serde_json::Value| v.as_f64().unwrap();
    let bytes = f(&reads["bytes_per_token"]);
    assert_eq!(
        bytes,
        f(&reads["weights_bytes"]) + 6.0 * f(&reads["bytes_per_cached_position"])
    );
    assert!(f(&reads["weights_bytes"]) > 0.0);
    let rates: Vec<f64> = reads["read_rates_bytes_per_s"]
        .as_array()
        .unwrap()
        .iter()
        .map(f)
        .collect();
    assert_eq!(rates.len(), 3);
    assert!(rates.iter().all(|&x| x > 1e8), "{rates:?}");
    let peer = &reads["implementations"][1];
    assert_eq!(f(&peer["bytes_per_s"]), bytes / 0.25);
    let mut shares: Vec<f64> = rates.iter().map(|x| bytes / 0.25 / x).collect();
    shares.sort_by(f64::total_cmp);
    assert!((f(&peer["share_of_read_rate"]) - shares[1]).abs() <= 1e-12 * shares[1]);
    assert!(stdout.contains("decode reads"), "{stdout}");
    // A level other than the peer's is named.
    if r["kernel_level"] != "avx2" {
        assert!(
            stderr.contains("warning: llama.cpp runs at avx2"),
            "{stderr}"
        );
    }
}

#[test]
fn a_failing_peer_is_a_clear_error() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    model(dir);
    let err = |out: std::process::Output| {
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        stderr
    };
    // No interpreter; the modules missing.
    let e = err(bench(
        dir,
        Path::new("/nonexistent/python"),
        &["--against", "llama.cpp"],
    ));
    assert!(
        e.contains("--against llama.cpp needs Python with llama_cpp, numpy"),
        "{e}"
    );
    assert!(e.contains("pip install llama-cpp-python"), "{e}");
    assert!(e.contains("/nonexistent/python"), "{e}");
    let missing = fake_python(dir, "missing", 1, "exit 0");
    let e = err(bench(dir, &missing, &["--against", "transformers"]));
    assert!(e.contains("needs Python with torch, transformers"), "{e}");
    assert!(e.contains("No module named llama_cpp"), "{e}");
    // It cannot load the model (says why on stderr and ends).
    let cannot = fake_python(
        dir,
        "cannot",
        0,
        "echo 'cannot convert: unknown architecture' >&2",
    );
    let e = err(bench(dir, &cannot, &["--against", "llama.cpp"]));
    assert!(e.contains("cannot convert: unknown architecture"), "{e}");
    assert!(e.contains("llama.cpp could not load m"), "{e}");
    // It dies on the first prompt.
    let dies = fake_python(
        dir,
        "dies",
        0,
        r#"echo '{"ready": true, "isa": "AVX2"}'; read -r line; exit 3"#,
    );
    let e = err(bench(dir, &dies, &["--against", "transformers"]));
    assert!(e.contains("transformers failed on the prompt"), "{e}");
    // An answer without its times.
    let partial = fake_python(
        dir,
        "partial",
        0,
        r#"echo '{"ready": true}'; while read -r l; do echo '{"logits": [0]}'; done"#,
    );
    let e = err(bench(dir, &partial, &["--against", "llama.cpp"]));
    assert!(
        e.contains("llama.cpp's answer has no time \"prefill_s\""),
        "{e}"
    );
}

#[test]
fn the_gguf_belongs_to_llama_cpp() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    model(dir);
    let e = occult_err(
        dir,
        &[
            "bench",
            "model",
            "--model",
            "m",
            "--against",
            "transformers",
            "--gguf",
            "x.gguf",
        ],
    );
    assert!(
        e.contains("--gguf is the converted checkpoint of --against llama.cpp"),
        "{e}"
    );
    // `llama-cpp` is taken for `llama.cpp`; the help names the peers.
    let help = occult(dir, &["bench", "model", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("llama.cpp"), "{help}");
}
