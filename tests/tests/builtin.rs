//! The built-in model's data: the same from the same seed, every task readable by the harness
//! with its gold answer right, the instructions readable by occult-train, and no word of any
//! text outside the tokenizer's vocabulary.

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
