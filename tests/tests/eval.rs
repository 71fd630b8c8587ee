//! `occult eval` end to end on a fixture model: every built-in task scores its sample data;
//! scores do not depend on context reuse, batch size or the number of expert-parallel ranks;
//! reuse feeds fewer tokens; and bad tasks or data are reported while good tasks go on.

mod common;

use common::{occult, occult_ok, read_samples, same_scores};
use serde_json::Value;
use std::path::{Path, PathBuf};

const ALL: &str =
    "arc_challenge,arc_easy,boolq,copa,hellaswag,mmlu,openbookqa,piqa,rte,sciq,winogrande";

fn model() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/models/qwen2_moe")
        .display()
        .to_string()
}

fn read(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Runs eval on all tasks with extra flags; returns results and per-task samples.
fn eval(dir: &Path, tag: &str, extra: &[&str]) -> (Value, Vec<(String, Vec<Value>)>) {
    let out = dir.join(tag);
    std::fs::create_dir_all(&out).unwrap();
    let m = model();
    let res = out.join("results.json");
    let res_s = res.display().to_string();
    let mut args = vec![
        "eval",
        "--model",
        &m,
        "--tasks",
        ALL,
        "--samples",
        "--output",
        &res_s,
        "--log-samples",
        "--num-fewshot",
        "1",
    ];
    args.extend(extra);
    occult_ok(dir, &args);
    (read(&res), read_samples(&out, ALL))
}

#[test]
fn every_task_scores_its_samples_the_same_every_way() {
    let t = tempfile::tempdir().unwrap();
    let (base, s_base) = eval(t.path(), "base", &[]);
    for task in ALL.split(',') {
        let r = &base["results"][task];
        assert!(r["acc"].as_f64().is_some(), "{task}: {r}");
        assert!(r["n"].as_u64().unwrap() >= 3, "{task}");
    }
    // MMLU reports its subjects and the pooled figure.
    let subs = base["results"]["mmlu"]["subtasks"].as_object().unwrap();
    assert!(
        subs.contains_key("mmlu_high_school_physics") && subs.contains_key("mmlu_world_religions")
    );
    assert_eq!(base["config"]["seed"], 1234);
    assert!(base["provenance"].is_object());

    let (plain, s_plain) = eval(
        t.path(),
        "plain",
        &["--no-context-reuse", "--batch-size", "1"],
    );
    same_scores(&s_base, &s_plain, "reuse vs plain batch 1");
    let (_, s_b8) = eval(t.path(), "b8", &["--no-context-reuse", "--batch-size", "8"]);
    same_scores(&s_base, &s_b8, "reuse vs plain batch 8");
    let (_, s_d4) = eval(t.path(), "d4", &["--devices", "4", "--mode", "occult"]);
    same_scores(&s_base, &s_d4, "D=1 vs D=4");

    // Reusing the shared context feeds fewer tokens. (WinoGrande has no shared context, and
    // 1-shot MMLU overflows the fixture's 128 positions, so both run whole.)
    for task in ["arc_easy", "hellaswag", "piqa"] {
        let with = base["results"][task]["speed"]["forward_tokens"]
            .as_u64()
            .unwrap();
        let without = plain["results"][task]["speed"]["forward_tokens"]
            .as_u64()
            .unwrap();
        assert!(with < without, "{task}: {with} vs {without}");
    }
}

#[test]
fn bad_tasks_are_reported_and_good_ones_go_on() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let m = model();
    let run = |args: &[&str]| {
        let mut a = vec!["eval", "--model", m.as_str(), "--output", "r.json"];
        a.extend(args);
        occult(d, &a)
    };
    // A data file with a document missing a field, beside a good task.
    std::fs::write(
        d.join("piqa.jsonl"),
        "{\"goal\": \"Open a door.\", \"sol1\": \"Turn the handle.\", \"sol2\": \"Eat it.\", \"label\": 0}\n\
         {\"goal\": \"Boil water.\", \"sol1\": \"Heat it.\", \"label\": 0}\n",
    )
    .unwrap();
    let out = run(&[
        "--tasks",
        "piqa,rte,nosuch",
        "--data",
        "piqa=piqa.jsonl",
        "--samples",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("piqa.jsonl row 1") && err.contains("no field `sol2`"),
        "{err}"
    );
    assert!(
        err.contains("unknown task \"nosuch\"") && err.contains("hellaswag"),
        "{err}"
    );
    let r = read(&d.join("r.json"));
    assert!(r["results"]["rte"]["acc"].is_number());
    assert!(r["errors"]["piqa"].as_str().unwrap().contains("sol2"));

    // Gold out of range, an empty choice list, a line that is not JSON.
    std::fs::write(
        d.join("arc.jsonl"),
        "{\"question\": \"Q\", \"choices\": {\"text\": [\"a\", \"b\"], \"label\": [\"A\", \"B\"]}, \"answerKey\": \"C\"}\n",
    )
    .unwrap();
    let out = run(&["--tasks", "arc_easy", "--data", "arc_easy=arc.jsonl"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("\"C\" is not one of"), "{err}");
    std::fs::write(
        d.join("arc.jsonl"),
        "{\"question\": \"Q\", \"choices\": {\"text\": [], \"label\": []}, \"answerKey\": \"A\"}\n",
    )
    .unwrap();
    let err = String::from_utf8_lossy(
        &run(&["--tasks", "arc_easy", "--data", "arc_easy=arc.jsonl"]).stderr,
    )
    .to_string();
    assert!(err.contains("no choices"), "{err}");
    std::fs::write(d.join("boolq.jsonl"), "{\"passage\": \"x\"}\nnot json\n").unwrap();
    let err =
        String::from_utf8_lossy(&run(&["--tasks", "boolq", "--data", "boolq=boolq.jsonl"]).stderr)
            .to_string();
    assert!(err.contains("boolq.jsonl line 2: not valid JSON"), "{err}");
    std::fs::write(
        d.join("rte.jsonl"),
        "{\"sentence1\": \"a\", \"sentence2\": \"b\", \"label\": 7}\n",
    )
    .unwrap();
    let err = String::from_utf8_lossy(&run(&["--tasks", "rte", "--data", "rte=rte.jsonl"]).stderr)
        .to_string();
    assert!(
        err.contains("gold index 7 is out of range for 2 choices"),
        "{err}"
    );
    // Few-shot examples need the declared few-shot split; a single file has none.
    std::fs::write(
        d.join("mm.jsonl"),
        "{\"question\": \"Q\", \"subject\": \"anatomy\", \"choices\": [\"a\", \"b\", \"c\", \"d\"], \"answer\": 0}\n",
    )
    .unwrap();
    let err = String::from_utf8_lossy(
        &run(&[
            "--tasks",
            "mmlu",
            "--data",
            "mmlu=mm.jsonl",
            "--num-fewshot",
            "2",
        ])
        .stderr,
    )
    .to_string();
    assert!(err.contains("2-shot mmlu needs its dev split"), "{err}");
    // Malformed Parquet found by fuzzing: two were panics in the parquet crate, a footer whose
    // column chunk lies outside the file (now checked) and a page shorter than its header says
    // (the panic is contained); one was a hang, a page header whose list runs billions of
    // elements past the end of the file; one aborted on a 38 GB allocation, a dictionary page
    // that claims 1.2 billion strings in 24 bytes (page headers are now read and checked
    // before the crate decodes them).
    let parquet_err = |fixture: &str| {
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures/malformed")
                .join(fixture),
            d.join("arc.parquet"),
        )
        .unwrap();
        let started = std::time::Instant::now();
        let out = run(&["--tasks", "arc_easy", "--data", "arc_easy=arc.parquet"]);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(started.elapsed().as_secs() < 10, "{:?}", started.elapsed());
        err
    };
    let err = parquet_err("chunk_outside_file.parquet");
    assert!(
        err.contains("arc.parquet: row group 0, column 2") && err.contains("lies outside the file"),
        "{err}"
    );
    let err = parquet_err("short_page.parquet");
    assert!(
        err.contains("arc.parquet: malformed Parquet data (the decoder stopped: "),
        "{err}"
    );
    let err = parquet_err("endless_list.parquet");
    assert!(
        err.contains("arc.parquet: row group 0, column 0: the page at offset 4: "),
        "{err}"
    );
    let err = parquet_err("huge_dictionary.parquet");
    assert!(
        err.contains(
            "arc.parquet: row group 0, column 0: the dictionary page at offset 4 says it holds \
             1205862399 values, but its 24 bytes hold at most 6 of type BYTE_ARRAY"
        ),
        "{err}"
    );
    let err = String::from_utf8_lossy(&run(&["--tasks", "rte", "--data", "piqa=x.jsonl"]).stderr)
        .to_string();
    assert!(
        err.contains("--data names \"piqa\", which is none of --tasks"),
        "{err}"
    );
    // --limit applies per MMLU subject.
    let out = run(&["--tasks", "mmlu", "--samples", "--limit", "1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = read(&d.join("r.json"));
    assert_eq!(r["results"]["mmlu"]["n"], 2);
    // A broken task file.
    std::fs::write(d.join("mine.toml"), "name = \"mine\"\n[prompt]\ntext = 3\n").unwrap();
    let err =
        String::from_utf8_lossy(&run(&["--tasks", "mine.toml", "--samples"]).stderr).to_string();
    assert!(err.contains("mine.toml: not a valid task file"), "{err}");
}

#[test]
fn cached_hub_datasets_in_parquet_score_like_the_samples() {
    let t = tempfile::tempdir().unwrap();
    let hub = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/datasets/hub");
    let m = model();
    let run = |tag: &str, extra: &[&str], cache: &Path| {
        let dir = t.path().join(tag);
        std::fs::create_dir_all(&dir).unwrap();
        let mut args = vec![
            "eval",
            "--model",
            m.as_str(),
            "--tasks",
            "arc_easy,hellaswag",
            "--num-fewshot",
            "1",
            "--output",
            "r.json",
            "--log-samples",
        ];
        args.extend(extra);
        let out = std::process::Command::new(common::occult_bin())
            .args(&args)
            .env("HF_HUB_CACHE", cache)
            .current_dir(&dir)
            .output()
            .unwrap();
        (out, dir)
    };
    let (a, da) = run("hub", &[], &hub);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    let (b, db) = run("samples", &["--samples"], &hub);
    assert!(b.status.success());
    for task in ["arc_easy", "hellaswag"] {
        let f = format!("samples_{task}.jsonl");
        assert_eq!(
            std::fs::read_to_string(da.join(&f)).unwrap(),
            std::fs::read_to_string(db.join(&f)).unwrap(),
            "{task}"
        );
    }
    let (c, _) = run("missing", &[], &t.path().join("empty"));
    assert_eq!(c.status.code(), Some(1));
    let err = String::from_utf8_lossy(&c.stderr);
    assert!(
        err.contains("dataset allenai/ai2_arc is not in the Hugging Face cache"),
        "{err}"
    );
}

#[test]
fn traced_evaluation_records_every_token_and_bench_compares_reuse() {
    let t = tempfile::tempdir().unwrap();
    let m = model();
    occult_ok(
        t.path(),
        &[
            "eval",
            "--model",
            &m,
            "--tasks",
            "copa,arc_easy",
            "--samples",
            "--output",
            "r.json",
            "--trace",
            "t.safetensors",
        ],
    );
    let r = read(&t.path().join("r.json"));
    let fed: u64 = ["copa", "arc_easy"]
        .iter()
        .map(|k| r["results"][k]["speed"]["forward_tokens"].as_u64().unwrap())
        .sum();
    let trace = occult_core::analysis::trace::Trace::read(&t.path().join("t.safetensors")).unwrap();
    // qwen2_moe's layer 0 is dense: MoE layers 1 and 2 each saw every token fed.
    assert_eq!(trace.layer_ids(), vec![1, 2]);
    for l in &trace.layers {
        assert_eq!(l.tokens as u64, fed);
        assert!(l.router_logits.is_some());
    }
    let out = occult_ok(
        t.path(),
        &[
            "bench",
            "eval",
            "--model",
            &m,
            "--tasks",
            "arc_easy,winogrande",
            "--samples",
        ],
    );
    assert!(
        out.contains("tokens/item reuse") && out.contains("winogrande"),
        "{out}"
    );
}

/// Whole few-shot prompts, request by request, equal to the ones lm-evaluation-harness 0.4.13
/// built for the built-in samples with seed 1234 (scripts/make_prompt_fixtures.py): the draw,
/// the n + 1 rule, the order, the delimiters and the preprocessing together.
#[test]
fn few_shot_prompts_are_lm_eval_0_4_13s() {
    use occult_eval::harness::evaluate::{prepare, PrepareOptions};
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/lmeval_prompts.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let tasks = v["tasks"].as_object().unwrap();
    assert_eq!(tasks.len(), 14);
    for (name, t) in tasks {
        let shots = t["shots"].as_u64().unwrap() as usize;
        let opts = PrepareOptions {
            data: Default::default(),
            samples: true,
            num_fewshot: Some(shots),
            limit: None,
            seed: 1234,
            max_gen_toks: None,
        };
        let p = prepare(name, &opts).unwrap();
        let want = t["docs"].as_array().unwrap();
        assert_eq!(p.items.len(), want.len(), "{name}");
        for (item, reqs) in p.items.iter().zip(want) {
            let reqs = reqs.as_array().unwrap();
            assert_eq!(item.continuations.len(), reqs.len(), "{name}");
            for (i, r) in reqs.iter().enumerate() {
                assert_eq!(
                    item.contexts[i],
                    r[0].as_str().unwrap(),
                    "{name} doc {}",
                    item.doc_id
                );
                assert_eq!(
                    item.continuations[i],
                    r[1].as_str().unwrap(),
                    "{name} doc {}",
                    item.doc_id
                );
            }
        }
    }
}

/// Every task's items, scored by `occult eval` on the qwen2_moe fixture, against what
/// lm-evaluation-harness 0.4.13 (HF backend, float32) gave the same checkpoint on the same
/// samples (scripts/make_score_fixtures.py): each choice's log-likelihood within 2e-5 (plus
/// 2e-7 of its size, f32 sums), and acc,
/// acc_norm and the gold index exactly; zero-shot, and with each task's few-shot count.
#[test]
fn scores_are_lm_eval_0_4_13s_item_by_item() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/lmeval_scores.json");
    let v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert_eq!(v["model"], "qwen2_moe");
    let t = tempfile::tempdir().unwrap();
    let m = model();
    let (mut items, mut choices) = (0, 0);
    for (r, run) in v["runs"].as_array().unwrap().iter().enumerate() {
        let run = run.as_object().unwrap();
        assert_eq!(run.len(), 14);
        // One eval per few-shot count.
        let mut by_shots: std::collections::BTreeMap<u64, Vec<&str>> = Default::default();
        for (name, task) in run {
            by_shots
                .entry(task["shots"].as_u64().unwrap())
                .or_default()
                .push(name);
        }
        for (shots, names) in by_shots {
            let dir = t.path().join(format!("run{r}_{shots}"));
            std::fs::create_dir_all(&dir).unwrap();
            let (tasks, res) = (names.join(","), dir.join("results.json"));
            let (shots_s, res_s) = (shots.to_string(), res.display().to_string());
            occult_ok(
                &dir,
                &[
                    "eval",
                    "--model",
                    &m,
                    "--tasks",
                    &tasks,
                    "--samples",
                    "--num-fewshot",
                    &shots_s,
                    "--output",
                    &res_s,
                    "--log-samples",
                    "--quiet",
                ],
            );
            for (name, ours) in read_samples(&dir, &tasks) {
                let want = run[&name]["docs"].as_array().unwrap();
                assert_eq!(ours.len(), want.len(), "{name} {shots}-shot");
                for (i, (o, w)) in ours.iter().zip(want).enumerate() {
                    let at = format!("{name} {shots}-shot doc {i}");
                    assert_eq!(o["target"], w["target"], "{at}: gold");
                    assert_eq!(o["acc"], w["acc"], "{at}: acc");
                    if !w["acc_norm"].is_null() {
                        assert_eq!(o["acc_norm"], w["acc_norm"], "{at}: acc_norm");
                    }
                    let (lo, lw) = (
                        o["loglikelihoods"].as_array().unwrap(),
                        w["loglikelihoods"].as_array().unwrap(),
                    );
                    assert_eq!(lo.len(), lw.len(), "{at}: choices");
                    for (a, b) in lo.iter().zip(lw) {
                        let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
                        // Both sides sum token log-probabilities in f32: long
                        // continuations carry that rounding (seen: 1.4e-7 relative).
                        assert!(
                            (a - b).abs() <= 2e-5 + 2e-7 * b.abs(),
                            "{at}: log-likelihood {a}, harness {b}"
                        );
                    }
                    items += 1;
                    choices += lw.len();
                }
            }
        }
    }
    // 14 tasks' samples, twice.
    assert!(
        items >= 2 * 40 && choices > items,
        "{items} items, {choices} choices"
    );
}
