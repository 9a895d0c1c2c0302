//! Loading a MiniCPM-o 4.5 checkpoint directory: `config.json`, the safetensors shards listed by
//! `model.safetensors.index.json` (or a single `model.safetensors`), memory-mapped, and
//! `tokenizer.json`.
//!
//! Tensors are reached through a `VarBuilder` whose prefixes route to the parts: `llm.` and `apm.`
//! and `audio_projection_layer.` (Stage 0), `tts.` (Stage 1). Vision tensors (`vpm.`,
//! `resampler.`) are never read. Every tensor is checked against the shape the model expects and
//! converted to the requested dtype; a missing or misshaped tensor is an error naming it and the
//! expected shape.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use crate::models::config::MiniCpmoConfig;
use crate::models::talker::Talker;
use crate::models::thinker::Thinker;
use crate::tokenizer::TextTokenizer;

/// The index file's layout.
#[derive(Debug, serde::Deserialize, serde::Serialize)]
pub struct SafetensorsIndex {
    #[serde(default)]
    pub metadata: serde_json::Value,
    pub weight_map: BTreeMap<String, String>,
}

/// An opened checkpoint directory (nothing but the config is read yet).
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: MiniCpmoConfig,
    pub shards: Vec<PathBuf>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?;
        let config = MiniCpmoConfig::from_json(&text).with_context(|| format!("parsing {}", cfg_path.display()))?;
        let index_path = dir.join("model.safetensors.index.json");
        let shards = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)?;
            let index: SafetensorsIndex = serde_json::from_str(&text).with_context(|| format!("parsing {}", index_path.display()))?;
            let files: std::collections::BTreeSet<&String> = index.weight_map.values().collect();
            let mut shards = Vec::new();
            for f in files {
                let p = dir.join(f);
                if !p.exists() {
                    bail!("{} names shard {f}, which is missing", index_path.display());
                }
                shards.push(p);
            }
            shards
        } else if dir.join("model.safetensors").exists() {
            vec![dir.join("model.safetensors")]
        } else {
            bail!("{}: neither model.safetensors.index.json nor model.safetensors", dir.display());
        };
        Ok(Self { dir: dir.to_path_buf(), config, shards })
    }

    /// A `VarBuilder` over the memory-mapped shards, yielding `dtype` on `device`.
    pub fn var_builder(&self, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
        // SAFETY: the files are mapped read-only; like every mmap-based loader, this assumes
        // nobody truncates them while the server runs.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&self.shards) }
            .with_context(|| format!("mapping the safetensors shards of {}", self.dir.display()))?;
        let backend = Checked { inner: Box::new(st), origin: self.dir.display().to_string(), seen: None };
        Ok(VarBuilder::from_backend(Box::new(backend), dtype, device.clone()))
    }

    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        TextTokenizer::from_file(&self.dir.join("tokenizer.json"))
    }

    /// Stage 0 and Stage 1 modules.
    pub fn load_models(&self, dtype: DType, device: &Device) -> Result<(Thinker, Talker)> {
        load_models(&self.var_builder(dtype, device)?, &self.config)
    }
}

/// Builds the Thinker and the Talker from any `VarBuilder` rooted at the checkpoint's top level.
pub fn load_models(vb: &VarBuilder, cfg: &MiniCpmoConfig) -> Result<(Thinker, Talker)> {
    load_models_on(vb, cfg, vb.device())
}

/// As [`load_models`], with the Talker's tensors on `talker_device` (its own stream).
pub fn load_models_on(vb: &VarBuilder, cfg: &MiniCpmoConfig, talker_device: &Device) -> Result<(Thinker, Talker)> {
    let thinker = Thinker::load(vb.clone(), cfg).context("loading the Thinker (llm., apm., audio_projection_layer.)")?;
    let talker = Talker::load(vb.pp("tts").set_device(talker_device.clone()), &cfg.tts_config).context("loading the Talker (tts.)")?;
    Ok((thinker, talker))
}

/// A backend that checks names and shapes with messages that say what was expected, and can
/// record which tensors were read.
pub struct Checked {
    pub inner: Box<dyn SimpleBackend>,
    pub origin: String,
    pub seen: Option<Mutex<HashSet<String>>>,
}

impl Checked {
    pub fn recording(inner: Box<dyn SimpleBackend>, origin: impl Into<String>) -> Self {
        Self { inner, origin: origin.into(), seen: Some(Mutex::new(HashSet::new())) }
    }

    /// Names read so far (when recording).
    pub fn seen(&self) -> HashSet<String> {
        self.seen.as_ref().map(|m| m.lock().expect("not poisoned").clone()).unwrap_or_default()
    }

    fn note(&self, name: &str) {
        if let Some(m) = &self.seen {
            m.lock().expect("not poisoned").insert(name.to_string());
        }
    }
}

impl SimpleBackend for Checked {
    fn get(&self, s: Shape, name: &str, h: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        if !self.inner.contains_tensor(name) {
            candle_core::bail!("{}: missing tensor {name} (expected shape {:?})", self.origin, s.dims());
        }
        let t = self.inner.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            candle_core::bail!("{}: tensor {name} has shape {:?}, expected {:?}", self.origin, t.shape().dims(), s.dims());
        }
        let _ = h;
        self.note(name);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        if !self.inner.contains_tensor(name) {
            candle_core::bail!("{}: missing tensor {name}", self.origin);
        }
        self.note(name);
        self.inner.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// A `VarBuilder` over a torch state dict (`.pt`, zip or legacy pickle), with an optional key prefix
/// stripped (`generator.` in some HiFT files); tensors are checked like checkpoint tensors.
pub fn pth_var_builder(path: &Path, strip_prefix: Option<&str>, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    let all = candle_core::pickle::read_all(path).with_context(|| format!("reading torch state dict {}", path.display()))?;
    let map: std::collections::HashMap<String, Tensor> = all
        .into_iter()
        .map(|(k, v)| {
            let k = match strip_prefix {
                Some(p) => k.strip_prefix(p).map(str::to_string).unwrap_or(k),
                None => k,
            };
            (k, v)
        })
        .collect();
    let backend = Checked { inner: Box::new(map), origin: path.display().to_string(), seen: None };
    Ok(VarBuilder::from_backend(Box::new(backend), dtype, device.clone()))
}

/// A backend shared through an `Arc`, so its owner can inspect it (e.g. what was read) after a
/// `VarBuilder` has been handed to a loader.
pub struct SharedBackend<T: SimpleBackend>(pub std::sync::Arc<T>);

impl<T: SimpleBackend> SimpleBackend for SharedBackend<T> {
    fn get(&self, s: Shape, name: &str, h: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.get(s, name, h, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_tensor(name)
    }
}
