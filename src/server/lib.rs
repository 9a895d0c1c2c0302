//! The server: axum over tokio. `/v1/realtime` (the WebSocket protocol), operations endpoints
//! (`/healthz`, `/readyz`, `/metrics`, `/api/build_info`), the browser demo at `/`, graceful
//! shutdown. Sessions and the audio edge live here; model code lives in the engine's threads.

mod accept;
pub mod audio_edge;
pub mod auth;
pub mod config;
pub mod journal;
mod metrics;
pub mod openai;
mod operations;
pub mod session;
pub mod turn_model;
mod voice_error;
pub mod voice_features;
pub mod voices;
pub mod ws;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use axum::extract::{Query, State, WebSocketUpgrade};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;

use antiphon_engine::{
    Engine, EngineEvent, GenerationParams, Mode, Models, RequestId, RequestSpec, Status, UserInput,
};
use config::{Config, ModelSource};
pub use metrics::{DeviceMemory, ErrorLabel, ResponseLabel, ServerMetrics};
use operations::{build_info, metrics, readyz};
use session::SessionManager;

/// What every connection and session shares.
pub struct Shared {
    pub config: Arc<Config>,
    pub engine: Arc<Engine>,
    pub sessions: Arc<SessionManager>,
    /// The configured and the registered voices.
    pub voices: voices::Voices,
    pub metrics: ServerMetrics,
    pub synthetic: bool,
    pub ready: AtomicBool,
    shutting_down: AtomicBool,
    pub started: Instant,
    /// One permit per open WebSocket (`server.max_connections`).
    pub connection_permits: Arc<tokio::sync::Semaphore>,
    /// The turn model behind `semantic_vad` (`server.smart_turn_model`), if one is configured.
    pub turn_model: Option<turn_model::TurnModel>,
}

/// Text longer than this is counted in tokens with the worker handed over
/// ([`Shared::count_tokens`]): the Thinker's tokenizer takes milliseconds over tens of KiB.
const LONG_TEXT_BYTES: usize = 4096;

impl Shared {
    /// The Thinker's tokens in `text`. A session's task counts on a tokio worker: a long text is
    /// counted with `block_in_place` (on the multi-threaded runtime the server runs), so the
    /// worker's other tasks move to another worker instead of waiting for the tokenizer.
    pub fn count_tokens(&self, text: &str) -> anyhow::Result<usize> {
        use tokio::runtime::{Handle, RuntimeFlavor};
        let multi =
            Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
        if multi && text.len() > LONG_TEXT_BYTES {
            tokio::task::block_in_place(|| self.engine.count_tokens(text))
        } else {
            self.engine.count_tokens(text)
        }
    }

    /// `instructions` within the protocol's cap in characters, then within
    /// `server.max_instructions_tokens` of the Thinker's tokens (`bad_field` naming the limit).
    pub fn check_instructions(&self, i: Option<&str>) -> Result<(), antiphon_protocol::WireError> {
        use antiphon_protocol::{ErrorCode, WireError};
        antiphon_protocol::validate_instructions(i)?;
        let Some(i) = i else { return Ok(()) };
        let max = self.config.server.max_instructions_tokens;
        let n = self.count_tokens(i).map_err(|e| {
            WireError::new(ErrorCode::BadField, format!("field `instructions`: {e}"))
        })?;
        if n > max {
            return Err(WireError::new(
                ErrorCode::BadField,
                format!(
                    "field `instructions`: {n} tokens, more than this server takes (at most {max})"
                ),
            ));
        }
        Ok(())
    }

    /// A user's text input within what one turn holds: the Thinker's context less the longest
    /// instructions this server takes, the voice and a reply of the default length (so an input
    /// accepted now never fails a later response of the default length for its own length).
    /// Counted in tokens only when it could be over: byte-level BPE makes at most a token a byte
    /// of the normalized text, and NFC makes at most three bytes of one.
    pub fn check_user_text(&self, text: &str) -> Result<(), String> {
        let max = self.engine.max_input_tokens(self.config.server.max_instructions_tokens);
        if text.len().saturating_mul(3) <= max {
            return Ok(());
        }
        let n = self.count_tokens(text).map_err(|e| format!("{e:#}"))?;
        if n > max {
            return Err(format!(
                "{n} tokens of text, more than one turn holds beside the \
                instructions and a reply (at most {max})"
            ));
        }
        Ok(())
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }
}

/// Loads (or makes) the models a configuration names.
pub fn load_models(cfg: &Config) -> Result<Models> {
    let devs = antiphon_models::gpu::open_stages(
        cfg.model.device,
        cfg.model.streams == config::Streams::PerStage,
    )?;
    let dtype = cfg.model.dtype.dtype();
    match cfg.model.source {
        ModelSource::Synthetic => {
            antiphon_assets::synth::models_on(cfg.model.preset, cfg.model.seed, dtype, &devs)
        }
        ModelSource::Checkpoint => {
            let dir = cfg.model.path.as_ref().expect("validated");
            let ck = antiphon_assets::checkpoint::Checkpoint::open(dir)?;
            let (thinker, talker) = antiphon_assets::checkpoint::load_models_on(
                &ck.var_builder(dtype, &devs.thinker)?,
                &ck.config,
                &devs.talker,
            )?;
            let tokenizer = ck.tokenizer()?;
            let code2wav = antiphon_assets::token2wav::load_dir(
                &dir.join("assets").join("token2wav"),
                dtype,
                &devs.code2wav,
                antiphon_models::code2wav::BufferSeeds {
                    seed: cfg.model.seed,
                    ..Default::default()
                },
            )?;
            Ok(Models { thinker, talker, code2wav, tokenizer })
        }
    }
}

/// A running server: its address and the means to stop it.
pub struct Server {
    pub addr: SocketAddr,
    pub shared: Arc<Shared>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<()>>,
}

impl Server {
    /// Stops accepting, tells every session (`session.closing`), lets responses finish for up to
    /// the drain period, then returns.
    pub async fn shutdown(self) -> Result<()> {
        let _ = self.stop.send(true);
        self.task.await.context("server task")?
    }
}

/// Builds everything and starts serving on `cfg.server.listen` (port 0 picks a free port).
pub async fn start(cfg: Config, models: Models) -> Result<Server> {
    let cfg = Arc::new(cfg);
    if !cfg.server.web_dir.join("index.html").is_file() {
        tracing::warn!(web_dir = %cfg.server.web_dir.display(),
            "no index.html in server.web_dir: the demo at / answers 404");
    }
    let metrics = ServerMetrics::new();
    // model code (the stages' graphs and warm-up, the voices' files, the turn model) runs on a
    // blocking thread, never on a runtime worker
    let (voices, engine, unprepared, turn_model) = tokio::task::spawn_blocking({
        let (cfg, registry) = (cfg.clone(), metrics.registry.clone());
        move || -> Result<_> {
            let voices = voices::Voices::load(&cfg)?;
            let engine = Arc::new(Engine::start(models, cfg.engine.clone())?);
            // saved features into Code2Wav before any request; the rest prepared before ready
            let unprepared = voices.install_saved(&engine);
            let turn_model = if cfg.server.smart_turn_model.as_os_str().is_empty() {
                None
            } else {
                let m = turn_model::TurnModel::load(
                    &cfg.server.smart_turn_model,
                    cfg.server.smart_turn_workers,
                    &registry,
                )?;
                tracing::info!(model = %cfg.server.smart_turn_model.display(),
                    "semantic_vad: the turn model is loaded");
                Some(m)
            };
            Ok((voices, engine, unprepared, turn_model))
        }
    })
    .await
    .context("the start-up thread")??;
    let shared = Arc::new(Shared {
        config: cfg.clone(),
        engine,
        sessions: Arc::new(SessionManager::default()),
        voices,
        metrics,
        synthetic: cfg.model.source == ModelSource::Synthetic,
        ready: AtomicBool::new(false),
        shutting_down: AtomicBool::new(false),
        started: Instant::now(),
        connection_permits: Arc::new(tokio::sync::Semaphore::new(cfg.server.max_connections)),
        turn_model,
    });
    shared.metrics.mark_replica(&cfg.server.replica_id);
    let listener = TcpListener::bind(&cfg.server.listen)
        .await
        .with_context(|| format!("binding {}", cfg.server.listen))?;
    let addr = listener.local_addr()?;
    let app = router(shared.clone());
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    // warm-up before ready: one short request through all three stages
    let warm = shared.clone();
    tokio::spawn(async move {
        if !unprepared.is_empty() {
            let w = warm.clone();
            let _ = tokio::task::spawn_blocking(move || {
                w.voices.prepare_missing(&w.engine, &unprepared)
            })
            .await;
        }
        match warm_up(&warm).await {
            Ok(ms) => tracing::info!("warm-up done in {ms:.0} ms; ready"),
            Err(e) => tracing::error!("warm-up failed: {e:#}"),
        }
        warm.ready.store(true, Ordering::SeqCst);
    });
    let tls = match &cfg.tls {
        None => None,
        Some(tls) => {
            let _ = rustls::crypto::ring::default_provider().install_default();
            let loaded = axum_server::tls_rustls::RustlsConfig::from_pem_file(&tls.cert, &tls.key)
                .await
                .with_context(|| {
                    format!("loading {} / {}", tls.cert.display(), tls.key.display())
                })?;
            // HTTP/1.1 only: WebSockets upgrade over it, and its request heads have a timeout
            let mut c = (*loaded.get_inner()).clone();
            c.alpn_protocols = vec![b"http/1.1".to_vec()];
            Some(Arc::new(c))
        }
    };
    let limits = accept::AcceptLimits {
        max_tcp_connections: cfg.server.max_tcp_connections,
        header_timeout: Duration::from_secs(cfg.server.header_timeout_s),
    };
    let sh = shared.clone();
    let task = tokio::spawn(async move {
        accept::serve(listener, app, tls, limits, async move {
            let _ = stopped.wait_for(|s| *s).await;
            drain(&sh).await;
        })
        .await;
        Ok(())
    });
    tracing::info!("listening on {addr}");
    Ok(Server { addr, shared, stop, task })
}

/// Tells every session the server is going, waits for them to finish (bounded).
async fn drain(shared: &Arc<Shared>) {
    shared.shutting_down.store(true, Ordering::SeqCst);
    shared.ready.store(false, Ordering::SeqCst);
    let retry = shared.config.server.retry_after_ms;
    for h in shared.sessions.all() {
        let _ = h.tx.send(session::SessionMsg::Shutdown { retry_after_ms: retry });
    }
    let deadline = Instant::now() + Duration::from_secs(shared.config.server.shutdown_drain_s);
    while !shared.sessions.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // past the deadline: what still runs is cancelled (its response.done goes out) and each
    // session closes with 1001, rather than the sockets being cut
    let left = shared.sessions.all();
    if !left.is_empty() {
        tracing::info!(left = left.len(), "drain deadline: cancelling what still runs");
        for h in left {
            let _ = h.tx.send(session::SessionMsg::DrainDeadline);
        }
        let cut = Instant::now() + Duration::from_secs(2);
        while !shared.sessions.is_empty() && Instant::now() < cut {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // a session is gone once its close is queued: its socket sends the close frame (1001) and
    // hands its permit back after; the server does not exit under a frame still being written
    let all = shared.config.server.max_connections;
    let flushed = Instant::now() + Duration::from_secs(2);
    while shared.connection_permits.available_permits() < all && Instant::now() < flushed {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tracing::info!(
        left = shared.sessions.len(),
        sockets = all - shared.connection_permits.available_permits(),
        "drained"
    );
}

async fn warm_up(shared: &Arc<Shared>) -> Result<f64> {
    let t0 = Instant::now();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let spec = RequestSpec {
        id: RequestId("warm-up".into()),
        mode: Mode::Turn,
        input: UserInput::Text("warm up".into()),
        instructions: None,
        history: vec![],
        voice: shared.voices.default_input(),
        generation: GenerationParams {
            min_text_tokens: Some(4),
            max_text_tokens: Some(4),
            min_audio_tokens: Some(30),
            max_audio_tokens: Some(30),
            temperature: None,
            seed: Some(0),
            prefix: None,
        },
        tools: Default::default(),
        text_only: false,
        task: Default::default(),
    };
    shared.engine.submit(spec, Arc::new(move |e| drop(tx.send(e))))?;
    while let Some(e) = rx.recv().await {
        if let EngineEvent::Done { status, .. } = e {
            anyhow::ensure!(status == Status::Completed, "warm-up ended {status:?}");
            break;
        }
    }
    Ok(t0.elapsed().as_secs_f64() * 1000.0)
}

pub fn router(shared: Arc<Shared>) -> Router {
    use axum::http::{header, HeaderValue};
    use tower_http::set_header::SetResponseHeaderLayer as SetHeader;
    let web = tower_http::services::ServeDir::new(&shared.config.server.web_dir);
    Router::new()
        .route("/v1/realtime", get(realtime))
        .route("/openai/v1/realtime", get(openai::realtime))
        .route(
            "/v1/voices",
            get(voices::list)
                .post(voices::register)
                .layer(axum::extract::DefaultBodyLimit::max(shared.config.server.max_voice_bytes))
                .route_layer(axum::middleware::from_fn_with_state(shared.clone(), auth::keyed)),
        )
        .route(
            "/v1/voices/{id}",
            get(voices::one)
                .delete(voices::remove)
                .route_layer(axum::middleware::from_fn_with_state(shared.clone(), auth::keyed)),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route(
            "/metrics",
            get(metrics).route_layer(axum::middleware::from_fn_with_state(
                shared.clone(),
                auth::operational,
            )),
        )
        .route(
            "/api/build_info",
            get(build_info).route_layer(axum::middleware::from_fn_with_state(
                shared.clone(),
                auth::operational,
            )),
        )
        .fallback_service(web)
        .layer(axum::middleware::from_fn(reject_long_segments))
        // on every answer: no MIME sniffing, no framing by other sites, no referrer sent on
        .layer(SetHeader::if_not_present(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ))
        .layer(SetHeader::if_not_present(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")))
        .layer(SetHeader::if_not_present(
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ))
        .layer(tower_http::trace::TraceLayer::new_for_http().on_failure(log_failure))
        .with_state(shared)
}

/// A server error answered over HTTP, logged at ERROR, but for 503: `/readyz` says so while the
/// server warms up or refuses calls, and a full server refuses upgrades with it. Those are states
/// (the metrics and `/readyz`'s body report them), not faults, and a probe polls every few seconds.
fn log_failure(
    class: tower_http::classify::ServerErrorsFailureClass,
    latency: std::time::Duration,
    _span: &tracing::Span,
) {
    use tower_http::classify::ServerErrorsFailureClass::StatusCode as Status;
    let ms = latency.as_secs_f64() * 1e3;
    match class {
        Status(code) if code == StatusCode::SERVICE_UNAVAILABLE => {
            tracing::debug!(ms, "503 service unavailable")
        }
        class => tracing::error!(ms, "response failed: {class}"),
    }
}

#[derive(serde::Deserialize)]
struct RealtimeQuery {
    token: Option<String>,
    /// The session a reconnection resumes, for a proxy to route on (`session.resume` decides).
    session_id: Option<String>,
}

/// Whether a WebSocket may open: the key (when the server has keys), the origin, not shutting
/// down, and a free connection permit (`server.max_connections`); the answer to send otherwise.
pub(crate) fn admit(
    shared: &Arc<Shared>,
    headers: &HeaderMap,
    key: Option<&str>,
) -> Result<tokio::sync::OwnedSemaphorePermit, (StatusCode, String)> {
    let auth = &shared.config.auth;
    if !auth.api_keys.is_empty() && !auth::key_ok(auth, key) {
        return Err((StatusCode::UNAUTHORIZED, "missing or wrong API key".into()));
    }
    if !auth.allowed_origins.is_empty() {
        if let Some(origin) = headers.get(axum::http::header::ORIGIN).and_then(|v| v.to_str().ok())
        {
            if !auth.allowed_origins.iter().any(|o| o == origin) {
                return Err((StatusCode::FORBIDDEN, "origin not allowed".into()));
            }
        }
    }
    if shared.is_shutting_down() {
        return Err((StatusCode::SERVICE_UNAVAILABLE, "shutting down".into()));
    }
    shared.connection_permits.clone().try_acquire_owned().map_err(|_| {
        let n = shared.config.server.max_connections;
        (StatusCode::SERVICE_UNAVAILABLE, format!("too many connections (limit {n}); retry later"))
    })
}

async fn realtime(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    q: Query<RealtimeQuery>,
    ws: WebSocketUpgrade,
) -> Response {
    let key = auth::presented_key(&headers, None).or_else(|| q.token.clone());
    let permit = match admit(&shared, &headers, key.as_deref()) {
        Ok(p) => p,
        Err(r) => return r.into_response(),
    };
    // the transport's limit is the configured one: a bigger frame is refused before it is buffered
    let limit = shared.config.server.max_text_frame.max(shared.config.server.max_binary_frame);
    let routed = q.0.session_id;
    ws.max_message_size(limit)
        .max_frame_size(limit)
        .on_upgrade(move |socket| ws::handle_socket(socket, shared, routed, permit))
}

/// Paths with a segment longer than any file name can be are answered 404 before they reach a
/// handler (the static files' service answered 500 for them).
async fn reject_long_segments(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if req.uri().path().split('/').any(|seg| seg.len() > 255) {
        return (StatusCode::NOT_FOUND, "not found").into_response();
    }
    next.run(req).await
}
