//! Every bad input of the analysis commands gets one clear error (exit code 1, no panic) that
//! names the file and what is wrong, and no output file is left behind or replaced.

mod common;
use common::{meta, occult_err, occult_ok, write_raw, Raw};
use std::path::Path;

fn contains_all(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "error message lacks {p:?}:\n{msg}");
    }
}

fn good_trace(d: &Path) {
    occult_ok(
        d,
        &[
            "trace",
            "synth",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--layers",
            "2",
            "--tokens",
            "50",
            "-o",
            "good.safetensors",
        ],
    );
}

/// A tiny synthetic OLMoE-shaped checkpoint in `d/name`.
fn tiny_model(d: &Path, name: &str) {
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
            "4",
            "--top-k",
            "2",
            "--intermediate",
            "16",
            "-o",
            name,
        ],
    );
}

#[test]
fn expert_id_out_of_range() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_raw(
        &d.join("b.safetensors"),
        vec![("layers.0.topk_ids", Raw::I32(vec![2, 2], vec![0, 1, 2, 9]))],
        &meta("8", "2"),
    );
    let e = occult_err(d, &["collab", "--trace", "b.safetensors", "--devices", "2"]);
    contains_all(
        &e,
        &[
            "b.safetensors",
            "layers.0.topk_ids",
            "row 1",
            "9",
            "out of range",
        ],
    );
    write_raw(
        &d.join("n.safetensors"),
        vec![("layers.0.topk_ids", Raw::I32(vec![1, 2], vec![-1, 1]))],
        &meta("8", "2"),
    );
    let e = occult_err(d, &["collab", "--trace", "n.safetensors", "--devices", "2"]);
    contains_all(&e, &["n.safetensors", "-1", "out of range"]);
}

#[test]
fn duplicate_expert_in_one_token() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_raw(
        &d.join("b.safetensors"),
        vec![("layers.4.topk_ids", Raw::I32(vec![2, 2], vec![0, 1, 3, 3]))],
        &meta("8", "2"),
    );
    let e = occult_err(d, &["collab", "--trace", "b.safetensors", "--devices", "2"]);
    contains_all(
        &e,
        &[
            "b.safetensors",
            "layers.4.topk_ids",
            "row 1",
            "expert 3 appears twice",
        ],
    );
}

#[test]
fn k_mismatched_with_metadata_and_bad_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_raw(
        &d.join("k.safetensors"),
        vec![(
            "layers.0.topk_ids",
            Raw::I32(vec![2, 3], vec![0, 1, 2, 3, 4, 5]),
        )],
        &meta("8", "2"),
    );
    let e = occult_err(d, &["collab", "--trace", "k.safetensors", "--devices", "2"]);
    contains_all(
        &e,
        &["k.safetensors", "shape [2, 3]", "expected [tokens, 2]"],
    );
    // Logits of the wrong width.
    write_raw(
        &d.join("l.safetensors"),
        vec![
            ("layers.0.topk_ids", Raw::I32(vec![1, 2], vec![0, 1])),
            ("layers.0.router_logits", Raw::F32(vec![1, 7], vec![0.0; 7])),
        ],
        &meta("8", "2"),
    );
    let e = occult_err(d, &["collab", "--trace", "l.safetensors", "--devices", "2"]);
    contains_all(&e, &["layers.0.router_logits", "[1, 7]", "expected [1, 8]"]);
    // Non-finite logits.
    let mut v = vec![0.0f32; 8];
    v[3] = f32::NAN;
    write_raw(
        &d.join("nan.safetensors"),
        vec![
            ("layers.0.topk_ids", Raw::I32(vec![1, 2], vec![0, 1])),
            ("layers.0.router_logits", Raw::F32(vec![1, 8], v)),
        ],
        &meta("8", "2"),
    );
    let e = occult_err(
        d,
        &["collab", "--trace", "nan.safetensors", "--devices", "2"],
    );
    contains_all(&e, &["router_logits", "not finite"]);
    // Missing or wrong format tag, missing or non-numeric counts.
    let ids = || vec![("layers.0.topk_ids", Raw::I32(vec![1, 2], vec![0, 1]))];
    write_raw(
        &d.join("f.safetensors"),
        ids(),
        &[("num_experts", "8"), ("top_k", "2")],
    );
    contains_all(
        &occult_err(d, &["collab", "--trace", "f.safetensors", "--devices", "2"]),
        &["no `format` metadata"],
    );
    write_raw(
        &d.join("g.safetensors"),
        ids(),
        &[
            ("format", "occult.trace.v1"),
            ("num_experts", "eight"),
            ("top_k", "2"),
        ],
    );
    contains_all(
        &occult_err(d, &["collab", "--trace", "g.safetensors", "--devices", "2"]),
        &["num_experts", "\"eight\""],
    );
    write_raw(
        &d.join("h.safetensors"),
        ids(),
        &[("format", "occult.trace.v1"), ("top_k", "2")],
    );
    contains_all(
        &occult_err(d, &["collab", "--trace", "h.safetensors", "--devices", "2"]),
        &["no num_experts"],
    );
    write_raw(
        &d.join("x.safetensors"),
        vec![("model.embed", Raw::I32(vec![1], vec![0]))],
        &meta("8", "2"),
    );
    contains_all(
        &occult_err(d, &["collab", "--trace", "x.safetensors", "--devices", "2"]),
        &["unexpected tensor \"model.embed\""],
    );
}

#[test]
fn unreadable_and_truncated_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let e = occult_err(
        d,
        &["collab", "--trace", "missing.safetensors", "--devices", "2"],
    );
    contains_all(&e, &["missing.safetensors", "No such file"]);
    std::fs::write(d.join("junk.safetensors"), b"this is not safetensors").unwrap();
    let e = occult_err(
        d,
        &["collab", "--trace", "junk.safetensors", "--devices", "2"],
    );
    contains_all(&e, &["junk.safetensors", "not a readable safetensors file"]);
    good_trace(d);
    let bytes = std::fs::read(d.join("good.safetensors")).unwrap();
    std::fs::write(d.join("cut.safetensors"), &bytes[..bytes.len() - 100]).unwrap();
    let e = occult_err(
        d,
        &["collab", "--trace", "cut.safetensors", "--devices", "2"],
    );
    contains_all(&e, &["cut.safetensors", "not a readable safetensors file"]);
    std::fs::write(d.join("p.json"), b"{\"format\": \"occult.placement.v1\", ").unwrap();
    let e = occult_err(
        d,
        &[
            "collab",
            "--trace",
            "good.safetensors",
            "--placement",
            "p.json",
        ],
    );
    contains_all(&e, &["p.json", "not a valid placement file"]);
}

fn placement_json(e: usize, d: usize, map: &[u32]) -> String {
    serde_json::json!({
        "format": "occult.placement.v1", "num_experts": e, "num_devices": d, "method": "hand",
        "layers": [{"layer": 0, "device_of_expert": map}, {"layer": 1, "device_of_expert": map}]
    })
    .to_string()
}

#[test]
fn bad_placements() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    good_trace(d);
    let run = |name: &str, text: String| {
        std::fs::write(d.join(name), text).unwrap();
        occult_err(
            d,
            &["collab", "--trace", "good.safetensors", "--placement", name],
        )
    };
    let e = run("len.json", placement_json(8, 2, &[0, 0, 0, 1, 1, 1, 1]));
    contains_all(&e, &["len.json", "layer 0", "7 entries", "8"]);
    let e = run(
        "unbal.json",
        placement_json(8, 2, &[0, 0, 0, 0, 0, 1, 1, 1]),
    );
    contains_all(&e, &["unbal.json", "unbalanced", "device 0 holds 5"]);
    let e = run(
        "range.json",
        placement_json(8, 2, &[0, 0, 0, 0, 1, 1, 1, 2]),
    );
    contains_all(&e, &["range.json", "expert 7 is on device 2"]);
    let e = run("exp.json", placement_json(6, 2, &[0, 0, 0, 1, 1, 1]));
    contains_all(&e, &["exp.json", "6 experts, the trace has 8"]);
    let mut v: serde_json::Value =
        serde_json::from_str(&placement_json(8, 2, &[0, 0, 0, 0, 1, 1, 1, 1])).unwrap();
    v["layers"].as_array_mut().unwrap().pop();
    let e = run("layer.json", v.to_string());
    contains_all(&e, &["layer.json", "no entry for layer 1"]);
    let e = run(
        "fmt.json",
        placement_json(8, 2, &[0; 8]).replace("occult.placement.v1", "v0"),
    );
    contains_all(&e, &["fmt.json", "format is \"v0\""]);
    let e = run("many.json", placement_json(8, 9, &[0, 1, 2, 3, 4, 5, 6, 7]));
    contains_all(&e, &["many.json", "9 devices for 8 experts"]);
}

#[test]
fn bad_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    good_trace(d);
    let e = occult_err(
        d,
        &["collab", "--trace", "good.safetensors", "--devices", "9"],
    );
    contains_all(&e, &["9 devices for 8 experts"]);
    let e = occult_err(
        d,
        &[
            "place",
            "--trace",
            "good.safetensors",
            "--devices",
            "0",
            "-o",
            "p.json",
        ],
    );
    contains_all(&e, &["at least 1"]);
    let e = occult_err(
        d,
        &[
            "prune",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "--max-devices",
            "0",
            "--rule",
            "router",
        ],
    );
    contains_all(&e, &["--max-devices must be at least 1"]);
    let e = occult_err(
        d,
        &[
            "place",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "--method",
            "greedy",
            "--max-load-factor",
            "1.1",
            "-o",
            "p.json",
        ],
    );
    contains_all(&e, &["occult method only"]);
    let e = occult_err(
        d,
        &[
            "place",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "--max-load-factor",
            "0.5",
            "-o",
            "p.json",
        ],
    );
    contains_all(&e, &["factor >= 1"]);
    // A model rule that does not reproduce the recorded gate weights.
    let e = occult_err(
        d,
        &[
            "prune",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "--max-devices",
            "1",
            "--rule",
            "router",
            "--renormalize",
        ],
    );
    contains_all(
        &e,
        &[
            "does not reproduce the trace's gate weights",
            "--renormalize",
        ],
    );
    // A trace recorded on 3 ranks analysed on 2 devices.
    occult_ok(
        d,
        &[
            "trace",
            "synth",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--layers",
            "1",
            "--tokens",
            "30",
            "--num-ranks",
            "3",
            "-o",
            "r3.safetensors",
        ],
    );
    let e = occult_err(
        d,
        &["collab", "--trace", "r3.safetensors", "--devices", "2"],
    );
    contains_all(&e, &["3 source rank(s)", "--resplit"]);
    occult_ok(
        d,
        &[
            "collab",
            "--trace",
            "r3.safetensors",
            "--devices",
            "2",
            "--resplit",
        ],
    );
    // Pruning needs router logits.
    occult_ok(
        d,
        &[
            "trace",
            "synth",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--layers",
            "1",
            "--tokens",
            "30",
            "--no-logits",
            "-o",
            "nl.safetensors",
        ],
    );
    let e = occult_err(
        d,
        &[
            "prune",
            "--trace",
            "nl.safetensors",
            "--devices",
            "2",
            "--max-devices",
            "1",
            "--rule",
            "router",
        ],
    );
    contains_all(&e, &["no router logits"]);
    // Pruning to N devices that cannot hold k experts.
    occult_ok(
        d,
        &[
            "trace",
            "synth",
            "--experts",
            "8",
            "--top-k",
            "4",
            "--layers",
            "1",
            "--tokens",
            "30",
            "-o",
            "k4.safetensors",
        ],
    );
    let e = occult_err(
        d,
        &[
            "prune",
            "--trace",
            "k4.safetensors",
            "--devices",
            "4",
            "--max-devices",
            "1",
            "--rule",
            "similarity",
        ],
    );
    contains_all(&e, &["cannot keep top_k = 4"]);
    // Synthetic generation with impossible sizes, and a broken recipe.
    let e = occult_err(
        d,
        &[
            "trace",
            "synth",
            "--experts",
            "4",
            "--top-k",
            "5",
            "-o",
            "x.safetensors",
        ],
    );
    contains_all(&e, &["top_k = 5"]);
    std::fs::write(
        d.join("r.toml"),
        "name = \"x\"\ndevices = 2\n[model]\nbuiltin = true\n[analysis]\nrestars = 3\n",
    )
    .unwrap();
    let e = occult_err(d, &["reproduce", "r.toml", "--out", "rep"]);
    contains_all(&e, &["r.toml", "restars"]);
    std::fs::write(
        d.join("r.toml"),
        "name = \"x\"\ndevices = 4\n[model]\npath = \"m\"\n",
    )
    .unwrap();
    let e = occult_err(d, &["reproduce", "r.toml", "--out", "rep"]);
    contains_all(&e, &["r.toml", "[calibration] data is required"]);
}

#[test]
fn failed_commands_leave_outputs_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    good_trace(d);
    std::fs::write(d.join("keep.json"), "precious").unwrap();
    occult_err(
        d,
        &[
            "place",
            "--trace",
            "good.safetensors",
            "--devices",
            "9",
            "-o",
            "keep.json",
        ],
    );
    assert_eq!(
        std::fs::read_to_string(d.join("keep.json")).unwrap(),
        "precious"
    );
    occult_err(
        d,
        &[
            "place",
            "--trace",
            "good.safetensors",
            "--devices",
            "9",
            "-o",
            "new.json",
        ],
    );
    assert!(!d.join("new.json").exists());
    let e = occult_err(
        d,
        &[
            "place",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "-o",
            "no/such/dir/p.json",
        ],
    );
    contains_all(&e, &["no/such/dir/p.json", "does not exist"]);
    // A failure at the very end (the output path is a folder, so the final rename fails):
    // the folder is untouched and the temporary file is gone.
    std::fs::create_dir(d.join("taken")).unwrap();
    std::fs::write(d.join("taken/inside"), "x").unwrap();
    let e = occult_err(
        d,
        &[
            "place",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "-o",
            "taken",
        ],
    );
    contains_all(&e, &["taken"]);
    assert_eq!(
        std::fs::read_to_string(d.join("taken/inside")).unwrap(),
        "x"
    );
    // No temporary files remain.
    let names: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().all(|n| !n.starts_with(".occult-tmp")),
        "{names:?}"
    );
}

#[test]
fn sizes_that_would_exhaust_memory_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    good_trace(d);
    // A huge --max-devices is just "no limit" (it used to size an allocation).
    occult_ok(
        d,
        &[
            "prune",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "--max-devices",
            "18446744073709551615",
            "--rule",
            "router",
        ],
    );
    // Expert counts from file metadata are bounded before anything is allocated by them.
    write_raw(
        &d.join("big.safetensors"),
        vec![("layers.0.topk_ids", Raw::I32(vec![1, 2], vec![0, 1]))],
        &meta("1000000000000", "2"),
    );
    for args in [
        &["trace", "info", "big.safetensors"][..],
        &["collab", "--trace", "big.safetensors", "--devices", "2"],
    ] {
        contains_all(
            &occult_err(d, args),
            &[
                "big.safetensors",
                "num_experts = 1000000000000 must be in 1..=4096",
            ],
        );
    }
    contains_all(
        &occult_err(
            d,
            &[
                "trace",
                "synth",
                "--experts",
                "4000000000",
                "-o",
                "x.safetensors",
            ],
        ),
        &["num_experts"],
    );
    contains_all(
        &occult_err(
            d,
            &[
                "trace",
                "synth",
                "--tokens",
                "100000000",
                "-o",
                "x.safetensors",
            ],
        ),
        &["too large", "--no-logits"],
    );
    contains_all(
        &occult_err(
            d,
            &[
                "place",
                "--trace",
                "good.safetensors",
                "--devices",
                "2",
                "--restarts",
                "100000000",
                "-o",
                "p.json",
            ],
        ),
        &["--restarts"],
    );
    contains_all(
        &occult_err(
            d,
            &[
                "collab",
                "--trace",
                "good.safetensors",
                "--devices",
                "2",
                "--hidden-size",
                "18446744073709551615",
            ],
        ),
        &["--hidden-size"],
    );
}

#[test]
fn ambiguous_tensor_names_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ids = || Raw::I32(vec![1, 2], vec![0, 1]);
    write_raw(
        &d.join("a.safetensors"),
        vec![("layers.1.topk_ids", ids()), ("layers.01.topk_ids", ids())],
        &meta("8", "2"),
    );
    contains_all(
        &occult_err(d, &["trace", "info", "a.safetensors"]),
        &["a.safetensors", "\"01\" is not a layer index"],
    );
    write_raw(
        &d.join("b.safetensors"),
        vec![("layers.+1.topk_ids", ids())],
        &meta("8", "2"),
    );
    contains_all(
        &occult_err(d, &["trace", "info", "b.safetensors"]),
        &["\"+1\" is not a layer index"],
    );
}

/// Outputs that would replace an input, a folder, a FIFO or a device are refused before any
/// work, and the inputs stay byte for byte; an output through a symbolic link writes its target.
#[test]
fn outputs_never_replace_inputs_or_special_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    good_trace(d);
    tiny_model(d, "m");
    std::fs::write(d.join("calib.txt"), "one two three\n").unwrap();
    let weights = std::fs::read(d.join("m/model.safetensors")).unwrap();
    let trace = std::fs::read(d.join("good.safetensors")).unwrap();
    // profile -o MODEL/model.safetensors would destroy the weights.
    let err = occult_err(
        d,
        &[
            "profile",
            "--model",
            "m",
            "--data",
            "calib.txt",
            "-o",
            "m/model.safetensors",
        ],
    );
    contains_all(&err, &["m/model.safetensors", "inside the input folder"]);
    // prune -o onto its own trace, and --json onto the trace.
    let err = occult_err(
        d,
        &[
            "prune",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "--max-devices",
            "1",
            "--rule",
            "router",
            "-o",
            "good.safetensors",
        ],
    );
    contains_all(&err, &["good.safetensors", "destroy"]);
    let err = occult_err(
        d,
        &[
            "collab",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "--json",
            "./good.safetensors",
        ],
    );
    contains_all(&err, &["destroy"]);
    // Two outputs that are one file.
    let err = occult_err(
        d,
        &[
            "prune",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "--max-devices",
            "1",
            "--rule",
            "router",
            "-o",
            "p.safetensors",
            "--json",
            "p.safetensors",
        ],
    );
    contains_all(&err, &["same file"]);
    // A missing output folder is found before the work, not after.
    let err = occult_err(
        d,
        &[
            "place",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "--method",
            "occult",
            "-o",
            "no/p.json",
        ],
    );
    contains_all(&err, &["no/p.json", "does not exist"]);
    // A folder, a FIFO and a device as outputs.
    std::fs::create_dir(d.join("folder")).unwrap();
    let err = occult_err(d, &["trace", "synth", "--tokens", "10", "-o", "folder"]);
    contains_all(&err, &["folder", "a folder"]);
    assert!(std::process::Command::new("mkfifo")
        .arg(d.join("fifo"))
        .status()
        .unwrap()
        .success());
    let err = occult_err(
        d,
        &[
            "place",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "--method",
            "occult",
            "-o",
            "fifo",
        ],
    );
    contains_all(&err, &["fifo", "a FIFO"]);
    let err = occult_err(d, &["trace", "synth", "--tokens", "10", "-o", "/dev/null"]);
    contains_all(&err, &["/dev/null", "a device"]);
    // Inputs unchanged, the special files still what they were.
    assert_eq!(
        std::fs::read(d.join("m/model.safetensors")).unwrap(),
        weights
    );
    assert_eq!(std::fs::read(d.join("good.safetensors")).unwrap(), trace);
    assert!(d.join("folder").is_dir());
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::symlink_metadata(d.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert!(!d.join("p.safetensors").exists());
    // Through a link: the target is written, the link stays.
    std::os::unix::fs::symlink("target.json", d.join("link.json")).unwrap();
    occult_ok(
        d,
        &[
            "place",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "--method",
            "occult",
            "-o",
            "link.json",
        ],
    );
    assert!(std::fs::symlink_metadata(d.join("link.json"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(std::fs::read_to_string(d.join("target.json"))
        .unwrap()
        .contains("occult.placement.v1"));
}

/// Inputs that are not regular files (a device that never ends, a FIFO that would block, a
/// folder) are named, never read.
#[test]
fn inputs_that_are_not_files_are_named_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    good_trace(d);
    for f in ["fifo", "t.toml"] {
        let made = std::process::Command::new("mkfifo").arg(d.join(f)).status();
        assert!(made.unwrap().success());
    }
    std::fs::create_dir(d.join("folder")).unwrap();
    let cases: [(&[&str], &str, &str); 7] = [
        (
            &["collab", "--trace", "/dev/zero", "--devices", "2"],
            "/dev/zero",
            "a device",
        ),
        (
            &[
                "place",
                "--trace",
                "fifo",
                "--devices",
                "2",
                "--method",
                "greedy",
                "-o",
                "p.json",
            ],
            "fifo",
            "a FIFO",
        ),
        (
            &[
                "collab",
                "--trace",
                "good.safetensors",
                "--placement",
                "fifo",
            ],
            "fifo",
            "a FIFO",
        ),
        (
            &[
                "project",
                "--trace",
                "folder",
                "--hidden",
                "8",
                "--intermediate",
                "8",
            ],
            "folder",
            "a folder",
        ),
        (&["reproduce", "fifo", "--out", "r"], "fifo", "a FIFO"),
        (&["bench", "suite", "/dev/zero"], "/dev/zero", "a device"),
        (
            &["eval", "--model", "m", "--tasks", "t.toml"],
            "t.toml",
            "a FIFO",
        ),
    ];
    for (args, file, what) in cases {
        let err = occult_err(d, args);
        contains_all(&err, &[file, what]);
    }
    assert!(!d.join("p.json").exists() && !d.join("r").exists());
}

/// Silent garbage turned into named errors: a trace layer without tokens, a header that names
/// a tensor twice, a task name that would leave the output folder, and NaN logits.
#[test]
fn inputs_that_would_give_garbage_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_raw(
        &d.join("empty.safetensors"),
        vec![("layers.0.topk_ids", Raw::I32(vec![0, 2], vec![]))],
        &meta("4", "2"),
    );
    let err = occult_err(
        d,
        &["collab", "--trace", "empty.safetensors", "--devices", "2"],
    );
    contains_all(
        &err,
        &["empty.safetensors", "layers.0.topk_ids", "no tokens"],
    );
    // The same tensor named twice: safetensors itself keeps the last one silently.
    write_raw(
        &d.join("one.safetensors"),
        vec![("layers.0.topk_ids", Raw::I32(vec![1, 2], vec![0, 1]))],
        &meta("4", "2"),
    );
    let bytes = std::fs::read(d.join("one.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n])
        .unwrap()
        .trim_end()
        .to_string();
    let entry_at = header.find("\"layers.0.topk_ids\"").unwrap();
    let entry_end = entry_at + header[entry_at..].find('}').unwrap() + 1;
    let entry = &header[entry_at..entry_end];
    let twice = format!("{},{entry}}}", &header[..header.len() - 1]);
    let mut out = (twice.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(twice.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(d.join("twice.safetensors"), out).unwrap();
    let err = occult_err(
        d,
        &["collab", "--trace", "twice.safetensors", "--devices", "2"],
    );
    contains_all(&err, &["twice.safetensors", "layers.0.topk_ids", "twice"]);
    // A task whose name is a path.
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tasks/arc_easy.toml");
    let text = std::fs::read_to_string(shipped).unwrap();
    let renamed: Vec<String> = text
        .lines()
        .map(|l| {
            if l.starts_with("name =") {
                "name = \"../../escape\"".to_string()
            } else {
                l.to_string()
            }
        })
        .collect();
    std::fs::write(d.join("t.toml"), renamed.join("\n")).unwrap();
    let err = occult_err(d, &["eval", "--model", "m", "--tasks", "t.toml"]);
    contains_all(&err, &["t.toml", "../../escape"]);
    // NaN weights: generate names the fault instead of printing token 0.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/olmoe");
    std::fs::create_dir(d.join("nan")).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture.join(f), d.join("nan").join(f)).unwrap();
    }
    let path = d.join("nan/model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let (start, end) = {
        let (h, _) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let n = 8 + h;
        let meta: serde_json::Value = serde_json::from_slice(&bytes[8..n]).unwrap();
        let off = &meta["model.embed_tokens.weight"]["data_offsets"];
        (
            n + off[0].as_u64().unwrap() as usize,
            n + off[1].as_u64().unwrap() as usize,
        )
    };
    for c in bytes[start..end].chunks_mut(4) {
        c.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(&path, bytes).unwrap();
    let err = occult_err(
        d,
        &["generate", "--model", "nan", "--prompt", "hello world"],
    );
    contains_all(&err, &["not finite", "NaN"]);
    // A tokenizer.json cut short inside its decoder (found by fuzzing: the tokenizers crate
    // panics on it); the panic is contained and the file named.
    std::fs::create_dir(d.join("badtok")).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), d.join("badtok").join(f)).unwrap();
    }
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/malformed/tokenizer_cut_in_decoder.json"),
        d.join("badtok/tokenizer.json"),
    )
    .unwrap();
    let err = occult_err(d, &["generate", "--model", "badtok", "--prompt", "hi"]);
    contains_all(
        &err,
        &[
            "tokenizer.json",
            "not a readable tokenizer.json (the tokenizers crate stopped",
        ],
    );
    assert!(!err.contains("panicked"), "{err}");
    // profile says the model's routing is at fault, not the trace file.
    std::fs::write(d.join("calib.txt"), "hello world\n").unwrap();
    let err = occult_err(
        d,
        &[
            "profile",
            "--model",
            "nan",
            "--data",
            "calib.txt",
            "-o",
            "nan.safetensors",
        ],
    );
    contains_all(&err, &["routing at layer", "not finite"]);
    assert!(!d.join("nan.safetensors").exists());
}

/// `model synth` names empty and enormous sizes before creating anything, and a config.json
/// with an empty vocabulary is refused where it is read.
#[test]
fn model_sizes_are_checked_before_anything_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let synth = |extra: &[&str]| {
        let mut args = vec!["model", "synth", "--family", "olmoe", "-o", "m"];
        args.extend_from_slice(extra);
        occult_err(d, &args)
    };
    for (flags, needle) in [
        (&["--vocab", "0"][..], "--vocab must be at least 1"),
        (&["--layers", "0"][..], "--layers must be at least 1"),
        (&["--hidden", "0"][..], "--hidden must be at least 1"),
        (
            &["--hidden", "100", "--heads", "3"][..],
            "whole number of --heads",
        ),
        (
            &[
                "--hidden",
                "65536",
                "--experts",
                "256",
                "--intermediate",
                "65536",
            ][..],
            "limited to 8 GB",
        ),
    ] {
        let err = synth(flags);
        contains_all(&err, &[needle]);
        assert!(!d.join("m").exists(), "{flags:?} left a folder behind");
    }
    // bench layer: every buffer's size, with products that would overflow.
    for (flags, needle) in [
        (
            &[
                "--experts",
                "64",
                "--hidden",
                "65536",
                "--intermediate",
                "65536",
            ][..],
            "the experts' weights",
        ),
        (
            &["--tokens", "18446744073709551615"][..],
            "--tokens x --devices x --hidden",
        ),
    ] {
        let mut args = vec!["bench", "layer"];
        args.extend_from_slice(flags);
        contains_all(&occult_err(d, &args), &[needle, "too large"]);
    }
    occult_ok(d, &["model", "synth", "--family", "olmoe", "-o", "ok"]);
    let cfg = std::fs::read_to_string(d.join("ok/config.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    let mut v0 = v.clone();
    v0["vocab_size"] = 0.into();
    std::fs::write(d.join("ok/config.json"), v0.to_string()).unwrap();
    let err = occult_err(d, &["model", "info", "--model", "ok"]);
    contains_all(&err, &["config.json", "vocab_size", "at least 1"]);
}

/// `train --out` over its own model, and bench outputs onto their inputs, are refused first.
#[test]
fn training_and_bench_outputs_spare_their_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    good_trace(d);
    tiny_model(d, "m");
    std::fs::write(d.join("data.jsonl"), "{\"text\": \"a b c\"}\n").unwrap();
    let weights = std::fs::read(d.join("m/model.safetensors")).unwrap();
    for out in ["m", "m/sub", "./m/../m"] {
        let err = occult_err(
            d,
            &[
                "train",
                "--model",
                "m",
                "--data",
                "data.jsonl",
                "--out",
                out,
                "--steps",
                "1",
            ],
        );
        contains_all(&err, &["--out", "input model's folder"]);
    }
    assert_eq!(
        std::fs::read(d.join("m/model.safetensors")).unwrap(),
        weights
    );
    let err = occult_err(
        d,
        &[
            "bench",
            "place",
            "--trace",
            "good.safetensors",
            "--devices",
            "2",
            "--json",
            "good.safetensors",
        ],
    );
    contains_all(&err, &["good.safetensors", "destroy"]);
    let err = occult_err(
        d,
        &["bench", "model", "--model", "m", "--json", "m/bench.json"],
    );
    contains_all(&err, &["inside the input folder"]);
}

/// `prune` re-picks experts from the router logits, so a trace whose ids are not the logits'
/// top-k, best first, is refused with the layer and token.
#[test]
fn prune_refuses_ids_that_disagree_with_the_logits() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let logits = vec![0.0, 5.0, 1.0, -1.0, 0.0, 5.0, 1.0, -1.0];
    for (name, ids, needle) in [
        ("order", vec![1, 2, 2, 1], "token 1"),
        ("set", vec![1, 2, 1, 3], "not the top-2"),
    ] {
        let file = format!("{name}.safetensors");
        write_raw(
            &d.join(&file),
            vec![
                ("layers.0.topk_ids", Raw::I32(vec![2, 2], ids)),
                (
                    "layers.0.router_logits",
                    Raw::F32(vec![2, 4], logits.clone()),
                ),
            ],
            &meta("4", "2"),
        );
        let err = occult_err(
            d,
            &[
                "prune",
                "--trace",
                &file,
                "--devices",
                "2",
                "--max-devices",
                "1",
                "--rule",
                "router",
            ],
        );
        contains_all(&err, &[&file, "layer 0", needle]);
    }
    // The same logits with their own top-2, best first, prune.
    write_raw(
        &d.join("ok.safetensors"),
        vec![
            ("layers.0.topk_ids", Raw::I32(vec![2, 2], vec![1, 2, 1, 2])),
            ("layers.0.router_logits", Raw::F32(vec![2, 4], logits)),
        ],
        &meta("4", "2"),
    );
    occult_ok(
        d,
        &[
            "prune",
            "--trace",
            "ok.safetensors",
            "--devices",
            "2",
            "--max-devices",
            "1",
            "--rule",
            "router",
        ],
    );
}

/// Accepted absurdities now named: a DeepSeek config whose dense layers leave no MoE layer,
/// `--revision` on a folder, a window longer than the model's positions, no repeats, and a
/// trace recorded on other ranks given to `prune`.
#[test]
fn absurd_settings_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tiny_model(d, "m");
    occult_ok(
        d,
        &[
            "model",
            "synth",
            "--family",
            "deepseek",
            "--hidden",
            "32",
            "--experts",
            "4",
            "--top-k",
            "2",
            "--intermediate",
            "16",
            "--layers",
            "2",
            "-o",
            "ds",
        ],
    );
    let cfg = std::fs::read_to_string(d.join("ds/config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v["first_k_dense_replace"] = 5.into();
    std::fs::write(d.join("ds/config.json"), v.to_string()).unwrap();
    let err = occult_err(d, &["model", "info", "--model", "ds"]);
    contains_all(
        &err,
        &["ds/config.json", "dense", "not a mixture-of-experts"],
    );
    let err = occult_err(d, &["model", "info", "--model", "m", "--revision", "main"]);
    contains_all(&err, &["--revision", "is a folder"]);
    std::fs::write(d.join("calib.txt"), "one two three\n").unwrap();
    let err = occult_err(
        d,
        &[
            "profile",
            "--model",
            "m",
            "--data",
            "calib.txt",
            "-o",
            "t.safetensors",
            "--seq-len",
            "100000",
        ],
    );
    contains_all(&err, &["--seq-len 100000", "positions"]);
    assert!(!d.join("t.safetensors").exists());
    let err = occult_err(d, &["bench", "model", "--model", "m", "--repeats", "0"]);
    contains_all(&err, &["--repeats"]);
    // A trace recorded on 4 ranks, pruned for 2 devices.
    let mut md = meta("4", "2");
    md.push(("num_ranks", "4"));
    write_raw(
        &d.join("r4.safetensors"),
        vec![
            ("layers.0.topk_ids", Raw::I32(vec![1, 2], vec![1, 2])),
            (
                "layers.0.router_logits",
                Raw::F32(vec![1, 4], vec![0.0, 5.0, 1.0, -1.0]),
            ),
        ],
        &md,
    );
    let prune = [
        "prune",
        "--trace",
        "r4.safetensors",
        "--devices",
        "2",
        "--max-devices",
        "1",
        "--rule",
        "router",
    ];
    let err = occult_err(d, &prune);
    contains_all(&err, &["4 source rank", "--resplit"]);
    let mut ok = prune.to_vec();
    ok.push("--resplit");
    occult_ok(d, &ok);
}

/// `place` at the documented maximum of 4,096 experts finishes in bounded time (it used to run
/// for minutes: a full scan of every pair per swap). The trace is small; the experts are many.
#[test]
fn place_at_the_maximum_expert_count_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    occult_ok(
        d,
        &[
            "trace",
            "synth",
            "--experts",
            "4096",
            "--top-k",
            "8",
            "--layers",
            "1",
            "--tokens",
            "500",
            "-o",
            "t.safetensors",
        ],
    );
    let start = std::time::Instant::now();
    occult_ok(
        d,
        &[
            "place",
            "--trace",
            "t.safetensors",
            "--devices",
            "8",
            "-o",
            "p.json",
        ],
    );
    let took = start.elapsed();
    assert!(took.as_secs() < 120, "place took {took:?}");
    let p: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("p.json")).unwrap()).unwrap();
    assert_eq!(
        p["layers"][0]["device_of_expert"].as_array().unwrap().len(),
        4096
    );
}
