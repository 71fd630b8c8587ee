//! Prompt templates over a document (a JSON object): `{field}` and `{field.sub}` insert a
//! field's text (strings as they are, numbers and booleans printed), `{list[field]}` the item
//! of a list at the index another field holds (the gold choice), `{field|strip}` strips
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

/// The value a template names: a dotted path, or `list[field]`, a list's item at the index
/// another field holds (the gold choice, `choices[label]`).
fn resolve<'a>(doc: &'a Value, path: &str) -> Result<&'a Value> {
    let field = |p: &str| lookup(doc, p).ok_or_else(|| anyhow::anyhow!("no field `{p}`"));
    let Some((list, index)) = path.strip_suffix(']').and_then(|p| p.split_once('[')) else {
        return field(path);
    };
    let i = field(index.trim())?;
    let at = i
        .as_u64()
        .or_else(|| i.as_str().and_then(|s| s.trim().parse().ok()))
        .ok_or_else(|| anyhow::anyhow!("field `{index}` is not an index (it is {i})"))?;
    let items = field(list.trim())?
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("field `{list}` is not a list"))?;
    items.get(at as usize).ok_or_else(|| {
        anyhow::anyhow!(
            "`{path}`: index {at} is past the {} items of `{list}`",
            items.len()
        )
    })
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
        let value = resolve(doc, path)?;
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
        let mc = json!({"choices": ["1", "2", "7"], "label": 2, "s": "1", "big": 5});
        assert_eq!(render("{choices[label]}", &mc).unwrap(), "7");
        assert_eq!(render("{choices[s]}", &mc).unwrap(), "2");
        for (t, says) in [
            ("{choices[big]}", "past the 3 items"),
            ("{choices[nope]}", "no field `nope`"),
            ("{label[s]}", "not a list"),
            ("{choices[choices]}", "not an index"),
        ] {
            let e = render(t, &mc).unwrap_err().to_string();
            assert!(e.contains(says), "{t}: {e}");
        }
    }
}
