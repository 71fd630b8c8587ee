//! The built-in model's data, written to a folder: pre-training and calibration text, an
//! instruction set in Alpaca format (train and held-out), one multiple-choice task per domain
//! in the project's task format with its data, a generative task on the arithmetic questions,
//! and the word-level tokenizer that covers them all. Everything is generated from one seed.
//!
//! ```text
//! DIR/pretrain.jsonl            {"text": ...}: documents mixing the four domains
//! DIR/calibration.jsonl         {"text": ...}: other documents, for routing profiles
//! DIR/instructions/train.jsonl  {"instruction", "input", "output"}
//! DIR/instructions/held_out.jsonl
//! DIR/tasks/builtin_DOMAIN.toml the task builtin_DOMAIN: context, choices, label
//! DIR/tasks/builtin_arithmetic_gen.toml  the arithmetic questions answered in writing
//! DIR/tasks/DOMAIN/test.jsonl   scored items; train.jsonl: few-shot items
//! DIR/tokenizer.json
//! ```

use super::vocab::{tokenizer_json, vocabulary};
use super::world::{documents, item, Domain, Item, World};
use anyhow::{Context, Result};
use occult_core::atomic::write_atomic;
use occult_train::examples::{PROMPT_NO_INPUT, PROMPT_WITH_INPUT};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::path::Path;

/// How much of everything to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataSizes {
    /// Documents of plain sentences in the pre-training text.
    pub pretrain_docs: usize,
    /// Questions answered in the Alpaca template, mixed into the pre-training text (the domains
    /// in turn), so that the start answers in the format its tasks ask in.
    pub pretrain_questions: usize,
    pub calibration_docs: usize,
    /// Sentences per document.
    pub sentences: usize,
    pub instructions: usize,
    pub held_out: usize,
    /// Scored items per task.
    pub task_items: usize,
}

impl Default for DataSizes {
    fn default() -> Self {
        DataSizes {
            pretrain_docs: 4000,
            pretrain_questions: 8000,
            calibration_docs: 64,
            sentences: 8,
            instructions: 2000,
            held_out: 200,
            task_items: 1000,
        }
    }
}

/// A task's name.
pub fn task_name(d: Domain) -> String {
    format!("builtin_{}", d.name())
}

/// The task file of a domain.
pub fn task_toml(d: Domain) -> String {
    let about = match d {
        Domain::Arithmetic => "sums and differences of numbers below 20",
        Domain::Facts => "where the people of the built-in world live, their jobs and pets",
        Domain::Grammar => "subject-verb agreement across a distracting noun",
        Domain::Code => "the value a three-line program prints",
    };
    format!(
        "name = \"{}\"\nabout = \"The built-in model's {} task: {about}.\"\n\
         metrics = [\"acc\", \"acc_norm\"]\n\n[data]\nhub = \"occult/{}\"\n\
         eval_split = \"test\"\nfewshot_split = \"train\"\n\n[prompt]\n\
         # The question in the Alpaca template, as the model answers instructions.\n\
         text = {}\nchoices_field = \"choices\"\ngold = \"label\"\n",
        task_name(d),
        d.name(),
        task_name(d),
        serde_json::to_string(&alpaca_prompt("{instruction}")).expect("a string")
    )
}

/// The domain whose questions are also asked for a written answer: arithmetic, where a model
/// that ranks the right sum first may still fail to write it.
pub const GENERATIVE: Domain = Domain::Arithmetic;

/// The generative task's name.
pub fn gen_task_name(d: Domain) -> String {
    format!("builtin_{}_gen", d.name())
}

/// The generative task file of a domain: its questions in the Alpaca template, the answer
/// generated greedily (up to 8 tokens) and scored by exact match against the right choice.
/// It reads the multiple-choice task's data folder.
pub fn gen_task_toml(d: Domain) -> String {
    format!(
        "name = \"{}\"\nabout = \"The built-in model's {} questions, the answer written, not \
         chosen, and scored by exact match.\"\noutput_type = \"generate_until\"\n\n[data]\n\
         hub = \"occult/{}\"\neval_split = \"test\"\nfewshot_split = \"train\"\n\n[prompt]\n\
         text = {}\ntarget = \"{{choices[label]}}\"\n\n[generation]\nuntil = [\"\\n\"]\n\
         max_gen_toks = 8\n",
        gen_task_name(d),
        d.name(),
        task_name(d),
        serde_json::to_string(&alpaca_prompt("{instruction}")).expect("a string")
    )
}

/// The Alpaca prompt (no input) of an instruction.
pub fn alpaca_prompt(instruction: &str) -> String {
    PROMPT_NO_INPUT.replace("{instruction}", instruction)
}

/// An item as a task document: the choices shuffled, `label` the right one's index.
fn task_doc(it: &Item, r: &mut ChaCha8Rng) -> Value {
    let mut order: Vec<usize> = (0..it.choices.len()).collect();
    order.shuffle(r);
    let label = order
        .iter()
        .position(|&i| i == 0)
        .expect("the right answer");
    let choices: Vec<&String> = order.iter().map(|&i| &it.choices[i]).collect();
    json!({"context": it.context, "instruction": it.instruction, "choices": choices, "label": label})
}

/// An item as an instruction: the question form, or (every other one of its domain)
/// completing the text. `i` counts the items, the domains in turn, so each domain gets both
/// forms.
fn instruction(it: &Item, i: usize) -> Value {
    if (i / Domain::ALL.len()).is_multiple_of(2) {
        json!({"instruction": it.instruction, "input": "", "output": it.choices[0]})
    } else {
        json!({"instruction": "complete the text .", "input": it.context, "output": it.choices[0]})
    }
}

fn write_lines(path: &Path, lines: &[Value]) -> Result<()> {
    write_atomic(path, |w| {
        for l in lines {
            writeln!(w, "{l}")?;
        }
        Ok(())
    })
    .with_context(|| format!("writing {}", path.display()))
}

/// `n` items, each domain in turn, drawn with `r`, preferring contexts not in `seen` (so that
/// held-out and scored questions are new where the domain has enough of them; the world's
/// facts are few, so those repeat).
fn fresh_items(
    world: &World,
    n: usize,
    r: &mut ChaCha8Rng,
    seen: &mut std::collections::HashSet<String>,
    domains: &[Domain],
) -> Vec<Item> {
    (0..n)
        .map(|i| {
            let d = domains[i % domains.len()];
            let mut it = item(world, d, r);
            for _ in 0..50 {
                if !seen.contains(&it.context) {
                    break;
                }
                it = item(world, d, r);
            }
            seen.insert(it.context.clone());
            it
        })
        .collect()
}

/// Writes the built-in data for `world` into `dir`; returns the vocabulary size.
pub fn write_data(dir: &Path, world: &World, sizes: DataSizes, seed: u64) -> Result<usize> {
    std::fs::create_dir_all(dir.join("instructions"))
        .with_context(|| format!("creating {}", dir.display()))?;
    // Pre-training text: documents of sentences, and questions answered in the Alpaca
    // template, so that the start already follows instructions, as chat-ready base models do.
    let mut pretrain = documents(world, sizes.pretrain_docs, sizes.sentences, seed);
    let mut r = ChaCha8Rng::seed_from_u64(seed + 3);
    for i in 0..sizes.pretrain_questions {
        let it = item(world, Domain::ALL[i % Domain::ALL.len()], &mut r);
        pretrain.push(format!(
            "{}{}",
            alpaca_prompt(&it.instruction),
            it.choices[0]
        ));
    }
    pretrain.shuffle(&mut r);
    let calibration = documents(world, sizes.calibration_docs, sizes.sentences, seed + 1);
    let text_lines =
        |docs: &[String]| -> Vec<Value> { docs.iter().map(|d| json!({ "text": d })).collect() };
    write_lines(&dir.join("pretrain.jsonl"), &text_lines(&pretrain))?;
    write_lines(&dir.join("calibration.jsonl"), &text_lines(&calibration))?;
    let mut r = ChaCha8Rng::seed_from_u64(seed + 2);
    let mut seen = std::collections::HashSet::new();
    // Scored items first, so that instructions avoid their contexts where the domain has enough
    // others (facts, arithmetic and grammar have too few: docs/reproduce.md gives the overlap).
    let mut all_texts: Vec<String> = Vec::new();
    for d in Domain::ALL {
        let test = fresh_items(world, sizes.task_items, &mut r, &mut seen, &[d]);
        let train = fresh_items(world, 10, &mut r, &mut seen, &[d]);
        let folder = dir.join("tasks").join(d.name());
        std::fs::create_dir_all(&folder)
            .with_context(|| format!("creating {}", folder.display()))?;
        for (split, items) in [("test", &test), ("train", &train)] {
            let docs: Vec<Value> = items.iter().map(|it| task_doc(it, &mut r)).collect();
            write_lines(&folder.join(format!("{split}.jsonl")), &docs)?;
            all_texts.extend(
                items
                    .iter()
                    .flat_map(|it| [it.context.clone(), it.instruction.clone()])
                    .chain(items.iter().flat_map(|it| it.choices.clone())),
            );
        }
        let mut files = vec![(task_name(d), task_toml(d))];
        if d == GENERATIVE {
            files.push((gen_task_name(d), gen_task_toml(d)));
        }
        for (name, toml) in files {
            let path = dir.join("tasks").join(format!("{name}.toml"));
            write_atomic(&path, |w| w.write_all(toml.as_bytes()))
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    let held = fresh_items(world, sizes.held_out, &mut r, &mut seen, &Domain::ALL);
    let train = fresh_items(world, sizes.instructions, &mut r, &mut seen, &Domain::ALL);
    let as_instructions = |items: &[Item]| -> Vec<Value> {
        items
            .iter()
            .enumerate()
            .map(|(i, it)| instruction(it, i))
            .collect()
    };
    let (held, train) = (as_instructions(&held), as_instructions(&train));
    write_lines(&dir.join("instructions/held_out.jsonl"), &held)?;
    write_lines(&dir.join("instructions/train.jsonl"), &train)?;
    for v in held.iter().chain(&train) {
        for k in ["instruction", "input", "output"] {
            all_texts.push(v[k].as_str().unwrap_or_default().to_string());
        }
    }
    let vocab = vocabulary(
        pretrain
            .iter()
            .chain(&calibration)
            .chain(&all_texts)
            .map(String::as_str)
            .chain([PROMPT_NO_INPUT, PROMPT_WITH_INPUT]),
    );
    let path = dir.join("tokenizer.json");
    let text = serde_json::to_string(&tokenizer_json(&vocab))?;
    write_atomic(&path, |w| w.write_all(text.as_bytes()))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(vocab.len())
}
