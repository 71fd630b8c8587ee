//! The documentation holds: README.md, every `docs/**/*.md` and the crate READMEs
//! (`occult-core/README.md`, `occult-train/README.md`, `occult-eval/README.md`) are read as
//! Markdown and checked against the repository and the `occult` binary:
//!
//! - every relative link and image points to a file that exists, and every `#anchor` (in the
//!   same file or `file.md#anchor`) matches a heading of that file by GitHub's slug rule
//!   (lowercase; punctuation dropped except `-` and `_`; spaces to `-`; `-1`, `-2` for repeats);
//! - every line of a `bash`, `sh`, `shell` or `console` code block that runs `occult` (directly,
//!   as `target/release/occult`, under `mpirun`, through `scripts/shaped_links.sh ... --`, or as
//!   `cargo run ... --bin occult -- ...`) names subcommands that exist, and every flag it uses
//!   appears in that subcommand's `--help` (run once per subcommand and cached). Line
//!   continuations (`\`), comments, pipes and `&&`, `VAR=value` prefixes and `$VARS` are handled;
//!   `...` stands for elided arguments and is skipped;
//! - every path under `scripts/`, `configs/`, `tasks/`, `docs/` or `tests/fixtures/` named in a
//!   code block or in backticks exists (a `*` matches within one path component; names holding
//!   a placeholder such as `NAME` are skipped, as is the short list in [`PATH_SKIPS`]);
//! - every guide in `docs/` is linked from the index, `docs/README.md`;
//! - the crate READMEs can become crate docs (`#![doc = include_str!("../README.md")]`): every
//!   code block carries a language tag and no rustdoc intra-doc link (``[`name`]`` without a
//!   target) is used.
//!
//! Every failure is collected and reported at once, each with its file and line.

mod common;

use common::occult_bin;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The crate READMEs: checked like the rest, and held to what a crate doc needs.
const CRATE_READMES: &[&str] = &[
    "occult-core/README.md",
    "occult-train/README.md",
    "occult-eval/README.md",
];

/// Paths the docs may name without their existing in a clean checkout, with why. Empty today:
/// the commands' outputs are written outside the checked prefixes (`out/`, `/tmp/`, `p.json`).
const PATH_SKIPS: &[(&str, &str)] = &[];

/// The folders whose paths, when named in code, must exist.
const PATH_PREFIXES: &[&str] = &[
    "scripts/",
    "configs/",
    "tasks/",
    "docs/",
    "tests/fixtures/",
    "occult-core/src/",
    "occult-train/src/",
    "occult-eval/src/",
];

/// Words that mark a path as a placeholder rather than a real file.
const PLACEHOLDERS: &[&str] = &["NAME", "<", "{", "$"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

/// One fenced code block.
struct Block {
    lang: String,
    /// 1-based line of the opening fence.
    line: usize,
    lines: Vec<(usize, String)>,
}

/// One Markdown file, split into prose paragraphs and code blocks.
struct Doc {
    /// Relative to the repository root.
    rel: PathBuf,
    /// Paragraphs of prose: (first line, text with `\n` between lines).
    paragraphs: Vec<(usize, String)>,
    blocks: Vec<Block>,
    /// The anchors of the headings, by GitHub's rule.
    anchors: BTreeSet<String>,
}

fn fence_of(line: &str) -> Option<(char, usize, String)> {
    let t = line.trim_start();
    let c = t.chars().next()?;
    if c != '`' && c != '~' {
        return None;
    }
    let n = t.chars().take_while(|&x| x == c).count();
    if n < 3 {
        return None;
    }
    let info = t[n..].trim();
    if c == '`' && info.contains('`') {
        return None;
    }
    let lang = info
        .split(|ch: char| ch.is_whitespace() || ch == ',' || ch == '{')
        .next()
        .unwrap_or("")
        .to_string();
    Some((c, n, lang))
}

fn parse(root: &Path, rel: &Path) -> Doc {
    let text = std::fs::read_to_string(root.join(rel))
        .unwrap_or_else(|e| panic!("reading {}: {e}", rel.display()));
    let mut paragraphs = Vec::new();
    let mut blocks = Vec::new();
    let mut headings = Vec::new();
    let mut open: Option<(char, usize, Block)> = None;
    let mut para: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let no = i + 1;
        if let Some((c, n, block)) = open.as_mut() {
            let t = line.trim();
            if t.chars().all(|x| x == *c) && t.len() >= *n {
                blocks.push(open.take().unwrap().2);
            } else {
                block.lines.push((no, line.to_string()));
            }
            continue;
        }
        if let Some((c, n, lang)) = fence_of(line) {
            paragraphs.extend(para.take());
            open = Some((
                c,
                n,
                Block {
                    lang,
                    line: no,
                    lines: Vec::new(),
                },
            ));
            continue;
        }
        let t = line.trim();
        if t.is_empty() {
            paragraphs.extend(para.take());
            continue;
        }
        if let Some(h) = heading_text(line) {
            paragraphs.extend(para.take());
            headings.push(h.to_string());
            paragraphs.push((no, h.to_string()));
            continue;
        }
        match para.as_mut() {
            Some((_, p)) => {
                p.push('\n');
                p.push_str(line);
            }
            None => para = Some((no, line.to_string())),
        }
    }
    paragraphs.extend(para.take());
    if let Some((_, _, block)) = open {
        blocks.push(block);
    }
    let mut anchors = BTreeSet::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for h in &headings {
        let base = slug(h);
        let n = seen.entry(base.clone()).or_insert(0);
        anchors.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    Doc {
        rel: rel.to_path_buf(),
        paragraphs,
        blocks,
        anchors,
    }
}

/// The text of an ATX heading (`## Title ##`), or None.
fn heading_text(line: &str) -> Option<&str> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    if indent > 3 {
        return None;
    }
    let t = &line[indent..];
    let hashes = t.chars().take_while(|&c| c == '#').count();
    if hashes == 0 || hashes > 6 {
        return None;
    }
    let rest = &t[hashes..];
    if !rest.is_empty() && !rest.starts_with(' ') && !rest.starts_with('\t') {
        return None;
    }
    Some(rest.trim().trim_end_matches('#').trim_end())
}

/// GitHub's anchor for a heading: the rendered text (link targets dropped), lowercased,
/// without punctuation other than `-` and `_`, spaces turned into `-`.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // `[text](target)` renders as `text`.
    while let Some(i) = rest.find("](") {
        let end = rest[i..].find(')').map(|j| i + j + 1).unwrap_or(rest.len());
        text.push_str(&rest[..i]);
        rest = &rest[end..];
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter(|&c| c.is_alphanumeric() || c == '-' || c == '_' || c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The inline code spans of a paragraph (byte offset of the span's text, its text), and the
/// paragraph with those spans blanked out (so that links inside code are not links).
fn code_spans(p: &str) -> (Vec<(usize, String)>, String) {
    let bytes = p.as_bytes();
    let mut spans = Vec::new();
    let mut blanked = String::with_capacity(p.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'`' {
            let n = bytes[i..].iter().take_while(|&&b| b == b'`').count();
            let start = i + n;
            // The closing run: exactly n backticks.
            let mut j = start;
            let mut close = None;
            while j < bytes.len() {
                if bytes[j] == b'`' {
                    let m = bytes[j..].iter().take_while(|&&b| b == b'`').count();
                    if m == n {
                        close = Some(j);
                        break;
                    }
                    j += m;
                } else {
                    j += 1;
                }
            }
            match close {
                Some(j) => {
                    spans.push((start, p[start..j].to_string()));
                    for c in p[i..j + n].chars() {
                        blanked.push(if c == '\n' { '\n' } else { ' ' });
                    }
                    i = j + n;
                }
                None => {
                    blanked.push_str(&p[i..start]);
                    i = start;
                }
            }
        } else {
            let c = p[i..].chars().next().unwrap();
            blanked.push(c);
            i += c.len_utf8();
        }
    }
    (spans, blanked)
}

fn line_at(first: usize, p: &str, offset: usize) -> usize {
    first + p[..offset].matches('\n').count()
}

/// Link targets of a paragraph (code spans already blanked): inline links and images
/// (`[text](target)`, `![alt](target)`), reference definitions (`[x]: target`), and HTML
/// `href="..."` / `src="..."`.
fn link_targets(p: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(k) = p[from..].find("](") {
        let start = from + k + 2;
        let mut depth = 0usize;
        let mut end = p.len();
        for (j, c) in p[start..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' if depth == 0 => {
                    end = start + j;
                    break;
                }
                ')' => depth -= 1,
                _ => {}
            }
        }
        let mut target = p[start..end].trim();
        // An optional title: `(target "title")`.
        if let Some(sp) = target.find(char::is_whitespace) {
            target = &target[..sp];
        }
        let target = target.trim_start_matches('<').trim_end_matches('>');
        out.push((start, target.to_string()));
        from = end.min(p.len());
        if from == start {
            from += 1;
        }
    }
    for (off, line) in line_offsets(p) {
        let t = line.trim_start();
        if t.starts_with('[') {
            if let Some(k) = t.find("]:") {
                let target = t[k + 2..].split_whitespace().next().unwrap_or("");
                out.push((off, target.to_string()));
            }
        }
        for attr in ["href=\"", "src=\""] {
            let mut from = 0;
            while let Some(k) = line[from..].find(attr) {
                let s = from + k + attr.len();
                let e = line[s..].find('"').map(|x| s + x).unwrap_or(line.len());
                out.push((off + s, line[s..e].to_string()));
                from = e;
            }
        }
    }
    out
}

fn line_offsets(p: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut off = 0;
    for line in p.split('\n') {
        out.push((off, line));
        off += line.len() + 1;
    }
    out
}

fn check_links(root: &Path, doc: &Doc, docs: &HashMap<PathBuf, Doc>, fails: &mut Vec<String>) {
    let dir = doc.rel.parent().unwrap_or(Path::new(""));
    for (first, p) in &doc.paragraphs {
        let (_, blanked) = code_spans(p);
        for (off, target) in link_targets(&blanked) {
            let line = line_at(*first, &blanked, off);
            let at = format!("{}:{line}", doc.rel.display());
            if target.is_empty() {
                fails.push(format!("{at}: empty link target"));
                continue;
            }
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let target_rel = if path.is_empty() {
                doc.rel.clone()
            } else if let Some(abs) = path.strip_prefix('/') {
                PathBuf::from(abs)
            } else {
                normalise(&dir.join(path))
            };
            if !path.is_empty() && !root.join(&target_rel).exists() {
                fails.push(format!(
                    "{at}: link `{target}`: {} does not exist",
                    target_rel.display()
                ));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            let parsed;
            let target_doc = match docs.get(&target_rel) {
                Some(d) => d,
                None if target_rel.extension().is_some_and(|e| e == "md") => {
                    parsed = parse(root, &target_rel);
                    &parsed
                }
                None => {
                    fails.push(format!(
                        "{at}: link `{target}`: an anchor into a file that is not Markdown"
                    ));
                    continue;
                }
            };
            if !target_doc.anchors.contains(anchor) {
                fails.push(format!(
                    "{at}: link `{target}`: no heading of {} has the anchor `#{anchor}`",
                    target_rel.display()
                ));
            }
        }
    }
}

/// `a/b/../c` to `a/c`, `./a` to `a`.
fn normalise(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                if !out.pop() {
                    out.push("..");
                }
            }
            std::path::Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    out
}

// ---- commands -------------------------------------------------------------------------

/// What `occult PATH --help` says: its subcommands and its flags.
struct Help {
    commands: BTreeSet<String>,
    flags: BTreeSet<String>,
}

struct Helps {
    bin: PathBuf,
    cache: HashMap<Vec<String>, Result<Help, String>>,
}

impl Helps {
    fn get(&mut self, path: &[String]) -> &Result<Help, String> {
        if !self.cache.contains_key(path) {
            let out = Command::new(&self.bin)
                .args(path)
                .arg("--help")
                .output()
                .expect("running occult --help");
            let help = if out.status.success() {
                Ok(parse_help(&String::from_utf8_lossy(&out.stdout)))
            } else {
                Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
            };
            self.cache.insert(path.to_vec(), help);
        }
        &self.cache[path]
    }
}

fn parse_help(text: &str) -> Help {
    let mut commands = BTreeSet::new();
    let mut flags = BTreeSet::new();
    let mut in_commands = false;
    for line in text.lines() {
        if line.trim_end() == "Commands:" {
            in_commands = true;
            continue;
        }
        if in_commands {
            if line.trim().is_empty() || !line.starts_with(' ') {
                in_commands = false;
            } else if let Some(name) = line.split_whitespace().next() {
                if name != "help" {
                    commands.insert(name.to_string());
                }
                continue;
            }
        }
        // Option lines: `  -o, --out <OUT>`, `      --devices <DEVICES>`.
        let t = line.trim_start();
        if line.starts_with(' ') && t.starts_with('-') {
            let words = t
                .split(&[' ', ','][..])
                .take_while(|w| w.is_empty() || w.starts_with('-'));
            for w in words.filter(|w| w.len() > 1) {
                flags.insert(w.trim_end_matches('=').to_string());
            }
        }
    }
    Help { commands, flags }
}

/// The logical command lines of a shell block: continuations joined, comments dropped;
/// for ```console, only the lines after a `$ ` prompt.
fn shell_lines(block: &Block) -> Vec<(usize, String)> {
    let console = block.lang == "console";
    let mut out = Vec::new();
    let mut cur: Option<(usize, String)> = None;
    for (no, raw) in &block.lines {
        let mut line = raw.as_str();
        if cur.is_none() && console {
            match line.trim_start().strip_prefix("$ ") {
                Some(rest) => line = rest,
                None => continue,
            }
        }
        let line = strip_comment(line);
        let trimmed = line.trim_end();
        let (text, more) = match trimmed.strip_suffix('\\') {
            Some(t) => (t.to_string(), true),
            None => (trimmed.to_string(), false),
        };
        match cur.as_mut() {
            Some((_, acc)) => {
                acc.push(' ');
                acc.push_str(&text);
            }
            None => cur = Some((*no, text)),
        }
        if !more {
            out.extend(cur.take());
        }
    }
    out.extend(cur.take());
    out
}

/// Drops a `#` comment (a `#` at a word's start, outside quotes).
fn strip_comment(line: &str) -> String {
    let mut out = String::new();
    let mut quote: Option<char> = None;
    let mut prev = ' ';
    for c in line.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '\'' || c == '"' => quote = Some(c),
            None if c == '#' && prev.is_whitespace() => break,
            None => {}
        }
        out.push(c);
        prev = c;
    }
    out
}

/// Splits a command line into simple commands (at `|`, `||`, `&&`, `&`, `;` outside quotes)
/// and each into words, quotes removed.
fn simple_commands(line: &str) -> Vec<Vec<String>> {
    let mut cmds = Vec::new();
    let mut words: Vec<String> = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    for c in line.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => word.push(c),
            None => match c {
                '\'' | '"' => {
                    quote = Some(c);
                    in_word = true;
                }
                '|' | '&' | ';' => {
                    if in_word {
                        words.push(std::mem::take(&mut word));
                        in_word = false;
                    }
                    if !words.is_empty() {
                        cmds.push(std::mem::take(&mut words));
                    }
                }
                c if c.is_whitespace() => {
                    if in_word {
                        words.push(std::mem::take(&mut word));
                        in_word = false;
                    }
                }
                c => {
                    word.push(c);
                    in_word = true;
                }
            },
        }
    }
    if in_word {
        words.push(word);
    }
    if !words.is_empty() {
        cmds.push(words);
    }
    cmds
}

fn basename(w: &str) -> &str {
    w.rsplit('/').next().unwrap_or(w)
}

fn is_assignment(w: &str) -> bool {
    match w.split_once('=') {
        Some((name, _)) => {
            !name.is_empty()
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !name.starts_with(|c: char| c.is_ascii_digit())
        }
        None => false,
    }
}

/// The arguments given to `occult` by a simple command, if it runs `occult`.
fn occult_args(words: &[String]) -> Option<Vec<String>> {
    let mut i = 0;
    while i < words.len()
        && (is_assignment(&words[i]) || matches!(words[i].as_str(), "sudo" | "env" | "exec"))
    {
        i += 1;
    }
    let prog = words.get(i)?;
    let after_dashdash = |from: usize| -> Option<Vec<String>> {
        let k = words[from..].iter().position(|w| w == "--")?;
        Some(words[from + k + 1..].to_vec())
    };
    match basename(prog) {
        "occult" => Some(words[i + 1..].to_vec()),
        "cargo" => {
            let run = words.get(i + 1).is_some_and(|w| w == "run");
            let bin = words
                .windows(2)
                .any(|w| w[0] == "--bin" && w[1] == "occult")
                || words.iter().any(|w| w == "--bin=occult");
            if run && bin {
                Some(after_dashdash(i).unwrap_or_default())
            } else {
                None
            }
        }
        "shaped_links.sh" => after_dashdash(i),
        "mpirun" | "mpiexec" | "timeout" | "nice" | "taskset" | "numactl" => {
            let j = words[i + 1..]
                .iter()
                .position(|w| basename(w) == "occult")?;
            Some(words[i + 1 + j + 1..].to_vec())
        }
        _ => None,
    }
}

fn check_command(at: &str, args: &[String], helps: &mut Helps, fails: &mut Vec<String>) {
    let mut path: Vec<String> = Vec::new();
    let mut k = 0;
    loop {
        let help = match helps.get(&path) {
            Ok(h) => h,
            Err(e) => {
                fails.push(format!(
                    "{at}: `occult {} --help` failed: {e}",
                    path.join(" ")
                ));
                return;
            }
        };
        if help.commands.is_empty() {
            break;
        }
        match args.get(k) {
            Some(w) if w == "..." => return,
            Some(w) if !w.starts_with('-') => {
                if help.commands.contains(w) {
                    path.push(w.clone());
                    k += 1;
                } else {
                    fails.push(format!(
                        "{at}: `occult {}` has no subcommand `{w}` (it has: {})",
                        path.join(" "),
                        help.commands.iter().cloned().collect::<Vec<_>>().join(", ")
                    ));
                    return;
                }
            }
            Some(w) if w == "--help" || w == "-h" || w == "--version" || w == "-V" => return,
            _ => {
                fails.push(format!(
                    "{at}: `occult {}` needs a subcommand",
                    path.join(" ")
                ));
                return;
            }
        }
    }
    let help = helps.get(&path).as_ref().unwrap();
    for w in &args[k..] {
        if w == "--" {
            break;
        }
        let flag = if let Some(long) = w.strip_prefix("--") {
            format!("--{}", long.split('=').next().unwrap())
        } else if w.len() >= 2
            && w.starts_with('-')
            && w[1..].starts_with(|c: char| c.is_ascii_alphabetic())
        {
            w[..2].to_string()
        } else {
            continue;
        };
        if flag == "--" || flag.contains("...") {
            continue;
        }
        if !help.flags.contains(&flag) {
            fails.push(format!(
                "{at}: `occult {}` has no flag `{flag}` (see `occult {} --help`)",
                path.join(" "),
                path.join(" ")
            ));
        }
    }
}

// ---- paths ----------------------------------------------------------------------------

/// The repository paths named in a piece of code: those under [`PATH_PREFIXES`].
fn named_paths(code: &str) -> Vec<String> {
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || "_.-/*".contains(c);
    let mut out = Vec::new();
    for prefix in PATH_PREFIXES {
        let mut from = 0;
        while let Some(k) = code[from..].find(prefix) {
            let s = from + k;
            from = s + prefix.len();
            let before = code[..s].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || "_.-/".contains(c)) {
                continue;
            }
            let end = code[s..]
                .find(|c: char| !is_path_char(c))
                .map(|e| s + e)
                .unwrap_or(code.len());
            let after = code[end..].chars().next();
            let mut p = &code[s..end];
            p = p.trim_end_matches(['.', ',']);
            if PLACEHOLDERS.iter().any(|w| p.contains(w))
                || after.is_some_and(|c| PLACEHOLDERS.iter().any(|w| w.starts_with(c)))
            {
                continue;
            }
            out.push(p.to_string());
        }
    }
    out
}

fn wildcard(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, tail)) => {
            let Some(rest) = name.strip_prefix(head) else {
                return false;
            };
            (0..=rest.len())
                .filter(|&i| rest.is_char_boundary(i))
                .any(|i| wildcard(tail, &rest[i..]))
        }
    }
}

/// Whether a path (with `*` wildcards within components) names at least one file or folder.
fn path_exists(root: &Path, path: &str) -> bool {
    let mut here = vec![root.to_path_buf()];
    for comp in path.split('/').filter(|c| !c.is_empty()) {
        let mut next = Vec::new();
        for dir in &here {
            if comp.contains('*') {
                if let Ok(entries) = std::fs::read_dir(dir) {
                    for e in entries.flatten() {
                        if wildcard(comp, &e.file_name().to_string_lossy()) {
                            next.push(e.path());
                        }
                    }
                }
            } else if dir.join(comp).exists() {
                next.push(dir.join(comp));
            }
        }
        here = next;
        if here.is_empty() {
            return false;
        }
    }
    true
}

fn check_path(root: &Path, at: &str, p: &str, fails: &mut Vec<String>) {
    if PATH_SKIPS.iter().any(|(s, _)| p == *s) {
        return;
    }
    if !path_exists(root, p) {
        fails.push(format!("{at}: `{p}` does not exist in the repository"));
    }
}

// ---- the test -------------------------------------------------------------------------

fn markdown_files(root: &Path) -> Vec<PathBuf> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(root.join(dir))
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .flatten()
            .collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let rel = dir.join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                walk(root, &rel, out);
            } else if rel.extension().is_some_and(|x| x == "md") {
                out.push(rel);
            }
        }
    }
    let mut files = vec![PathBuf::from("README.md")];
    walk(root, Path::new("docs"), &mut files);
    files.extend(CRATE_READMES.iter().map(PathBuf::from));
    files
}

#[test]
fn the_docs_hold() {
    let root = repo_root();
    let mut fails = Vec::new();
    let files = markdown_files(&root);
    for f in &files {
        if !root.join(f).is_file() {
            fails.push(format!("{}: missing", f.display()));
        }
    }
    let docs: HashMap<PathBuf, Doc> = files
        .iter()
        .filter(|f| root.join(f).is_file())
        .map(|f| (f.clone(), parse(&root, f)))
        .collect();
    let mut helps = Helps {
        bin: occult_bin(),
        cache: HashMap::new(),
    };
    let mut commands = 0;
    for f in files.iter().filter(|f| docs.contains_key(*f)) {
        let doc = &docs[f];
        let name = f.display().to_string();
        check_links(&root, doc, &docs, &mut fails);
        for block in &doc.blocks {
            if matches!(
                block.lang.as_str(),
                "bash" | "sh" | "shell" | "console" | "zsh"
            ) {
                for (no, line) in shell_lines(block) {
                    for words in simple_commands(&line) {
                        if let Some(args) = occult_args(&words) {
                            commands += 1;
                            check_command(&format!("{name}:{no}"), &args, &mut helps, &mut fails);
                        }
                    }
                }
            }
            for (no, line) in &block.lines {
                for p in named_paths(line) {
                    check_path(&root, &format!("{name}:{no}"), &p, &mut fails);
                }
            }
        }
        for (first, p) in &doc.paragraphs {
            let (spans, _) = code_spans(p);
            for (off, code) in spans {
                for path in named_paths(&code) {
                    let at = format!("{name}:{}", line_at(*first, p, off));
                    check_path(&root, &at, &path, &mut fails);
                }
            }
        }
        if CRATE_READMES.contains(&name.as_str()) {
            for block in &doc.blocks {
                if block.lang.is_empty() {
                    fails.push(format!(
                        "{name}:{}: a code block without a language tag (as a crate doc it \
                         would be compiled as Rust): tag it ```text, ```bash or ```toml",
                        block.line
                    ));
                }
            }
            for (first, p) in &doc.paragraphs {
                let (_, blanked) = code_spans(p);
                // ``[`name`]`` not followed by `(`: a rustdoc intra-doc link.
                let mut from = 0;
                while let Some(k) = p[from..].find("[`") {
                    let s = from + k;
                    from = s + 2;
                    let Some(e) = p[s..].find("`]").map(|e| s + e + 2) else {
                        break;
                    };
                    if !blanked[e..].starts_with('(') && !blanked[e..].starts_with(':') {
                        fails.push(format!(
                            "{name}:{}: `{}` is a rustdoc intra-doc link; use a plain \
                             relative link",
                            line_at(*first, p, s),
                            &p[s..e]
                        ));
                    }
                }
            }
        }
    }
    // Every guide is in the index.
    if let Some(index) = docs.get(Path::new("docs/README.md")) {
        let mut linked = BTreeSet::new();
        for (_, p) in &index.paragraphs {
            let (_, blanked) = code_spans(p);
            for (_, t) in link_targets(&blanked) {
                linked.insert(normalise(
                    &Path::new("docs").join(t.split('#').next().unwrap()),
                ));
            }
        }
        for f in docs.keys() {
            if f.parent() == Some(Path::new("docs"))
                && f != Path::new("docs/README.md")
                && !linked.contains(f)
            {
                fails.push(format!(
                    "docs/README.md: the index does not link {}",
                    f.display()
                ));
            }
        }
    } else {
        fails.push("docs/README.md: missing (the index of the guides)".to_string());
    }
    assert!(
        commands > 0,
        "no `occult` command found in the docs' shell blocks"
    );
    eprintln!(
        "checked {} files, {commands} occult commands, {} subcommands' --help",
        docs.len(),
        helps.cache.len()
    );
    assert!(
        fails.is_empty(),
        "{} problems in the docs:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

#[test]
fn slugs_follow_github() {
    assert_eq!(slug("`occult reproduce`"), "occult-reproduce");
    assert_eq!(
        slug("GPU: CUDA and NCCL (built, type-checked and tested on the CPU side; not yet run on a GPU)"),
        "gpu-cuda-and-nccl-built-type-checked-and-tested-on-the-cpu-side-not-yet-run-on-a-gpu"
    );
    assert_eq!(
        slug("Sizing a cluster: `occult project`"),
        "sizing-a-cluster-occult-project"
    );
    assert_eq!(
        slug("Trust: what was tried and what held"),
        "trust-what-was-tried-and-what-held"
    );
    assert_eq!(slug("E[C_T] and [a link](x.md)"), "ec_t-and-a-link");
}

#[test]
fn shell_lines_are_read_as_a_shell_reads_them() {
    let block = Block {
        lang: "bash".into(),
        line: 1,
        lines: vec![
            (2, "M=x occult eval --model $M \\".into()),
            (3, "    --tasks piqa   # a comment --not-a-flag".into()),
            (
                4,
                "occult place ... -o p.json | tee log && echo '# not a comment'".into(),
            ),
        ],
    };
    let lines = shell_lines(&block);
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0].0, 2);
    let cmds = simple_commands(&lines[0].1);
    assert_eq!(
        occult_args(&cmds[0]).unwrap(),
        ["eval", "--model", "$M", "--tasks", "piqa"]
    );
    let cmds = simple_commands(&lines[1].1);
    assert_eq!(cmds.len(), 3);
    assert_eq!(cmds[2], ["echo", "# not a comment"]);
    let w = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
    assert_eq!(
        occult_args(&w(
            "cargo run --release -p occult-eval --bin occult -- reproduce"
        ))
        .unwrap(),
        ["reproduce"]
    );
    assert_eq!(
        occult_args(&w(
            "mpirun -np 4 target/release/occult bench layer --backend mpi"
        ))
        .unwrap(),
        ["bench", "layer", "--backend", "mpi"]
    );
    assert_eq!(
        occult_args(&w(
            "sudo scripts/shaped_links.sh -n 4 -- bench model --model m"
        ))
        .unwrap(),
        ["bench", "model", "--model", "m"]
    );
    assert!(occult_args(&w("cargo build --release --features occult-eval/mpi")).is_none());
    assert_eq!(
        named_paths(
            "see scripts/bench_*.py and /tmp/configs/x, configs/links/, scripts/bench_NAME.py"
        ),
        ["scripts/bench_*.py", "configs/links/"]
    );
    assert!(path_exists(&repo_root(), "configs/reproduce/*.toml"));
    assert!(!path_exists(&repo_root(), "configs/reproduce/*.yaml"));
}
