//! A registered voice's prepared features on disk: `<id>.features.safetensors` beside its audio
//! and metadata in `server.voice_dir`. The file's metadata names the reference key the features
//! were made from and the model that made them; a restart installs them into Code2Wav when the
//! model is the same, and prepares the voice again (then rewrites the file) when it is not.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use antiphon_engine::voices::PreparedVoice;
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use super::config::{Config, ModelSource};

/// Bumped when the preparation changes what it makes (a file of another version is stale).
pub const FEATURES_VERSION: u32 = 1;

/// The features file of voice `id`.
pub fn path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.features.safetensors"))
}

/// What identifies the models that prepare a voice: the features' version, the model's source,
/// and for synthetic weights their preset, seed and dtype, for a checkpoint its directory and the
/// name, size and modification time of each file in it. Hex SHA-256.
pub fn model_fingerprint(cfg: &Config) -> String {
    let m = &cfg.model;
    let mut d = format!("features v{FEATURES_VERSION}; dtype {:?}; ", m.dtype);
    match m.source {
        ModelSource::Synthetic => d.push_str(&format!("synthetic {:?} seed {}", m.preset, m.seed)),
        ModelSource::Checkpoint => {
            let dir = m.path.clone().unwrap_or_default();
            let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
            d.push_str(&format!("checkpoint {}", dir.display()));
            let mut files: Vec<String> = std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| {
                    let meta = e.metadata().ok()?;
                    let mtime =
                        meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs();
                    Some(format!("{} {} {mtime}", e.file_name().to_string_lossy(), meta.len()))
                })
                .collect();
            files.sort();
            for f in files {
                d.push_str("; ");
                d.push_str(&f);
            }
        }
    }
    Sha256::digest(d.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes the features of voice `id` (to a temporary file renamed into place).
pub fn save(dir: &Path, id: &str, v: &PreparedVoice, fingerprint: &str) -> Result<()> {
    let tensors = v.tensors()?;
    let meta = HashMap::from([
        ("reference_key".to_string(), v.key.clone()),
        ("model".to_string(), fingerprint.to_string()),
        ("version".to_string(), FEATURES_VERSION.to_string()),
    ]);
    let mut named: Vec<(String, candle_core::Tensor)> = tensors.into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    safetensors::serialize_to_file(named, Some(meta), &path(dir, id))
        .with_context(|| format!("writing the features of {id}"))?;
    Ok(())
}

/// The features of voice `id` as saved for the model `fingerprint`: `Ok(None)` when there is no
/// file or it was made by another model (or version); an error when it cannot be read or its
/// tensors are damaged.
pub fn load(dir: &Path, id: &str, fingerprint: &str) -> Result<Option<PreparedVoice>> {
    let p = path(dir, id);
    let bytes = match std::fs::read(&p) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", p.display())),
    };
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
        .with_context(|| format!("{}: not a safetensors file", p.display()))?;
    let meta = header.metadata().clone().unwrap_or_default();
    if meta.get("model").map(String::as_str) != Some(fingerprint) {
        return Ok(None);
    }
    let Some(key) = meta.get("reference_key").filter(|k| !k.is_empty()) else {
        bail!("{}: no reference_key in its metadata", p.display());
    };
    let tensors = candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu)
        .with_context(|| format!("{}", p.display()))?;
    Ok(Some(
        PreparedVoice::from_tensors(key, &tensors).with_context(|| format!("{}", p.display()))?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn voice() -> PreparedVoice {
        PreparedVoice {
            key: "abc".into(),
            codes: vec![4, 5, 6],
            speaker: vec![0.25; 3],
            mel: (0..8).map(|i| i as f32).collect(),
            mel_bins: 2,
        }
    }

    #[test]
    fn features_come_back_for_their_model_only() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), "v_a", &voice(), "model-1").unwrap();
        assert_eq!(load(dir.path(), "v_a", "model-1").unwrap(), Some(voice()));
        assert_eq!(
            load(dir.path(), "v_a", "model-2").unwrap(),
            None,
            "another model's features are stale"
        );
        assert_eq!(load(dir.path(), "v_b", "model-1").unwrap(), None, "no file");
        std::fs::write(path(dir.path(), "v_c"), b"not a safetensors file").unwrap();
        assert!(load(dir.path(), "v_c", "model-1").is_err());
    }

    #[test]
    fn the_fingerprint_follows_the_model() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let a = Config::parse(super::super::config::DEFAULT_TOML, &root).unwrap();
        let mut b = a.clone();
        b.model.seed += 1;
        assert_eq!(model_fingerprint(&a), model_fingerprint(&a.clone()));
        assert_ne!(model_fingerprint(&a), model_fingerprint(&b));
    }
}
