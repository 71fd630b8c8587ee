//! Shared pieces of the fuzz targets. Each target writes its input as the file its reader opens
//! (in a scratch folder of this process, in memory where the machine has /dev/shm) and calls
//! the same reader a command would; an `Err` is the expected answer to a bad input, while a
//! panic, a hang, or an allocation over libFuzzer's `-malloc_limit_mb` is a finding.

use occult_core::models::family::FAMILIES;
use occult_core::models::synth::SynthModel;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// This process's scratch folder.
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let t = if shm.is_dir() {
            tempfile::Builder::new().prefix("occult-fuzz").tempdir_in(shm)
        } else {
            tempfile::tempdir()
        };
        t.expect("a scratch folder")
    })
    .path()
}

/// Writes `bytes` as `name` in the scratch folder; returns its path.
pub fn put(name: &str, bytes: &[u8]) -> PathBuf {
    let p = scratch().join(name);
    if let Some(dir) = p.parent() {
        std::fs::create_dir_all(dir).expect("scratch folder");
    }
    std::fs::write(&p, bytes).expect("scratch write");
    p
}

/// The repository's test fixtures.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// A tiny checkpoint of each family (hidden 8, one MoE layer of 4 experts, top-2, the fixture
/// tokenizer), made once per process in the scratch folder: the good folder a model target
/// replaces one file of. Returns the folder of the family whose `model_type` the input names
/// (OLMoE when none).
pub fn model_dir(input: &[u8]) -> PathBuf {
    static DIRS: OnceLock<Vec<(&'static str, PathBuf)>> = OnceLock::new();
    let dirs = DIRS.get_or_init(|| {
        FAMILIES
            .iter()
            .map(|f| {
                let dir = scratch().join(format!("model-{}", f.model_type));
                let mut m = SynthModel::tiny(f);
                (m.vocab, m.hidden, m.layers, m.heads, m.kv_heads) = (304, 8, 1, 2, 1);
                (m.experts, m.expert_intermediate) = (4, 4);
                (m.dense_intermediate, m.shared_intermediate) = (8, 4);
                m.write(&dir).expect("a tiny model");
                std::fs::copy(fixtures().join("models/tokenizer.json"), dir.join("tokenizer.json"))
                    .expect("tokenizer");
                (f.model_type, dir)
            })
            .collect()
    });
    let text = String::from_utf8_lossy(input);
    dirs.iter()
        .find(|(t, _)| text.contains(&format!("\"{t}\"")))
        .unwrap_or(&dirs[0])
        .1
        .clone()
}

/// Opens a model folder as a command does, then builds the model from it.
pub fn open_model(dir: &Path) {
    use occult_core::models::loader::Checkpoint;
    let Ok(ck) = Checkpoint::open(&dir.display().to_string(), None, candle::DType::F32) else {
        return;
    };
    if let Ok(tok) = ck.tokenizer() {
        if let Ok(ids) = tok.encode("The quick brown fox.", true) {
            let _ = tok.decode(&ids);
        }
    }
    let _ = occult_core::models::model::Model::load_reference(&ck.weights, &ck.cfg);
}

/// Prepares arc_easy and gsm8k 1-shot, as `occult eval --data TASK=FILE` would, from `bytes`
/// written as `file_name` (whose extension picks the reader: .json, .jsonl or .parquet).
pub fn prepare_task_data(file_name: &str, bytes: &[u8]) {
    use occult_eval::harness::evaluate::{prepare_any, PrepareOptions};
    let path = put(file_name, bytes);
    let opts = PrepareOptions {
        data: [
            ("arc_easy".to_string(), path.clone()),
            ("gsm8k".to_string(), path),
        ]
        .into(),
        samples: false,
        num_fewshot: Some(1),
        limit: None,
        seed: 1234,
        max_gen_toks: None,
    };
    let _ = prepare_any("arc_easy", &opts);
    let _ = prepare_any("gsm8k", &opts);
}
