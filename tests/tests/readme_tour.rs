//! The README's tour, run as a reader runs it: every command of its `bash` block, in order, in
//! one shell (so `M=...` and the files one command writes reach the next), in a scratch folder,
//! on the committed fixtures. Left out: the build line (the tests have built `occult`) and
//! `occult reproduce` (the long job; `tests/tests/cli.rs` runs it on a tiny recipe).

mod common;

use common::occult_bin;
use std::path::Path;
use std::process::Command;

/// The lines of the fenced block under `## A tour`.
fn tour_block(readme: &str) -> Vec<String> {
    let at = readme.find("\n## A tour").expect("README has `## A tour`");
    let rest = &readme[at..];
    let open = rest.find("```bash\n").expect("the tour has a bash block") + "```bash\n".len();
    let close = rest[open..]
        .find("\n```")
        .expect("the tour's block is closed");
    rest[open..open + close]
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn the_readme_tour_runs_on_the_fixtures() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let lines = tour_block(&readme);
    let mut script = vec!["set -euo pipefail".to_string()];
    let mut commands = 0;
    for line in &lines {
        let code = line.trim();
        if code.starts_with("cargo build") || code == "occult reproduce" {
            continue;
        }
        if code.starts_with("occult ") {
            commands += 1;
        }
        // Paths into the repository, from the scratch folder.
        script.push(line.replace(
            "tests/fixtures/",
            &format!("{}/tests/fixtures/", root.display()),
        ));
    }
    assert!(commands >= 10, "the tour lost its commands: {lines:?}");
    let dir = tempfile::tempdir().unwrap();
    let bin_dir = occult_bin().parent().unwrap().to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .arg("-c")
        .arg(script.join("\n"))
        .current_dir(dir.path())
        .env("PATH", path)
        .output()
        .expect("running bash");
    assert!(
        out.status.success(),
        "the README's tour failed:\n{}\n--- stderr ---\n{}",
        script.join("\n"),
        String::from_utf8_lossy(&out.stderr)
    );
    // What the tour says its commands write.
    for file in ["t.safetensors", "p.json", "collab.json"] {
        assert!(dir.path().join(file).is_file(), "the tour wrote no {file}");
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("E[C_T]"), "{stdout}");
}
