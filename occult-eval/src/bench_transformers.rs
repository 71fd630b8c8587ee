//! The transformers side of `occult bench model --against transformers`: a Python process
//! (`$OCCULT_PYTHON`, default `python3`) running `scripts/bench_transformers.py` on the same
//! checkpoint, dtype and thread count, asked for one timed prefill and greedy decode per
//! repeat over a pipe (it times itself, so the pipe is not counted).

use crate::bench_model::Timed;
use anyhow::{anyhow, bail, Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// The script, carried in the binary so that the bench works outside the repository.
const SCRIPT: &str = include_str!("../../scripts/bench_transformers.py");

/// A running transformers process with the model loaded.
pub struct Transformers {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// "transformers X (torch Y)".
    label: String,
    _script: tempfile::TempPath,
}

fn python() -> String {
    std::env::var("OCCULT_PYTHON").unwrap_or_else(|_| "python3".into())
}

impl Transformers {
    /// Starts Python on `model_dir` in `dtype` (f32, bf16 or f16) with `threads` threads; fails
    /// with what to install when Python, torch or transformers is missing.
    pub fn start(model_dir: &Path, dtype: &str, threads: usize) -> Result<Self> {
        let py = python();
        let install = format!(
            "--against transformers needs Python with torch and transformers: `pip install torch \
             transformers`, then run again (or set OCCULT_PYTHON to an interpreter that has them; \
             now {py})"
        );
        let probe = Command::new(&py)
            .args(["-c", "import torch, transformers"])
            .output()
            .map_err(|e| anyhow!("{install}. Starting {py} failed: {e}"))?;
        if !probe.status.success() {
            let err = String::from_utf8_lossy(&probe.stderr);
            let last = err.lines().last().unwrap_or("").to_string();
            bail!("{install}. {py} says: {last}");
        }
        let mut file = tempfile::Builder::new()
            .prefix("occult-bench-transformers-")
            .suffix(".py")
            .tempfile()?;
        file.write_all(SCRIPT.as_bytes())?;
        let script = file.into_temp_path();
        let mut child = Command::new(&py)
            .arg(&*script)
            .arg(model_dir)
            .args(["--dtype", dtype, "--threads", &threads.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {py}"))?;
        let stdin = child.stdin.take().expect("piped");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let ready = read_line(&mut stdout).with_context(|| {
            format!(
                "transformers could not load {} (its error is above)",
                model_dir.display()
            )
        })?;
        let label = format!(
            "transformers {} (torch {})",
            ready["transformers"].as_str().unwrap_or("?"),
            ready["torch"].as_str().unwrap_or("?")
        );
        Ok(Transformers {
            child,
            stdin,
            stdout,
            label,
            _script: script,
        })
    }
}

fn read_line(r: &mut impl BufRead) -> Result<serde_json::Value> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        bail!("the transformers process ended");
    }
    serde_json::from_str(&line).with_context(|| format!("reading its answer {line:?}"))
}

impl Timed for Transformers {
    fn name(&self) -> String {
        self.label.clone()
    }

    fn time(&mut self, prompt: &[u32], steps: usize) -> Result<(f64, f64, Vec<f32>)> {
        let req = serde_json::json!({"prompt": prompt, "steps": steps});
        writeln!(self.stdin, "{req}")?;
        self.stdin.flush()?;
        let v = read_line(&mut self.stdout).context("transformers failed on the prompt")?;
        let num = |k: &str| {
            v[k].as_f64()
                .ok_or_else(|| anyhow!("transformers' answer has no number {k:?}"))
        };
        let logits = v["logits"]
            .as_array()
            .ok_or_else(|| anyhow!("transformers' answer has no logits"))?
            .iter()
            .map(|x| x.as_f64().unwrap_or(f64::NAN) as f32)
            .collect();
        Ok((num("prefill_s")?, num("decode_s_per_token")?, logits))
    }
}

impl Drop for Transformers {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
