//! The other side of `occult bench model --against transformers|llama.cpp`: a Python process
//! (`$OCCULT_PYTHON`, default `python3`) running `scripts/bench_transformers.py` or
//! `scripts/bench_llama_cpp.py` on the same checkpoint, dtype and thread count, asked for one
//! timed prefill and greedy decode per repeat over a pipe (it times itself, so the pipe is not
//! counted).
//!
//! Both scripts speak one protocol: a first line `{"ready": true, ...}` once the model is loaded
//! (with the versions, and the instruction sets the peer's kernels use), then one JSON answer
//! `{"prefill_s", "decode_s_per_token", "logits"}` per request `{"prompt": [ids], "steps": D}`.
//!
//! A comparison holds both sides to one instruction-set level: transformers is capped to ours
//! through torch's, oneDNN's and MKL's own switches ([`torch_level_env`]); llama.cpp's level is
//! fixed when it is built, so the bench reads it back and says when it differs from ours.

use crate::bench::timing::Timed;
use anyhow::{anyhow, bail, Context, Result};
use occult_core::kernels::Level;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// Which implementation runs in the Python process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerKind {
    /// Hugging Face transformers on PyTorch.
    Transformers,
    /// llama.cpp through llama-cpp-python, on a GGUF converted by llama.cpp's own converter.
    LlamaCpp,
}

impl PeerKind {
    /// The name `--against` takes.
    pub fn name(self) -> &'static str {
        match self {
            PeerKind::Transformers => "transformers",
            PeerKind::LlamaCpp => "llama.cpp",
        }
    }

    /// The script, carried in the binary so that the bench works outside the repository.
    fn script(self) -> &'static str {
        match self {
            PeerKind::Transformers => include_str!("../../../../scripts/bench_transformers.py"),
            PeerKind::LlamaCpp => include_str!("../../../../scripts/bench_llama_cpp.py"),
        }
    }

    /// The modules the script needs, and how to install them.
    fn needs(self) -> (&'static str, &'static str) {
        match self {
            PeerKind::Transformers => ("torch, transformers", "pip install torch transformers"),
            PeerKind::LlamaCpp => (
                "llama_cpp, numpy",
                "pip install llama-cpp-python==0.3.36 (it builds llama.cpp from source: cmake \
                 and a C++ compiler needed); converting the checkpoint also needs torch, \
                 transformers, sentencepiece and gguf",
            ),
        }
    }
}

/// How to start a peer: beyond the checkpoint, dtype and threads.
#[derive(Clone, Debug)]
pub struct PeerOptions {
    /// llama.cpp: the converted GGUF, used if present and written there otherwise (without it,
    /// the checkpoint is converted into a temporary file at every start).
    pub gguf: Option<std::path::PathBuf>,
    /// The level our kernels run at: transformers is held to it ([`torch_level_env`]).
    pub level: Level,
}

/// A running peer with the model loaded.
pub struct Peer {
    kind: PeerKind,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// e.g. "transformers 5.25.0 (torch 2.15.0, AVX2)".
    label: String,
    /// The instruction-set level the peer's kernels run at, as it reported it (`None` where it
    /// did not say).
    pub level: Option<Level>,
    _script: tempfile::TempPath,
}

fn python() -> String {
    std::env::var("OCCULT_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The environment that caps PyTorch's CPU kernels at `level`: ATen's vectorised kernels
/// (`ATEN_CPU_CAPABILITY`), oneDNN's matmuls (`ONEDNN_MAX_CPU_ISA`, without AMX below
/// [`Level::Amx`]) and MKL's (`MKL_ENABLE_INSTRUCTIONS`). Empty at the portable level, where
/// ours has no kernel to compare (candle's matmul picks its own instructions), and a variable
/// the caller's environment already sets is left as it is.
pub fn torch_level_env(level: Level) -> Vec<(&'static str, &'static str)> {
    let vars: &[(&str, &str)] = match level {
        Level::Portable => &[],
        Level::Avx2 => &[
            ("ATEN_CPU_CAPABILITY", "avx2"),
            ("ONEDNN_MAX_CPU_ISA", "AVX2"),
            ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
        ],
        Level::Avx512 => &[
            ("ATEN_CPU_CAPABILITY", "avx512"),
            ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE"),
            ("MKL_ENABLE_INSTRUCTIONS", "AVX512"),
        ],
        Level::Avx512Bf16 => &[
            ("ATEN_CPU_CAPABILITY", "avx512"),
            ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16"),
            ("MKL_ENABLE_INSTRUCTIONS", "AVX512"),
        ],
        Level::Amx => &[],
    };
    vars.iter()
        .copied()
        .filter(|(k, _)| std::env::var_os(k).is_none())
        .collect()
}

/// The level of a peer's `isa` report: llama.cpp's system info (`"AVX2 = 1 | AVX512 = 1 |
/// AMX_INT8 = 1 ..."`) or torch's CPU capability (`"AVX2"`, `"AVX512"`, `"DEFAULT"`). AMX counts
/// only where it multiplies bf16 (torch's oneDNN; llama.cpp's AMX kernels take quantised
/// types only, so a bf16 or f32 GGUF runs at AVX-512 there).
pub fn level_of_report(isa: &str) -> Option<Level> {
    let upper = isa.to_ascii_uppercase();
    let flag = |name: &str| {
        upper.split('|').any(|part| {
            let mut kv = part.split('=');
            kv.next().map(str::trim) == Some(name) && kv.next().map(str::trim) == Some("1")
        })
    };
    if upper.contains('=') {
        // llama.cpp's "NAME = 0|1" list.
        return Some(if flag("AVX512") && flag("AVX512_BF16") {
            Level::Avx512Bf16
        } else if flag("AVX512") {
            Level::Avx512
        } else if flag("AVX2") && flag("FMA") {
            Level::Avx2
        } else {
            Level::Portable
        });
    }
    match upper.trim() {
        "AMX" => Some(Level::Amx),
        "AVX512" => Some(Level::Avx512),
        "AVX2" => Some(Level::Avx2),
        "DEFAULT" | "NO AVX" => Some(Level::Portable),
        _ => None,
    }
}

/// The level that matters for a product in `dtype`: AMX and AVX-512 BF16 multiply bf16 only,
/// so for f32 and f16 those levels run as AVX-512. (torch reports `AVX512` either way: at
/// `avx512bf16` its bf16 products are capped to oneDNN's `AVX512_CORE_BF16`.)
pub fn effective_level(level: Level, dtype: &str) -> Level {
    match level {
        Level::Amx | Level::Avx512Bf16 if dtype != "bf16" => Level::Avx512,
        _ => level,
    }
}

/// What to say when the peer's kernels run at another level than ours (`ours`, the process's
/// level, and `theirs`, as the peer reported it) for products in `dtype`, or `None` where they
/// run at one level (or the peer did not say).
pub fn level_mismatch(
    kind: PeerKind,
    ours: Level,
    theirs: Option<Level>,
    dtype: &str,
) -> Option<String> {
    let theirs = effective_level(theirs?, dtype);
    let ours = effective_level(ours, dtype);
    let torch_cannot_say =
        kind == PeerKind::Transformers && ours == Level::Avx512Bf16 && theirs == Level::Avx512;
    if theirs == ours || torch_cannot_say {
        return None;
    }
    let why = match (kind, ours, theirs) {
        (PeerKind::LlamaCpp, Level::Amx, Level::Avx512 | Level::Avx512Bf16) => {
            "llama.cpp has no AMX kernel for bf16 weights (its AMX path takes quantised types \
             only); OCCULT_KERNELS=avx512 compares both at AVX-512"
        }
        (PeerKind::LlamaCpp, _, _) => {
            "llama.cpp's level is fixed when it is built: build llama-cpp-python for this level \
             (see scripts/bench_llama_cpp.py) or set OCCULT_KERNELS to llama.cpp's"
        }
        (PeerKind::Transformers, _, _) => {
            "torch did not take the cap occult set (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, \
             MKL_ENABLE_INSTRUCTIONS), or the environment set its own"
        }
    };
    Some(format!(
        "{} runs at {theirs} and our kernels at {ours} for {dtype}: not one level ({why})",
        kind.name()
    ))
}

impl Peer {
    /// Starts the peer on `model_dir` in `dtype` (f32, bf16 or f16) with `threads` threads;
    /// fails with what to install when Python or a module the script needs is missing, and
    /// with the peer's own error (on stderr above) when it cannot load the model.
    pub fn start(
        kind: PeerKind,
        model_dir: &Path,
        dtype: &str,
        threads: usize,
        opts: &PeerOptions,
    ) -> Result<Self> {
        let py = python();
        let (modules, how) = kind.needs();
        let install = format!(
            "--against {} needs Python with {modules}: {how}; then run again (or set \
             OCCULT_PYTHON to an interpreter that has them; now {py})",
            kind.name()
        );
        let probe = Command::new(&py)
            .args(["-c", &format!("import {modules}")])
            .output()
            .map_err(|e| anyhow!("{install}. Starting {py} failed: {e}"))?;
        if !probe.status.success() {
            let err = String::from_utf8_lossy(&probe.stderr);
            let last = err.lines().last().unwrap_or("").to_string();
            bail!("{install}. {py} says: {last}");
        }
        let mut file = tempfile::Builder::new()
            .prefix(&format!("occult-bench-{}-", kind.name().replace('.', "-")))
            .suffix(".py")
            .tempfile()?;
        file.write_all(kind.script().as_bytes())?;
        let script = file.into_temp_path();
        let mut cmd = Command::new(&py);
        cmd.arg(&*script)
            .arg(model_dir)
            .args(["--dtype", dtype, "--threads", &threads.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        match kind {
            PeerKind::Transformers => {
                cmd.envs(torch_level_env(opts.level));
            }
            PeerKind::LlamaCpp => {
                if let Some(g) = &opts.gguf {
                    cmd.arg("--gguf").arg(g);
                }
            }
        }
        let mut child = cmd.spawn().with_context(|| format!("starting {py}"))?;
        let stdin = child.stdin.take().expect("piped");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let ready = read_line(&mut stdout, kind).with_context(|| {
            format!(
                "{} could not load {} (its error is above)",
                kind.name(),
                model_dir.display()
            )
        })?;
        let text = |k: &str| ready[k].as_str().unwrap_or("?").to_string();
        let isa = ready["isa"].as_str().unwrap_or("");
        let level = level_of_report(isa);
        let level_name = level.map_or("level unknown", Level::name);
        let label = match kind {
            PeerKind::Transformers => format!(
                "transformers {} (torch {}, {level_name})",
                text("transformers"),
                text("torch")
            ),
            PeerKind::LlamaCpp => format!(
                "llama.cpp (llama-cpp-python {}, {level_name})",
                text("llama_cpp_python")
            ),
        };
        Ok(Peer {
            kind,
            child,
            stdin,
            stdout,
            label,
            level,
            _script: script,
        })
    }
}

fn read_line(r: &mut impl BufRead, kind: PeerKind) -> Result<serde_json::Value> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        bail!("the {} process ended", kind.name());
    }
    serde_json::from_str(&line).with_context(|| format!("reading its answer {line:?}"))
}

impl Timed for Peer {
    fn name(&self) -> String {
        self.label.clone()
    }

    fn time(&mut self, prompt: &[u32], steps: usize) -> Result<(f64, f64, Vec<f32>)> {
        let who = self.kind.name();
        let req = serde_json::json!({"prompt": prompt, "steps": steps});
        writeln!(self.stdin, "{req}")
            .and_then(|_| self.stdin.flush())
            .with_context(|| format!("sending the prompt to {who} (did it end?)"))?;
        let v = read_line(&mut self.stdout, self.kind)
            .with_context(|| format!("{who} failed on the prompt"))?;
        let num = |k: &str| {
            v[k].as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| anyhow!("{who}'s answer has no time {k:?}: {v}"))
        };
        let logits = v["logits"]
            .as_array()
            .ok_or_else(|| anyhow!("{who}'s answer has no logits"))?
            .iter()
            .map(|x| x.as_f64().unwrap_or(f64::NAN) as f32)
            .collect();
        Ok((num("prefill_s")?, num("decode_s_per_token")?, logits))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_read_from_the_peers_reports() {
        let lc = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | \
                  BMI2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |";
        assert_eq!(level_of_report(lc), Some(Level::Avx2));
        let lc512 = format!("{lc} AVX512 = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 |");
        assert_eq!(level_of_report(&lc512), Some(Level::Avx512Bf16));
        let skx = format!("{lc} AVX512 = 1 | AVX512_BF16 = 0 |");
        assert_eq!(level_of_report(&skx), Some(Level::Avx512));

        assert_eq!(
            level_of_report("CPU : SSE3 = 1 | AVX512_VBMI = 1 | AVX2 = 0 |"),
            Some(Level::Portable)
        );
        assert_eq!(level_of_report("AMX"), Some(Level::Amx));
        assert_eq!(level_of_report("AVX2"), Some(Level::Avx2));
        assert_eq!(level_of_report("AVX512"), Some(Level::Avx512));
        assert_eq!(level_of_report("DEFAULT"), Some(Level::Portable));
        assert_eq!(level_of_report(""), None);
    }

    #[test]
    fn a_mismatch_is_named_only_where_the_dtype_runs_differently() {
        use PeerKind::*;
        // AMX against AVX-512 matters for bf16 only.
        assert!(level_mismatch(LlamaCpp, Level::Amx, Some(Level::Avx512), "f32").is_none());
        let bf16 = level_mismatch(LlamaCpp, Level::Amx, Some(Level::Avx512), "bf16").unwrap();
        assert!(bf16.contains("no AMX kernel for bf16"), "{bf16}");
        // llama.cpp at AVX-512 with BF16 against ours at AMX: one level for f32, not for bf16.
        assert!(level_mismatch(LlamaCpp, Level::Amx, Some(Level::Avx512Bf16), "f32").is_none());
        assert!(level_mismatch(LlamaCpp, Level::Amx, Some(Level::Avx512Bf16), "bf16").is_some());
        // torch says AVX512 either way.
        assert!(
            level_mismatch(Transformers, Level::Avx512Bf16, Some(Level::Avx512), "bf16").is_none()
        );
        let built = level_mismatch(LlamaCpp, Level::Avx2, Some(Level::Avx512), "f32").unwrap();
        assert!(
            built.contains("runs at avx512 and our kernels at avx2"),
            "{built}"
        );
        assert!(level_mismatch(Transformers, Level::Avx2, Some(Level::Avx2), "bf16").is_none());
        assert!(level_mismatch(Transformers, Level::Avx2, None, "bf16").is_none());
        assert!(level_mismatch(Transformers, Level::Avx2, Some(Level::Amx), "bf16").is_some());
    }

    #[test]
    fn torch_is_capped_below_amx_only() {
        assert!(torch_level_env(Level::Amx).is_empty());
        assert!(torch_level_env(Level::Portable).is_empty());
        let avx2 = torch_level_env(Level::Avx2);
        for k in [
            "ATEN_CPU_CAPABILITY",
            "ONEDNN_MAX_CPU_ISA",
            "MKL_ENABLE_INSTRUCTIONS",
        ] {
            if std::env::var_os(k).is_none() {
                assert!(avx2.iter().any(|(name, _)| *name == k), "{k}");
            }
        }
    }
}
