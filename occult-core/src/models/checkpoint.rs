//! Finding a model's files: a local folder, or a model id already in the Hugging Face cache
//! (offline; `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`, with revision
//! refs such as `main` or a commit hash). A model is `config.json`, its safetensors weights
//! (the shards named by `model.safetensors.index.json`, or every `*.safetensors`), and, if
//! present, `tokenizer.json`.

use crate::{Error, Result};
use hf_hub::{Cache, Repo, RepoType};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The files of one model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelFiles {
    /// The folder the files were found in (a cache snapshot for hub ids).
    pub dir: PathBuf,
    pub config: PathBuf,
    /// Safetensors weights, in shard order.
    pub weights: Vec<PathBuf>,
    pub tokenizer: Option<PathBuf>,
}

/// The Hugging Face hub cache folder from the environment's values.
pub fn cache_dir_from(
    hf_hub_cache: Option<String>,
    hf_home: Option<String>,
    home: Option<PathBuf>,
) -> Option<PathBuf> {
    if let Some(c) = hf_hub_cache.filter(|s| !s.is_empty()) {
        return Some(PathBuf::from(c));
    }
    if let Some(h) = hf_home.filter(|s| !s.is_empty()) {
        return Some(PathBuf::from(h).join("hub"));
    }
    home.map(|h| h.join(".cache").join("huggingface").join("hub"))
}

/// The Hugging Face hub cache folder of this process's environment.
pub fn hub_cache_dir() -> Option<PathBuf> {
    cache_dir_from(
        std::env::var("HF_HUB_CACHE").ok(),
        std::env::var("HF_HOME").ok(),
        std::env::var_os("HOME").map(PathBuf::from),
    )
}

/// Resolves `model`: a folder, or a hub id (`org/name`) in the cache at `revision` (default
/// `main`).
pub fn resolve(model: &str, revision: Option<&str>) -> Result<ModelFiles> {
    resolve_in(model, revision, hub_cache_dir().as_deref())
}

/// As [`resolve`], with an explicit cache folder.
pub fn resolve_in(model: &str, revision: Option<&str>, cache: Option<&Path>) -> Result<ModelFiles> {
    let path = Path::new(model);
    if path.is_dir() {
        return from_folder(path);
    }
    if path.exists() {
        return Err(Error::bad_file(
            path,
            "a model must be a folder (with config.json) or a hub id",
        ));
    }
    let looks_like_id =
        model.split('/').count() == 2 && !model.starts_with('.') && !model.contains('\\');
    let Some(cache) = cache else {
        return Err(Error::invalid(format!(
            "{model:?} is not a folder, and no Hugging Face cache folder is known (set HF_HUB_CACHE or HF_HOME)"
        )));
    };
    if !looks_like_id {
        return Err(Error::invalid(format!(
            "{model:?} is not a folder, nor a hub model id of the form org/name"
        )));
    }
    let rev = revision.unwrap_or("main");
    let repo = Cache::new(cache.to_path_buf()).repo(Repo::with_revision(
        model.to_string(),
        RepoType::Model,
        rev.to_string(),
    ));
    if let Some(config) = repo.get("config.json") {
        let dir = config.parent().map(Path::to_path_buf).unwrap_or_default();
        return from_folder(&dir);
    }
    // A commit hash given as the revision names its snapshot directly, ref or not.
    let folder = cache.join(format!("models--{}", model.replace('/', "--")));
    let snapshot = folder.join("snapshots").join(rev);
    if snapshot.join("config.json").is_file() {
        return from_folder(&snapshot);
    }
    #[cfg(feature = "download")]
    if std::env::var("HF_HUB_OFFLINE").map_or(true, |v| v != "1") {
        return download(model, rev, cache);
    }
    Err(Error::invalid(if folder.is_dir() {
        format!(
            "{model} is in the Hugging Face cache ({}), but not at revision {rev:?} with a config.json \
             (downloading is not built in: fetch it with `huggingface-cli download {model}`)",
            folder.display()
        )
    } else {
        format!(
            "{model} is not a folder and not in the Hugging Face cache at {} (downloading is not \
             built in: fetch it with `huggingface-cli download {model}`, or give a folder)",
            cache.display()
        )
    }))
}

/// Downloads a model's config, safetensors weights (every shard the index names) and tokenizer
/// into the cache, then reads them from there (feature `download`).
#[cfg(feature = "download")]
fn download(model: &str, rev: &str, cache: &Path) -> Result<ModelFiles> {
    use hf_hub::api::sync::ApiBuilder;
    let fail = |what: &str, e: hf_hub::api::sync::ApiError| {
        Error::invalid(format!("downloading {what} of {model} at {rev:?}: {e}"))
    };
    let api = ApiBuilder::from_cache(Cache::new(cache.to_path_buf()))
        .with_progress(true)
        .build()
        .map_err(|e| fail("(connecting)", e))?;
    let repo = api.repo(Repo::with_revision(
        model.to_string(),
        RepoType::Model,
        rev.to_string(),
    ));
    let config = repo
        .get("config.json")
        .map_err(|e| fail("config.json", e))?;
    match repo.get("model.safetensors.index.json") {
        Ok(index) => {
            let dir = index.parent().unwrap_or(Path::new("."));
            let text = crate::input::read_text(&index)?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::bad_file(&index, format!("not valid JSON: {e}")))?;
            let shards: BTreeSet<String> = v["weight_map"]
                .as_object()
                .map(|m| {
                    m.values()
                        .filter_map(|f| f.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            for shard in shards {
                if !dir.join(&shard).is_file() {
                    repo.get(&shard).map_err(|e| fail(&shard, e))?;
                }
            }
        }
        Err(_) => {
            repo.get("model.safetensors")
                .map_err(|e| fail("model.safetensors", e))?;
        }
    }
    // Optional: some repositories ship only the slow tokenizer files.
    let _ = repo.get("tokenizer.json");
    from_folder(config.parent().unwrap_or(Path::new(".")))
}

/// The files of a model folder.
pub fn from_folder(dir: &Path) -> Result<ModelFiles> {
    let config = dir.join("config.json");
    if !config.is_file() {
        return Err(Error::bad_file(
            dir,
            "no config.json: not a Hugging Face model folder",
        ));
    }
    let index = dir.join("model.safetensors.index.json");
    let weights = if index.is_file() {
        shards_from_index(&index, dir)?
    } else {
        let mut w: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| Error::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        w.sort();
        w
    };
    if weights.is_empty() {
        return Err(Error::bad_file(
            dir,
            "no safetensors weights (model.safetensors, shards with model.safetensors.index.json); \
             .bin and .pth checkpoints are not read",
        ));
    }
    let tokenizer = Some(dir.join("tokenizer.json")).filter(|p| p.is_file());
    Ok(ModelFiles {
        dir: dir.to_path_buf(),
        config,
        weights,
        tokenizer,
    })
}

/// The shard files that `model.safetensors.index.json`'s `weight_map` names, in name order.
fn shards_from_index(index: &Path, dir: &Path) -> Result<Vec<PathBuf>> {
    let text = crate::input::read_text(index)?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::bad_file(index, format!("not valid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::bad_file(index, "no weight_map object"))?;
    let mut names = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .filter(|f| !f.contains("..") && !f.starts_with('/'))
            .ok_or_else(|| {
                Error::bad_file(
                    index,
                    format!("weight_map[{tensor:?}] is not a shard file name"),
                )
            })?;
        names.insert(file.to_string());
    }
    names
        .into_iter()
        .map(|n| {
            let p = dir.join(&n);
            if p.is_file() {
                Ok(p)
            } else {
                Err(Error::bad_file(
                    index,
                    format!("names shard {n}, which is missing"),
                ))
            }
        })
        .collect()
}

/// Reads `config.json` as JSON.
pub fn read_config(path: &Path) -> Result<serde_json::Value> {
    let text = crate::input::read_text(path)?;
    serde_json::from_str(&text).map_err(|e| Error::bad_file(path, format!("not valid JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(p: &Path, text: &str) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    #[test]
    fn cache_folder_precedence() {
        let home = Some(PathBuf::from("/h"));
        assert_eq!(
            cache_dir_from(Some("/c".into()), Some("/x".into()), home.clone()),
            Some("/c".into())
        );
        assert_eq!(
            cache_dir_from(None, Some("/x".into()), home.clone()),
            Some("/x/hub".into())
        );
        assert_eq!(
            cache_dir_from(Some(String::new()), None, home),
            Some("/h/.cache/huggingface/hub".into())
        );
        assert_eq!(cache_dir_from(None, None, None), None);
    }

    #[test]
    fn folders_single_and_sharded() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path();
        touch(&d.join("a/config.json"), "{}");
        touch(&d.join("a/model.safetensors"), "");
        touch(&d.join("a/tokenizer.json"), "{}");
        let f = from_folder(&d.join("a")).unwrap();
        assert_eq!(f.weights, vec![d.join("a/model.safetensors")]);
        assert!(f.tokenizer.is_some());

        touch(&d.join("b/config.json"), "{}");
        touch(&d.join("b/model-00002-of-00002.safetensors"), "");
        touch(&d.join("b/model-00001-of-00002.safetensors"), "");
        touch(
            &d.join("b/model.safetensors.index.json"),
            r#"{"weight_map": {"x": "model-00002-of-00002.safetensors", "y": "model-00001-of-00002.safetensors", "z": "model-00001-of-00002.safetensors"}}"#,
        );
        let f = from_folder(&d.join("b")).unwrap();
        assert_eq!(f.weights.len(), 2);
        assert!(f.weights[0].ends_with("model-00001-of-00002.safetensors"));
        assert!(f.tokenizer.is_none());

        // An index naming a missing shard, a folder without weights or config.
        touch(&d.join("c/config.json"), "{}");
        touch(
            &d.join("c/model.safetensors.index.json"),
            r#"{"weight_map": {"x": "gone.safetensors"}}"#,
        );
        let e = from_folder(&d.join("c")).unwrap_err().to_string();
        assert!(
            e.contains("gone.safetensors") && e.contains("missing"),
            "{e}"
        );
        touch(&d.join("e/config.json"), "{}");
        assert!(from_folder(&d.join("e"))
            .unwrap_err()
            .to_string()
            .contains("no safetensors"));
        std::fs::create_dir_all(d.join("f")).unwrap();
        assert!(from_folder(&d.join("f"))
            .unwrap_err()
            .to_string()
            .contains("no config.json"));
    }

    #[test]
    fn hub_ids_resolve_offline_through_refs_and_hashes() {
        let t = tempfile::tempdir().unwrap();
        let cache = t.path();
        let repo = cache.join("models--org--tiny");
        let hash = "0123456789abcdef0123456789abcdef01234567";
        touch(&repo.join("refs/main"), hash);
        touch(
            &repo.join(format!("snapshots/{hash}/config.json")),
            "{\"model_type\": \"olmoe\"}",
        );
        touch(
            &repo.join(format!("snapshots/{hash}/model.safetensors")),
            "",
        );
        let other = "fedcba9876543210fedcba9876543210fedcba98";
        touch(&repo.join(format!("snapshots/{other}/config.json")), "{}");
        touch(
            &repo.join(format!("snapshots/{other}/model.safetensors")),
            "",
        );
        touch(&repo.join("refs/v2"), other);

        let f = resolve_in("org/tiny", None, Some(cache)).unwrap();
        assert!(f.dir.ends_with(hash));
        assert_eq!(read_config(&f.config).unwrap()["model_type"], "olmoe");
        assert!(resolve_in("org/tiny", Some("v2"), Some(cache))
            .unwrap()
            .dir
            .ends_with(other));
        assert!(resolve_in("org/tiny", Some(other), Some(cache))
            .unwrap()
            .dir
            .ends_with(other));

        let e = resolve_in("org/tiny", Some("v9"), Some(cache))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not at revision \"v9\""), "{e}");
        let e = resolve_in("org/absent", None, Some(cache))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not in the Hugging Face cache"), "{e}");
        let e = resolve_in("no-slash", None, Some(cache))
            .unwrap_err()
            .to_string();
        assert!(e.contains("org/name"), "{e}");
    }
}
