//! The maps of the code hold, by test: the README's layout, each crate's README and each
//! module's own map name every folder and public module, and every path that the README's
//! "Where a change goes" names exists.
//!
//! - Every folder under `occult-*/src` appears as `NAME/` in the README's `## Layout` block and
//!   in its crate's README.
//! - Every `pub mod NAME;` is named in its parent's map: for a crate root (`lib.rs`) the
//!   `## Map` of the crate's README, as `NAME/`, `NAME.rs` or `` `NAME` ``; for any other file
//!   its `//!` doc, as a link ``[`NAME`]``.
//! - No map names a module that is gone: each row of a map's table (``| [`NAME`] |`` in a
//!   `//!` doc, ``| `NAME` |`` in a crate README's `## Map`) is a module its file declares.
//! - Every path in a code span of the README's `## Where a change goes` (a span with a `/` or
//!   a file extension, no spaces; the placeholder `NAME` stands for any name) names
//!   a file or folder of the repository: from its root, or the tail of one (an entry names
//!   the folder, then files inside it).

use std::path::{Path, PathBuf};

const CRATES: [&str; 3] = ["occult-core", "occult-eval", "occult-train"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
        .to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The text of the section headed `## title` (to the next heading of level 2 or above).
fn section<'a>(md: &'a str, title: &str) -> &'a str {
    let head = format!("\n## {title}\n");
    let start = md
        .find(&head)
        .unwrap_or_else(|| panic!("no section `## {title}`"))
        + head.len();
    let end = md[start..]
        .find("\n## ")
        .or_else(|| md[start..].find("\n# "))
        .map_or(md.len(), |e| start + e);
    &md[start..end]
}

/// Every folder under `dir`, as paths relative to it.
fn folders(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        if e.file_type().unwrap().is_dir() {
            let name = PathBuf::from(e.file_name());
            out.push(name.clone());
            out.extend(folders(&e.path()).into_iter().map(|p| name.join(p)));
        }
    }
    out
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for f in folders(dir)
        .into_iter()
        .map(|f| dir.join(f))
        .chain([dir.to_path_buf()])
    {
        for e in std::fs::read_dir(&f).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "rs") {
                out.push(e.path());
            }
        }
    }
    out.sort();
    out
}

/// The modules a file declares public (`pub mod NAME;`), each with whether a `#[cfg(...)]`
/// gates it (its map then names it in plain code, since a link to it would break without the
/// feature).
fn pub_mods(text: &str) -> Vec<(String, bool)> {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    lines
        .iter()
        .enumerate()
        .filter_map(|(i, l)| {
            let name = l.strip_prefix("pub mod ")?.strip_suffix(';')?;
            let gated = i > 0 && lines[i - 1].starts_with("#[cfg(");
            Some((name.to_string(), gated))
        })
        .collect()
}

/// Every module a file declares, public or not.
fn mods(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.trim())
        .map(|l| l.strip_prefix("pub ").unwrap_or(l))
        .filter_map(|l| l.strip_prefix("mod "))
        .filter_map(|rest| rest.strip_suffix(';'))
        .map(str::to_string)
        .collect()
}

/// The modules a map's table rows name: ``| [`NAME`] |`` (a `//!` map) or ``| `NAME` |`` (a
/// crate README's).
fn table_rows(map: &str, readme: bool) -> Vec<String> {
    let (open, close) = if readme {
        ("| `", "` |")
    } else {
        ("| [`", "`] |")
    };
    map.lines()
        .map(str::trim_start)
        .filter_map(|l| l.strip_prefix(open))
        .filter_map(|l| l.split_once(close).map(|(name, _)| name))
        .filter(|name| {
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
        .map(str::to_string)
        .collect()
}

/// A file's own map: its `//!` lines.
fn inner_doc(text: &str) -> String {
    text.lines()
        .map(str::trim_start)
        .filter_map(|l| l.strip_prefix("//!"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Everything a map must name that it does not, in `root` (the repository).
fn missing_from_maps(root: &Path) -> Vec<String> {
    let mut fails = Vec::new();
    let readme = read(&root.join("README.md"));
    let layout = section(&readme, "Layout");
    for krate in CRATES {
        let src = root.join(krate).join("src");
        let crate_readme = read(&root.join(krate).join("README.md"));
        for f in folders(&src) {
            let name = f.file_name().unwrap().to_string_lossy();
            let shown = format!("{name}/");
            if !layout.contains(&shown) {
                fails.push(format!(
                    "README.md, ## Layout: the folder {krate}/src/{} is not named (`{shown}`)",
                    f.display()
                ));
            }
            if !crate_readme.contains(&shown) {
                fails.push(format!(
                    "{krate}/README.md: the folder src/{} is not named (`{shown}`)",
                    f.display()
                ));
            }
        }
        for file in rust_files(&src) {
            let text = read(&file);
            let rel = file.strip_prefix(root).unwrap().display().to_string();
            let is_root = file == src.join("lib.rs");
            let map = if is_root {
                section(&crate_readme, "Map").to_string()
            } else {
                inner_doc(&text)
            };
            let declared = mods(&text);
            for row in table_rows(&map, is_root) {
                if !declared.contains(&row) {
                    fails.push(format!(
                        "{}: the map's row `{row}` is not a module of {rel}",
                        if is_root {
                            format!("{krate}/README.md")
                        } else {
                            rel.clone()
                        }
                    ));
                }
            }
            for (m, gated) in pub_mods(&text) {
                let forms = if is_root {
                    vec![format!("`{m}`"), format!("{m}/"), format!("{m}.rs")]
                } else if gated {
                    vec![format!("[`{m}`]"), format!("`{m}`")]
                } else {
                    vec![format!("[`{m}`]")]
                };
                let named = forms.iter().any(|w| map.contains(w.as_str()));
                if !named {
                    let whose = if is_root {
                        format!("{krate}/README.md")
                    } else {
                        format!("{rel}'s //! map")
                    };
                    fails.push(format!("{whose}: `pub mod {m};` ({rel}) is not named"));
                }
            }
        }
    }
    fails
}

/// Every file and folder of the repository, as its path components from the root (build
/// output, in any folder named `target`, and git's folder left out).
fn repo_paths(root: &Path) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut todo = vec![(root.to_path_buf(), Vec::<String>::new())];
    while let Some((dir, comps)) = todo.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name == "target" || name == ".git" {
                continue;
            }
            let mut here = comps.clone();
            here.push(name);
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push((e.path(), here.clone()));
            }
            out.push(here);
        }
    }
    out
}

/// Whether `pattern` (components with `*` for any run of characters) names a file or folder:
/// a path from the root, or the tail of one (`placement/mod.rs`, `greedy.rs`), as the entries
/// name files inside the folder they named first.
fn exists(paths: &[Vec<String>], pattern: &str) -> bool {
    let want: Vec<&str> = pattern.split('/').filter(|c| !c.is_empty()).collect();
    paths.iter().any(|p| {
        p.len() >= want.len()
            && p[p.len() - want.len()..]
                .iter()
                .zip(&want)
                .all(|(name, w)| wildcard(w, name))
    })
}

fn wildcard(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, tail)) => name.strip_prefix(head).is_some_and(|rest| {
            (0..=rest.len())
                .filter(|&i| rest.is_char_boundary(i))
                .any(|i| wildcard(tail, &rest[i..]))
        }),
    }
}

/// The code spans of `text` that name paths, with placeholders (capitalised words such as
/// `NAME`) turned into `*`.
fn path_spans(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut parts = text.split('`');
    parts.next();
    while let Some(span) = parts.next() {
        parts.next();
        let looks_like_path = !span.contains(' ')
            && !span.starts_with('-')
            && !span.contains("::")
            && (span.contains('/')
                || [".rs", ".toml", ".py", ".md", ".json", ".sh"]
                    .iter()
                    .any(|x| span.ends_with(x)));
        if !looks_like_path {
            continue;
        }
        out.push(placeholders_as_wildcards(span));
    }
    out
}

/// `span` with the placeholder `NAME` as `*`.
fn placeholders_as_wildcards(span: &str) -> String {
    span.replace("NAME", "*")
}

/// The paths the "Where a change goes" of `readme` names that do not exist in the repository
/// at `root`.
fn missing_paths(root: &Path, readme: &str) -> Vec<String> {
    let spans = path_spans(section(readme, "Where a change goes"));
    assert!(spans.len() > 20, "too few paths read: {spans:?}");
    let paths = repo_paths(root);
    spans
        .into_iter()
        .filter(|p| !exists(&paths, p))
        .map(|p| format!("README.md, ## Where a change goes: `{p}` does not exist"))
        .collect()
}

#[test]
fn every_folder_and_public_module_is_on_its_maps() {
    let fails = missing_from_maps(&repo_root());
    assert!(
        fails.is_empty(),
        "{} missing from the maps:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

#[test]
fn where_a_change_goes_names_real_paths() {
    let root = repo_root();
    let fails = missing_paths(&root, &read(&root.join("README.md")));
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

/// The checks fail on a map that lost a module, a folder missing from the layout and an entry
/// that names a file that is not there (a copy of the tree's maps, each broken once).
#[test]
fn a_map_that_falls_behind_fails() {
    let root = repo_root();
    let copy = tempfile::tempdir().unwrap();
    let c = copy.path();
    let cp = |rel: &str| {
        let to = c.join(rel);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(root.join(rel), &to).unwrap();
    };
    cp("README.md");
    for k in CRATES {
        cp(&format!("{k}/README.md"));
        for f in rust_files(&root.join(k).join("src")) {
            cp(&f.strip_prefix(&root).unwrap().display().to_string());
        }
    }
    assert_eq!(missing_from_maps(c), Vec::<String>::new());
    // A new public module that its folder's map does not name.
    let m = c.join("occult-core/src/analysis/mod.rs");
    let text = read(&m);
    std::fs::write(
        &m,
        text.replace("pub mod trace;", "pub mod trace;\npub mod fresh;"),
    )
    .unwrap();
    let fails = missing_from_maps(c);
    assert!(
        fails.len() == 1 && fails[0].contains("`pub mod fresh;`"),
        "{fails:?}"
    );
    // A row of a map's table for a module that is gone.
    std::fs::write(&m, text.replace("pub mod synth;", "")).unwrap();
    let fails = missing_from_maps(c);
    assert!(
        fails.len() == 1 && fails[0].contains("row `synth`"),
        "{fails:?}"
    );
    std::fs::write(&m, &text).unwrap();
    // A new folder that neither the layout nor the crate's README names.
    std::fs::create_dir_all(c.join("occult-eval/src/newroom")).unwrap();
    let fails = missing_from_maps(c);
    assert!(
        fails.len() == 2 && fails.iter().all(|f| f.contains("newroom")),
        "{fails:?}"
    );
    std::fs::remove_dir(c.join("occult-eval/src/newroom")).unwrap();
    // An entry of "Where a change goes" naming a file that does not exist.
    let readme = read(&root.join("README.md"));
    assert!(readme.contains("`occult-core/src/ep/moe.rs`"));
    let broken = readme.replace(
        "`occult-core/src/ep/moe.rs`",
        "`occult-core/src/ep/layer.rs`",
    );
    let fails = missing_paths(&root, &broken);
    assert!(
        !fails.is_empty()
            && fails
                .iter()
                .all(|f| f.contains("occult-core/src/ep/layer.rs")),
        "{fails:?}"
    );
}
