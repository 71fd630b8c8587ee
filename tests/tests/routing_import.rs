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
        "Megatron-Core's router trace (.jsonl)",
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

/// The fixture's SGLang dump with its records' token ids changed by `edit` (the storage name,
/// `data/0` for record 0's `[4 layers, 40 tokens, 8]` int32 or `data/2` for record 1's
/// `[4, 57, 8]`, and its values), written as a `.pt` in `dir`.
fn edited_dump(dir: &std::path::Path, name: &str, edit: impl Fn(&str, &mut [i32])) -> PathBuf {
    use std::io::{Read, Write};
    let bytes = std::fs::read(fixture("sglang_per_token.pt")).unwrap();
    let mut from = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
    let path = dir.join(name);
    let mut to = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for i in 0..from.len() {
        let mut entry = from.by_index(i).unwrap();
        let entry_name = entry.name().unwrap().to_string();
        let mut data = Vec::new();
        entry.read_to_end(&mut data).unwrap();
        for storage in ["data/0", "data/2"] {
            if entry_name.ends_with(&format!("/{storage}")) {
                let mut v: Vec<i32> = data
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                edit(storage, &mut v);
                data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            }
        }
        to.start_file(entry_name, stored).unwrap();
        to.write_all(&data).unwrap();
    }
    to.finish().unwrap();
    path
}

/// Whether a layer recorded anything is every id's call, not the first's: a dump whose first
/// token is padding in every layer (a padded batch), or whose first record is all padding (an
/// idle rank's forward), imports with its padded rows dropped; one with nothing but padding is
/// refused.
#[test]
fn a_dump_that_begins_with_padding_imports() {
    let t = tempfile::tempdir().unwrap();
    let whole = import(&fixture("sglang_per_token.pt"), &opts()).unwrap();
    let k = whole.meta.top_k;
    assert_eq!((whole.layers[0].tokens, k), (96, 2));
    // Record 0's token 0, padded in every layer.
    let first = edited_dump(t.path(), "first.pt", |storage, v| {
        if storage == "data/0" {
            for layer in v.chunks_exact_mut(40 * 8) {
                layer[..8].fill(-1);
            }
        }
    });
    let got = import(&first, &opts()).unwrap();
    assert_eq!(got.layer_ids(), whole.layer_ids());
    for (w, g) in whole.layers.iter().zip(&got.layers) {
        assert_eq!(g.topk_ids, w.topk_ids[k..], "layer {}", w.layer);
    }
    // Record 0 all padding: record 1's 56 tokens.
    let idle = edited_dump(t.path(), "idle.pt", |storage, v| {
        if storage == "data/0" {
            v.fill(-1);
        }
    });
    let got = import(&idle, &opts()).unwrap();
    assert_eq!(got.layer_ids(), whole.layer_ids());
    for (w, g) in whole.layers.iter().zip(&got.layers) {
        assert_eq!(g.topk_ids, w.topk_ids[40 * k..], "layer {}", w.layer);
    }
    // Nothing but padding.
    let empty = edited_dump(t.path(), "empty.pt", |_, v| v.fill(-1));
    let err = import(&empty, &opts()).unwrap_err().to_string();
    assert!(err.contains("every recorded id is -1"), "{err}");
}
