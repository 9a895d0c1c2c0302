//! The configuration file (TOML). One file is one deployment: where to listen, limits, auth, TLS,
//! the model (a checkpoint directory or synthetic weights), the engine's knobs, and voices.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use antiphon_assets::synth::Preset;
use antiphon_engine::EngineConfig;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerSection,
    #[serde(default)]
    pub auth: AuthSection,
    #[serde(default)]
    pub tls: Option<TlsSection>,
    pub model: ModelSection,
    #[serde(default)]
    pub engine: EngineSection,
    #[serde(default)]
    pub voices: Vec<VoiceEntry>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSection {
    pub listen: String,
    /// Static files served at `/` (the browser demo).
    pub web_dir: PathBuf,
    pub max_sessions: usize,
    pub resume_grace_s: u64,
    /// On shutdown, how long live responses may take to finish.
    pub shutdown_drain_s: u64,
    pub max_text_frame: usize,
    pub max_binary_frame: usize,
    pub journal_max_bytes: usize,
    pub journal_max_audio_s: u64,
    /// Suggested back-off when the server is full or shutting down.
    pub retry_after_ms: u64,
    /// Sessions idle (no input, no output) this long are closed (0 = never).
    pub idle_timeout_s: u64,
    /// Sessions older than this are closed (0 = never).
    pub max_duration_s: u64,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            web_dir: "web".into(),
            max_sessions: 16,
            resume_grace_s: 30,
            shutdown_drain_s: 10,
            max_text_frame: 256 * 1024,
            max_binary_frame: 16 * 1024,
            journal_max_bytes: 4 * 1024 * 1024,
            journal_max_audio_s: 30,
            retry_after_ms: 2000,
            idle_timeout_s: 0,
            max_duration_s: 0,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthSection {
    /// Accepted API keys (`Authorization: Bearer <key>` or `?token=<key>`); empty = no auth.
    pub api_keys: Vec<String>,
    /// Accepted `Origin` values; empty = any.
    pub allowed_origins: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelSource {
    Synthetic,
    Checkpoint,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub source: ModelSource,
    /// For `synthetic`: the dimensions.
    #[serde(default = "default_preset")]
    pub preset: Preset,
    #[serde(default)]
    pub seed: u64,
    /// For `checkpoint`: the MiniCPM-o 4.5 directory.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// `cpu` or `cuda` / `cuda:N` (needs the `cuda` build).
    #[serde(default = "default_device")]
    pub device: String,
    /// `f32` or `bf16`.
    #[serde(default = "default_dtype")]
    pub dtype: String,
    /// On CUDA: `per_stage` (each stage its own stream on the GPU) or `one` (all stages queue on
    /// one stream).
    #[serde(default)]
    pub streams: Streams,
}

/// How the stages share the GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Streams {
    #[default]
    PerStage,
    One,
}

fn default_preset() -> Preset {
    Preset::Tiny
}
fn default_device() -> String {
    "cpu".into()
}
fn default_dtype() -> String {
    "f32".into()
}

/// The engine's knobs as they appear in the file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    pub thinker_max_batch: usize,
    pub thinker_prefill_tokens: usize,
    pub talker_max_batch: usize,
    pub code2wav_max_batch: usize,
    pub first_chunk_codes: usize,
    /// A small first chunk only for a stream joining the Talker with at most this many streams
    /// (0: never; absent: always).
    pub small_first_chunk_streams: Option<usize>,
    pub chunk_codes: usize,
    pub talker_streaming_prefill: bool,
    /// Turn mode: the Talker runs at most this many chunks ahead of the delivered audio (-1: no
    /// limit).
    pub talker_lead_chunks: i64,
    /// No codes beyond a stream's first chunk until its audio is delivered.
    pub talker_hold_first_chunk: bool,
    /// Prompt prefixes (the system turn with the voice) whose KV the Thinker keeps (0 = off).
    pub thinker_prefix_cache: usize,
    /// CUDA graphs for one-stream decode steps (GPU only).
    pub decode_graphs: bool,
    /// CUDA graphs for Code2Wav's flow chunks (GPU only).
    pub code2wav_graphs: bool,
    pub ref_cache_capacity: usize,
    pub setup_cache_capacity: usize,
    pub prefetch: bool,
    pub prefetch_setup: bool,
    pub default_max_text_tokens: usize,
    pub default_min_audio_tokens: usize,
    pub default_max_audio_tokens: usize,
    pub thinker_hears_reference: bool,
    /// Duplex unit length (a multiple of 100 ms; 1000 as the model was trained).
    pub duplex_unit_ms: u32,
    /// Codes the Talker may drain at the end of a duplex turn.
    pub duplex_drain_codes: usize,
    /// Thinker positions a duplex session may use (0 = the model's context).
    pub duplex_max_context: usize,
}

impl Default for EngineSection {
    fn default() -> Self {
        let e = EngineConfig::default();
        Self {
            thinker_max_batch: e.thinker_max_batch,
            thinker_prefill_tokens: e.thinker_prefill_tokens,
            talker_max_batch: e.talker_max_batch,
            code2wav_max_batch: e.code2wav_max_batch,
            first_chunk_codes: e.first_chunk_codes,
            small_first_chunk_streams: None,
            chunk_codes: e.chunk_codes,
            talker_streaming_prefill: e.talker_streaming_prefill,
            talker_lead_chunks: e.talker_lead_chunks.map(|n| n as i64).unwrap_or(-1),
            talker_hold_first_chunk: e.talker_hold_first_chunk,
            thinker_prefix_cache: e.thinker_prefix_cache,
            decode_graphs: e.decode_graphs,
            code2wav_graphs: e.code2wav_graphs,
            ref_cache_capacity: e.ref_cache_capacity,
            setup_cache_capacity: e.setup_cache_capacity,
            prefetch: e.prefetch,
            prefetch_setup: e.prefetch_setup,
            default_max_text_tokens: e.default_max_text_tokens,
            default_min_audio_tokens: e.default_min_audio_tokens,
            default_max_audio_tokens: e.default_max_audio_tokens,
            thinker_hears_reference: e.thinker_hears_reference,
            duplex_unit_ms: 1000,
            duplex_drain_codes: e.duplex_drain_codes,
            duplex_max_context: 0,
        }
    }
}

impl EngineSection {
    pub fn to_engine(&self) -> EngineConfig {
        EngineConfig {
            thinker_max_batch: self.thinker_max_batch,
            thinker_prefill_tokens: self.thinker_prefill_tokens,
            talker_max_batch: self.talker_max_batch,
            code2wav_max_batch: self.code2wav_max_batch,
            first_chunk_codes: self.first_chunk_codes,
            small_first_chunk_streams: self.small_first_chunk_streams.unwrap_or(usize::MAX),
            chunk_codes: self.chunk_codes,
            talker_streaming_prefill: self.talker_streaming_prefill,
            talker_lead_chunks: usize::try_from(self.talker_lead_chunks).ok(),
            talker_hold_first_chunk: self.talker_hold_first_chunk,
            thinker_prefix_cache: self.thinker_prefix_cache,
            decode_graphs: self.decode_graphs,
            code2wav_graphs: self.code2wav_graphs,
            ref_cache_capacity: self.ref_cache_capacity,
            setup_cache_capacity: self.setup_cache_capacity,
            prefetch: self.prefetch,
            prefetch_setup: self.prefetch_setup,
            default_max_text_tokens: self.default_max_text_tokens,
            default_min_audio_tokens: self.default_min_audio_tokens,
            default_max_audio_tokens: self.default_max_audio_tokens,
            thinker_hears_reference: self.thinker_hears_reference,
            // 25 codes per second of speech
            duplex_codes_per_unit: (self.duplex_unit_ms as usize / 40).max(1),
            duplex_drain_codes: self.duplex_drain_codes,
            duplex_max_context: (self.duplex_max_context > 0).then_some(self.duplex_max_context),
            ..EngineConfig::default()
        }
    }
}

/// A configured voice: an id and a WAV file (relative paths are relative to the config file's
/// directory).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VoiceEntry {
    pub id: String,
    pub wav: PathBuf,
}

/// The embedded default (`configs/default.toml`).
pub const DEFAULT_TOML: &str = include_str!("../../configs/default.toml");

impl Config {
    /// Parses and validates; relative paths are resolved against `base`.
    pub fn parse(text: &str, base: &Path) -> Result<Self> {
        let mut c: Config = toml::from_str(text).context("parsing the configuration")?;
        let rel = |p: &Path| {
            if p.is_relative() {
                base.join(p)
            } else {
                p.to_path_buf()
            }
        };
        c.server.web_dir = rel(&c.server.web_dir);
        for v in c.voices.iter_mut() {
            v.wav = rel(&v.wav);
        }
        if let Some(p) = c.model.path.as_mut() {
            *p = rel(p);
        }
        if let Some(t) = c.tls.as_mut() {
            t.cert = rel(&t.cert);
            t.key = rel(&t.key);
        }
        c.validate()?;
        Ok(c)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::parse(&text, &base).with_context(|| format!("in {}", path.display()))
    }

    /// The embedded default; its paths are relative to `configs/` under the current directory
    /// (the repository root, where `cargo run` runs).
    pub fn embedded_default() -> Result<Self> {
        Self::parse(DEFAULT_TOML, Path::new("configs"))
    }

    pub fn validate(&self) -> Result<()> {
        if self.server.listen.parse::<std::net::SocketAddr>().is_err() {
            bail!("server.listen {:?} is not an address like 127.0.0.1:8080", self.server.listen);
        }
        if self.server.max_sessions == 0 {
            bail!("server.max_sessions must be at least 1");
        }
        if self.server.max_binary_frame < 64 || self.server.max_text_frame < 1024 {
            bail!("server.max_binary_frame / max_text_frame are too small");
        }
        match self.model.source {
            ModelSource::Checkpoint => {
                let Some(p) = &self.model.path else { bail!("model.path is required with source = \"checkpoint\"") };
                if !p.join("config.json").is_file() {
                    bail!("model.path {}: no config.json there", p.display());
                }
            }
            ModelSource::Synthetic => {}
        }
        if !matches!(self.model.dtype.as_str(), "f32" | "bf16") {
            bail!("model.dtype {:?}: expected f32 or bf16", self.model.dtype);
        }
        if !(self.model.device == "cpu" || self.model.device.starts_with("cuda")) {
            bail!("model.device {:?}: expected cpu, cuda or cuda:N", self.model.device);
        }
        let e = &self.engine;
        if e.chunk_codes == 0 || e.thinker_max_batch == 0 || e.talker_max_batch == 0 || e.code2wav_max_batch == 0 {
            bail!("engine batch limits and chunk_codes must be at least 1");
        }
        if e.duplex_unit_ms == 0 || !e.duplex_unit_ms.is_multiple_of(100) || e.duplex_unit_ms > 10_000 {
            bail!("engine.duplex_unit_ms {}: a multiple of 100 ms up to 10000", e.duplex_unit_ms);
        }
        if self.voices.is_empty() {
            bail!("at least one [[voices]] entry is needed (the first is the default voice)");
        }
        let mut ids = std::collections::HashSet::new();
        for v in &self.voices {
            if !ids.insert(&v.id) {
                bail!("voice id {:?} appears twice", v.id);
            }
            if !v.wav.is_file() {
                bail!("voice {:?}: {} does not exist", v.id, v.wav.display());
            }
        }
        if let Some(t) = &self.tls {
            if !t.cert.is_file() || !t.key.is_file() {
                bail!("tls.cert / tls.key must name existing files");
            }
        }
        Ok(())
    }
}
