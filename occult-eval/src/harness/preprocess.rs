//! The document preprocessing some tasks need before their templates apply, as
//! lm-evaluation-harness defines it. Each adds fields to the document:
//! - `hellaswag`: `query` and `endings_pre` (`hellaswag/utils.py`);
//! - `winogrande`: `contexts` (the sentence up to the blank, with each option) and `target`
//!   (the rest of the sentence);
//! - `copa`: `text` (the premise with "because"/"therefore") and `choices_pre`;
//! - `wsc`: `text_pre` (the passage with the pronoun starred, detokenised, and the question);
//! - `mathqa`: `choices_pre` (the five options parsed out of `options`);
//! - `race`: `text_pre` (the article with the earlier questions answered, then the last
//!   question), `choices_pre` and `answer_pre` (the last question's options and answer).

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

/// The preprocessors a task file may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Preprocess {
    None,
    Hellaswag,
    Winogrande,
    Copa,
    Wsc,
    Mathqa,
    Race,
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
    // Non-greedy `\[.*?\]` (`.` stops at newlines): from a `[` to the next `]` on its line.
    while let Some(i) = rest.find('[') {
        let line_end = rest[i..].find('\n').map_or(rest.len(), |n| i + n);
        match rest[i..line_end].find(']') {
            Some(j) => {
                out.push_str(&rest[..i]);
                rest = &rest[i + j + 1..];
            }
            None => {
                out.push_str(&rest[..=i]);
                rest = &rest[i + 1..];
            }
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
        Preprocess::Hellaswag => hellaswag(doc, obj)?,
        Preprocess::Winogrande => winogrande(doc, obj)?,
        Preprocess::Copa => copa(doc, obj)?,
        Preprocess::Wsc => wsc(doc, obj)?,
        Preprocess::Mathqa => mathqa(doc, obj)?,
        Preprocess::Race => race(doc, obj)?,
    }
    Ok(d)
}

/// HellaSwag: `query` (the activity label, both contexts, cleaned) and `endings_pre`.
fn hellaswag(doc: &Value, obj: &mut Map<String, Value>) -> Result<()> {
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
    Ok(())
}

/// Winogrande: a context per option (the sentence up to the blank, with the option) and
/// `target` (the rest of the sentence).
fn winogrande(doc: &Value, obj: &mut Map<String, Value>) -> Result<()> {
    let s = field(doc, "sentence")?;
    let i = s.find('_').context("`sentence` has no `_` blank")?;
    let contexts = [
        format!("{}{}", &s[..i], field(doc, "option1")?),
        format!("{}{}", &s[..i], field(doc, "option2")?),
    ];
    obj.insert("contexts".into(), json!(contexts));
    obj.insert("target".into(), json!(s[i + 1..].trim()));
    Ok(())
}

/// COPA: `text` (the premise with its connector) and `choices_pre` (each choice lower-cased
/// first, after a space).
fn copa(doc: &Value, obj: &mut Map<String, Value>) -> Result<()> {
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
    Ok(())
}

/// WSC: `text_pre`, the passage with the pronoun marked and the question.
fn wsc(doc: &Value, obj: &mut Map<String, Value>) -> Result<()> {
    let text = field(doc, "text")?;
    let span2 = field(doc, "span2_text")?;
    let span1 = field(doc, "span1_text")?;
    let index = doc
        .get("span2_index")
        .and_then(Value::as_u64)
        .context("no integer field `span2_index`")? as usize;
    // Word indices, as the hub stores them; `post` slices characters after `pre`.
    let pre = text
        .split_whitespace()
        .take(index)
        .collect::<Vec<_>>()
        .join(" ");
    let skip = pre.chars().count() + span2.chars().count() + 1;
    let post: String = text.chars().skip(skip).collect();
    let passage = detokenize(&format!("{pre} *{span2}*{post}"));
    obj.insert(
        "text_pre".into(),
        json!(format!(
            "Passage: {passage}\nQuestion: In the passage above, does the pronoun \
             \"*{span2}*\" refer to \"*{span1}*\"?\nAnswer:"
        )),
    );
    Ok(())
}

/// MathQA: `choices_pre`, the options split.
fn mathqa(doc: &Value, obj: &mut Map<String, Value>) -> Result<()> {
    let choices = mathqa_options(field(doc, "options")?);
    obj.insert("choices_pre".into(), json!(choices));
    Ok(())
}

/// RACE: `text_pre` (the article and every problem but the last, answered, then the last
/// question), `choices_pre` and `answer_pre` of the last problem.
fn race(doc: &Value, obj: &mut Map<String, Value>) -> Result<()> {
    let problems = python_literal(field(doc, "problems")?)
        .context("`problems` is not a Python literal list")?;
    let problems = problems
        .as_array()
        .filter(|a| !a.is_empty())
        .context("`problems` is not a non-empty list")?;
    let answer_of = |p: &Value| -> Result<(usize, String)> {
        let letter = p
            .get("answer")
            .and_then(Value::as_str)
            .context("a problem has no `answer`")?;
        let i = ["A", "B", "C", "D", "E"]
            .iter()
            .position(|l| *l == letter)
            .with_context(|| format!("answer {letter:?} is not A-E"))?;
        let opt = p
            .get("options")
            .and_then(|o| o.get(i))
            .and_then(Value::as_str)
            .with_context(|| format!("no option {letter}"))?;
        Ok((i, opt.to_string()))
    };
    let question = |p: &Value| -> Result<String> {
        p.get("question")
            .and_then(Value::as_str)
            .map(String::from)
            .context("a problem has no `question`")
    };
    let mut text = format!("Article: {}\n\n", field(doc, "article")?);
    let (last, earlier) = problems.split_last().expect("non-empty");
    for p in earlier {
        let q = question(p)?;
        let (_, answer) = answer_of(p)?;
        if q.ends_with("  _  .") {
            // A fill-in question: the harness keeps all but its last five characters
            // (`question[:-5]`, code points) and appends the answer.
            let n = q.chars().count();
            let head: String = q.chars().take(n - 5).collect();
            text.push_str(&format!("{head}{answer}\n"));
        } else {
            text.push_str(&format!("Question: {q}\nAnswer: {answer}\n"));
        }
    }
    text.push_str(&question(last)?);
    let options: Vec<String> = (0..4)
        .map(|i| {
            last.get("options")
                .and_then(|o| o.get(i))
                .and_then(Value::as_str)
                .map(String::from)
                .with_context(|| format!("the last problem has no option {i}"))
        })
        .collect::<Result<_>>()?;
    obj.insert("text_pre".into(), json!(text));
    obj.insert("choices_pre".into(), json!(options));
    obj.insert("answer_pre".into(), json!(answer_of(last)?.0));
    Ok(())
}

/// The harness's `general_detokenize`.
pub fn detokenize(s: &str) -> String {
    let mut t = s
        .replace(" n't", "n't")
        .replace(" )", ")")
        .replace("( ", "(")
        .replace("\" ", "\"")
        .replace(" \"", "\"");
    for c in ["'", ".", ","] {
        t = t.replace(&format!(" {c}"), c);
    }
    t
}

/// MathQA's options: the matches of `[abcd] \) .*?, ` and `e \) .*?$`, each without its first
/// four characters and trailing spaces and commas.
pub fn mathqa_options(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let rest = &s[i..];
        let head = rest.as_bytes();
        let is_opt = head.len() >= 4 && &head[1..4] == b" ) ";
        if is_opt && matches!(head[0], b'a'..=b'd') {
            if let Some(j) = rest[4..].find(", ") {
                let m = &rest[..4 + j + 2];
                out.push(m[4..].trim_end_matches([' ', ',']).to_string());
                i += m.len();
                continue;
            }
        } else if is_opt && head[0] == b'e' {
            out.push(rest[4..].trim_end_matches([' ', ',']).to_string());
            break;
        }
        i += rest.chars().next().map_or(1, char::len_utf8);
    }
    out
}

/// Parses a Python literal of strings, numbers, booleans, None, lists and dicts (what
/// `ast.literal_eval` reads in RACE's `problems`).
pub fn python_literal(s: &str) -> Result<Value> {
    let chars: Vec<char> = s.chars().collect();
    let mut pos = 0;
    let v = py_value(&chars, &mut pos)?;
    skip_ws(&chars, &mut pos);
    if pos != chars.len() {
        bail!("trailing text at character {pos}");
    }
    Ok(v)
}

fn skip_ws(c: &[char], pos: &mut usize) {
    while *pos < c.len() && c[*pos].is_whitespace() {
        *pos += 1;
    }
}

fn py_value(c: &[char], pos: &mut usize) -> Result<Value> {
    skip_ws(c, pos);
    let Some(&ch) = c.get(*pos) else {
        bail!("unexpected end");
    };
    match ch {
        '\'' | '"' => {
            *pos += 1;
            let mut out = String::new();
            while let Some(&x) = c.get(*pos) {
                *pos += 1;
                if x == ch {
                    return Ok(Value::String(out));
                }
                if x != '\\' {
                    out.push(x);
                    continue;
                }
                let e = *c.get(*pos).context("a string ends in a backslash")?;
                *pos += 1;
                match e {
                    'n' => out.push('\n'),
                    't' => out.push('\t'),
                    'r' => out.push('\r'),
                    'x' | 'u' => {
                        let n = if e == 'x' { 2 } else { 4 };
                        let hex: String = c
                            .get(*pos..*pos + n)
                            .context("a short escape")?
                            .iter()
                            .collect();
                        *pos += n;
                        let code = u32::from_str_radix(&hex, 16).context("a bad escape")?;
                        out.push(char::from_u32(code).context("a bad escape")?);
                    }
                    other => out.push(other),
                }
            }
            bail!("a string is never closed")
        }
        '[' | '{' => {
            let close = if ch == '[' { ']' } else { '}' };
            *pos += 1;
            let mut list = Vec::new();
            let mut map = serde_json::Map::new();
            loop {
                skip_ws(c, pos);
                if c.get(*pos) == Some(&close) {
                    *pos += 1;
                    break;
                }
                let v = py_value(c, pos)?;
                if ch == '{' {
                    skip_ws(c, pos);
                    if c.get(*pos) != Some(&':') {
                        bail!("expected `:` at character {}", *pos);
                    }
                    *pos += 1;
                    let key = v
                        .as_str()
                        .context("a dict key is not a string")?
                        .to_string();
                    map.insert(key, py_value(c, pos)?);
                } else {
                    list.push(v);
                }
                skip_ws(c, pos);
                match c.get(*pos) {
                    Some(',') => *pos += 1,
                    Some(x) if *x == close => {}
                    _ => bail!("expected `,` or `{close}` at character {}", *pos),
                }
            }
            Ok(if ch == '[' {
                Value::Array(list)
            } else {
                Value::Object(map)
            })
        }
        _ => {
            let start = *pos;
            while *pos < c.len()
                && !matches!(c[*pos], ',' | ']' | '}' | ':')
                && !c[*pos].is_whitespace()
            {
                *pos += 1;
            }
            let word: String = c[start..*pos].iter().collect();
            match word.as_str() {
                "True" => Ok(Value::Bool(true)),
                "False" => Ok(Value::Bool(false)),
                "None" => Ok(Value::Null),
                w => serde_json::from_str::<serde_json::Number>(w)
                    .map(Value::Number)
                    .with_context(|| format!("{w:?} is not a literal")),
            }
        }
    }
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
        // A `[` without a `]` on its line stays.
        assert_eq!(hellaswag_pre("a [b\nc] d"), "a [b\nc] d");
        let d = json!({"activity_label": "Baking", "ctx_a": "A cook mixes flour.",
            "ctx_b": "tHEN she", "endings": ["bakes [x]it.", " pours  it."]});
        let p = apply(Preprocess::Hellaswag, &d).unwrap();
        assert_eq!(p["query"], "Baking: A cook mixes flour. Then she");
        assert_eq!(p["endings_pre"], json!(["bakes it.", "pours it."]));
    }

    #[test]
    fn race_is_lm_eval_0_4_13s_on_the_samples() {
        // What lm-evaluation-harness's own preprocess_race.py made of the built-in samples
        // (scripts/make_race_fixtures.py); one has an earlier fill-in question.
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
        let docs =
            std::fs::read_to_string(format!("{root}/tasks/samples/race/test.jsonl")).unwrap();
        let want: Value = serde_json::from_str(
            &std::fs::read_to_string(format!("{root}/tests/fixtures/lmeval_race.json")).unwrap(),
        )
        .unwrap();
        let want = want["docs"].as_array().unwrap();
        let docs: Vec<Value> = docs
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(docs.len(), want.len());
        for (d, w) in docs.iter().zip(want) {
            let p = apply(Preprocess::Race, d).unwrap();
            assert_eq!(p["text_pre"], w["text"]);
            assert_eq!(p["choices_pre"], w["choices"]);
            assert_eq!(p["answer_pre"], w["gold"]);
        }
    }

    #[test]
    fn wsc_mathqa_and_race_hand_checked() {
        let d = json!({"text": "Mark told Pete many lies about himself , which Pete included in his book .",
            "span1_index": 0, "span1_text": "Mark", "span2_index": 6, "span2_text": "himself",
            "label": 1});
        let p = apply(Preprocess::Wsc, &d).unwrap();
        assert_eq!(
            p["text_pre"],
            "Passage: Mark told Pete many lies about *himself*, which Pete included in his book.\n\
             Question: In the passage above, does the pronoun \"*himself*\" refer to \"*Mark*\"?\n\
             Answer:"
        );
        assert_eq!(
            detokenize("he did n't ( really ) say \" hi \" ."),
            "he didn't (really) say\"hi\"."
        );
        assert_eq!(
            mathqa_options("a ) 38 , b ) 27.6 , c ) 1,200 , d ) - 4 , e ) none"),
            vec!["38", "27.6", "1,200", "- 4", "none"]
        );
        let r = json!({"article": "Tom has a cat.", "problems":
            "[{'answer': 'B', 'options': ['a dog', 'a cat', 'a fish', 'a bird'], 'question': 'Tom has  _  .'}, {'answer': 'A', 'options': ['yes', 'no', \"don't know\", 'maybe'], 'question': 'Is it Tom\\'s?'}]"});
        let p = apply(Preprocess::Race, &r).unwrap();
        assert_eq!(
            p["text_pre"],
            "Article: Tom has a cat.\n\nTom has a cat\nIs it Tom's?"
        );
        assert_eq!(
            p["choices_pre"],
            json!(["yes", "no", "don't know", "maybe"])
        );
        assert_eq!(p["answer_pre"], 0);
        assert!(python_literal("[{'a': 1, 'b': [True, None, -2.5]}]").is_ok());
        assert_eq!(mathqa_options("é ) x , e ) y"), vec!["y"]);
        assert!(python_literal("[{'a' 1}]").is_err());
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
