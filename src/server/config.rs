//! The configuration file (TOML). One file is one deployment: where to listen, limits, auth, TLS,
//! the model (a checkpoint directory or synthetic weights), the engine's knobs, and voices.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use antiphon_assets::synth::Preset;
use antiphon_engine::EngineConfig;
use antiphon_models::gpu::{DeviceSpec, Precision};

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
    pub engine: EngineConfig,
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
    /// Messages queued for one socket's writer; a client that reads slower than this is closed
    /// (its session parks and can resume: the journal holds what it missed).
    pub outbound_queue: usize,
    /// Client messages queued for one session's task; a client that sends faster than its session
    /// handles them waits (its socket is not read meanwhile), nothing is buffered beyond this.
    pub session_inbox: usize,
    /// Open WebSocket connections at once; beyond, an upgrade is answered 503.
    pub max_connections: usize,
    /// A socket that has neither created nor resumed a session this long after its upgrade is
    /// closed.
    pub first_event_timeout_s: u64,
    /// Client audio a session holds at once (an uncommitted turn); a packet beyond gets
    /// `bad_audio` and is dropped.
    pub max_input_audio_s: u64,
    /// This replica's name (e.g. its StatefulSet pod name): every session id starts with it and a
    /// dot, so a proxy routes a resume (`?session_id=`) to the replica that holds the session.
    /// Empty: ids start with `s_` (one server). Letters, digits and `-`, at most 63.
    pub replica_id: String,
    /// TCP connections open at once, upgraded or not (beyond: a plain 503 and close). At least
    /// `max_connections`.
    pub max_tcp_connections: usize,
    /// A TLS handshake, and every HTTP request head (an idle keep-alive wait included), must
    /// complete within this many seconds, or the connection is closed.
    pub header_timeout_s: u64,
    /// The longest `instructions` (system prompt) accepted, in Thinker tokens (beside the
    /// protocol's cap in characters).
    pub max_instructions_tokens: usize,
    /// Where voices registered over HTTP (`POST /v1/voices`) are kept, so a restart serves them
    /// again (made if missing). Empty: kept in memory only.
    pub voice_dir: PathBuf,
    /// Registered voices kept at once (configured ones not counted).
    pub max_voices: usize,
    /// The largest voice upload, in bytes.
    pub max_voice_bytes: usize,
    /// The longest voice upload, in seconds of audio.
    pub max_voice_s: f64,
    /// The turn model behind the dialect's `semantic_vad`: Smart Turn v3's ONNX file (pipecat-ai's
    /// wheel ships it as `pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx`). Empty:
    /// none, and `semantic_vad` is served by the silence detector (`server_vad`'s).
    pub smart_turn_model: PathBuf,
    /// Turn-model evaluations at once (each ~0.1-0.2 s of one CPU core's time); a pause that
    /// finds them all busy waits for one.
    pub smart_turn_workers: usize,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            web_dir: "../web".into(),
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
            outbound_queue: 4096,
            session_inbox: 256,
            max_connections: 256,
            first_event_timeout_s: 10,
            max_input_audio_s: 120,
            replica_id: String::new(),
            max_tcp_connections: 1024,
            header_timeout_s: 10,
            max_instructions_tokens: 2048,
            voice_dir: PathBuf::new(),
            max_voices: 100,
            max_voice_bytes: 8 * 1024 * 1024,
            max_voice_s: 30.0,
            smart_turn_model: PathBuf::new(),
            smart_turn_workers: 2,
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
    /// With keys set: `/metrics` and `/api/build_info` answer without a key too (off: they need
    /// one, like the WebSocket).
    pub open_metrics: bool,
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
    pub device: DeviceSpec,
    /// `f32` or `bf16`.
    #[serde(default)]
    pub dtype: Precision,
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
fn default_device() -> DeviceSpec {
    DeviceSpec::Cpu
}

/// A configured voice: an id and a WAV file (relative paths are relative to the config file's
/// directory).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VoiceEntry {
    pub id: String,
    pub wav: PathBuf,
}

/// A key of the flat `[engine]` table from before the stages' sections is refused with the place
/// it moved to (`antiphon_engine::legacy_key`), rather than as an unknown key.
fn refuse_moved_engine_keys(text: &str) -> Result<()> {
    let Ok(table) = text.parse::<toml::Table>() else {
        return Ok(()); // (the parse below says what is wrong)
    };
    let Some(engine) = table.get("engine").and_then(|e| e.as_table()) else {
        return Ok(());
    };
    for (key, value) in engine {
        if let Some(new) = antiphon_engine::legacy_key(key, value.is_table()) {
            let (section, leaf) = new.split_once('.').unwrap_or(("", new));
            bail!(
                "engine.{key} has moved to engine.{new}: write `{leaf} = ...` under \
                [engine.{section}]"
            );
        }
    }
    Ok(())
}

/// The embedded default (`configs/default.toml`).
pub const DEFAULT_TOML: &str = include_str!("../../configs/default.toml");

impl Config {
    /// Parses and validates; relative paths are resolved against `base`.
    pub fn parse(text: &str, base: &Path) -> Result<Self> {
        refuse_moved_engine_keys(text)?;
        let de = toml::Deserializer::parse(text).context("parsing the configuration")?;
        // errors name the key (`model.dtype: unknown variant ...`)
        let mut c: Config = serde_path_to_error::deserialize(de)
            .map_err(|e| anyhow::anyhow!("{}: {}", e.path(), e.inner()))?;
        let rel = |p: &Path| {
            if p.is_relative() {
                base.join(p)
            } else {
                p.to_path_buf()
            }
        };
        c.server.web_dir = rel(&c.server.web_dir);
        if !c.server.voice_dir.as_os_str().is_empty() {
            c.server.voice_dir = rel(&c.server.voice_dir);
        }
        if !c.server.smart_turn_model.as_os_str().is_empty() {
            c.server.smart_turn_model = rel(&c.server.smart_turn_model);
        }
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
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
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
        let s = &self.server;
        if s.outbound_queue == 0
            || s.session_inbox == 0
            || s.max_connections == 0
            || s.first_event_timeout_s == 0
            || s.max_input_audio_s == 0
        {
            bail!(
                "server.outbound_queue, session_inbox, max_connections, first_event_timeout_s \
                and max_input_audio_s must be at least 1"
            );
        }
        if s.max_instructions_tokens == 0 {
            bail!("server.max_instructions_tokens must be at least 1");
        }
        if self.server.smart_turn_workers == 0 {
            bail!("server.smart_turn_workers must be at least 1");
        }
        if s.header_timeout_s == 0 || s.max_tcp_connections < s.max_connections {
            bail!(
                "server.header_timeout_s must be at least 1, and server.max_tcp_connections at \
                least server.max_connections"
            );
        }
        if let Err(e) = check_replica_id(&s.replica_id) {
            bail!("server.replica_id {:?}: {e}", s.replica_id);
        }
        if !self.server.max_voice_s.is_finite()
            || self.server.max_voice_s <= 0.0
            || self.server.max_voice_bytes < 1024
        {
            bail!("server.max_voice_s must be above 0 and server.max_voice_bytes at least 1024");
        }
        if self.server.max_binary_frame < 64 || self.server.max_text_frame < 1024 {
            bail!("server.max_binary_frame / max_text_frame are too small");
        }
        match self.model.source {
            ModelSource::Checkpoint => {
                let Some(p) = &self.model.path else {
                    bail!("model.path is required with source = \"checkpoint\"")
                };
                if !p.join("config.json").is_file() {
                    bail!("model.path {}: no config.json there", p.display());
                }
            }
            ModelSource::Synthetic => {}
        }
        self.engine.validate().map_err(anyhow::Error::msg)?;
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

impl Config {
    /// What `serve` would refuse or miss that [`Config::parse`] does not see, found without loading
    /// a weight (`antiphon check-config`): the device on this build, the demo's `web_dir`, each
    /// voice file as audio, a checkpoint's files ([`antiphon_assets::check::check_checkpoint`]),
    /// and the turn model (a small file: it is opened as `serve` opens it).
    /// Each problem names the file or key and what was expected; empty: none found.
    pub fn preflight(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let DeviceSpec::Cuda(_) = self.model.device {
            if !candle_core::utils::cuda_is_available() {
                problems.push(format!(
                    "model.device = \"{}\": this build has no CUDA (build it with `cargo build \
                    --release --features cuda`)",
                    self.model.device
                ));
            } else if let Err(e) = antiphon_models::gpu::open(self.model.device) {
                problems.push(format!("model.device = \"{}\": {e:#}", self.model.device));
            }
        }
        let web = &self.server.web_dir;
        if !web.join("index.html").is_file() {
            problems.push(format!(
                "server.web_dir = {}: no index.html there, so the demo at / would answer 404 (a \
                relative web_dir is read from the configuration file's directory)",
                web.display()
            ));
        }
        for v in &self.voices {
            let audio = std::fs::read(&v.wav)
                .map_err(anyhow::Error::from)
                .and_then(|b| antiphon_audio::decode_wav(&b));
            match audio {
                Err(e) => problems.push(format!("voice {:?}: {}: {e:#}", v.id, v.wav.display())),
                Ok((samples, rate)) => {
                    if let Some(why) = antiphon_audio::voice_fault(&samples, rate) {
                        problems.push(format!("voice {:?}: {}: {why}", v.id, v.wav.display()));
                    }
                }
            }
        }
        if let (ModelSource::Checkpoint, Some(dir)) = (self.model.source, &self.model.path) {
            problems.extend(antiphon_assets::check::check_checkpoint(dir));
        }
        let turn_model = &self.server.smart_turn_model;
        if !turn_model.as_os_str().is_empty() {
            let loaded = antiphon_assets::onnx::read_model(turn_model)
                .and_then(|m| antiphon_models::smart_turn::SmartTurn::from_model(&m));
            if let Err(e) = loaded {
                problems.push(format!("server.smart_turn_model = {}: {e:#}", turn_model.display()));
            }
        }
        problems
    }
}

/// A replica id: empty, or 1–63 letters, digits and `-` (a DNS label, as a pod name is).
pub fn check_replica_id(id: &str) -> std::result::Result<(), &'static str> {
    if id.len() > 63
        || !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        || id.starts_with('-')
    {
        return Err("letters, digits and '-' (not first), at most 63");
    }
    Ok(())
}
