//! Loading a MiniCPM-o 4.5 checkpoint directory: `config.json`, the safetensors shards listed by
//! `model.safetensors.index.json` (or a single `model.safetensors`), memory-mapped, and
//! `tokenizer.json`.
//!
//! Tensors are reached through a `VarBuilder` whose prefixes route to the parts: `llm.` and `apm.`
//! and `audio_projection_layer.`, `tts.`. Vision tensors (`vpm.`,
//! `resampler.`) are never read. Every tensor is checked against the shape the model expects and
//! converted to the requested dtype; a missing or misshaped tensor is an error naming it and the
//! expected shape.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

pub use antiphon_models::backend::{Checked, SharedBackend};

use antiphon_models::config::MiniCpmoConfig;
use antiphon_models::talker::Talker;
use antiphon_models::thinker::Thinker;
use antiphon_models::tokenizer::TextTokenizer;

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
        let text = std::fs::read_to_string(&cfg_path)
            .with_context(|| format!("reading {}", cfg_path.display()))?;
        let config = MiniCpmoConfig::from_json(&text)
            .with_context(|| format!("parsing {}", cfg_path.display()))?;
        let index_path = dir.join("model.safetensors.index.json");
        let shards = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)?;
            let index: SafetensorsIndex = serde_json::from_str(&text)
                .with_context(|| format!("parsing {}", index_path.display()))?;
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
        let backend =
            Checked { inner: Box::new(st), origin: self.dir.display().to_string(), seen: None };
        Ok(VarBuilder::from_backend(Box::new(backend), dtype, device.clone()))
    }

    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        tokenizer_file(&self.dir.join("tokenizer.json"))
    }

    /// The Thinker's and the Talker's modules.
    pub fn load_models(&self, dtype: DType, device: &Device) -> Result<(Thinker, Talker)> {
        load_models(&self.var_builder(dtype, device)?, &self.config)
    }
}

/// Builds the Thinker and the Talker from any `VarBuilder` rooted at the checkpoint's top level.
pub fn load_models(vb: &VarBuilder, cfg: &MiniCpmoConfig) -> Result<(Thinker, Talker)> {
    load_models_on(vb, cfg, vb.device())
}

/// As [`load_models`], with the Talker's tensors on `talker_device` (its own stream).
pub fn load_models_on(
    vb: &VarBuilder,
    cfg: &MiniCpmoConfig,
    talker_device: &Device,
) -> Result<(Thinker, Talker)> {
    let thinker = Thinker::load(vb.clone(), cfg)
        .context("loading the Thinker (llm., apm., audio_projection_layer.)")?;
    let talker = Talker::load(vb.pp("tts").set_device(talker_device.clone()), &cfg.tts_config)
        .context("loading the Talker (tts.)")?;
    Ok((thinker, talker))
}

/// A `VarBuilder` over a torch state dict (`.pt`, zip or legacy pickle), with an optional key
/// prefix stripped (`generator.` in some HiFT files); tensors are checked like checkpoint tensors.
pub fn pth_var_builder(
    path: &Path,
    strip_prefix: Option<&str>,
    dtype: DType,
    device: &Device,
) -> Result<VarBuilder<'static>> {
    let all = candle_core::pickle::read_all(path)
        .with_context(|| format!("reading torch state dict {}", path.display()))?;
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

/// `tokenizer.json` read from a file.
pub fn tokenizer_file(path: &Path) -> Result<TextTokenizer> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    TextTokenizer::from_bytes(&bytes).with_context(|| format!("loading {}", path.display()))
}
