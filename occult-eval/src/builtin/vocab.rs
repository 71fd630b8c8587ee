//! The built-in model's tokenizer: a word-level `tokenizer.json` (lower-cased, split into runs
//! of word characters and runs of punctuation, as the `tokenizers` library's `Whitespace`
//! pre-tokenizer splits) whose vocabulary is every word the built-in texts use, with
//! `<|endoftext|>` as id 0 (BOS, EOS and lm-eval's prefix token) and `<unk>` as id 1.
//! transformers and the `tokenizers` library read it as they read any `tokenizer.json`.

use serde_json::{json, Value};
use std::collections::BTreeSet;

pub const EOT: &str = "<|endoftext|>";
pub const UNK: &str = "<unk>";

/// `text` as the tokenizer splits it: lower-cased runs of word characters (letters, digits,
/// `_`) and runs of other non-space characters.
pub fn words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut cur_word = false;
    for c in text.to_lowercase().chars() {
        if c.is_whitespace() {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            continue;
        }
        let word = c.is_alphanumeric() || c == '_';
        if !cur.is_empty() && word != cur_word {
            out.push(std::mem::take(&mut cur));
        }
        cur_word = word;
        cur.push(c);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The vocabulary of `texts`, sorted, after the two special tokens.
pub fn vocabulary<'a>(texts: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut set = BTreeSet::new();
    for t in texts {
        set.extend(words(t));
    }
    let mut v = vec![EOT.to_string(), UNK.to_string()];
    v.extend(set);
    v
}

/// The `tokenizer.json` of a vocabulary (ids in its order).
pub fn tokenizer_json(vocab: &[String]) -> Value {
    let ids: serde_json::Map<String, Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, w)| (w.clone(), json!(i)))
        .collect();
    let special = |id: usize, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, EOT), special(1, UNK)],
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": ids, "unk_token": UNK},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tokenizers_library_splits_as_we_do() {
        let texts = [
            "Below is an instruction.\n\n### Response:\n12",
            "let x = 4 ; print x ; # 7",
            "the wolves near the tree run .",
        ];
        let vocab = vocabulary(texts);
        assert_eq!(&vocab[..2], &[EOT.to_string(), UNK.to_string()]);
        let json = tokenizer_json(&vocab).to_string();
        let tok: tokenizers::Tokenizer = json.parse().unwrap();
        for t in texts {
            let enc = tok.encode(t, false).unwrap();
            let want: Vec<u32> = words(t)
                .iter()
                .map(|w| vocab.iter().position(|v| v == w).unwrap() as u32)
                .collect();
            assert_eq!(enc.get_ids(), want.as_slice(), "{t}");
            assert!(!enc.get_ids().contains(&1), "no unknown words in {t}");
        }
        assert_eq!(
            words("### Instruction:\nx"),
            ["###", "instruction", ":", "x"]
        );
        let unknown = tok.encode("zebra", false).unwrap();
        assert_eq!(unknown.get_ids(), &[1]);
    }
}
