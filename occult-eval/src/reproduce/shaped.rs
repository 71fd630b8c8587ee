//! The shaped-link stage of `occult reproduce`: when the machine allows it (root, iproute2's
//! `ip` and `tc`, OpenMPI, and this binary built with MPI), the prefill and the training step
//! run again as one MPI process per rank, each in its own network namespace, over veth links
//! shaped with tc to a fixed rate (`scripts/shaped_links.sh`). Those times are measured over
//! real slow links, not projected. Otherwise the stage says which requirement is missing.

use super::speed::SpeedRow;
use crate::bench::modes::ModeSummary;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;

/// What the stage runs.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShapedRecipe {
    pub skip: bool,
    /// Rate of each rank's link, each direction, in tc's notation.
    pub rate: String,
    /// Tokens over all ranks of the prefill, in sequences of `seq_len`.
    pub prefill_tokens: usize,
    pub seq_len: usize,
    /// Sequences per rank of the training step (of `seq_len` tokens).
    pub train_batch_per_rank: usize,
    /// Both runs again on two levels: nodes of the analysis's node size, each rank's link to
    /// its own node shaped to this rate and to other nodes to `rate`; the two-level exchange
    /// and pruning to one node run as more modes. Empty: no two-level run.
    pub intra_rate: String,
}

impl Default for ShapedRecipe {
    fn default() -> Self {
        ShapedRecipe {
            skip: false,
            rate: "80mbit".into(),
            prefill_tokens: 4096,
            seq_len: 128,
            train_batch_per_rank: 4,
            intra_rate: "2gbit".into(),
        }
    }
}

/// Why the stage cannot run here, or `None` when it can.
pub fn unavailable(script: &Path) -> Option<String> {
    if !cfg!(feature = "mpi") {
        return Some(
            "this binary was built without MPI (cargo build --release --features \
             occult-eval/mpi)"
                .into(),
        );
    }
    if !script.is_file() {
        return Some(format!("{} is not here", script.display()));
    }
    let uid = Command::new("id").arg("-u").output().ok();
    if uid.is_none_or(|o| String::from_utf8_lossy(&o.stdout).trim() != "0") {
        return Some("network namespaces and tc need root".into());
    }
    for tool in ["ip", "tc", "mpirun"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Some(format!("{tool} is not installed"));
        }
    }
    None
}

/// The script, found beside the sources this binary was built from.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/shaped_links.sh")
}

/// Runs the prefill and the training step over shaped links; returns their rows (suites
/// `prefill, shaped` and `train, shaped`), measured and projected with the emulated
/// machine's profile. With `nodes_of` G (and an intra-node rate), both run again on nodes of
/// G (suites `... shaped, nodes of G`), with the two-level exchange and pruning to one node.
pub fn run(
    s: &ShapedRecipe,
    model: &str,
    placement: &Path,
    devices: usize,
    nodes_of: Option<usize>,
    out: &Path,
) -> Result<Vec<SpeedRow>> {
    let mut rows = run_level(s, model, placement, devices, None, out)?;
    if let Some(g) = nodes_of.filter(|&g| g < devices && !s.intra_rate.is_empty()) {
        // A failure here costs the two-level rows, not the flat ones.
        match run_level(s, model, placement, devices, Some(g), out) {
            Ok(more) => rows.extend(more),
            Err(e) => eprintln!("  the two-level run failed: {e:#}"),
        }
    }
    Ok(rows)
}

/// One level's runs: flat links, or nodes of `nodes_of`.
fn run_level(
    s: &ShapedRecipe,
    model: &str,
    placement: &Path,
    devices: usize,
    nodes_of: Option<usize>,
    out: &Path,
) -> Result<Vec<SpeedRow>> {
    let dir = match nodes_of {
        None => out.join("shaped"),
        Some(_) => out.join("shaped").join("nodes"),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let (len, batch) = crate::bench::model_ep::prefill_shape(s.prefill_tokens, devices, s.seq_len);
    let exe = std::env::current_exe().context("finding this binary")?;
    let placement = placement.display().to_string();
    let mut common: Vec<String> = ["--model", model, "--placement", &placement]
        .map(String::from)
        .to_vec();
    let mut shape = vec![
        "-n".to_string(),
        devices.to_string(),
        "-r".into(),
        s.rate.clone(),
    ];
    let files = ["shaped.json", "shaped-train.json"];
    let level = match nodes_of {
        None => String::new(),
        Some(g) => {
            common.extend(
                ["--max-nodes", "1", "--devices-per-node", &g.to_string()].map(String::from),
            );
            shape.extend([
                "-g".into(),
                g.to_string(),
                "-i".into(),
                s.intra_rate.clone(),
            ]);
            format!(", nodes of {g}")
        }
    };
    let prefill: Vec<String> = ["bench".to_string(), "model".into()]
        .into_iter()
        .chain(common.iter().cloned())
        .chain([
            "--prompt-len".into(),
            len.to_string(),
            "--batch".into(),
            batch.to_string(),
            "--decode-tokens".into(),
            "0".into(),
            // The best of two prefills and of three training steps: one step over shaped links
            // varies by a fifth from run to run.
            "--repeats".into(),
            "2".into(),
        ])
        .collect();
    let train: Vec<String> = ["bench".to_string(), "train".into()]
        .into_iter()
        .chain(common.iter().cloned())
        .chain([
            "--batch-size".into(),
            s.train_batch_per_rank.to_string(),
            "--seq-len".into(),
            s.seq_len.to_string(),
            "--steps".into(),
            "3".into(),
        ])
        .collect();
    let mut rows = Vec::new();
    for (suite, args, file) in [
        (format!("prefill, shaped{level}"), prefill, files[0]),
        (format!("train, shaped{level}"), train, files[1]),
    ] {
        eprintln!("  {suite}: {devices} ranks over {} links", s.rate);
        let run = Command::new(script())
            .args(&shape)
            .arg("-o")
            .arg(&dir)
            .arg("--")
            .args(&args)
            .env("OCCULT_BIN", &exe)
            .output()
            .context("starting scripts/shaped_links.sh")?;
        if !run.status.success() {
            let err = String::from_utf8_lossy(&run.stderr);
            let tail: Vec<&str> = err.lines().rev().take(4).collect();
            bail!(
                "scripts/shaped_links.sh failed ({}) running {suite}: {}",
                run.status,
                tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
            );
        }
        let link = match nodes_of {
            None => format!("shaped-{}", s.rate),
            Some(_) => format!("shaped-{}-between-{}-inside", s.rate, s.intra_rate),
        };
        rows.extend(read_rows(&dir.join(file), &suite, &link)?);
    }
    Ok(rows)
}

/// A bench's JSON: each run's figures.
#[derive(Deserialize)]
struct BenchFile {
    results: Vec<ModeSummary>,
}

/// The EP runs of a bench's JSON (`results`) as speed rows.
fn read_rows(path: &Path, suite: &str, link: &str) -> Result<Vec<SpeedRow>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let file: BenchFile = serde_json::from_str(&text)
        .with_context(|| format!("reading the bench results {}", path.display()))?;
    Ok(file
        .results
        .iter()
        .filter(|r| r.devices > 1)
        .map(|r| super::speed::row(suite, r, link))
        .collect())
}
