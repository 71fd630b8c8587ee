//! The standing adversarial suite (issue 14): hundreds of hostile inputs, generated here from a
//! few good ones, run against every command. Each run must end with exit status 1 or 2 and a
//! message naming the file (or flag) and the fault; no panic, no signal, no hang (a time
//! limit), no output written or replaced, and every input unchanged byte for byte. Before the
//! hostile runs, each command runs once on the good inputs and must succeed, so a failure is
//! the hostile input's doing. The counts per class are printed (`--nocapture`) and are the ones
//! `docs/robustness.md`'s "What a bad input gets" table gives.

mod common;
use common::occult_bin;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Longest a single run may take before it counts as a hang.
const TIME_LIMIT: Duration = Duration::from_secs(90);

/// Something a case puts in its folder before the run.
enum Item {
    File(String, Vec<u8>),
    Dir(String),
    Fifo(String),
    Symlink(String, String),
    /// A copy of a folder of the base inputs.
    CopyDir(String, String),
}

struct Case {
    class: &'static str,
    label: String,
    items: Vec<Item>,
    args: Vec<String>,
    /// Every one of these must appear in stderr (case-insensitive; `a|b` takes either).
    expect: Vec<String>,
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// The good inputs every case starts from, in `base/`.
struct Base {
    dir: PathBuf,
    trace: Vec<u8>,
    placement: serde_json::Value,
    config: serde_json::Value,
    weights: Vec<u8>,
}

fn run_ok(dir: &Path, args: &[&str]) {
    let out = Command::new(occult_bin())
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "good run `occult {}` failed:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn make_base(root: &Path) -> Base {
    let dir = root.join("base");
    std::fs::create_dir(&dir).unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/olmoe");
    std::fs::create_dir(dir.join("model")).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture.join(f), dir.join("model").join(f)).unwrap();
    }
    let text = "the cat sat on the mat and looked at the dog\n".repeat(4);
    std::fs::write(dir.join("calib.txt"), &text).unwrap();
    let rows: Vec<String> = (0..6)
        .map(|i| {
            serde_json::json!({"text": format!("the cat sat on the mat {i} times and the dog looked")})
                .to_string()
        })
        .collect();
    std::fs::write(dir.join("train.jsonl"), rows.join("\n") + "\n").unwrap();
    std::fs::write(dir.join("task.toml"), TASK).unwrap();
    std::fs::write(dir.join("task.jsonl"), TASK_DOCS).unwrap();
    run_ok(
        &dir,
        &[
            "profile",
            "--model",
            "model",
            "--data",
            "calib.txt",
            "-o",
            "trace.safetensors",
        ],
    );
    run_ok(
        &dir,
        &[
            "place",
            "--trace",
            "trace.safetensors",
            "--devices",
            "2",
            "-o",
            "place.json",
        ],
    );
    let read = |p: &str| std::fs::read(dir.join(p)).unwrap();
    Base {
        trace: read("trace.safetensors"),
        placement: serde_json::from_slice(&read("place.json")).unwrap(),
        config: serde_json::from_slice(&read("model/config.json")).unwrap(),
        weights: read("model/model.safetensors"),
        dir,
    }
}

const TASK: &str = r#"name = "tiny"
metrics = ["acc", "acc_norm"]

[data]
hub = "local/tiny"
eval_split = "test"

[prompt]
text = "Question: {question}\nAnswer:"
choices_field = "choices.text"
gold = { field = "answerKey", among = "choices.label" }
"#;

const TASK_DOCS: &str = r#"{"question": "what sat?", "choices": {"text": ["the cat", "the dog"], "label": ["A", "B"]}, "answerKey": "A"}
{"question": "where?", "choices": {"text": ["on the mat", "at the dog"], "label": ["A", "B"]}, "answerKey": "B"}
"#;

/// Splits a safetensors file into its header (JSON) and data.
fn split(bytes: &[u8]) -> (serde_json::Map<String, serde_json::Value>, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

fn join(header_json: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header_json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header_json);
    out.extend_from_slice(data);
    out
}

fn rejoin(header: &serde_json::Map<String, serde_json::Value>, data: &[u8]) -> Vec<u8> {
    join(&serde_json::to_vec(header).unwrap(), data)
}

/// One tensor of a file being rebuilt: dtype, shape, bytes.
type Owned = (safetensors::Dtype, Vec<usize>, Vec<u8>);
/// A file's tensors by name, and its metadata.
type Tensors = BTreeMap<String, Owned>;
type Metadata = std::collections::HashMap<String, String>;

/// Reads a safetensors file, lets `f` change its tensors and metadata, and writes a valid file
/// again (offsets and lengths consistent), so that only the intended fault is in it.
fn rebuild(good: &[u8], f: &dyn Fn(&mut Tensors, &mut Metadata)) -> Vec<u8> {
    let st = safetensors::SafeTensors::deserialize(good).unwrap();
    let (_, m) = safetensors::SafeTensors::read_metadata(good).unwrap();
    let mut meta = m.metadata().clone().unwrap_or_default();
    let mut tensors: Tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    f(&mut tensors, &mut meta);
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, (d, sh, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, sh.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, Some(meta)).unwrap()
}

/// A mutation of a safetensors file: its label, the bytes, and words its error must hold.
type Mutation = (String, Vec<u8>, Vec<String>);

/// Byte-level and header-level damage that any safetensors reader must refuse.
fn safetensors_damage(good: &[u8]) -> Vec<Mutation> {
    let (header, data) = split(good);
    let hlen = good.len() - data.len() - 8;
    let mut out: Vec<Mutation> = Vec::new();
    for (what, at) in [
        ("empty", 0),
        ("4 bytes", 4),
        ("length prefix only", 8),
        ("half the header", 8 + hlen / 2),
        ("header only", 8 + hlen),
        ("one byte short", good.len() - 1),
        ("half the data", 8 + hlen + data.len() / 2),
    ] {
        out.push((format!("truncated: {what}"), good[..at].to_vec(), vec![]));
    }
    for (what, n) in [
        ("huge", u64::MAX),
        ("zero", 0u64),
        ("past the end", good.len() as u64),
    ] {
        let mut b = good.to_vec();
        b[..8].copy_from_slice(&n.to_le_bytes());
        out.push((format!("header length {what}"), b, vec![]));
    }
    for (what, h) in [
        ("not JSON", b"this is not json".to_vec()),
        ("a JSON array", b"[1, 2, 3]".to_vec()),
        ("not UTF-8", vec![0xff, 0xfe, 0x7b, 0x7d]),
        ("JSON null", b"null".to_vec()),
    ] {
        out.push((format!("header {what}"), join(&h, &data), vec![]));
    }
    // Offsets and shapes that disagree with the data.
    let first = header
        .keys()
        .find(|k| *k != "__metadata__")
        .unwrap()
        .clone();
    for (what, f) in [
        (
            "offsets past the data",
            Box::new(|t: &mut serde_json::Value, n: usize| {
                t["data_offsets"] = serde_json::json!([0, n + 64]);
            }) as Box<dyn Fn(&mut serde_json::Value, usize)>,
        ),
        (
            "offsets reversed",
            Box::new(|t: &mut serde_json::Value, _| {
                let o = t["data_offsets"].clone();
                t["data_offsets"] = serde_json::json!([o[1], o[0]]);
            }),
        ),
        (
            "shape larger than its bytes",
            Box::new(|t: &mut serde_json::Value, _| {
                let mut sh = t["shape"].as_array().unwrap().clone();
                sh[0] = serde_json::json!(sh[0].as_u64().unwrap() * 3 + 1);
                t["shape"] = serde_json::Value::Array(sh);
            }),
        ),
        (
            "unknown dtype",
            Box::new(|t: &mut serde_json::Value, _| {
                t["dtype"] = serde_json::json!("Q4");
            }),
        ),
    ] {
        let mut h = header.clone();
        f(h.get_mut(&first).unwrap(), data.len());
        out.push((format!("{first}: {what}"), rejoin(&h, &data), vec![]));
    }
    // A tensor named twice (JSON allows it; safetensors forbids it).
    let text = String::from_utf8(serde_json::to_vec(&header).unwrap()).unwrap();
    let entry = format!(
        "\"{first}\":{}",
        serde_json::to_string(&header[&first]).unwrap()
    );
    let twice = text.replacen(&entry, &format!("{entry},{entry}"), 1);
    assert_ne!(twice, text);
    out.push((
        format!("{first} named twice"),
        join(twice.as_bytes(), &data),
        s(&["twice"]),
    ));
    out
}

/// Traces whose bytes are sound but whose content breaks the format's rules.
fn trace_content_faults(good: &[u8]) -> Vec<Mutation> {
    let (header, data) = split(good);
    let mut out: Vec<Mutation> = Vec::new();
    let meta = |f: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let mut h = header.clone();
        f(h.get_mut("__metadata__").unwrap().as_object_mut().unwrap());
        rejoin(&h, &data)
    };
    for (what, key, value, words) in [
        (
            "format of another kind",
            "format",
            Some("occult.placement.v1"),
            &["format"][..],
        ),
        ("format missing", "format", None, &["format"]),
        ("num_experts missing", "num_experts", None, &["num_experts"]),
        (
            "num_experts not a number",
            "num_experts",
            Some("eight"),
            &["num_experts"],
        ),
        (
            "num_experts zero",
            "num_experts",
            Some("0"),
            &["num_experts"],
        ),
        (
            "num_experts below the ids",
            "num_experts",
            Some("3"),
            &["out of range"],
        ),
        (
            "num_experts negative",
            "num_experts",
            Some("-8"),
            &["num_experts"],
        ),
        ("top_k missing", "top_k", None, &["top_k"]),
        ("top_k zero", "top_k", Some("0"), &["top_k"]),
        (
            "top_k other than the ids'",
            "top_k",
            Some("3"),
            &["expected [tokens, 3]"],
        ),
        ("top_k above num_experts", "top_k", Some("9"), &["top_k"]),
        ("num_ranks zero", "num_ranks", Some("0"), &["num_ranks"]),
        (
            "num_ranks not a number",
            "num_ranks",
            Some("x"),
            &["num_ranks"],
        ),
    ] {
        let b = meta(&|m| match value {
            Some(v) => {
                m.insert(key.into(), serde_json::json!(v));
            }
            None => {
                m.remove(key);
            }
        });
        out.push((what.to_string(), b, s(words)));
    }
    // Tensor-level faults, each on layer 0's ids or logits, in otherwise valid files.
    let ids = "layers.0.topk_ids";
    let logits = "layers.0.router_logits";
    let with_ids = |f: &dyn Fn(&mut Vec<i32>)| {
        rebuild(good, &|t, _| {
            let b = &mut t.get_mut(ids).unwrap().2;
            let mut v: Vec<i32> = b
                .chunks(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            f(&mut v);
            *b = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        })
    };
    out.push((
        "an id past num_experts".into(),
        with_ids(&|v| v[3] = 8),
        s(&["out of range"]),
    ));
    out.push((
        "a negative id".into(),
        with_ids(&|v| v[0] = -1),
        s(&["out of range"]),
    ));
    out.push((
        "an expert twice in one token".into(),
        with_ids(&|v| v[1] = v[0]),
        s(&["twice"]),
    ));
    let edit = |f: &dyn Fn(&mut BTreeMap<String, Owned>)| rebuild(good, &|t, _| f(t));
    out.push((
        "ids stored as F32".into(),
        edit(&|t| t.get_mut(ids).unwrap().0 = safetensors::Dtype::F32),
        s(&[ids]),
    ));
    out.push((
        "ids of rank 1".into(),
        edit(&|t| {
            let e = t.get_mut(ids).unwrap();
            e.1 = vec![e.1[0] * e.1[1]];
        }),
        s(&[ids]),
    ));
    out.push((
        "logits without ids".into(),
        edit(&|t| {
            t.remove(ids);
        }),
        s(&[ids]),
    ));
    out.push(("no layers".into(), edit(&|t| t.clear()), s(&["no layers"])));
    out.push((
        "a layer that is not a number".into(),
        edit(&|t| {
            let x = t.remove(ids).unwrap();
            t.insert("layers.x.topk_ids".into(), x);
        }),
        s(&["layers.x.topk_ids"]),
    ));
    out.push((
        "logits 7 wide".into(),
        edit(&|t| {
            let e = t.get_mut(logits).unwrap();
            let rows = e.1[0];
            e.1 = vec![rows, 7];
            e.2.truncate(rows * 7 * 4);
        }),
        s(&[logits]),
    ));
    for (what, x) in [
        ("a NaN logit", f32::NAN),
        ("an infinite logit", f32::INFINITY),
    ] {
        out.push((
            what.into(),
            edit(&|t| t.get_mut(logits).unwrap().2[..4].copy_from_slice(&x.to_le_bytes())),
            s(&["not finite"]),
        ));
    }
    out.push((
        "a layer with no tokens".into(),
        edit(&|t| {
            for (name, e) in t.iter_mut() {
                if name.starts_with("layers.0.") {
                    e.1[0] = 0;
                    e.2.clear();
                }
            }
        }),
        s(&["no tokens"]),
    ));
    out
}

/// Placements that are not valid for the base trace and model (8 experts, 3 layers).
fn placement_faults(good: &serde_json::Value) -> Vec<Mutation> {
    let mut out: Vec<Mutation> = Vec::new();
    let text = serde_json::to_vec_pretty(good).unwrap();
    out.push(("empty".into(), vec![], vec![]));
    out.push(("truncated".into(), text[..text.len() / 2].to_vec(), vec![]));
    out.push(("not JSON".into(), b"placement".to_vec(), vec![]));
    out.push(("a JSON array".into(), b"[0, 1]".to_vec(), vec![]));
    out.push(("not UTF-8".into(), vec![0xff, 0x00, 0x7b], vec![]));
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v = good.clone();
        f(&mut v);
        serde_json::to_vec(&v).unwrap()
    };
    let map0 = "/layers/0/device_of_expert";
    // Layer 0 in the replica form (format v2) with these slots.
    let replica_layer = |slots: serde_json::Value| {
        edit(&|v| {
            v["format"] = serde_json::json!("occult.placement.v2");
            v["layers"][0]["device_of_expert"] = serde_json::json!([]);
            v["layers"][0]["slots"] = slots.clone();
        })
    };
    for (what, b, words) in [
        (
            "format of another kind",
            edit(&|v| v["format"] = serde_json::json!("occult.trace.v1")),
            &["format"][..],
        ),
        (
            "num_devices zero",
            edit(&|v| v["num_devices"] = serde_json::json!(0)),
            &["device"],
        ),
        (
            "num_devices above num_experts",
            edit(&|v| v["num_devices"] = serde_json::json!(9)),
            &["device"],
        ),
        (
            "num_experts other than the trace's",
            edit(&|v| v["num_experts"] = serde_json::json!(16)),
            &["16"],
        ),
        (
            "a device id past num_devices",
            edit(&|v| *v.pointer_mut(map0).unwrap() = serde_json::json!([0, 0, 0, 0, 1, 1, 1, 2])),
            &["device"],
        ),
        (
            "a map too short",
            edit(&|v| *v.pointer_mut(map0).unwrap() = serde_json::json!([0, 0, 0, 1, 1, 1, 1])),
            &["7"],
        ),
        (
            "a map too long",
            edit(&|v| {
                *v.pointer_mut(map0).unwrap() = serde_json::json!([0, 0, 0, 0, 1, 1, 1, 1, 0])
            }),
            &["9"],
        ),
        (
            "a negative device",
            edit(&|v| *v.pointer_mut(map0).unwrap() = serde_json::json!([-1, 0, 0, 0, 1, 1, 1, 1])),
            &[],
        ),
        (
            "a device that is not a number",
            edit(&|v| {
                *v.pointer_mut(map0).unwrap() = serde_json::json!(["a", 0, 0, 0, 1, 1, 1, 1])
            }),
            &[],
        ),
        (
            "a device left empty",
            edit(&|v| *v.pointer_mut(map0).unwrap() = serde_json::json!([0, 0, 0, 0, 0, 0, 0, 0])),
            &["unbalanced"],
        ),
        (
            "a layer twice",
            edit(&|v| {
                let l = v["layers"][0].clone();
                v["layers"].as_array_mut().unwrap()[1] = l;
            }),
            &["layer 0"],
        ),
        // The replica form (format v2: a layer's E + R slots instead of its map).
        (
            "replica slots under the v1 format",
            edit(&|v| {
                v["layers"][0]["device_of_expert"] = serde_json::json!([]);
                v["layers"][0]["slots"] = serde_json::json!([0, 1, 2, 3, 4, 5, 6, 7, 0, 1]);
            }),
            &["v2"],
        ),
        (
            "replica slots that leave an expert out",
            replica_layer(serde_json::json!([0, 1, 2, 3, 0, 1, 2, 3, 4, 5])),
            &["no slot"],
        ),
        (
            "replica slots that do not fill the devices evenly",
            replica_layer(serde_json::json!([0, 1, 2, 3, 4, 5, 6, 7, 0])),
            &["evenly"],
        ),
        (
            "a replica slot past the experts",
            replica_layer(serde_json::json!([0, 1, 2, 3, 4, 5, 6, 7, 99, 1])),
            &["99"],
        ),
        (
            "expert loads of the wrong length beside replica slots",
            edit(&|v| {
                v["format"] = serde_json::json!("occult.placement.v2");
                v["layers"][0]["device_of_expert"] = serde_json::json!([]);
                v["layers"][0]["slots"] = serde_json::json!([0, 1, 2, 3, 4, 5, 6, 7, 0, 1]);
                v["layers"][0]["expert_load"] = serde_json::json!([1.0, 2.0]);
            }),
            &["expert loads"],
        ),
        (
            "a negative expert load beside replica slots",
            edit(&|v| {
                v["format"] = serde_json::json!("occult.placement.v2");
                v["layers"][0]["device_of_expert"] = serde_json::json!([]);
                v["layers"][0]["slots"] = serde_json::json!([0, 1, 2, 3, 4, 5, 6, 7, 0, 1]);
                v["layers"][0]["expert_load"] =
                    serde_json::json!([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, -8.0]);
            }),
            &["expert loads"],
        ),
        (
            "expert loads on a layer without replicas",
            edit(&|v| {
                v["layers"][0]["expert_load"] =
                    serde_json::json!([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
            }),
            &["expert_load"],
        ),
        (
            "a layer with both a map and replica slots",
            edit(&|v| {
                v["format"] = serde_json::json!("occult.placement.v2");
                v["layers"][0]["slots"] = serde_json::json!([0, 1, 2, 3, 4, 5, 6, 7, 0, 1]);
            }),
            &["device_of_expert"],
        ),
        (
            "no layers",
            edit(&|v| v["layers"] = serde_json::json!([])),
            &["layer"],
        ),
    ] {
        out.push((what.to_string(), b, s(words)));
    }
    out
}

/// config.json faults of the base model.
fn config_faults(good: &serde_json::Value) -> Vec<Mutation> {
    let mut out: Vec<Mutation> = Vec::new();
    let text = serde_json::to_vec_pretty(good).unwrap();
    out.push(("empty".into(), vec![], vec![]));
    out.push(("truncated".into(), text[..text.len() / 2].to_vec(), vec![]));
    out.push(("not an object".into(), b"[]".to_vec(), vec![]));
    let edit = |key: &str, value: Option<serde_json::Value>| {
        let mut v = good.clone();
        match value {
            Some(x) => v[key] = x,
            None => {
                v.as_object_mut().unwrap().remove(key);
            }
        }
        serde_json::to_vec(&v).unwrap()
    };
    use serde_json::json;
    for (key, value) in [
        ("model_type", Some(json!("gpt2"))),
        ("model_type", None),
        ("hidden_size", None),
        ("hidden_size", Some(json!(0))),
        ("hidden_size", Some(json!(63))),
        ("hidden_size", Some(json!("64"))),
        ("hidden_size", Some(json!(-64))),
        ("num_hidden_layers", Some(json!(0))),
        ("num_hidden_layers", Some(json!(4))),
        ("num_attention_heads", Some(json!(0))),
        ("num_attention_heads", Some(json!(5))),
        ("num_key_value_heads", Some(json!(3))),
        ("num_experts", Some(json!(0))),
        ("num_experts", Some(json!(4))),
        ("num_experts_per_tok", Some(json!(0))),
        ("num_experts_per_tok", Some(json!(9))),
        ("vocab_size", Some(json!(0))),
        ("vocab_size", Some(json!(100))),
        ("intermediate_size", Some(json!(17))),
        ("max_position_embeddings", Some(json!(0))),
        ("rms_norm_eps", Some(json!(-1.0))),
        ("rope_theta", Some(json!(0.0))),
    ] {
        let what = match &value {
            Some(v) => format!("{key} = {v}"),
            None => format!("{key} missing"),
        };
        // What a message may call the field instead of its key.
        let also = match key {
            "hidden_size" => "|head_dim",
            "num_hidden_layers" => "|model.layers.3",
            "num_attention_heads" => "|attention heads",
            "num_key_value_heads" => "|key/value heads",
            "num_experts" => "|experts",
            "num_experts_per_tok" => "|top_k",
            "vocab_size" => "|vocabulary|embed_tokens",
            "intermediate_size" => "|expected [17",
            _ => "",
        };
        out.push((what, edit(key, value), vec![format!("{key}{also}")]));
    }
    out
}

/// Weight-file faults of the base model (beyond byte-level damage), in valid files.
fn weight_faults(good: &[u8]) -> Vec<Mutation> {
    let mut out: Vec<Mutation> = Vec::new();
    for name in [
        "model.embed_tokens.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.2.mlp.experts.7.down_proj.weight",
        "lm_head.weight",
    ] {
        let b = rebuild(good, &|t, _| {
            assert!(t.remove(name).is_some(), "{name}");
        });
        out.push((format!("{name} missing"), b, s(&[name])));
    }
    for name in [
        "model.layers.0.mlp.experts.3.up_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ] {
        let b = rebuild(good, &|t, _| {
            let e = t.get_mut(name).unwrap();
            assert_ne!(e.1[0], e.1[1], "{name} is square");
            e.1.reverse();
        });
        out.push((format!("{name} transposed"), b, s(&[name])));
    }
    let b = rebuild(good, &|t, _| {
        let e = t.get_mut("model.norm.weight").unwrap();
        e.0 = safetensors::Dtype::I32;
    });
    out.push((
        "model.norm.weight stored as I32".into(),
        b,
        s(&["model.norm.weight"]),
    ));
    out
}

/// Task-file faults.
fn task_faults() -> Vec<Mutation> {
    let mut out: Vec<Mutation> = Vec::new();
    let edit = |from: &str, to: &str| {
        assert!(TASK.contains(from), "{from}");
        TASK.replacen(from, to, 1).into_bytes()
    };
    for (what, b, words) in [
        ("empty", vec![], &[][..]),
        ("not TOML", b"name = \n[[[".to_vec(), &[]),
        ("not UTF-8", vec![0xff, 0xfe], &[]),
        (
            "a name with ..",
            edit("\"tiny\"", "\"../escape\""),
            &["../escape"],
        ),
        ("a name with a slash", edit("\"tiny\"", "\"a/b\""), &["a/b"]),
        ("an empty name", edit("\"tiny\"", "\"\""), &["name"]),
        (
            "no metrics",
            edit("[\"acc\", \"acc_norm\"]", "[]"),
            &["metrics"],
        ),
        (
            "an unknown metric",
            edit("\"acc_norm\"", "\"bleu\""),
            &["bleu"],
        ),
        ("no prompt", edit("[prompt]", "[prompt_]"), &["prompt"]),
        (
            "choices twice",
            edit(
                "choices_field = \"choices.text\"",
                "choices_field = \"choices.text\"\nchoices = [\"a\"]",
            ),
            &["choices"],
        ),
        (
            "no choices",
            edit("choices_field = \"choices.text\"", ""),
            &["choices"],
        ),
        (
            "an unknown key",
            edit("[prompt]", "[prompt]\nchoises = 1"),
            &["choises"],
        ),
        (
            "an unknown preprocess",
            edit("[prompt]", "[prompt]\npreprocess = \"nope\""),
            &["nope"],
        ),
        (
            "a template never closed",
            edit("{question}", "{question"),
            &["question"],
        ),
        (
            "a gold index past the choices",
            edit(
                "gold = { field = \"answerKey\", among = \"choices.label\" }",
                "gold = { index = 5 }",
            ),
            &["5"],
        ),
        (
            "gold labels not one per choice",
            edit("among = \"choices.label\"", "among = [\"A\", \"B\", \"C\"]"),
            &["labels"],
        ),
        ("a missing field", edit("{question}", "{query}"), &["query"]),
    ] {
        out.push((what.to_string(), b, s(words)));
    }
    out
}

/// Task-data faults (the documents of the base task).
fn task_data_faults() -> Vec<Mutation> {
    let mut out: Vec<Mutation> = Vec::new();
    let line2 = TASK_DOCS.lines().nth(1).unwrap();
    for (what, text, words) in [
        ("empty", String::new(), &[][..]),
        (
            "a line that is not JSON",
            format!("{line2}\nnot json\n"),
            &["line 2"],
        ),
        (
            "a document that is not an object",
            format!("{line2}\n[1]\n"),
            &["document 1"],
        ),
        (
            "a gold label not among the labels",
            line2.replace("\"answerKey\": \"B\"", "\"answerKey\": \"C\""),
            &["\"C\""],
        ),
        (
            "no gold",
            line2.replace(", \"answerKey\": \"B\"", ""),
            &["answerKey"],
        ),
        (
            "labels and texts of different lengths",
            line2.replace("[\"A\", \"B\"]", "[\"A\", \"B\", \"C\"]"),
            &["labels"],
        ),
        (
            "choices that are not a list",
            line2.replace("[\"on the mat\", \"at the dog\"]", "\"on the mat\""),
            &["choices.text"],
        ),
        (
            "a truncated line",
            line2[..line2.len() / 2].to_string(),
            &[],
        ),
    ] {
        out.push((what.to_string(), text.into_bytes(), s(words)));
    }
    out
}

/// Commands that read a trace, with `T` standing for it (outputs in the case folder).
fn trace_commands() -> Vec<Vec<&'static str>> {
    vec![
        vec!["trace", "info", "T"],
        vec!["collab", "--trace", "T", "--devices", "2"],
        vec!["place", "--trace", "T", "--devices", "2", "-o", "out.json"],
        vec![
            "prune",
            "--trace",
            "T",
            "--devices",
            "2",
            "--max-devices",
            "1",
            "--rule",
            "router",
            "-o",
            "out.safetensors",
        ],
        vec!["bench", "place", "--trace", "T", "--devices", "2"],
        vec![
            "project",
            "--trace",
            "T",
            "--hidden",
            "64",
            "--intermediate",
            "16",
            "--devices",
            "2",
            "--tokens-per-device",
            "64",
        ],
    ]
}

/// Commands that read a placement `P`.
fn placement_commands() -> Vec<Vec<&'static str>> {
    vec![
        vec![
            "collab",
            "--trace",
            "../base/trace.safetensors",
            "--placement",
            "P",
        ],
        vec![
            "prune",
            "--trace",
            "../base/trace.safetensors",
            "--placement",
            "P",
            "--max-devices",
            "1",
            "--rule",
            "router",
            "-o",
            "out.safetensors",
        ],
        vec![
            "model",
            "check",
            "--model",
            "../base/model",
            "--devices",
            "2",
            "--placement",
            "P",
        ],
        vec![
            "export",
            "checkpoint",
            "--model",
            "../base/model",
            "--placement",
            "P",
            "-o",
            "exported",
        ],
    ]
}

/// Commands that read a model folder `M`, each with its output if it has one.
fn model_commands() -> Vec<Vec<&'static str>> {
    vec![
        vec!["model", "info", "--model", "M"],
        vec![
            "generate",
            "--model",
            "M",
            "--prompt",
            "the cat",
            "--max-new-tokens",
            "2",
        ],
        vec![
            "loglik",
            "--model",
            "M",
            "--context",
            "the cat",
            "--continuation",
            " sat",
        ],
        vec!["loss", "--model", "M", "--data", "../base/train.jsonl"],
        vec![
            "profile",
            "--model",
            "M",
            "--data",
            "../base/calib.txt",
            "-o",
            "out.safetensors",
        ],
        vec![
            "eval",
            "--model",
            "M",
            "--tasks",
            "../base/task.toml",
            "--data",
            "tiny=../base/task.jsonl",
            "--output",
            "out.json",
        ],
        vec![
            "train",
            "--model",
            "M",
            "--data",
            "../base/train.jsonl",
            "--out",
            "tuned",
            "--steps",
            "1",
            "--seq-len",
            "64",
        ],
        vec![
            "bench",
            "model",
            "--model",
            "M",
            "--prompt-len",
            "8",
            "--batch",
            "1",
        ],
    ]
}

/// Commands with every input flag that names a file, the flag's good value, and outputs.
fn file_inputs() -> Vec<(Vec<&'static str>, &'static str)> {
    // (command with X for the input under test, the flag or position named in errors)
    vec![
        (vec!["trace", "info", "X"], "X"),
        (vec!["collab", "--trace", "X", "--devices", "2"], "X"),
        (
            vec![
                "collab",
                "--trace",
                "../base/trace.safetensors",
                "--placement",
                "X",
            ],
            "X",
        ),
        (
            vec!["place", "--trace", "X", "--devices", "2", "-o", "out.json"],
            "X",
        ),
        (
            vec![
                "prune",
                "--trace",
                "X",
                "--devices",
                "2",
                "--max-devices",
                "1",
                "--rule",
                "router",
                "-o",
                "out.safetensors",
            ],
            "X",
        ),
        (
            vec![
                "prune",
                "--trace",
                "../base/trace.safetensors",
                "--devices",
                "2",
                "--max-devices",
                "1",
                "--rule",
                "similarity",
                "--calibration",
                "X",
                "-o",
                "out.safetensors",
            ],
            "X",
        ),
        (
            vec!["bench", "place", "--trace", "X", "--devices", "2"],
            "X",
        ),
        (
            vec![
                "project",
                "--trace",
                "X",
                "--hidden",
                "64",
                "--intermediate",
                "16",
            ],
            "X",
        ),
        (
            vec![
                "profile",
                "--model",
                "../base/model",
                "--data",
                "X",
                "-o",
                "out.safetensors",
            ],
            "X",
        ),
        (vec!["loss", "--model", "../base/model", "--data", "X"], "X"),
        (
            vec![
                "train",
                "--model",
                "../base/model",
                "--data",
                "X",
                "--out",
                "tuned",
                "--steps",
                "1",
            ],
            "X",
        ),
        (
            vec!["eval", "--model", "../base/model", "--tasks", "X"],
            "X",
        ),
        (
            vec![
                "eval",
                "--model",
                "../base/model",
                "--tasks",
                "../base/task.toml",
                "--data",
                "tiny=X",
            ],
            "X",
        ),
        (
            vec![
                "model",
                "check",
                "--model",
                "../base/model",
                "--devices",
                "2",
                "--placement",
                "X",
            ],
            "X",
        ),
    ]
}

/// Commands that write, with `O` for the output under test.
fn output_commands() -> Vec<Vec<&'static str>> {
    vec![
        vec![
            "trace",
            "synth",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--layers",
            "1",
            "--tokens",
            "20",
            "-o",
            "O",
        ],
        vec![
            "place",
            "--trace",
            "../base/trace.safetensors",
            "--devices",
            "2",
            "-o",
            "O",
        ],
        vec![
            "prune",
            "--trace",
            "../base/trace.safetensors",
            "--devices",
            "2",
            "--max-devices",
            "1",
            "--rule",
            "router",
            "-o",
            "O",
        ],
        vec![
            "collab",
            "--trace",
            "../base/trace.safetensors",
            "--devices",
            "2",
            "--json",
            "O",
        ],
        vec![
            "profile",
            "--model",
            "../base/model",
            "--data",
            "../base/calib.txt",
            "-o",
            "O",
        ],
        vec![
            "eval",
            "--model",
            "../base/model",
            "--tasks",
            "../base/task.toml",
            "--data",
            "tiny=../base/task.jsonl",
            "--output",
            "O",
        ],
        vec![
            "bench",
            "place",
            "--trace",
            "../base/trace.safetensors",
            "--devices",
            "2",
            "--json",
            "O",
        ],
        vec![
            "model",
            "synth",
            "--family",
            "olmoe",
            "--hidden",
            "32",
            "--experts",
            "4",
            "--intermediate",
            "16",
            "-o",
            "O",
        ],
    ]
}

/// `base` followed by `more`.
fn with(base: &[&'static str], more: &[&'static str]) -> Vec<&'static str> {
    base.iter().chain(more).copied().collect()
}

/// Flags with values no run can honour, per command, and a word the error must hold.
fn flag_faults() -> Vec<(Vec<&'static str>, &'static str)> {
    let t = "../base/trace.safetensors";
    let m = "../base/model";
    let g = |more: &[&'static str]| with(&["generate", "--model", m, "--prompt", "the cat"], more);
    let tr = |more: &[&'static str]| {
        with(
            &[
                "train",
                "--model",
                m,
                "--data",
                "../base/train.jsonl",
                "--out",
                "tuned",
            ],
            more,
        )
    };
    let synth =
        |more: &[&'static str]| with(&["model", "synth", "--family", "olmoe", "-o", "out"], more);
    let ts = |more: &[&'static str]| with(&["trace", "synth", "-o", "out.safetensors"], more);
    let pr = |more: &[&'static str]| {
        with(
            &[
                "prune",
                "--trace",
                t,
                "--devices",
                "2",
                "--rule",
                "router",
                "-o",
                "out.safetensors",
            ],
            more,
        )
    };
    let pl = |more: &[&'static str]| with(&["place", "--trace", t, "-o", "out.json"], more);
    let pj = |more: &[&'static str]| {
        with(
            &[
                "project",
                "--trace",
                t,
                "--hidden",
                "64",
                "--intermediate",
                "16",
            ],
            more,
        )
    };
    let ev = |more: &[&'static str]| {
        with(
            &[
                "eval",
                "--model",
                m,
                "--tasks",
                "../base/task.toml",
                "--data",
                "tiny=../base/task.jsonl",
            ],
            more,
        )
    };
    vec![
        (vec!["collab", "--trace", t, "--devices", "0"], "devices"),
        (vec!["collab", "--trace", t, "--devices", "9"], "9"),
        (vec!["collab", "--trace", t, "--devices=-1"], "--devices"),
        (
            vec!["collab", "--trace", t, "--devices", "two"],
            "--devices",
        ),
        (pl(&["--devices", "0"]), "devices"),
        (pl(&["--devices", "9"]), "9"),
        (pl(&["--devices", "2", "--max-load-factor", "0.5"]), "load"),
        (pl(&["--devices", "2", "--max-load-factor", "NaN"]), "load"),
        (pl(&["--devices", "2", "--restarts", "100000"]), "restarts"),
        (pl(&["--devices", "2", "--method", "best"]), "--method"),
        (pr(&["--max-devices", "0"]), "max-devices"),
        (
            pr(&["--max-devices", "1", "--scaling-factor", "inf"]),
            "scaling",
        ),
        (pr(&["--max-devices", "1", "--num-groups", "3"]), "group"),
        (ts(&["--experts", "0"]), "experts"),
        (ts(&["--top-k", "0"]), "top"),
        (ts(&["--experts", "8", "--top-k", "9"]), "top"),
        (ts(&["--experts", "100000"]), "experts"),
        (ts(&["--tokens", "0"]), "tokens"),
        (ts(&["--layers", "0"]), "layers"),
        (ts(&["--tokens", "18446744073709551615"]), "tokens"),
        (ts(&["--strength", "NaN"]), "strength"),
        (ts(&["--skew=-1"]), "skew"),
        (ts(&["--clusters", "0"]), "clusters"),
        (synth(&["--vocab", "0"]), "vocab"),
        (synth(&["--hidden", "0"]), "hidden"),
        (synth(&["--layers", "0"]), "layers"),
        (synth(&["--heads", "3"]), "heads"),
        (synth(&["--experts", "1000000"]), "experts"),
        (synth(&["--hidden", "1048576"]), "GB"),
        (synth(&["--top-k", "9"]), "top"),
        (
            vec!["model", "synth", "--family", "gpt2", "-o", "out"],
            "gpt2",
        ),
        (
            vec![
                "model",
                "synth",
                "--family",
                "mixtral",
                "--shared-intermediate",
                "64",
                "-o",
                "out",
            ],
            "shared",
        ),
        (synth(&["--dense-layers", "1"]), "dense"),
        (
            vec![
                "model",
                "synth",
                "--family",
                "deepseek",
                "--dense-intermediate",
                "64",
                "-o",
                "out",
            ],
            "dense",
        ),
        (
            vec![
                "model",
                "synth",
                "--family",
                "deepseek",
                "--dense-layers",
                "2",
                "-o",
                "out",
            ],
            "MoE",
        ),
        (synth(&["--dtype", "f8"]), "f8"),
        (vec!["bench", "layer", "--experts", "0"], "experts"),
        (vec!["bench", "layer", "--tokens", "0"], "tokens"),
        (vec!["bench", "layer", "--hidden", "4000000000"], "hidden"),
        (
            vec![
                "bench",
                "layer",
                "--experts",
                "4096",
                "--intermediate",
                "1000000",
            ],
            "intermediate",
        ),
        (vec!["bench", "layer", "--devices", "0"], "devices"),
        (vec!["bench", "layer", "--steps", "0"], "steps"),
        (g(&["--temperature", "NaN"]), "temperature"),
        (g(&["--temperature=-1"]), "temperature"),
        (g(&["--devices", "0"]), "devices"),
        (g(&["--devices", "9"]), "9"),
        (g(&["--dtype", "f64"]), "f64"),
        (g(&["--comm-timeout", "NaN"]), "timeout"),
        (g(&["--comm-timeout=-1"]), "timeout"),
        (g(&["--max-devices", "2"]), "max-devices"),
        (g(&["--revision", "main"]), "revision"),
        (
            vec![
                "loss",
                "--model",
                m,
                "--data",
                "../base/train.jsonl",
                "--seq-len",
                "0",
            ],
            "seq-len",
        ),
        (
            vec![
                "loss",
                "--model",
                m,
                "--data",
                "../base/train.jsonl",
                "--batch-size",
                "0",
            ],
            "batch",
        ),
        (
            vec![
                "profile",
                "--model",
                m,
                "--data",
                "../base/calib.txt",
                "--seq-len",
                "100000",
                "-o",
                "out.safetensors",
            ],
            "seq-len",
        ),
        (
            vec![
                "profile",
                "--model",
                m,
                "--data",
                "../base/calib.txt",
                "--seq-len",
                "0",
                "-o",
                "out.safetensors",
            ],
            "seq-len",
        ),
        (ev(&["--batch-size", "0"]), "batch"),
        (ev(&["--data", "other=../base/task.jsonl"]), "other"),
        (
            vec![
                "eval",
                "--model",
                m,
                "--tasks",
                "../base/task.toml",
                "--data",
                "../base/task.jsonl",
            ],
            "TASK=PATH",
        ),
        (
            vec!["eval", "--model", m, "--tasks", "nosuchtask"],
            "nosuchtask",
        ),
        (ev(&["--num-fewshot", "1000000"]), "few"),
        (tr(&["--steps", "0"]), "step"),
        (tr(&["--lr", "NaN"]), "learning rate"),
        (tr(&["--lr=-1"]), "learning rate"),
        (tr(&["--batch-size", "0"]), "batch"),
        (tr(&["--grad-accum", "0"]), "grad-accum"),
        (tr(&["--max-grad-norm=-1"]), "grad"),
        (tr(&["--min-lr-ratio", "2"]), "learning-rate ratio"),
        (tr(&["--resume"]), "resume"),
        (
            vec!["bench", "model", "--model", m, "--repeats", "0"],
            "repeats",
        ),
        (
            vec!["bench", "model", "--model", m, "--prompt-len", "0"],
            "prompt-len",
        ),
        (
            vec!["bench", "model", "--model", m, "--batch", "0"],
            "batch",
        ),
        (
            vec!["bench", "model", "--model", m, "--prompt-len", "1000000"],
            "positions",
        ),
        (pj(&["--hidden", "0"]), "hidden"),
        (pj(&["--link", "warp"]), "warp"),
        (pj(&["--devices", "0"]), "device"),
        (pj(&["--tokens-per-device", "0"]), "tokens"),
        (vec!["project", "--trace", t], "hidden"),
        (
            vec!["bench", "place", "--trace", t, "--devices", "0"],
            "devices",
        ),
        (vec!["reproduce", "nosuch.toml"], "nosuch.toml"),
    ]
}

fn build_cases(base: &Base) -> Vec<Case> {
    let mut cases = Vec::new();
    let sub = |cmd: &[&str], from: &str, to: &str| -> Vec<String> {
        cmd.iter()
            .map(|a| {
                if *a == from {
                    to.to_string()
                } else if let Some(rest) = a.strip_prefix("tiny=") {
                    if rest == from {
                        format!("tiny={to}")
                    } else {
                        a.to_string()
                    }
                } else {
                    a.to_string()
                }
            })
            .collect()
    };
    // Traces: damaged bytes and broken content, through every command that reads one.
    let mut traces = safetensors_damage(&base.trace);
    traces.extend(trace_content_faults(&base.trace));
    for (label, bytes, words) in &traces {
        for cmd in trace_commands() {
            let mut expect = vec!["t.safetensors".to_string()];
            expect.extend(words.iter().cloned());
            cases.push(Case {
                class: "trace file",
                label: format!("{label} | {}", cmd[..2].join(" ")),
                items: vec![Item::File("t.safetensors".into(), bytes.clone())],
                args: sub(&cmd, "T", "t.safetensors"),
                expect,
            });
        }
    }
    // Traces other commands may read but `prune` must not trust: ids that disagree with the
    // logits, or tokens recorded on other ranks.
    let ids_of = |t: &Tensors| -> Vec<i32> {
        t["layers.0.topk_ids"]
            .2
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let set_ids = |t: &mut Tensors, v: &[i32]| {
        t.get_mut("layers.0.topk_ids").unwrap().2 =
            v.iter().flat_map(|x| x.to_le_bytes()).collect();
    };
    let prune_faults: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "ids not best first",
            rebuild(&base.trace, &|t, _| {
                let mut v = ids_of(t);
                v.swap(0, 1);
                set_ids(t, &v);
            }),
            "layer 0",
        ),
        (
            "ids not the logits' top-k",
            rebuild(&base.trace, &|t, _| {
                let mut v = ids_of(t);
                // An expert outside the token's top-2 (neither of its two ids).
                v[1] = (0..8).find(|x| *x != v[0] && *x != v[1]).unwrap();
                set_ids(t, &v);
            }),
            "layer 0",
        ),
        (
            "recorded on 4 ranks",
            rebuild(&base.trace, &|_, m| {
                m.insert("num_ranks".into(), "4".into());
            }),
            "--resplit",
        ),
    ];
    for (label, bytes, word) in prune_faults {
        cases.push(Case {
            class: "trace file",
            label: format!("{label} | prune"),
            items: vec![Item::File("t.safetensors".into(), bytes)],
            args: s(&[
                "prune",
                "--trace",
                "t.safetensors",
                "--devices",
                "2",
                "--max-devices",
                "1",
                "--rule",
                "router",
                "-o",
                "out.safetensors",
            ]),
            expect: s(&["t.safetensors", word]),
        });
    }
    // A second output that cannot be written is found before the first is written.
    for (cmd, second) in [
        (
            vec![
                "prune",
                "--trace",
                "../base/trace.safetensors",
                "--devices",
                "2",
                "--max-devices",
                "1",
                "--rule",
                "router",
                "-o",
                "out.safetensors",
                "--json",
                "O",
            ],
            "--json",
        ),
        (
            vec![
                "eval",
                "--model",
                "../base/model",
                "--tasks",
                "../base/task.toml",
                "--data",
                "tiny=../base/task.jsonl",
                "--output",
                "out.json",
                "--trace",
                "O",
            ],
            "--trace",
        ),
    ] {
        cases.push(Case {
            class: "output location",
            label: format!("second output {second} in a missing folder | {}", cmd[0]),
            items: vec![],
            args: sub(&cmd, "O", "no/such/x"),
            expect: s(&["no/such"]),
        });
    }
    for (label, bytes, words) in placement_faults(&base.placement) {
        for cmd in placement_commands() {
            let mut expect = vec!["p.json".to_string()];
            expect.extend(words.iter().cloned());
            cases.push(Case {
                class: "placement file",
                label: format!("{label} | {}", cmd[..2].join(" ")),
                items: vec![Item::File("p.json".into(), bytes.clone())],
                args: sub(&cmd, "P", "p.json"),
                expect,
            });
        }
    }
    // Model folders: config.json, weights (damaged bytes and wrong tensors), tokenizer.
    let mut models: Vec<(&str, String, Vec<u8>, Vec<String>)> = Vec::new();
    for (label, b, w) in config_faults(&base.config) {
        models.push(("config.json", label, b, w));
    }
    for (label, b, w) in safetensors_damage(&base.weights)
        .into_iter()
        .chain(weight_faults(&base.weights))
    {
        models.push(("model.safetensors", label, b, w));
    }
    for (label, b) in [
        ("empty", vec![]),
        ("not JSON", b"tokenizer".to_vec()),
        ("an empty object", b"{}".to_vec()),
    ] {
        models.push(("tokenizer.json", label.into(), b, vec![]));
    }
    let cmds = model_commands();
    for (i, (file, label, bytes, words)) in models.iter().enumerate() {
        // Every fault through two commands, taking turns, and config faults through all.
        let chosen: Vec<&Vec<&str>> = if *file == "config.json" && i % 3 == 0 {
            cmds.iter().collect()
        } else {
            vec![&cmds[i % cmds.len()], &cmds[(i + 3) % cmds.len()]]
        };
        for cmd in chosen {
            // The folder (the fault may show where its files disagree) and the words.
            let mut expect = vec![format!("m/{file}|model m")];
            expect.extend(words.iter().cloned());
            cases.push(Case {
                class: "model folder",
                label: format!("{file}: {label} | {}", cmd[..2].join(" ")),
                items: vec![
                    Item::CopyDir("model".into(), "m".into()),
                    Item::File(format!("m/{file}"), bytes.clone()),
                ],
                args: sub(cmd, "M", "m"),
                expect,
            });
        }
    }
    // NaN weights: every model command names non-finite values instead of scoring garbage.
    let nan_weights = {
        let (header, mut data) = split(&base.weights);
        let o = &header["model.embed_tokens.weight"]["data_offsets"];
        let (a, b) = (
            o[0].as_u64().unwrap() as usize,
            o[1].as_u64().unwrap() as usize,
        );
        for c in data[a..b].chunks_mut(4) {
            c.copy_from_slice(&f32::NAN.to_le_bytes());
        }
        rejoin(&header, &data)
    };
    for cmd in model_commands() {
        if cmd[0] == "model" || cmd[0] == "bench" {
            continue; // `model info` reads no weights; `bench model` times, it scores nothing
        }
        cases.push(Case {
            class: "non-finite model outputs",
            label: format!("NaN embeddings | {}", cmd[..2].join(" ")),
            items: vec![
                Item::CopyDir("model".into(), "m".into()),
                Item::File("m/model.safetensors".into(), nan_weights.clone()),
            ],
            args: sub(&cmd, "M", "m"),
            expect: s(&["finite"]),
        });
    }
    for (label, bytes, words) in task_faults() {
        let mut expect = vec!["t.toml".to_string()];
        expect.extend(words.iter().cloned());
        cases.push(Case {
            class: "task file or data",
            label: format!("task file: {label}"),
            items: vec![Item::File("t.toml".into(), bytes)],
            args: s(&[
                "eval",
                "--model",
                "../base/model",
                "--tasks",
                "t.toml",
                "--data",
                "tiny=../base/task.jsonl",
                "--output",
                "out.json",
            ]),
            expect,
        });
    }
    for (label, bytes, words) in task_data_faults() {
        let mut expect = vec!["d.jsonl".to_string()];
        expect.extend(words.iter().cloned());
        cases.push(Case {
            class: "task file or data",
            label: format!("task data: {label}"),
            items: vec![Item::File("d.jsonl".into(), bytes)],
            args: s(&[
                "eval",
                "--model",
                "../base/model",
                "--tasks",
                "../base/task.toml",
                "--data",
                "tiny=d.jsonl",
                "--output",
                "out.json",
            ]),
            expect,
        });
    }
    // Inputs that are not regular files, or not there.
    for (cmd, _) in file_inputs() {
        for (what, item) in [
            ("/dev/zero", None),
            ("a FIFO", Some(Item::Fifo("x".into()))),
            ("a folder", Some(Item::Dir("x".into()))),
            ("missing", None),
            (
                "a link to /dev/zero",
                Some(Item::Symlink("x".into(), "/dev/zero".into())),
            ),
        ] {
            let (arg, items) = match (what, item) {
                ("/dev/zero", _) => ("/dev/zero".to_string(), vec![]),
                ("missing", _) => ("x".to_string(), vec![]),
                (_, Some(it)) => ("x".to_string(), vec![it]),
                _ => unreachable!(),
            };
            // A folder is a valid --data source and a valid model; it must then hold data.
            cases.push(Case {
                class: "input not a regular file",
                label: format!("{what} | {}", cmd.join(" ")),
                items,
                args: sub(&cmd, "X", &arg),
                expect: vec![if arg == "x" { "x".into() } else { arg.clone() }],
            });
        }
    }
    // Outputs that are inputs, folders, FIFOs, devices or in missing folders.
    for cmd in output_commands() {
        let writes_folder = cmd[0] == "model";
        // The command's own inputs, and the model folder it reads, as outputs.
        let mut places: Vec<(String, &str, Vec<Item>)> = vec![
            ("in a missing folder".into(), "no/such/out", vec![]),
            ("a FIFO".into(), "o", vec![Item::Fifo("o".into())]),
            ("/dev/null".into(), "/dev/null", vec![]),
        ];
        if writes_folder {
            // An output folder is made with its parents, as `mkdir -p` would.
            places.remove(0);
            places.push((
                "a regular file".into(),
                "o",
                vec![Item::File("o".into(), b"keep".to_vec())],
            ));
        } else {
            places.push(("a folder".into(), "o", vec![Item::Dir("o".into())]));
        }
        for a in cmd.iter().filter(|a| a.starts_with("../base/")) {
            if *a == "../base/model" {
                places.push((
                    "inside its model folder".into(),
                    "../base/model/out",
                    vec![],
                ));
                places.push((
                    "its model's weights".into(),
                    "../base/model/model.safetensors",
                    vec![],
                ));
            } else {
                places.push((format!("its input {a}"), a, vec![]));
            }
        }
        for (what, arg, items) in places {
            let name = arg.rsplit('/').next().unwrap().to_string();
            cases.push(Case {
                class: "output location",
                label: format!("{what} | {}", cmd[..2].join(" ")),
                items,
                args: sub(&cmd, "O", arg),
                expect: vec![name],
            });
        }
    }
    for (cmd, word) in flag_faults() {
        cases.push(Case {
            class: "flag value",
            label: cmd.join(" "),
            items: vec![],
            args: s(&cmd),
            expect: vec![word.to_string()],
        });
    }
    cases
}

/// Everything under `dir`: path to (kind, bytes) for files, kind only otherwise.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (String, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let ft = m.file_type();
            let entry = if ft.is_symlink() {
                (
                    "link".into(),
                    std::fs::read_link(&p)
                        .unwrap()
                        .into_os_string()
                        .into_encoded_bytes(),
                )
            } else if ft.is_dir() {
                stack.push(p.clone());
                ("dir".into(), vec![])
            } else if ft.is_file() {
                ("file".into(), std::fs::read(&p).unwrap())
            } else {
                (format!("{:?}", ft), vec![])
            };
            out.insert(p, entry);
        }
    }
    out
}

/// What differs between two snapshots: entries removed, changed or added.
fn changes(
    before: &BTreeMap<PathBuf, (String, Vec<u8>)>,
    after: &BTreeMap<PathBuf, (String, Vec<u8>)>,
) -> Vec<String> {
    let mut out = Vec::new();
    for (p, v) in before {
        match after.get(p) {
            None => out.push(format!("{} was removed", p.display())),
            Some(w) if w != v => out.push(format!("{} was changed", p.display())),
            _ => {}
        }
    }
    for p in after.keys().filter(|p| !before.contains_key(*p)) {
        out.push(format!("{} was left behind", p.display()));
    }
    out
}

fn make_items(dir: &Path, base: &Path, items: &[Item]) {
    for it in items {
        match it {
            Item::File(p, b) => std::fs::write(dir.join(p), b).unwrap(),
            Item::Dir(p) => std::fs::create_dir(dir.join(p)).unwrap(),
            Item::Fifo(p) => {
                let ok = Command::new("mkfifo")
                    .arg(dir.join(p))
                    .status()
                    .unwrap()
                    .success();
                assert!(ok, "mkfifo");
            }
            Item::Symlink(p, to) => std::os::unix::fs::symlink(to, dir.join(p)).unwrap(),
            Item::CopyDir(from, to) => {
                std::fs::create_dir(dir.join(to)).unwrap();
                for e in std::fs::read_dir(base.join(from)).unwrap() {
                    let e = e.unwrap();
                    std::fs::copy(e.path(), dir.join(to).join(e.file_name())).unwrap();
                }
            }
        }
    }
}

/// Runs one case in `dir`; returns what went wrong, if anything.
fn run_case(case: &Case, dir: &Path, base: &Path, logs: &Path) -> Option<String> {
    std::fs::create_dir(dir).unwrap();
    make_items(dir, base, &case.items);
    let before = snapshot(dir);
    let err_path = logs.join(format!(
        "{}.stderr",
        dir.file_name().unwrap().to_string_lossy()
    ));
    let mut child = Command::new(occult_bin())
        .args(&case.args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > TIME_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            return Some(format!("no answer within {TIME_LIMIT:?} (a hang)"));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    let mut faults = Vec::new();
    match status.code() {
        Some(1) | Some(2) => {}
        Some(c) => faults.push(format!("exit status {c}")),
        None => faults.push(format!("killed by a signal ({status})")),
    }
    if stderr.contains("panicked") || stderr.contains("RUST_BACKTRACE") {
        faults.push("a panic".into());
    }
    if !stderr.starts_with("error: ") && !stderr.contains("\nerror: ") {
        faults.push("no `error: ` line".into());
    }
    let low = stderr.to_lowercase();
    for w in &case.expect {
        // `a|b`: either will do.
        if !w.split('|').any(|alt| low.contains(&alt.to_lowercase())) {
            faults.push(format!("the message lacks {w:?}"));
        }
    }
    faults.extend(changes(&before, &snapshot(dir)));
    if faults.is_empty() {
        None
    } else {
        Some(format!(
            "{}\n    stderr: {}",
            faults.join("; "),
            stderr.trim()
        ))
    }
}

#[test]
fn hostile_inputs_get_named_errors_and_touch_nothing() {
    let root = tempfile::tempdir().unwrap();
    let base = make_base(root.path());
    // Every command the cases use works on the good inputs.
    let good = |cmd: &[&str], from: &str, to: &str| -> Vec<String> {
        cmd.iter()
            .map(|a| {
                if *a == from {
                    to.to_string()
                } else {
                    a.to_string()
                }
            })
            .collect()
    };
    let good_runs: Vec<Vec<String>> = trace_commands()
        .iter()
        .map(|c| good(c, "T", "../base/trace.safetensors"))
        .chain(
            placement_commands()
                .iter()
                .map(|c| good(c, "P", "../base/place.json")),
        )
        .chain(
            model_commands()
                .iter()
                .map(|c| good(c, "M", "../base/model")),
        )
        .collect();
    for (i, args) in good_runs.iter().enumerate() {
        let d = root.path().join(format!("good{i}"));
        std::fs::create_dir(&d).unwrap();
        run_ok(&d, &args.iter().map(String::as_str).collect::<Vec<_>>());
    }
    let base_before = snapshot(&base.dir);
    let cases = build_cases(&base);
    let logs = root.path().join("logs");
    std::fs::create_dir(&logs).unwrap();
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
    std::thread::scope(|sc| {
        for _ in 0..workers {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(case) = cases.get(i) else { break };
                let dir = root.path().join(format!("case{i}"));
                if let Some(f) = run_case(case, &dir, &base.dir, &logs) {
                    failures.lock().unwrap().push(format!(
                        "[{}] {}\n  occult {}\n  {f}",
                        case.class,
                        case.label,
                        case.args.join(" ")
                    ));
                }
                let _ = std::fs::remove_dir_all(&dir);
            });
        }
    });
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &cases {
        *counts.entry(c.class).or_default() += 1;
    }
    println!("{} hostile cases:", cases.len());
    for (class, n) in &counts {
        println!("  {class}: {n}");
    }
    let mut failures = failures.into_inner().unwrap();
    let base_changes = changes(&base_before, &snapshot(&base.dir));
    if !base_changes.is_empty() {
        failures.push(format!("the shared good inputs changed: {base_changes:?}"));
    }
    assert!(
        failures.is_empty(),
        "{} of {} hostile cases went wrong:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
