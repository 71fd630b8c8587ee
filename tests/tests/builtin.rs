//! The built-in model's data: the same from the same seed, every task readable by the harness
//! with its gold answer right, the instructions readable by occult-train, and no word of any
//! text outside the tokenizer's vocabulary.

mod common;

use occult_eval::builtin::data::{task_name, write_data, DataSizes};
use occult_eval::builtin::world::{Domain, World};
use occult_eval::harness::data::{load, Source};
use occult_eval::harness::task::TaskSpec;
use std::path::Path;

fn small() -> DataSizes {
    DataSizes {
        pretrain_docs: 40,
        pretrain_questions: 12,
        calibration_docs: 4,
        sentences: 6,
        instructions: 60,
        held_out: 20,
        task_items: 30,
    }
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap()
}

#[test]
fn the_built_in_data_is_seeded_complete_and_covered_by_its_tokenizer() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let world = World::new(7);
    let vocab = write_data(a.path(), &world, small(), 7).unwrap();
    assert_eq!(write_data(b.path(), &world, small(), 7).unwrap(), vocab);
    for f in [
        "pretrain.jsonl",
        "calibration.jsonl",
        "instructions/train.jsonl",
        "instructions/held_out.jsonl",
        "tokenizer.json",
        "tasks/code/test.jsonl",
    ] {
        assert_eq!(read(&a.path().join(f)), read(&b.path().join(f)), "{f}");
    }
    let tok = occult_core::models::tokenizer::TextTokenizer::read(
        &a.path().join("tokenizer.json"),
        vocab,
    )
    .unwrap();
    let unk = tok.token_id("<unk>").unwrap();
    let no_unknown = |text: &str| {
        let ids = tok.encode(text, false).unwrap();
        assert!(!ids.contains(&unk), "an unknown word in {text:?}");
    };
    for line in read(&a.path().join("pretrain.jsonl")).lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        no_unknown(v["text"].as_str().unwrap());
    }
    // Instructions: as many as asked, readable as Alpaca records.
    let recs = occult_train::dataset::read_records(
        a.path().join("instructions/train.jsonl").to_str().unwrap(),
    )
    .unwrap();
    assert_eq!(recs.docs.len(), 60);
    for d in &recs.docs {
        let i = occult_train::examples::Instruction::from_record(d, "x").unwrap();
        for t in [&i.instruction, &i.input, &i.output] {
            no_unknown(t);
        }
    }
    // Tasks: the harness reads them; the gold choice completes the sentence as the world says.
    for d in Domain::ALL {
        let spec = TaskSpec::read(&a.path().join(format!("tasks/{}.toml", task_name(d)))).unwrap();
        assert_eq!(spec.name, task_name(d));
        let (docs, few) =
            load(&spec, &Source::Path(a.path().join("tasks").join(d.name()))).unwrap();
        assert_eq!(docs.docs.len(), 30);
        assert!(few.is_some_and(|f| f.docs.len() == 10));
        for i in 0..docs.docs.len() {
            let it = spec
                .item(
                    &docs.docs,
                    i,
                    None,
                    0,
                    &mut occult_eval::harness::pyrandom::PyRandom::new(1),
                )
                .unwrap();
            let right = &it.continuations[it.gold];
            no_unknown(&format!("{}{right}", it.contexts[0]));
            // The question comes in the Alpaca template.
            assert!(
                it.contexts[0].starts_with("Below is an instruction"),
                "{it:?}"
            );
            if d == Domain::Arithmetic {
                let context = docs.docs[i]["context"].as_str().unwrap();
                let w: Vec<&str> = context.split(' ').collect();
                let (x, y): (i64, i64) = (w[0].parse().unwrap(), w[2].parse().unwrap());
                let want = if w[1] == "plus" { x + y } else { x - y };
                assert_eq!(right.trim(), want.to_string(), "{it:?}");
            }
        }
    }
}

/// `occult model builtin --recipe FILE` builds the recipe the file changes (here the tests'
/// tiny one), finds it in place the second time, and refuses an unknown field, naming it and
/// the file.
#[test]
fn model_builtin_builds_the_recipe_of_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tiny = common::TINY_RECIPE;
    let table = &tiny[tiny.find("[builtin]\n").unwrap() + "[builtin]\n".len()..];
    let table = &table[..table.find("[calibration]").unwrap()];
    std::fs::write(
        d.join("b.toml"),
        table.replace("[builtin.sizes]", "[sizes]"),
    )
    .unwrap();
    let args = ["model", "builtin", "--recipe", "b.toml", "--dir", "built"];
    let out = common::occult(d, &args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success() && err.contains("building the built-in model"),
        "{err}"
    );
    let printed = String::from_utf8(out.stdout).unwrap();
    assert!(printed.trim().ends_with("built/model"), "{printed}");
    assert!(d.join("built/model/model.safetensors").is_file());
    let recipe: serde_json::Value =
        serde_json::from_str(&read(&d.join("built/recipe.json"))).unwrap();
    assert_eq!(
        (recipe["hidden"].as_u64(), recipe["steps"].as_u64()),
        (Some(32), Some(20))
    );
    let again = common::occult(d, &args);
    assert!(again.status.success());
    assert!(!String::from_utf8_lossy(&again.stderr).contains("building"));
    std::fs::write(d.join("bad.toml"), "stepz = 3\n").unwrap();
    let err = common::occult_err(d, &["model", "builtin", "--recipe", "bad.toml"]);
    assert!(err.contains("stepz") && err.contains("bad.toml"), "{err}");
}

/// Every domain's instructions come in both forms, the question (as the tasks ask) and
/// completing the text: fine-tuning that saw one domain in one form only forgot how to answer
/// its questions (code fell from 0.96 to 0.68 after 300 steps).
#[test]
fn every_domain_is_instructed_in_both_forms() {
    let dir = tempfile::tempdir().unwrap();
    write_data(dir.path(), &World::new(3), small(), 3).unwrap();
    let lines: Vec<serde_json::Value> = read(&dir.path().join("instructions/train.jsonl"))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // (domain, a word only its texts have)
    for (domain, word) in [
        ("arithmetic", " plus "),
        ("facts", " lives in"),
        ("code", "print"),
    ] {
        let (mut asked, mut completed) = (0, 0);
        for l in &lines {
            let (ins, input) = (
                l["instruction"].as_str().unwrap(),
                l["input"].as_str().unwrap(),
            );
            if input.is_empty()
                && (ins.contains(word) || domain == "facts" && ins.contains("where does"))
            {
                asked += 1;
            } else if input.contains(word) {
                completed += 1;
            }
        }
        assert!(
            asked > 0 && completed > 0,
            "{domain}: {asked} asked, {completed} completed"
        );
    }
}
