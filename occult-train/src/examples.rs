//! Training examples: token ids and, per position, whether the loss falls on it.
//!
//! - **Instructions** (Alpaca: `instruction`, optional `input`, `output`): the Stanford Alpaca
//!   prompt template, with or without an input, then the output and EOS. The loss falls on the
//!   output's tokens and EOS only, as Alpaca's `train.py` masks the prompt's tokens.
//! - **Plain text** (`text`): documents joined with EOS and packed into windows of the sequence
//!   length; the loss falls on every position.
//!
//! Both are cut at the sequence length.

use crate::{Error, Result};
use occult_core::models::tokenizer::TextTokenizer;
use serde_json::Value;

/// The Alpaca template for records with an input.
pub const PROMPT_WITH_INPUT: &str =
    "Below is an instruction that describes a task, paired with an \
input that provides further context. Write a response that appropriately completes the request.\n\n\
### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";

/// The Alpaca template for records without one.
pub const PROMPT_NO_INPUT: &str = "Below is an instruction that describes a task. Write a \
response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n\
### Response:\n";

/// One training sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Example {
    pub ids: Vec<u32>,
    /// `target[i]`: the loss counts the prediction of `ids[i]` (from the positions before it).
    pub target: Vec<bool>,
}

impl Example {
    /// Positions the loss counts.
    pub fn targets(&self) -> usize {
        self.target.iter().filter(|&&t| t).count()
    }
}

/// An instruction record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instruction {
    pub instruction: String,
    pub input: String,
    pub output: String,
}

impl Instruction {
    /// Reads `instruction`, `input` (optional, may be empty) and `output` from a record;
    /// `origin` names it in errors.
    pub fn from_record(v: &Value, origin: &str) -> Result<Self> {
        let field = |k: &str, required: bool| -> Result<String> {
            match v.get(k) {
                Some(Value::String(s)) => Ok(s.clone()),
                None | Some(Value::Null) if !required => Ok(String::new()),
                None | Some(Value::Null) => Err(Error::Invalid(format!(
                    "{origin}: no `{k}` (instruction records need `instruction` and `output`)"
                ))),
                Some(other) => Err(Error::Invalid(format!(
                    "{origin}: `{k}` is {other}, not a string"
                ))),
            }
        };
        Ok(Instruction {
            instruction: field("instruction", true)?,
            input: field("input", false)?,
            output: field("output", true)?,
        })
    }

    /// The prompt: the Alpaca template filled in.
    pub fn prompt(&self) -> String {
        if self.input.is_empty() {
            PROMPT_NO_INPUT.replace("{instruction}", &self.instruction)
        } else {
            PROMPT_WITH_INPUT
                .replace("{instruction}", &self.instruction)
                .replace("{input}", &self.input)
        }
    }

    /// Tokenises prompt + output + EOS, cut at `seq_len` tokens; the loss falls on the output
    /// and EOS. `None` when the prompt leaves no room for any of the response.
    pub fn encode(
        &self,
        tok: &TextTokenizer,
        seq_len: usize,
        add_bos: bool,
    ) -> Result<Option<Example>> {
        let eos = *tok.eos.first().ok_or_else(|| {
            Error::Invalid("the tokenizer has no end-of-sequence token to end responses".into())
        })?;
        let prompt = self.prompt();
        let source = tok.encode(&prompt, add_bos)?;
        let mut ids = tok.encode(&format!("{prompt}{}", self.output), add_bos)?;
        ids.push(eos);
        // The prompt's tokens are those it encodes to alone (as Alpaca's train.py counts them).
        let masked = source.len().min(ids.len());
        ids.truncate(seq_len);
        if masked >= ids.len() {
            return Ok(None);
        }
        let target = (0..ids.len()).map(|i| i >= masked).collect();
        Ok(Some(Example { ids, target }))
    }
}

/// Packs documents (each followed by EOS) into windows of `seq_len` tokens; the loss falls on
/// every position but the first of each window (nothing precedes it). The last window may be
/// shorter.
pub fn pack_text(
    docs: &[String],
    tok: &TextTokenizer,
    seq_len: usize,
    add_bos: bool,
) -> Result<Vec<Example>> {
    if seq_len < 2 {
        return Err(Error::Invalid(format!(
            "a sequence length of {seq_len} leaves nothing to predict"
        )));
    }
    let eos = tok.eos.first().copied();
    let mut stream = Vec::new();
    for d in docs {
        stream.extend(tok.encode(d, add_bos)?);
        stream.extend(eos);
    }
    Ok(stream
        .chunks(seq_len)
        .filter(|w| w.len() >= 2)
        .map(|w| Example {
            ids: w.to_vec(),
            target: (0..w.len()).map(|i| i > 0).collect(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_alpaca_templates_word_for_word() {
        let r = Instruction::from_record(
            &json!({"instruction": "Add 2 and 3.", "input": "", "output": "5"}),
            "a.json row 0",
        )
        .unwrap();
        assert_eq!(
            r.prompt(),
            "Below is an instruction that describes a task. Write a response that appropriately \
             completes the request.\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n"
        );
        let r = Instruction {
            input: "3, 4".into(),
            ..r
        };
        assert_eq!(
            r.prompt(),
            "Below is an instruction that describes a task, paired with an input that provides \
             further context. Write a response that appropriately completes the request.\n\n\
             ### Instruction:\nAdd 2 and 3.\n\n### Input:\n3, 4\n\n### Response:\n"
        );
    }

    #[test]
    fn records_without_instruction_or_output_are_named() {
        let e = Instruction::from_record(&json!({"instruction": "x"}), "d.jsonl line 4")
            .unwrap_err()
            .to_string();
        assert!(e.contains("d.jsonl line 4: no `output`"), "{e}");
        let e = Instruction::from_record(&json!({"instruction": 3, "output": "y"}), "o")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`instruction` is 3, not a string"), "{e}");
        // A missing or null input is an empty one.
        let r = Instruction::from_record(
            &json!({"instruction": "a", "output": "b", "input": null}),
            "o",
        )
        .unwrap();
        assert_eq!(r.input, "");
    }
}
