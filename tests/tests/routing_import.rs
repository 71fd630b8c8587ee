//! Routing recorded outside Occult (tests/fixtures/routing, written by
//! scripts/make_routing_fixtures.py): the transformers forward-hook script's trace equals
//! `occult profile`'s on the same text, and the same routing written by numpy and safetensors as
//! plain arrays (per layer, stacked, SGLang-style -1 padding, compressed .npz, .npy) imports to
//! the same trace; bad files are refused with reasons.

mod common;

use occult_core::analysis::trace::Trace;
use occult_core::interop::routing_import::{import, ImportOptions};
use std::path::PathBuf;
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/routing")
        .join(name)
}

fn opts() -> ImportOptions {
    ImportOptions {
        num_experts: 8,
        ..Default::default()
    }
}

#[test]
fn the_hook_scripts_trace_is_occult_profiles_trace() {
    let hook = Trace::read(&fixture("olmoe_hook.safetensors")).unwrap();
    let t = tempfile::tempdir().unwrap();
    let ours = t.path().join("ours.safetensors");
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/olmoe");
    let out = Command::new(common::occult_bin())
        .args(["profile", "--model"])
        .arg(&model)
        .arg("--data")
        .arg(fixture("calib.txt"))
        .args(["--seq-len", "32", "--max-tokens", "96", "-o"])
        .arg(&ours)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ours = Trace::read(&ours).unwrap();
    assert_eq!(hook.layer_ids(), ours.layer_ids());
    for (h, o) in hook.layers.iter().zip(&ours.layers) {
        assert_eq!(h.tokens, 96);
        assert_eq!(h.topk_ids, o.topk_ids, "layer {}", h.layer);
        for (what, a, b) in [
            ("weights", &h.topk_weights, &o.topk_weights),
            ("logits", &h.router_logits, &o.router_logits),
        ] {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            let gap = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(gap < 1e-5, "layer {} {what}: {gap}", h.layer);
        }
    }
}

#[test]
fn plain_arrays_from_numpy_and_safetensors_import_to_the_same_trace() {
    let hook = Trace::read(&fixture("olmoe_hook.safetensors")).unwrap();
    for file in [
        "per_layer.npz",
        "stacked_padded.npz",
        "stacked.npy",
        "stacked.safetensors",
        "sglang_per_token.pt",
    ] {
        let t = import(&fixture(file), &opts()).unwrap();
        assert_eq!(t.meta.top_k, 2, "{file}");
        assert_eq!(t.layer_ids(), hook.layer_ids(), "{file}");
        for (h, o) in hook.layers.iter().zip(&t.layers) {
            assert_eq!(h.topk_ids, o.topk_ids, "{file} layer {}", h.layer);
        }
    }
    let with_weights = import(&fixture("per_layer.npz"), &opts()).unwrap();
    assert_eq!(
        with_weights.layers[0].topk_weights,
        hook.layers[0].topk_weights
    );
    let with_logits = import(&fixture("stacked.safetensors"), &opts()).unwrap();
    let (a, b) = (
        with_logits.layers[0].router_logits.as_ref().unwrap(),
        hook.layers[0].router_logits.as_ref().unwrap(),
    );
    // Stored as f16: within half a unit in the last place of f16.
    assert!(a
        .iter()
        .zip(b)
        .all(|(x, y)| (x - y).abs() <= y.abs() * 1e-3 + 1e-4));
}

#[test]
fn occult_trace_import_writes_a_trace_and_refuses_bad_files() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("t.safetensors");
    let run = |args: &[&str]| {
        Command::new(common::occult_bin())
            .args(["trace", "import"])
            .args(args)
            .output()
            .unwrap()
    };
    let ok = run(&[
        fixture("stacked_padded.npz").to_str().unwrap(),
        "--experts",
        "8",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let hook = Trace::read(&fixture("olmoe_hook.safetensors")).unwrap();
    assert_eq!(
        Trace::read(&out).unwrap().layers[2].topk_ids,
        hook.layers[2].topk_ids
    );
    // The model's config gives the expert count.
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/olmoe");
    let ok = run(&[
        fixture("stacked.npy").to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "-o",
        t.path().join("m.safetensors").to_str().unwrap(),
    ]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );

    let fails = |args: &[&str], want: &str| {
        let o = run(args);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
    };
    let bad = t.path().join("bad.npz");
    std::fs::write(&bad, b"PK\x03\x04 not really a zip").unwrap();
    fails(
        &[
            bad.to_str().unwrap(),
            "--experts",
            "8",
            "-o",
            "x.safetensors",
        ],
        "not a readable .npz",
    );
    fails(
        &[
            fixture("stacked.npy").to_str().unwrap(),
            "--experts",
            "4",
            "-o",
            t.path().join("y.safetensors").to_str().unwrap(),
        ],
        "is not an expert in 0..4",
    );
    fails(
        &[
            fixture("calib.txt").to_str().unwrap(),
            "--experts",
            "8",
            "-o",
            t.path().join("z.safetensors").to_str().unwrap(),
        ],
        ".npz, .npy, .safetensors or SGLang",
    );
    assert!(!t.path().join("y.safetensors").exists());
    // Several files (one per rank): their tokens in order.
    let two = t.path().join("two.safetensors");
    let ok = run(&[
        fixture("stacked.npy").to_str().unwrap(),
        fixture("sglang_per_token.pt").to_str().unwrap(),
        "--experts",
        "8",
        "-o",
        two.to_str().unwrap(),
    ]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let two = Trace::read(&two).unwrap();
    let ids = &hook.layers[1].topk_ids;
    assert_eq!(two.layers[1].topk_ids, [&ids[..], &ids[..]].concat());
    // An occult trace is itself such a file (per-layer names), so it imports too.
    let ok = run(&[
        t.path().join("m.safetensors").to_str().unwrap(),
        "--experts",
        "8",
        "-o",
        t.path().join("w.safetensors").to_str().unwrap(),
    ]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
}
