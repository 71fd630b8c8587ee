//! Helpers shared by the end-to-end tests: finding and running the `occult` binary, writing
//! raw (possibly broken) trace files.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The `occult` binary built beside this test (cargo builds it for occult-eval's tests),
/// refused when it is older than a source it is built from: a filtered run such as
/// `cargo test -p occult-tests --test train_cli` does not rebuild it, and would otherwise test
/// the binary of an earlier edit.
pub fn occult_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let bin = dir.join(format!("occult{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: run the tests with `cargo test --workspace` so that it is built",
        bin.display()
    );
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .expect("the binary's time");
    if let Some((newer, _)) = newest_source().filter(|(_, t)| *t > built) {
        panic!(
            "{} is older than {}, which changed after it was built: run the test files with \
             `scripts/test.sh NAME...`, which rebuilds it first (or rebuild it with `cargo \
             build --release -p occult-eval --features occult-eval/mpi`, the features the \
             tests use), or run the whole `cargo test --workspace --release --features \
             occult-tests/mpi`, which builds it",
            bin.display(),
            newer.display()
        );
    }
    bin
}

/// The newest file the `occult` binary is built from (what cargo rebuilds it for): the three
/// crates' Rust sources, manifests and READMEs (their crate docs), the workspace manifest and
/// lock file, and what the binary compiles in (task files and samples, the default recipe,
/// link profiles and the Python peers).
pub fn newest_source() -> Option<(PathBuf, std::time::SystemTime)> {
    static NEWEST: std::sync::OnceLock<Option<(PathBuf, std::time::SystemTime)>> =
        std::sync::OnceLock::new();
    NEWEST
        .get_or_init(|| {
            let root = Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .expect("the workspace");
            let mut files = Vec::new();
            for krate in ["occult-core", "occult-train", "occult-eval"] {
                walk(&root.join(krate), &mut files, &|p| {
                    p.extension().is_some_and(|e| e == "rs")
                        || p.file_name()
                            .is_some_and(|n| n == "Cargo.toml" || n == "README.md")
                });
            }
            walk(&root.join("tasks"), &mut files, &|p| {
                p.extension().is_some_and(|e| e == "toml" || e == "jsonl")
            });
            walk(&root.join("configs"), &mut files, &|p| {
                p.extension().is_some_and(|e| e == "toml")
            });
            for f in [
                "Cargo.toml",
                "Cargo.lock",
                "scripts/bench_transformers.py",
                "scripts/bench_llama_cpp.py",
            ] {
                files.push(root.join(f));
            }
            files
                .into_iter()
                .filter_map(|f| Some((std::fs::metadata(&f).ok()?.modified().ok()?, f)))
                .max()
                .map(|(t, f)| (f, t))
        })
        .clone()
}

/// Every file under `dir` that `keep` takes (skipping build output).
fn walk(dir: &Path, out: &mut Vec<PathBuf>, keep: &dyn Fn(&Path) -> bool) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "target") {
                walk(&p, out, keep);
            }
        } else if keep(&p) {
            out.push(p);
        }
    }
}

/// Runs `occult` with arguments in `dir`.
pub fn occult(dir: &Path, args: &[&str]) -> Output {
    Command::new(occult_bin())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("running occult")
}

/// Runs `occult` and insists that it succeeds; returns stdout.
pub fn occult_ok(dir: &Path, args: &[&str]) -> String {
    let out = occult(dir, args);
    assert!(
        out.status.success(),
        "occult {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `occult`, insists that it fails cleanly (exit 1, not a panic) and returns stderr.
pub fn occult_err(dir: &Path, args: &[&str]) -> String {
    let out = occult(dir, args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(
        out.status.code(),
        Some(1),
        "occult {args:?} should fail with exit code 1, got {:?}:\n{stderr}",
        out.status.code()
    );
    assert!(!stderr.contains("panicked"), "a panic:\n{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    stderr
}

/// A raw tensor for [`write_raw`].
pub enum Raw {
    I32(Vec<usize>, Vec<i32>),
    F32(Vec<usize>, Vec<f32>),
}

/// Writes a safetensors file with arbitrary tensors and metadata (no validation).
pub fn write_raw(path: &Path, tensors: Vec<(&str, Raw)>, metadata: &[(&str, &str)]) {
    let bufs: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, r)| match r {
            Raw::I32(s, v) => (
                n.to_string(),
                safetensors::Dtype::I32,
                s,
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            Raw::F32(s, v) => (
                n.to_string(),
                safetensors::Dtype::F32,
                s,
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bufs
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let md: HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let bytes = safetensors::serialize(views, Some(md)).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// Standard metadata of a trace with E experts, top-k.
pub fn meta(e: &'static str, k: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("format", "occult.trace.v1"),
        ("num_experts", e),
        ("top_k", k),
    ]
}

/// The `samples_TASK.jsonl` lines `occult eval --log-samples` wrote in `dir`, per task of the
/// comma-separated `tasks`.
pub fn read_samples(dir: &Path, tasks: &str) -> Vec<(String, Vec<serde_json::Value>)> {
    tasks
        .split(',')
        .map(|t| {
            let text = std::fs::read_to_string(dir.join(format!("samples_{t}.jsonl"))).unwrap();
            let rows = text
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            (t.to_string(), rows)
        })
        .collect()
}

/// Two runs' samples agree: the same acc and acc_norm for every item, and log-likelihoods
/// within 1e-4; for a generative task, the same responses, filtered answers and exact matches.
pub fn same_scores(
    a: &[(String, Vec<serde_json::Value>)],
    b: &[(String, Vec<serde_json::Value>)],
    what: &str,
) {
    for ((t, x), (_, y)) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len(), "{what} {t}");
        for (r, s) in x.iter().zip(y) {
            if r.get("loglikelihoods").is_none() {
                for key in ["doc_id", "filter", "resps", "filtered_resps", "exact_match"] {
                    assert_eq!(r[key], s[key], "{what} {t} doc {} {key}", r["doc_id"]);
                }
                continue;
            }
            assert_eq!(r["acc"], s["acc"], "{what} {t} doc {}", r["doc_id"]);
            assert_eq!(
                r["acc_norm"], s["acc_norm"],
                "{what} {t} doc {}",
                r["doc_id"]
            );
            let (l1, l2) = (
                r["loglikelihoods"].as_array().unwrap(),
                s["loglikelihoods"].as_array().unwrap(),
            );
            for (p, q) in l1.iter().zip(l2) {
                let (p, q) = (p.as_f64().unwrap(), q.as_f64().unwrap());
                assert!(
                    (p - q).abs() < 1e-4,
                    "{what} {t} doc {}: {p} vs {q}",
                    r["doc_id"]
                );
            }
        }
    }
}

/// A recipe for `occult reproduce` on a tiny built-in model (built in seconds), every stage on.
#[allow(dead_code)]
pub const TINY_RECIPE: &str = r#"
name = "tiny"
devices = 4
[model]
builtin = true
[builtin]
hidden = 32
layers = 2
experts = 16
top_k = 4
expert_intermediate = 16
steps = 20
batch_size = 8
seq_len = 64
[builtin.sizes]
pretrain_docs = 100
pretrain_questions = 30
calibration_docs = 8
sentences = 6
instructions = 100
held_out = 20
task_items = 20
[calibration]
seq_len = 64
[finetune]
steps = 4
batch_size = 8
seq_len = 64
[speed]
prefill_tokens = [32, 256]
prefill_seq_len = 32
decode_prompt_len = 8
decode_tokens = 2
train_batch_per_rank = 2
train_seq_len = 32
decode_batches = [1, 3]
repeats = 1
[shaped]
rate = "200mbit"
prefill_tokens = 256
seq_len = 32
train_batch_per_rank = 1
[projection]
hidden = 256
intermediate = 128
devices = [4, 32]
tokens_per_device = [64]
links = ["pcie4", "ib-ndr"]
"#;

/// One field of every line of a training run's `log.jsonl` (in `dir/run`), as numbers.
#[allow(dead_code)]
pub fn log_field(dir: &Path, run: &str, key: &str) -> Vec<f64> {
    std::fs::read_to_string(dir.join(run).join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{run}: no number {key} in {l}"))
        })
        .collect()
}
