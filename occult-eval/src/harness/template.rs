//! Prompt templates over a document (a JSON object): `{field}` and `{field.sub}` insert a
//! field's text (strings as they are, numbers and booleans printed), `{field|strip}` strips
//! whitespace, `{field|lstrip}` strips it on the left, `{field|spaces}` turns `_` into spaces
//! (MMLU's subject names), `{field|after:SEP}` keeps the text after the last `SEP` (GSM8K's
//! final answer after `####`), filters apply in turn (`{answer|after:####|strip}`), and `{{` /
//! `}}` are literal braces.

use anyhow::{bail, Result};
use serde_json::Value;

/// The value at a dotted path (`choices.text`), if present.
pub fn lookup<'a>(doc: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(doc, |v, key| match v {
        Value::Object(m) => m.get(key),
        Value::Array(a) => key.parse::<usize>().ok().and_then(|i| a.get(i)),
        _ => None,
    })
}

/// A scalar as text; lists and objects are not text.
pub fn as_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Renders `template` with `doc`'s fields.
pub fn render(template: &str, doc: &Value) -> Result<String> {
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(i) = rest.find(['{', '}']) {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(after) = tail.strip_prefix("{{") {
            out.push('{');
            rest = after;
            continue;
        }
        if let Some(after) = tail.strip_prefix("}}") {
            out.push('}');
            rest = after;
            continue;
        }
        if tail.starts_with('}') {
            bail!("template {template:?}: a lone `}}` (write `}}}}` for a brace)");
        }
        let Some(end) = tail.find('}') else {
            bail!("template {template:?}: `{{` is never closed");
        };
        let spec = &tail[1..end];
        let mut parts = spec.split('|');
        let path = parts.next().unwrap_or_default().trim();
        let value = lookup(doc, path).ok_or_else(|| anyhow::anyhow!("no field `{path}`"))?;
        let mut text = as_text(value)
            .ok_or_else(|| anyhow::anyhow!("field `{path}` is not text (it is {value})"))?;
        // Filters apply in turn.
        for filter in parts {
            let filter = filter.trim();
            text = match filter {
                "strip" => text.trim().to_string(),
                "lstrip" => text.trim_start().to_string(),
                "spaces" => text.replace('_', " "),
                f => match f.strip_prefix("after:") {
                    // Python's `text.split(sep)[-1]`: the text after the last `sep`, or all
                    // of it.
                    Some(sep) if !sep.is_empty() => {
                        text.rsplit(sep).next().unwrap_or_default().to_string()
                    }
                    _ => bail!("template {template:?}: unknown filter `{f}`"),
                },
            };
        }
        out.push_str(&text);
        rest = &tail[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fields_paths_filters_and_braces() {
        let doc = json!({"q": "  Why?  ", "n": 3, "c": {"text": ["a", "b"]}});
        assert_eq!(
            render("Q: {q|strip} ({n}) {c.text.1} {{x}}", &doc).unwrap(),
            "Q: Why? (3) b {x}"
        );
        assert_eq!(render("{q|lstrip}|", &doc).unwrap(), "Why?  |");
        assert!(render("{missing}", &doc)
            .unwrap_err()
            .to_string()
            .contains("no field `missing`"));
        assert!(render("{c}", &doc)
            .unwrap_err()
            .to_string()
            .contains("not text"));
        assert!(render("{q", &doc).is_err());
        let a = json!({"answer": "3 + 4 = 7.\n#### 7 ", "plain": "The answer is 6."});
        assert_eq!(render("{answer|after:####|strip}", &a).unwrap(), "7");
        assert_eq!(
            render("{plain|after:####|strip}", &a).unwrap(),
            "The answer is 6."
        );
        assert!(render("{plain|after:}", &a).is_err());
        assert!(render("{q|upper}", &doc).is_err());
    }
}
