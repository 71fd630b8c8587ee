//! `occult eval` on generative tasks end to end: every GSM8K run that lm-evaluation-harness
//! 0.4.13 made on the fixture models (`fixtures/generative/`) reproduced from the command
//! line, one request at a time, batched and on two expert-parallel ranks: the same
//! responses, filtered answers, exact matches, means and standard errors, with the samples
//! lines shaped as the harness writes them. Then the built-in GSM8K tasks on their sample
//! data beside a multiple-choice task, and what happens to bad input.

mod common;

use common::{occult, occult_ok, read_samples, same_scores};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn read(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Runs `occult eval` on one fixture task file; returns its results entry and samples lines.
fn run(dir: &Path, tag: &str, model: &str, task: &str, extra: &[&str]) -> (Value, Vec<Value>) {
    let out = dir.join(tag);
    std::fs::create_dir_all(&out).unwrap();
    let gen = fixtures().join("generative");
    let (m, file) = (
        fixtures().join("models").join(model).display().to_string(),
        gen.join(format!("{task}.toml")).display().to_string(),
    );
    let data = format!("{task}={}", gen.display());
    let res = out.join("results.json").display().to_string();
    let mut args = vec![
        "eval",
        "--model",
        &m,
        "--tasks",
        &file,
        "--data",
        &data,
        "--output",
        &res,
        "--log-samples",
        "--quiet",
    ];
    args.extend(extra);
    occult_ok(dir, &args);
    let r = read(&out.join("results.json"));
    let mut samples = read_samples(&out, task);
    (r["results"][task].clone(), samples.remove(0).1)
}

#[test]
fn gsm8k_runs_are_the_harness_s_from_the_command_line() {
    let t = tempfile::tempdir().unwrap();
    let mut lines_checked = 0;
    let prompts = read(&fixtures().join("generative/prompts.json"));
    for model in ["olmoe", "qwen3_moe"] {
        let want = read(&fixtures().join(format!("generative/{model}.json")));
        for (run_name, w) in want["runs"].as_object().unwrap() {
            let (task, shots) = run_name.split_once('/').unwrap();
            let tag = format!("{model}-{task}-{shots}");
            let shots_flag = ["--num-fewshot", shots];
            let (r, lines) = run(t.path(), &tag, model, task, &shots_flag);
            // Means and standard errors under the harness's keys.
            for (key, v) in w["results"].as_object().unwrap() {
                let (got, v) = (r[key].as_f64().unwrap(), v.as_f64().unwrap());
                assert!((got - v).abs() < 1e-12, "{tag} {key}: {got} vs {v}");
            }
            assert_eq!(r["num_fewshot"].as_u64().unwrap().to_string(), shots);
            // One line per document and filter, the filters in turn.
            let docs = w["docs"].as_array().unwrap();
            let filters: Vec<&str> = lines
                .iter()
                .map(|l| l["filter"].as_str().unwrap())
                .collect();
            assert_eq!(lines.len() % docs.len(), 0, "{tag}");
            for (i, line) in lines.iter().enumerate() {
                let (doc_id, filter) = (i % docs.len(), filters[i]);
                let d = &docs[doc_id];
                assert_eq!(line["doc_id"], doc_id, "{tag}");
                assert_eq!(line["resps"][0][0], d["resps"], "{tag} doc {doc_id}");
                assert_eq!(line["filtered_resps"][0], d["filtered"][filter], "{tag}");
                assert_eq!(line["exact_match"], d["exact_match"][filter], "{tag}");
                assert_eq!(line["metrics"], serde_json::json!(["exact_match"]));
                // The context the harness built, and (for one document) the hashes its own
                // log_samples wrote for it: lm_eval 0.4.13's evaluate on these files, gsm8k
                // 1-shot, seed 1234.
                let context = &line["arguments"]["gen_args_0"]["arg_0"];
                assert_eq!(
                    *context, prompts["runs"][run_name][doc_id]["context"],
                    "{tag}"
                );
                if run_name == "gsm8k/1" && doc_id == 0 {
                    assert_eq!(
                        line["prompt_hash"],
                        "afb91f4a992d0ae442477cf7c57fe982814be1c865df0a9832df2161ef1e2a23"
                    );
                    assert_eq!(
                        line["target_hash"],
                        "881c32329aba33819529319d0482bdc1f07fe25730dfd3554ae0f58335bcb3e0"
                    );
                }
                lines_checked += 1;
            }
            // Batched and on two ranks: the same answers.
            if run_name == "gsm8k/5" || run_name == "gsm8k_cot_stops/0" {
                for (how, flags) in [
                    ("b1", vec!["--batch-size", "1"]),
                    (
                        "d2",
                        vec!["--batch-size", "3", "--devices", "2", "--mode", "occult"],
                    ),
                ] {
                    let mut extra = shots_flag.to_vec();
                    extra.extend(flags);
                    let (r2, l2) = run(t.path(), &format!("{tag}-{how}"), model, task, &extra);
                    same_scores(
                        &[(task.to_string(), lines.clone())],
                        &[(task.to_string(), l2)],
                        &format!("{tag} {how}"),
                    );
                    assert_eq!(
                        r2["exact_match,strict-match"],
                        r["exact_match,strict-match"]
                    );
                }
            }
        }
    }
    eprintln!("{lines_checked} samples lines held to the harness's");
}

#[test]
fn builtin_gsm8k_runs_beside_multiple_choice_and_bad_input_is_named() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let model = fixtures().join("models/qwen3_moe").display().to_string();
    let tasks = "gsm8k,gsm8k_cot_zeroshot,piqa";
    // The harness's budget of 256 new tokens leaves no room in the fixture's 128 positions.
    let out = occult(
        dir,
        &["eval", "--model", &model, "--tasks", "gsm8k", "--samples"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("max_gen_toks 256") && err.contains("--max-gen-toks"),
        "{err}"
    );
    let stdout = occult_ok(
        dir,
        &[
            "eval",
            "--model",
            &model,
            "--tasks",
            tasks,
            "--samples",
            "--limit",
            "4",
            "--max-gen-toks",
            "16",
            "--output",
            "r.json",
            "--log-samples",
        ],
    );
    assert!(stdout.contains("exact_match,flexible-extract"), "{stdout}");
    let r = read(&dir.join("r.json"));
    assert_eq!(r["results"]["gsm8k"]["n"], 4);
    assert_eq!(r["results"]["gsm8k"]["num_fewshot"], 5);
    assert_eq!(r["results"]["gsm8k"]["gen_kwargs"]["max_gen_toks"], 16);
    assert!(
        r["results"]["gsm8k"]["speed"]["generated_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(r["results"]["gsm8k_cot_zeroshot"]["exact_match,strict-match"].is_number());
    assert!(r["results"]["piqa"]["acc"].is_number());
    assert_eq!(r["config"]["max_gen_toks"], 16);
    let lines = read_samples(dir, "gsm8k").remove(0).1;
    assert_eq!(lines.len(), 8, "4 documents x 2 filters");
    // The dataset as the hub publishes it (Parquet under main/), from the Hugging Face cache
    // and from a local copy: the same answers as the samples it was made from.
    let hub = fixtures().join("datasets/hub");
    let local =
        hub.join("datasets--openai--gsm8k/snapshots/1111111111111111111111111111111111111111");
    let local_data = format!("gsm8k={}", local.display());
    for (tag, extra) in [
        ("hub", vec![]),
        ("local", vec!["--data", local_data.as_str()]),
    ] {
        let out = dir.join(tag);
        std::fs::create_dir_all(&out).unwrap();
        let mut args = vec![
            "eval",
            "--model",
            &model,
            "--tasks",
            "gsm8k",
            "--limit",
            "4",
            "--max-gen-toks",
            "16",
            "--output",
            "r.json",
            "--log-samples",
            "--quiet",
        ];
        args.extend(extra);
        let run = std::process::Command::new(common::occult_bin())
            .args(&args)
            .env("HF_HUB_CACHE", &hub)
            .current_dir(&out)
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        assert_eq!(
            read_samples(&out, "gsm8k").remove(0).1,
            lines,
            "{tag}: the samples' answers"
        );
    }
    // Under a placement with replicas on two ranks: the same answers as one device.
    std::fs::write(
        dir.join("cal.txt"),
        "the cat sat on the mat\nexperts route tokens\n",
    )
    .unwrap();
    occult_ok(
        dir,
        &[
            "profile", "--model", &model, "--data", "cal.txt", "-o", "t.st",
        ],
    );
    occult_ok(
        dir,
        &[
            "place",
            "--trace",
            "t.st",
            "--devices",
            "2",
            "--replicas",
            "2",
            "-o",
            "p2.json",
        ],
    );
    let rep = dir.join("replicas");
    std::fs::create_dir_all(&rep).unwrap();
    occult_ok(
        &rep,
        &[
            "eval",
            "--model",
            &model,
            "--tasks",
            "gsm8k",
            "--samples",
            "--limit",
            "4",
            "--max-gen-toks",
            "16",
            "--devices",
            "2",
            "--placement",
            "../p2.json",
            "--output",
            "r.json",
            "--log-samples",
            "--quiet",
        ],
    );
    assert_eq!(read_samples(&rep, "gsm8k").remove(0).1, lines, "replicas");
    // Pruned routing runs the generation too.
    occult_ok(
        dir,
        &[
            "eval",
            "--model",
            &model,
            "--tasks",
            "gsm8k",
            "--samples",
            "--limit",
            "2",
            "--max-gen-toks",
            "8",
            "--devices",
            "2",
            "--max-devices",
            "1",
            "--quiet",
            "--output",
            "p.json",
        ],
    );
    assert_eq!(read(&dir.join("p.json"))["results"]["gsm8k"]["n"], 2);

    // A broken generative task file is named; the good task goes on.
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "name = \"bad\"\noutput_type = \"generate_until\"\n[data]\nhub = \"x/y\"\n\
         eval_split = \"test\"\n[prompt]\ntext = \"{question}\"\ntarget = \"{answer}\"\n\
         [generation]\nuntil = [\"Q:\"]\n[[filters]]\nname = \"f\"\n[[filters.steps]]\n\
         function = \"regex\"\nregex_pattern = \"(\"\n",
    )
    .unwrap();
    let both = format!("{},gsm8k", bad.display());
    let out = occult(
        dir,
        &[
            "eval",
            "--model",
            &model,
            "--tasks",
            &both,
            "--samples",
            "--limit",
            "2",
            "--max-gen-toks",
            "4",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("bad.toml") && err.contains("1 of 2 task(s) failed"),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("gsm8k"));
    // The benchmark runs both paths and checks they generate the same ids.
    occult_ok(
        dir,
        &[
            "bench",
            "generate",
            "--model",
            &model,
            "--batch",
            "3",
            "--prompt-len",
            "9",
            "--decode-tokens",
            "12",
            "--repeats",
            "1",
            "--json",
            "g.json",
        ],
    );
    let g = read(&dir.join("g.json"));
    assert!(g["ratio"].as_f64().unwrap() > 0.0, "{g}");
    assert!(occult(
        dir,
        &["bench", "generate", "--model", &model, "--batch", "0"]
    )
    .stderr
    .starts_with(b"error"));
    // --trace records multiple-choice scoring only.
    let out = occult(
        dir,
        &[
            "eval",
            "--model",
            &model,
            "--tasks",
            "gsm8k",
            "--samples",
            "--trace",
            "t.st",
        ],
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("generative tasks cannot be traced"));
}

/// A tokenizer whose post-processor adds a BOS (as Llama's, Mixtral's and DeepSeek's do):
/// lm-eval 0.4.13 encodes every context with it by default (`fixtures/bos/`, made by
/// `scripts/make_bos_fixtures.py`), and so does `occult eval`, for log-likelihoods and for the
/// windows it generates after; `--add-bos false` leaves it out and scores otherwise.
#[test]
fn a_bos_adding_tokenizer_is_encoded_as_the_harness_does() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let (src, bos) = (fixtures().join("models/qwen2_moe"), fixtures().join("bos"));
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        src.join("model.safetensors"),
        model.join("model.safetensors"),
    )
    .unwrap();
    let mut cfg = read(&src.join("config.json"));
    cfg["bos_token_id"] = 300.into();
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(bos.join(f), model.join(f)).unwrap();
    }
    let want = read(&bos.join("lmeval.json"));
    let m = model.display().to_string();
    let gen = fixtures().join("generative");
    let (gsm8k, data) = (
        gen.join("gsm8k.toml").display().to_string(),
        format!("gsm8k={}", gen.display()),
    );
    let tasks = format!("arc_easy,piqa,hellaswag,{gsm8k}");
    let run = |tag: &str, extra: &[&str]| -> Vec<(String, Vec<Value>)> {
        let out = dir.join(tag);
        std::fs::create_dir_all(&out).unwrap();
        let res = out.join("r.json").display().to_string();
        let mut args = vec![
            "eval",
            "--model",
            &m,
            "--tasks",
            &tasks,
            "--samples",
            "--data",
            &data,
            "--num-fewshot",
            "0",
            "--output",
            &res,
            "--log-samples",
            "--quiet",
        ];
        args.extend(extra);
        occult_ok(dir, &args);
        read_samples(&out, "arc_easy,piqa,hellaswag,gsm8k")
    };
    let close = |a: &Value, b: &Value| (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 2e-5;
    let ours = run("default", &[]);
    for (task, lines) in &ours[..3] {
        let w = want["tasks"][task].as_array().unwrap();
        assert_eq!(lines.len(), w.len(), "{task}");
        for (o, w) in lines.iter().zip(w) {
            let lo = o["loglikelihoods"].as_array().unwrap();
            let lw = w.as_array().unwrap();
            assert!(
                lo.iter().zip(lw).all(|(a, b)| close(a, b)),
                "{task}: {lo:?} vs {lw:?}"
            );
        }
    }
    let (_, gsm) = &ours[3];
    let w = want["gsm8k"].as_array().unwrap();
    for (i, d) in w.iter().enumerate() {
        assert_eq!(d["input_ids"][0], 300, "the harness fed the BOS");
        let line = &gsm[i];
        assert_eq!(line["resps"][0][0], d["resps"], "gsm8k doc {i}");
        assert_eq!(
            line["exact_match"],
            d["exact_match"][line["filter"].as_str().unwrap()]
        );
    }
    // Without the BOS the scores move.
    let without = run("no-bos", &["--add-bos", "false"]);
    let moved = without[..3]
        .iter()
        .zip(&ours[..3])
        .flat_map(|((_, a), (_, b))| a.iter().zip(b))
        .any(|(a, b)| !close(&a["loglikelihoods"][0], &b["loglikelihoods"][0]));
    assert!(moved, "--add-bos false changed nothing");
    let r = read(&dir.join("no-bos/r.json"));
    assert_eq!(r["config"]["add_bos"], false);
    assert_eq!(
        read(&dir.join("default/r.json"))["config"]["add_bos"],
        Value::Null
    );
}
