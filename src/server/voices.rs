//! The voice registry: the voices of `[[voices]]` plus voices registered over HTTP (`POST
//! /v1/voices`). A registered voice is prepared once, when it is registered (Code2Wav keeps its
//! features), and kept in `server.voice_dir`: the uploaded file as it came, its metadata and its
//! prepared features ([`super::voice_features`]), so a restart serves it again under the same id
//! without preparing it again. Sessions pick either kind by `voice.id`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use antiphon_engine::voices::PreparedVoice;
use antiphon_engine::{Engine, RefInput};
use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use super::config::Config;
pub use super::voice_error::{VoiceError, VoiceErrorCode};
use super::{voice_features, Shared};

/// What the API says of a voice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VoiceInfo {
    pub id: String,
    pub name: String,
    pub kind: VoiceKind,
    pub seconds: f64,
    pub sample_rate: u32,
    /// Unix time of the registration in seconds (0 for a configured voice).
    pub created: u64,
}

/// Where a voice comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VoiceKind {
    /// `[[voices]]` in the configuration: fixed, never deleted.
    Configured,
    /// `POST /v1/voices`: kept in `server.voice_dir`.
    Registered,
}

struct Entry {
    info: VoiceInfo,
    input: RefInput,
    /// The reference key of the features Code2Wav keeps for it (registered voices).
    key: Option<String>,
}

/// Every voice a session can name.
pub struct Voices {
    entries: RwLock<HashMap<String, Entry>>,
    /// The configured ids, in the configuration's order (the first is the default).
    configured: Vec<String>,
    dir: Option<PathBuf>,
    max_voices: usize,
    max_bytes: usize,
    max_seconds: f64,
    /// The models' fingerprint that saved features must carry
    /// ([`voice_features::model_fingerprint`]).
    fingerprint: String,
}

/// How long a registration or a start-up waits for Code2Wav's preparation of a voice.
const PREPARE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// A voice prepared by the engine (on Code2Wav's thread, in a step with no chunk due): its
/// features, or why not (`bad_audio` when the audio cannot make a voice, 503 when the engine is
/// stopped or does not answer in time).
pub fn prepare_with(engine: &Engine, input: RefInput) -> Result<PreparedVoice, VoiceError> {
    let unavailable = |m: String| {
        VoiceError::new(StatusCode::SERVICE_UNAVAILABLE, VoiceErrorCode::Unavailable, m)
    };
    let rx = engine.prepare_voice(input).map_err(|e| unavailable(format!("{e:#}")))?;
    match rx.recv_timeout(PREPARE_TIMEOUT) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(refused)) => Err(VoiceError::from_refusal(refused)),
        Err(_) => Err(unavailable(format!(
            "the engine did not prepare the voice within {} s",
            PREPARE_TIMEOUT.as_secs()
        ))),
    }
}

/// Registered ids: `v_` and letters, digits, `-` or `_` (they name files in the voice directory).
fn registered_id_ok(id: &str) -> bool {
    id.len() <= 64
        && id.strip_prefix("v_").is_some_and(|r| {
            !r.is_empty() && r.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        })
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Voices {
    /// The configured voices, and the registered ones found in `server.voice_dir` (made if
    /// missing). A registered voice that cannot be read is skipped with a warning.
    pub fn load(cfg: &Config) -> Result<Self> {
        let mut entries = HashMap::new();
        let mut configured = Vec::new();
        for v in &cfg.voices {
            let bytes = std::fs::read(&v.wav)
                .with_context(|| format!("voice {}: reading {}", v.id, v.wav.display()))?;
            let (samples, rate) =
                antiphon_audio::decode_wav(&bytes).with_context(|| format!("voice {}", v.id))?;
            if let Some(why) = antiphon_audio::voice_fault(&samples, rate) {
                anyhow::bail!("voice {} ({}): {why}", v.id, v.wav.display());
            }
            let seconds = samples.len() as f64 / f64::from(rate.max(1));
            let info = VoiceInfo {
                id: v.id.clone(),
                name: v.id.clone(),
                kind: VoiceKind::Configured,
                seconds,
                sample_rate: rate,
                created: 0,
            };
            entries.insert(
                v.id.clone(),
                Entry { info, input: RefInput::new(samples, rate), key: None },
            );
            configured.push(v.id.clone());
        }
        let s = &cfg.server;
        let dir = (!s.voice_dir.as_os_str().is_empty()).then(|| s.voice_dir.clone());
        let voices = Self {
            entries: RwLock::new(entries),
            configured,
            dir,
            max_voices: s.max_voices,
            max_bytes: s.max_voice_bytes,
            max_seconds: s.max_voice_s,
            fingerprint: voice_features::model_fingerprint(cfg),
        };
        if let Some(dir) = &voices.dir {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("server.voice_dir {}", dir.display()))?;
            voices.load_dir(dir)?;
        }
        Ok(voices)
    }

    fn load_dir(&self, dir: &Path) -> Result<()> {
        let mut found = 0;
        for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let path = e?.path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            match Self::read_registered(&path) {
                Ok(entry) => {
                    let mut m = self.entries.write().unwrap_or_else(|e| e.into_inner());
                    if m.contains_key(&entry.info.id) {
                        tracing::warn!(
                            "{}: voice id {} is taken, skipped",
                            path.display(),
                            entry.info.id
                        );
                        continue;
                    }
                    m.insert(entry.info.id.clone(), entry);
                    found += 1;
                }
                Err(err) => {
                    tracing::warn!("{}: not a registered voice, skipped: {err:#}", path.display())
                }
            }
        }
        tracing::info!("{found} registered voice(s) in {}", dir.display());
        Ok(())
    }

    fn read_registered(meta: &Path) -> Result<Entry> {
        let info: VoiceInfo = serde_json::from_slice(&std::fs::read(meta)?).context("metadata")?;
        if !registered_id_ok(&info.id) || info.kind != VoiceKind::Registered {
            anyhow::bail!("id {:?} / kind {:?}", info.id, info.kind);
        }
        let bytes = std::fs::read(meta.with_extension("wav")).context("its audio")?;
        let (samples, rate) = antiphon_audio::decode_wav(&bytes)?;
        Ok(Entry { info, input: RefInput::new(samples, rate), key: None })
    }

    /// At start-up: hands Code2Wav the saved features of every registered voice made by this
    /// model; returns the ids whose features are missing or stale ([`Voices::prepare_missing`]).
    pub fn install_saved(&self, engine: &Engine) -> Vec<String> {
        let Some(dir) = &self.dir else { return vec![] };
        let mut m = self.entries.write().unwrap_or_else(|e| e.into_inner());
        let mut missing = Vec::new();
        let mut installed = 0;
        for (id, e) in m.iter_mut().filter(|(_, e)| e.info.kind == VoiceKind::Registered) {
            match voice_features::load(dir, id, &self.fingerprint) {
                Ok(Some(v)) => {
                    let key = v.key.clone();
                    match engine.install_voice(v) {
                        Ok(()) => {
                            e.key = Some(key);
                            installed += 1;
                        }
                        Err(err) => {
                            tracing::warn!("voice {id}: its features were not installed: {err:#}")
                        }
                    }
                }
                Ok(None) => missing.push(id.clone()),
                Err(err) => {
                    tracing::warn!(
                        "voice {id}: its saved features cannot be read, preparing it \
                        again: {err:#}"
                    );
                    missing.push(id.clone());
                }
            }
        }
        tracing::info!(
            "{installed} registered voice(s) installed from their saved features, {} to prepare",
            missing.len()
        );
        missing.sort();
        missing
    }

    /// Prepares the voices `ids` (features missing or made by another model) and saves their
    /// features; a voice that fails stays registered and is prepared when a request needs it.
    pub fn prepare_missing(&self, engine: &Engine, ids: &[String]) {
        let Some(dir) = &self.dir else { return };
        for id in ids {
            let Some(input) = self.get(id) else { continue };
            match prepare_with(engine, input) {
                Ok(v) => {
                    if let Err(err) = voice_features::save(dir, id, &v, &self.fingerprint) {
                        tracing::warn!("voice {id}: its features were not saved: {err:#}");
                    }
                    if let Some(e) =
                        self.entries.write().unwrap_or_else(|e| e.into_inner()).get_mut(id)
                    {
                        e.key = Some(v.key);
                    }
                }
                Err(err) => {
                    tracing::warn!(code = ?err.code, "voice {id}: not prepared: {}", err.message)
                }
            }
        }
    }

    /// The voice a session names.
    pub fn get(&self, id: &str) -> Option<RefInput> {
        self.entries.read().unwrap_or_else(|e| e.into_inner()).get(id).map(|e| e.input.clone())
    }

    /// The default voice (the first configured one).
    pub fn default_input(&self) -> RefInput {
        self.get(&self.configured[0]).expect("the default voice is configured")
    }

    pub fn info(&self, id: &str) -> Option<VoiceInfo> {
        self.entries.read().unwrap_or_else(|e| e.into_inner()).get(id).map(|e| e.info.clone())
    }

    /// Configured voices first, in their order, then the registered ones by registration.
    pub fn list(&self) -> Vec<VoiceInfo> {
        let m = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<VoiceInfo> =
            self.configured.iter().filter_map(|id| m.get(id)).map(|e| e.info.clone()).collect();
        let mut registered: Vec<VoiceInfo> = m
            .values()
            .filter(|e| e.info.kind == VoiceKind::Registered)
            .map(|e| e.info.clone())
            .collect();
        registered.sort_by(|a, b| (a.created, &a.id).cmp(&(b.created, &b.id)));
        out.extend(registered);
        out
    }

    /// Registers `bytes` (a WAV file) as voice `name`, prepared by `prepare` (see
    /// [`prepare_with`]); every limit is checked and the voice prepared before anything is kept.
    /// A voice prepared but then not kept (the registry filled meanwhile, or its files could not
    /// be written) leaves nothing: its files are removed and `forget` gets its reference key
    /// (unless another voice has the same audio), for Code2Wav to drop its features.
    pub fn register(
        &self,
        name: &str,
        bytes: &[u8],
        prepare: impl FnOnce(RefInput) -> Result<PreparedVoice, VoiceError>,
        forget: impl FnOnce(&str),
    ) -> Result<VoiceInfo, VoiceError> {
        let bad = |code, m: String| VoiceError::new(StatusCode::BAD_REQUEST, code, m);
        let name = name.trim();
        if name.is_empty() || name.chars().count() > 64 || name.chars().any(char::is_control) {
            return Err(bad(
                VoiceErrorCode::BadField,
                "query parameter `name`: 1 to 64 characters, none of them control characters"
                    .into(),
            ));
        }
        if bytes.len() > self.max_bytes {
            return Err(VoiceError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                VoiceErrorCode::TooLarge,
                format!(
                    "the upload is {} bytes, more than this server takes \
                    (server.max_voice_bytes = {})",
                    bytes.len(),
                    self.max_bytes
                ),
            ));
        }
        if !bytes.starts_with(b"RIFF") {
            return Err(bad(
                VoiceErrorCode::BadAudio,
                "the body is not a WAV file (it must start with RIFF)".into(),
            ));
        }
        let (samples, rate) = antiphon_audio::decode_wav(bytes).map_err(|e| {
            bad(VoiceErrorCode::BadAudio, format!("the WAV file cannot be read: {e:#}"))
        })?;
        if !(8000..=192_000).contains(&rate) {
            return Err(bad(
                VoiceErrorCode::BadAudio,
                format!("sample rate {rate} Hz: 8000 to 192000 are taken"),
            ));
        }
        if let Some(why) = antiphon_audio::voice_fault(&samples, rate) {
            return Err(bad(VoiceErrorCode::BadAudio, why));
        }
        let seconds = samples.len() as f64 / f64::from(rate);
        if seconds > self.max_seconds {
            return Err(bad(
                VoiceErrorCode::TooLong,
                format!(
                    "{seconds:.1} s of audio, more than this server takes (server.max_voice_s \
                    = {})",
                    self.max_seconds
                ),
            ));
        }
        let full = |m: &HashMap<String, Entry>| {
            let registered = m.values().filter(|e| e.info.kind == VoiceKind::Registered).count();
            (registered >= self.max_voices).then(|| {
                VoiceError::new(
                    StatusCode::CONFLICT,
                    VoiceErrorCode::TooManyVoices,
                    format!(
                        "{registered} voices are registered, the most this server keeps \
                        (server.max_voices); delete one first"
                    ),
                )
            })
        };
        if let Some(e) = full(&self.entries.read().unwrap_or_else(|e| e.into_inner())) {
            return Err(e);
        }
        // (no lock held while Code2Wav prepares it)
        let input = RefInput::new(samples, rate);
        let prepared = prepare(input.clone())?;
        let mut m = self.entries.write().unwrap_or_else(|e| e.into_inner());
        let kept = self.keep(&mut m, name, bytes, input, seconds, rate, &prepared, full);
        if kept.is_err() && !m.values().any(|e| e.key.as_ref() == Some(&prepared.key)) {
            drop(m);
            forget(&prepared.key);
        }
        kept
    }

    #[allow(clippy::too_many_arguments)]
    fn keep(
        &self,
        m: &mut HashMap<String, Entry>,
        name: &str,
        bytes: &[u8],
        input: RefInput,
        seconds: f64,
        rate: u32,
        prepared: &PreparedVoice,
        full: impl Fn(&HashMap<String, Entry>) -> Option<VoiceError>,
    ) -> Result<VoiceInfo, VoiceError> {
        if let Some(e) = full(m) {
            return Err(e);
        }
        let id = loop {
            let id = format!("v_{}", super::session::random_token(12));
            if !m.contains_key(&id) {
                break id;
            }
        };
        let info = VoiceInfo {
            id: id.clone(),
            name: name.to_string(),
            kind: VoiceKind::Registered,
            seconds,
            sample_rate: rate,
            created: now_unix(),
        };
        if let Some(dir) = &self.dir {
            if let Err(e) = self.persist(dir, &info, bytes, prepared) {
                // a voice half written is no voice: what was written goes
                if let Err(r) = remove_files(dir, &info.id) {
                    tracing::warn!(
                        "voice {}: its partly written files could not all be removed: {r}",
                        info.id
                    );
                }
                return Err(VoiceError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    VoiceErrorCode::Internal,
                    format!("keeping the voice: {e:#}"),
                ));
            }
        }
        m.insert(id, Entry { info: info.clone(), input, key: Some(prepared.key.clone()) });
        Ok(info)
    }

    /// The audio and the features first, then the metadata (what a restart looks for), each
    /// written whole and renamed into place.
    fn persist(
        &self,
        dir: &Path,
        info: &VoiceInfo,
        bytes: &[u8],
        prepared: &PreparedVoice,
    ) -> Result<()> {
        let write = |name: String, data: &[u8]| -> Result<()> {
            let tmp = dir.join(format!(".{name}.tmp"));
            std::fs::write(&tmp, data)?;
            std::fs::rename(&tmp, dir.join(name))?;
            Ok(())
        };
        write(format!("{}.wav", info.id), bytes)?;
        voice_features::save(dir, &info.id, prepared, &self.fingerprint)?;
        write(format!("{}.json", info.id), &serde_json::to_vec_pretty(info)?)
    }

    /// Deletes a registered voice (its files too); returns the reference key whose features Stage
    /// 2 may now forget (none while another voice has the same audio). Sessions that already use
    /// it keep their copy.
    pub fn delete(&self, id: &str) -> Result<Option<String>, VoiceError> {
        let mut m = self.entries.write().unwrap_or_else(|e| e.into_inner());
        match m.get(id).map(|e| e.info.kind) {
            None => return Err(not_found(id)),
            Some(VoiceKind::Configured) => {
                return Err(VoiceError::new(
                    StatusCode::CONFLICT,
                    VoiceErrorCode::ConfiguredVoice,
                    format!("voice {id:?} is configured ([[voices]]); it cannot be deleted"),
                ))
            }
            Some(_) => {}
        }
        if let Some(dir) = &self.dir {
            remove_files(dir, id).map_err(|e| {
                VoiceError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    VoiceErrorCode::Internal,
                    format!("deleting the voice: {e}"),
                )
            })?;
        }
        let key = m.remove(id).and_then(|e| e.key);
        Ok(key.filter(|k| !m.values().any(|e| e.key.as_ref() == Some(k))))
    }
}

/// A registered voice's files, the metadata first (a restart after a partial removal does not
/// find the voice), then its audio, its features and any temporary file of a write.
fn remove_files(dir: &Path, id: &str) -> std::io::Result<()> {
    let names = [
        format!("{id}.json"),
        format!("{id}.wav"),
        format!("{id}.features.safetensors"),
        format!(".{id}.json.tmp"),
        format!(".{id}.wav.tmp"),
    ];
    for name in names {
        match std::fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn not_found(id: &str) -> VoiceError {
    VoiceError::new(StatusCode::NOT_FOUND, VoiceErrorCode::NotFound, format!("no voice {id:?}"))
}

#[derive(Deserialize)]
pub struct RegisterQuery {
    name: Option<String>,
}

/// `POST /v1/voices?name=<name>`, the body a WAV file: 201 and the voice.
pub async fn register(
    State(shared): State<Arc<Shared>>,
    q: Query<RegisterQuery>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            let max = shared.config.server.max_voice_bytes;
            return VoiceError::new(
                e.status(),
                VoiceErrorCode::TooLarge,
                format!(
                    "the upload is more than this server takes (server.max_voice_bytes = {max})"
                ),
            )
            .into_response();
        }
        Err(e) => {
            return VoiceError::new(e.status(), VoiceErrorCode::BadRequest, e.body_text())
                .into_response()
        }
    };
    let Some(name) = q.0.name else {
        return VoiceError::new(
            StatusCode::BAD_REQUEST,
            VoiceErrorCode::BadField,
            "query parameter `name` is required",
        )
        .into_response();
    };
    let s = shared.clone();
    match tokio::task::spawn_blocking(move || {
        s.voices.register(
            &name,
            &body,
            |input| prepare_with(&s.engine, input),
            |key| s.engine.forget_voice(key),
        )
    })
    .await
    {
        Ok(Ok(info)) => (StatusCode::CREATED, Json(info)).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(e) => VoiceError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            VoiceErrorCode::Internal,
            format!("{e}"),
        )
        .into_response(),
    }
}

/// `GET /v1/voices`: every voice.
pub async fn list(State(shared): State<Arc<Shared>>) -> Response {
    Json(serde_json::json!({"voices": shared.voices.list()})).into_response()
}

/// `GET /v1/voices/{id}`.
pub async fn one(State(shared): State<Arc<Shared>>, UrlPath(id): UrlPath<String>) -> Response {
    match shared.voices.info(&id) {
        Some(info) => Json(info).into_response(),
        None => not_found(&id).into_response(),
    }
}

/// `DELETE /v1/voices/{id}`: 204.
pub async fn remove(State(shared): State<Arc<Shared>>, UrlPath(id): UrlPath<String>) -> Response {
    let s = shared.clone();
    match tokio::task::spawn_blocking(move || {
        let key = s.voices.delete(&id)?;
        if let Some(key) = key {
            s.engine.forget_voice(&key);
        }
        Ok::<_, VoiceError>(())
    })
    .await
    {
        Ok(Ok(())) => StatusCode::NO_CONTENT.into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(e) => VoiceError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            VoiceErrorCode::Internal,
            format!("{e}"),
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests;
