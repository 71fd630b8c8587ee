//! The binary starts and documents every command (this test also makes `cargo test` build the
//! `occult` binary that the end-to-end tests in `tests/` run).

use std::process::Command;

#[test]
fn help_lists_every_command() {
    let out = Command::new(env!("CARGO_BIN_EXE_occult"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for cmd in ["trace", "collab", "place", "prune", "bench", "reproduce"] {
        assert!(text.contains(cmd), "--help does not mention {cmd}:\n{text}");
    }
}
