//! Records the git commit the binary was built from, for the provenance of results.
fn main() {
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    // `--no-optional-locks`: a plain `git status` refreshes and rewrites `.git/index`, which
    // is one of the files below, so the next cargo command would run this again and rebuild
    // everything above occult-eval (a minute of CI, after a fresh clone).
    let dirty = std::process::Command::new("git")
        .args([
            "--no-optional-locks",
            "status",
            "--porcelain",
            "--untracked-files=no",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .is_some_and(|o| !o.stdout.is_empty());
    let value = if commit.is_empty() {
        String::new()
    } else if dirty {
        format!("{commit}-dirty")
    } else {
        commit
    };
    println!("cargo:rustc-env=OCCULT_GIT_COMMIT={value}");
    for p in ["../.git/HEAD", "../.git/index", "../.git/refs"] {
        println!("cargo:rerun-if-changed={p}");
    }
}
