//! The document preprocessing some tasks need before their templates apply, as
//! lm-evaluation-harness defines it. Each adds fields to the document:
//! - `hellaswag`: `query` and `endings_pre` (`hellaswag/utils.py`);
//! - `winogrande`: `contexts` (the sentence up to the blank, with each option) and `target`
//!   (the rest of the sentence);
//! - `copa`: `text` (the premise with "because"/"therefore") and `choices_pre`.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

/// The preprocessors a task file may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Preprocess {
    None,
    Hellaswag,
    Winogrande,
    Copa,
}

fn field<'a>(doc: &'a Value, key: &str) -> Result<&'a str> {
    doc.get(key)
        .and_then(Value::as_str)
        .with_context(|| format!("no string field `{key}`"))
}

/// HellaSwag's `preprocess`: strip, `" [title]"` to `". "`, drop `[...]`, one pass of double
/// spaces to single.
pub fn hellaswag_pre(text: &str) -> String {
    let t = text.trim().replace(" [title]", ". ");
    let mut out = String::with_capacity(t.len());
    let mut rest = t.as_str();
    // Non-greedy `\[.*?\]`: from each `[` to the next `]`.
    while let Some(i) = rest.find('[') {
        match rest[i..].find(']') {
            Some(j) => {
                out.push_str(&rest[..i]);
                rest = &rest[i + j + 1..];
            }
            None => break,
        }
    }
    out.push_str(rest);
    out.replace("  ", " ")
}

/// Python's `str.capitalize`: the first character upper-cased, the rest lower-cased.
pub fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f
            .to_uppercase()
            .chain(c.flat_map(char::to_lowercase))
            .collect(),
        None => String::new(),
    }
}

/// Applies `p` to a document, returning it with the added fields.
pub fn apply(p: Preprocess, doc: &Value) -> Result<Value> {
    let mut d = doc.clone();
    let Some(obj) = d.as_object_mut() else {
        bail!("a document must be a JSON object");
    };
    match p {
        Preprocess::None => {}
        Preprocess::Hellaswag => {
            let ctx = format!(
                "{}: {} {}",
                field(doc, "activity_label")?,
                field(doc, "ctx_a")?,
                capitalize(field(doc, "ctx_b")?)
            );
            obj.insert("query".into(), json!(hellaswag_pre(&ctx)));
            let endings = doc
                .get("endings")
                .and_then(Value::as_array)
                .context("no list field `endings`")?;
            let pre: Vec<String> = endings
                .iter()
                .map(|e| e.as_str().map(hellaswag_pre))
                .collect::<Option<_>>()
                .context("`endings` holds a non-string")?;
            obj.insert("endings_pre".into(), json!(pre));
        }
        Preprocess::Winogrande => {
            let s = field(doc, "sentence")?;
            let i = s.find('_').context("`sentence` has no `_` blank")?;
            let contexts = [
                format!("{}{}", &s[..i], field(doc, "option1")?),
                format!("{}{}", &s[..i], field(doc, "option2")?),
            ];
            obj.insert("contexts".into(), json!(contexts));
            obj.insert("target".into(), json!(s[i + 1..].trim()));
        }
        Preprocess::Copa => {
            let premise = field(doc, "premise")?.trim();
            let connector = match field(doc, "question")? {
                "cause" => "because",
                "effect" => "therefore",
                q => bail!("`question` is {q:?}, not \"cause\" or \"effect\""),
            };
            let mut cut = premise.chars();
            cut.next_back();
            obj.insert(
                "text".into(),
                json!(format!("{} {connector}", cut.as_str())),
            );
            let lower_first = |s: &str| {
                let mut c = s.chars();
                match c.next() {
                    Some(f) => f.to_lowercase().chain(c).collect::<String>(),
                    None => String::new(),
                }
            };
            let choices = [
                format!(" {}", lower_first(field(doc, "choice1")?)),
                format!(" {}", lower_first(field(doc, "choice2")?)),
            ];
            obj.insert("choices_pre".into(), json!(choices));
        }
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellaswag_rules_hand_checked() {
        assert_eq!(
            hellaswag_pre("  Cooking [title] Add  salt [step] then stir.  "),
            "Cooking. Add salt then stir."
        );
        assert_eq!(capitalize("tHE man"), "The man");
        let d = json!({"activity_label": "Baking", "ctx_a": "A cook mixes flour.",
            "ctx_b": "tHEN she", "endings": ["bakes [x]it.", " pours  it."]});
        let p = apply(Preprocess::Hellaswag, &d).unwrap();
        assert_eq!(p["query"], "Baking: A cook mixes flour. Then she");
        assert_eq!(p["endings_pre"], json!(["bakes it.", "pours it."]));
    }

    #[test]
    fn winogrande_and_copa_hand_checked() {
        let d = json!({"sentence": "The cup fell off the shelf because _ was tilted.",
            "option1": "the cup", "option2": "the shelf", "answer": "2"});
        let p = apply(Preprocess::Winogrande, &d).unwrap();
        assert_eq!(
            p["contexts"],
            json!([
                "The cup fell off the shelf because the cup",
                "The cup fell off the shelf because the shelf"
            ])
        );
        assert_eq!(p["target"], "was tilted.");
        let c = json!({"premise": "The road was wet.", "choice1": "It rained.",
            "choice2": "The sun shone.", "question": "cause", "label": 0});
        let p = apply(Preprocess::Copa, &c).unwrap();
        assert_eq!(p["text"], "The road was wet because");
        assert_eq!(p["choices_pre"], json!([" it rained.", " the sun shone."]));
        assert!(apply(
            Preprocess::Copa,
            &json!({"premise": "x", "choice1": "a",
            "choice2": "b", "question": "why"})
        )
        .is_err());
    }
}
