//! What lm-evaluation-harness 0.4.13 does with a generated answer, step by step, as its
//! `generate_until` tasks (GSM8K) use them:
//! - [`cut_at_stops`]: the response is the decoded continuation split at each stop string in
//!   turn (`postprocess_generated_text`), after [`stop_sequences`] appends the EOS text;
//! - [`Filter`]: a named pipeline of steps over the response (`RegexFilter`: the
//!   `group_select`-th match of a pattern, its first non-empty group, stripped, or a fallback;
//!   `take_first`);
//! - [`ExactMatch`]: the `exact_match` metric (`exact_match_hf_evaluate`): the task's
//!   `regexes_to_ignore` removed from prediction and reference alike, then case and
//!   punctuation folded as the task says, then compared;
//!
//! Patterns are the task files' Python regular expressions, run on the `regex` crate, which
//! reads them alike (leftmost-first alternation, `.` stopping at `\n`). Python's `$` also
//! matches before a final newline; [`python_sub`] keeps that rule for a pattern that ends in `$`.

use anyhow::{bail, Context, Result};
use regex::Regex;
use serde::Deserialize;

/// The stop strings of a request: the task's `until`, and the EOS token's text appended if it
/// is not among them (`handle_stop_sequences`).
pub fn stop_sequences(until: &[String], eos_text: Option<&str>) -> Vec<String> {
    let mut out = until.to_vec();
    if let Some(e) = eos_text {
        if !out.iter().any(|u| u == e) {
            out.push(e.to_string());
        }
    }
    out
}

/// The response: `text` split at each stop string in turn, the part before it kept
/// (`for term in until: s = s.split(term)[0]`). Nothing is stripped.
pub fn cut_at_stops(text: &str, stops: &[String]) -> String {
    let mut s = text;
    for term in stops.iter().filter(|t| !t.is_empty()) {
        if let Some(at) = s.find(term.as_str()) {
            s = &s[..at];
        }
    }
    s.to_string()
}

/// Whether `c` is whitespace to Python's `str.strip()` (`str.isspace`), which adds the
/// information separators U+001C to U+001F to Unicode's White_Space.
fn python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// One step of a filter, as a task file names it.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(tag = "function", rename_all = "snake_case", deny_unknown_fields)]
pub enum Step {
    /// `RegexFilter`.
    Regex {
        regex_pattern: String,
        /// Which match: 0 the first, -1 the last (an index into the matches, not a group).
        #[serde(default)]
        group_select: i64,
        #[serde(default = "invalid")]
        fallback: String,
    },
    /// `take_first`: the first of a request's responses (one per repeat).
    TakeFirst,
}

fn invalid() -> String {
    "[invalid]".into()
}

/// A named pipeline of steps (a task's `filter_list` entry).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Filter {
    pub name: String,
    pub steps: Vec<Step>,
}

/// A [`Filter`] with its patterns compiled.
#[derive(Clone, Debug)]
pub struct CompiledFilter {
    pub name: String,
    steps: Vec<CompiledStep>,
}

#[derive(Clone, Debug)]
enum CompiledStep {
    Regex {
        re: Regex,
        group_select: i64,
        fallback: String,
    },
    TakeFirst,
}

impl Filter {
    /// Compiles the patterns; a pattern the regex engine cannot read is named.
    pub fn compile(&self) -> Result<CompiledFilter> {
        let steps = self
            .steps
            .iter()
            .map(|s| match s {
                Step::Regex {
                    regex_pattern,
                    group_select,
                    fallback,
                } => Ok(CompiledStep::Regex {
                    re: Regex::new(regex_pattern).with_context(|| {
                        format!("filter {:?}: pattern {regex_pattern:?}", self.name)
                    })?,
                    group_select: *group_select,
                    fallback: fallback.clone(),
                }),
                Step::TakeFirst => Ok(CompiledStep::TakeFirst),
            })
            .collect::<Result<Vec<_>>>()?;
        if !steps.iter().any(|s| matches!(s, CompiledStep::TakeFirst)) {
            bail!(
                "filter {:?} has no take_first step: each request's responses must become one \
                 answer",
                self.name
            );
        }
        Ok(CompiledFilter {
            name: self.name.clone(),
            steps,
        })
    }
}

/// `RegexFilter` on one response: the `group_select`-th match (negative from the end), its
/// first non-empty group (the whole match for a pattern without groups), stripped; the
/// fallback when there is no such match or every group is empty.
fn regex_select(re: &Regex, group_select: i64, fallback: &str, resp: &str) -> String {
    let matches: Vec<regex::Captures> = re.captures_iter(resp).collect();
    let n = matches.len() as i64;
    let at = if group_select < 0 {
        n + group_select
    } else {
        group_select
    };
    if at < 0 || at >= n {
        // Python indexes the list of matches: out of range is an error there too, except for
        // no match at all, the fallback. A task selects 0 or -1, in range whenever a match is.
        return fallback.to_string();
    }
    let caps = &matches[at as usize];
    let text = if re.captures_len() == 1 {
        caps.get(0).map(|m| m.as_str())
    } else if re.captures_len() == 2 {
        Some(caps.get(1).map_or("", |m| m.as_str()))
    } else {
        // findall gives a tuple of groups; the filter takes the first non-empty one.
        match (1..re.captures_len())
            .filter_map(|g| caps.get(g).map(|m| m.as_str()))
            .find(|s| !s.is_empty())
        {
            Some(s) => Some(s),
            None => return fallback.to_string(),
        }
    };
    text.unwrap_or("").trim_matches(python_space).to_string()
}

impl CompiledFilter {
    /// The filtered answer of one request's responses (one per repeat).
    pub fn apply(&self, responses: &[String]) -> String {
        let mut current: Vec<String> = responses.to_vec();
        for s in &self.steps {
            match s {
                CompiledStep::Regex {
                    re,
                    group_select,
                    fallback,
                } => {
                    current = current
                        .iter()
                        .map(|r| regex_select(re, *group_select, fallback, r))
                        .collect()
                }
                CompiledStep::TakeFirst => current.truncate(1),
            }
        }
        current.into_iter().next().unwrap_or_default()
    }
}

/// `re.sub(pattern, "", text)` with Python's reading of a final `$`: it matches at the end and
/// before a final newline (the regex crate's only at the end).
pub fn python_sub(re_end: &PythonPattern, text: &str) -> String {
    match re_end {
        PythonPattern::Plain(re) => re.replace_all(text, "").into_owned(),
        PythonPattern::AtEnd(re) => {
            // A match ending before the final newline comes first, then one at the very end.
            let (head, nl) = match text.strip_suffix('\n') {
                Some(h) => (h, "\n"),
                None => (text, ""),
            };
            let head = re.replace(head, "").into_owned();
            let joined = format!("{head}{nl}");
            if nl.is_empty() {
                return joined;
            }
            re.replace(&joined, "").into_owned()
        }
    }
}

/// A Python pattern compiled for [`python_sub`].
#[derive(Clone, Debug)]
pub enum PythonPattern {
    Plain(Regex),
    /// The pattern without its final `$`, anchored with `\z`.
    AtEnd(Regex),
}

impl PythonPattern {
    pub fn new(pattern: &str) -> Result<Self> {
        // A final `$` not escaped (an even number of backslashes before it).
        let trailing = pattern.strip_suffix('$').filter(|p| {
            let slashes = p.chars().rev().take_while(|&c| c == '\\').count();
            slashes % 2 == 0
        });
        Ok(match trailing {
            Some(core) if !core.contains('$') || core.contains("\\$") => PythonPattern::AtEnd(
                Regex::new(&format!("(?:{core})\\z"))
                    .with_context(|| format!("pattern {pattern:?}"))?,
            ),
            _ => PythonPattern::Plain(
                Regex::new(pattern).with_context(|| format!("pattern {pattern:?}"))?,
            ),
        })
    }
}

/// `exact_match`'s settings, as a task file gives them.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExactMatchSpec {
    #[serde(default)]
    pub ignore_case: bool,
    #[serde(default)]
    pub ignore_punctuation: bool,
    #[serde(default)]
    pub ignore_numbers: bool,
    #[serde(default)]
    pub regexes_to_ignore: Vec<String>,
}

/// [`ExactMatchSpec`] with its patterns compiled.
#[derive(Clone, Debug)]
pub struct ExactMatch {
    spec: ExactMatchSpec,
    ignore: Vec<PythonPattern>,
}

impl ExactMatch {
    pub fn new(spec: &ExactMatchSpec) -> Result<Self> {
        let ignore = spec
            .regexes_to_ignore
            .iter()
            .map(|p| PythonPattern::new(p).context("exact_match.regexes_to_ignore"))
            .collect::<Result<Vec<_>>>()?;
        Ok(ExactMatch {
            spec: spec.clone(),
            ignore,
        })
    }

    /// Prediction or reference as the metric compares it.
    pub fn normalise(&self, text: &str) -> String {
        let mut s = text.to_string();
        for re in &self.ignore {
            s = python_sub(re, &s);
        }
        if self.spec.ignore_case {
            s = s.to_lowercase();
        }
        if self.spec.ignore_punctuation {
            s.retain(|c| !c.is_ascii_punctuation());
        }
        if self.spec.ignore_numbers {
            s.retain(|c| !c.is_ascii_digit());
        }
        s
    }

    /// 1 if the normalised prediction equals the normalised reference, else 0.
    pub fn score(&self, prediction: &str, reference: &str) -> f64 {
        f64::from(u8::from(
            self.normalise(prediction) == self.normalise(reference),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::metrics::mean_stderr;

    fn gsm8k_strict() -> CompiledFilter {
        Filter {
            name: "strict-match".into(),
            steps: vec![
                Step::Regex {
                    regex_pattern: r"#### (\-?[0-9\.\,]+)".into(),
                    group_select: 0,
                    fallback: invalid(),
                },
                Step::TakeFirst,
            ],
        }
        .compile()
        .unwrap()
    }

    fn flexible() -> CompiledFilter {
        Filter {
            name: "flexible-extract".into(),
            steps: vec![
                Step::Regex {
                    regex_pattern: r"(-?[$0-9.,]{2,})|(-?[0-9]+)".into(),
                    group_select: -1,
                    fallback: invalid(),
                },
                Step::TakeFirst,
            ],
        }
        .compile()
        .unwrap()
    }

    fn gsm8k_metric() -> ExactMatch {
        ExactMatch::new(&ExactMatchSpec {
            ignore_case: true,
            regexes_to_ignore: vec![
                ",".into(),
                r"\$".into(),
                "(?s).*#### ".into(),
                r"\.$".into(),
            ],
            ..Default::default()
        })
        .unwrap()
    }

    /// The cases the harness's own run gave (`tests/fixtures/generative/scripted.json` holds
    /// them all; these are the ones its notes single out).
    #[test]
    fn filters_and_metric_as_the_harness_ran_them() {
        let r = |s: &str| vec![s.to_string()];
        assert_eq!(gsm8k_strict().apply(&r("\n#### 7\n#### 99")), "7");
        assert_eq!(gsm8k_strict().apply(&r("no answer")), "[invalid]");
        assert_eq!(flexible().apply(&r(" 800 or maybe 8000.")), "8000.");
        assert_eq!(flexible().apply(&r("$800.00")), "$800.00");
        assert_eq!(flexible().apply(&r(",,,,")), ",,,,");
        let m = gsm8k_metric();
        assert_eq!(m.score("$800.00", "800"), 0.0);
        assert_eq!(m.score("8.", "8"), 1.0);
        assert_eq!(m.score("1,200", "1200"), 1.0);
        assert_eq!(m.score("-7", "7"), 0.0);
        assert_eq!(m.score("[invalid]", "7"), 0.0);
        // The reference is GSM8K's whole answer: everything to the last "#### " goes.
        assert_eq!(
            m.score("18", "Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18"),
            1.0
        );
        // Python's `$` before a final newline.
        assert_eq!(m.normalise("42.\n"), "42\n");
    }

    #[test]
    fn stops_cut_in_turn_and_eos_is_appended() {
        let stops = stop_sequences(&["Question:".into(), "</s>".into()], Some("<|endoftext|>"));
        assert_eq!(stops.len(), 3);
        assert_eq!(cut_at_stops(" 5\n\nQuestion: x", &stops), " 5\n\n");
        // Sequential splits, not the earliest stop: "xab" with ["b", "ab"] and ["ab", "b"].
        assert_eq!(cut_at_stops("xab", &["b".into(), "ab".into()]), "xa");
        assert_eq!(cut_at_stops("xab", &["ab".into(), "b".into()]), "x");
        assert_eq!(
            stop_sequences(&["<|endoftext|>".into()], Some("<|endoftext|>")).len(),
            1
        );
    }

    #[test]
    fn the_harness_stderr_of_a_mean() {
        // 9 items, 2 right: 0.1469861839480328 in the harness's run.
        let mut xs = vec![0.0; 9];
        xs[0] = 1.0;
        xs[4] = 1.0;
        let super::super::metrics::Estimate {
            value: m,
            stderr: se,
            ..
        } = mean_stderr(&xs);
        assert!((m - 2.0 / 9.0).abs() < 1e-15);
        assert!((se.unwrap() - 0.1469861839480328).abs() < 1e-15);
        assert_eq!(mean_stderr(&[1.0]).stderr, None);
    }

    fn fixture(name: &str) -> serde_json::Value {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/generative")
            .join(name);
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    /// Every crafted response of `scripted.json` (14 rounds of 9 items for each of gsm8k,
    /// gsm8k_cot and gsm8k_cot_zeroshot, run through lm-eval 0.4.13's own `evaluate`): the
    /// filtered answers, the exact matches and the task's means and standard errors.
    #[test]
    fn every_scripted_response_filters_and_scores_as_in_the_harness() {
        let f = fixture("scripted.json");
        let cot = Filter {
            name: "strict-match".into(),
            steps: vec![
                Step::Regex {
                    regex_pattern: r"The answer is (\-?[0-9\.\,]+).".into(),
                    group_select: 0,
                    fallback: invalid(),
                },
                Step::TakeFirst,
            ],
        }
        .compile()
        .unwrap();
        let metric = gsm8k_metric();
        let mut checked = 0;
        for (task, t) in f["tasks"].as_object().unwrap() {
            let strict = if task == "gsm8k" {
                gsm8k_strict()
            } else {
                cot.clone()
            };
            let filters = [strict, flexible()];
            let targets: Vec<&str> = t["targets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap())
                .collect();
            for (r, round) in t["rounds"].as_array().unwrap().iter().enumerate() {
                let mut scores: Vec<Vec<f64>> = vec![Vec::new(); 2];
                for (i, doc) in round["docs"].as_array().unwrap().iter().enumerate() {
                    let resp = doc["resps"].as_str().unwrap().to_string();
                    for (k, flt) in filters.iter().enumerate() {
                        let got = flt.apply(std::slice::from_ref(&resp));
                        let want = doc["filtered"][&flt.name].as_str().unwrap();
                        assert_eq!(got, want, "{task} round {r} doc {i} {}: {resp:?}", flt.name);
                        let em = metric.score(&got, targets[i]);
                        assert_eq!(
                            em,
                            doc["exact_match"][&flt.name].as_f64().unwrap(),
                            "{task} round {r} doc {i} {}: {got:?} against {:?}",
                            flt.name,
                            targets[i]
                        );
                        scores[k].push(em);
                        checked += 1;
                    }
                }
                for (k, flt) in filters.iter().enumerate() {
                    let e = mean_stderr(&scores[k]);
                    let (mean, se) = (e.value, e.stderr);
                    let key = |m: &str| format!("{m},{}", flt.name);
                    let res = &round["results"];
                    assert!((mean - res[key("exact_match")].as_f64().unwrap()).abs() < 1e-12);
                    assert!(
                        (se.unwrap() - res[key("exact_match_stderr")].as_f64().unwrap()).abs()
                            < 1e-12,
                        "{task} round {r} {}",
                        flt.name
                    );
                }
            }
        }
        assert_eq!(checked, 3 * 14 * 9 * 2);
    }

    /// The stop-string cuts of `postprocess.json`, computed by the harness's own functions.
    #[test]
    fn stop_cuts_as_the_harness_made_them() {
        let f = fixture("postprocess.json");
        let eos = f["eos"].as_str().unwrap();
        // `until` may be a list, one string, or null (the harness takes all three).
        let strings = |v: &serde_json::Value| -> Vec<String> {
            match v {
                serde_json::Value::Null => Vec::new(),
                serde_json::Value::String(s) => vec![s.clone()],
                v => v
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_str().unwrap().to_string())
                    .collect(),
            }
        };
        for case in f["cases"].as_array().unwrap() {
            let stops = stop_sequences(&strings(&case["until"]), Some(eos));
            assert_eq!(stops, strings(&case["stops"]), "{case}");
            let text = case["text"].as_str().unwrap();
            assert_eq!(
                cut_at_stops(text, &stops),
                case["out"].as_str().unwrap(),
                "{case}"
            );
        }
    }

    #[test]
    fn bad_filters_are_named() {
        let bad = Filter {
            name: "f".into(),
            steps: vec![Step::Regex {
                regex_pattern: "(".into(),
                group_select: 0,
                fallback: invalid(),
            }],
        };
        let e = format!("{:#}", bad.compile().unwrap_err());
        assert!(e.contains("filter \"f\""), "{e}");
        let no_take = Filter {
            name: "g".into(),
            steps: vec![],
        };
        assert!(no_take.compile().is_err());
    }
}
