//! Sessions: the conversation state that outlives connections. Each session is one task (an
//! actor) owning its state: mode, formats, voice, instructions, generation defaults, history, the
//! server sequence counter and the replay journal, the highest applied input seq, the current
//! response. Connections feed it client events and audio, the engine feeds it response events;
//! it sends every conversation message with a seq, journals it, and writes it to the attached
//! socket if there is one. A socket that drops parks the session for the grace period; a resume
//! re-attaches and replays what the client lacks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

mod client_input;
mod conn;
mod duplex;
mod history;
mod manager;
mod replay;
mod response;
mod tools;
mod transcript;

pub use conn::{Conn, ConnId, Outbound, REPLAY_STALL};
use history::History;
pub(crate) use manager::random_token;
pub use manager::{Handle, SessionManager};

use super::audio_edge::{InputAudio, OutputAudio};
use super::journal::{Journal, WireMsg};
use super::Shared;
use antiphon_engine::{
    DuplexEvent, DuplexPolicy as EnginePolicy, EngineEvent, GenerationParams, Mode, RefInput,
    RequestId, RequestSpec, SpokenClip, Status, UserInput,
};
use antiphon_protocol::{
    AudioFrame, ClientEvent, ClosingReason, DoneStatus, DuplexPolicy, ErrorCode, Generation,
    Limits, Mode as WireMode, OutputAudio as OutputFormat, ServerEvent, SessionCreate,
    SessionUpdate, Trigger, Voice, WireError, KIND_AUDIO, PROTOCOL_VERSION,
};
use duplex::DuplexState;
use response::{resolve_voice, Resp};
use tools::SessionTools;

static NEXT_INCIDENT: AtomicU64 = AtomicU64::new(1);

/// An `internal` error for a client: what failed and the first line of why (at most 200
/// characters; never a backtrace), with an incident id under which the log holds the whole story.
pub fn internal_error(what: &str, detail: &str, fatal: bool) -> WireError {
    let id = NEXT_INCIDENT.fetch_add(1, Ordering::Relaxed);
    tracing::error!(incident = id, "{what}: {detail}");
    let first: String = detail.lines().next().unwrap_or("").chars().take(200).collect();
    let msg = format!("{what}: {first} (incident {id}; the server log has the details)");
    if fatal {
        WireError::fatal(ErrorCode::Internal, msg)
    } else {
        WireError::new(ErrorCode::Internal, msg)
    }
}

/// Messages to a session.
pub enum SessionMsg {
    Event {
        seq: Option<u64>,
        event: ClientEvent,
    },
    Audio {
        seq: Option<u64>,
        kind: u8,
        payload: Vec<u8>,
    },
    /// A client message that could not be parsed.
    Invalid(WireError),
    /// The connection is refused for what it sent (a frame over the limit, invalid UTF-8): the
    /// error goes out in the session's order (with its seq), then the close frame; the session
    /// parks when the socket ends.
    Refused {
        error: WireError,
        close: (u16, String),
    },
    /// A resume (token checked): attach this connection, replay after `last_seq`.
    Attach {
        conn: Conn,
        last_seq: u64,
    },
    /// The queue of a connection whose resume is replaying has room again.
    Pump {
        conn: ConnId,
    },
    /// The connection went away without `session.close`.
    Detach {
        conn: ConnId,
    },
    Engine {
        response_id: u32,
        event: EngineEvent,
    },
    /// The transcript request of the turn `response_id` answers.
    Transcript {
        response_id: u32,
        event: EngineEvent,
    },
    /// The engine's duplex stream of this session.
    Duplex(DuplexEvent),
    Shutdown {
        retry_after_ms: u64,
    },
    /// The drain deadline passed: responses still running are cancelled (each gets its
    /// `response.done`), then the session ends with close 1001.
    DrainDeadline,
    Tick,
}

/// A session's state (owned by its task).
pub struct Session {
    shared: Arc<Shared>,
    id: String,
    token: String,
    manager: Option<Arc<SessionManager>>,
    me: Option<UnboundedSender<SessionMsg>>,
    mode: WireMode,
    input: InputAudio,
    output_format: OutputFormat,
    pending_output: Option<OutputFormat>,
    voice: RefInput,
    instructions: Option<String>,
    generation: Generation,
    tools: SessionTools,
    /// Spoken turns are transcribed (`input_transcription`).
    transcription: bool,
    /// Transcript requests still running (cancelled when the session ends).
    transcripts: Vec<RequestId>,
    history: History,
    next_seq: u64,
    journal: Journal,
    applied_input: u64,
    input_since_ack: bool,
    last_ack: Instant,
    conn: Option<Conn>,
    /// While a resume replays the journal: the seq of the last message handed to the connection
    /// (`replay.rs`); `None`: the connection is live.
    replayed: Option<u64>,
    /// The connection a waiter will wake the replay for, when one waits.
    pump_waiting: Option<ConnId>,
    parked_at: Option<Instant>,
    created: Instant,
    last_activity: Instant,
    responses: u32,
    current: Option<Resp>,
    /// Duplex: earlier turns' responses still finishing while a newer one runs.
    older: Vec<Resp>,
    duplex: Option<DuplexState>,
    closing: bool,
    ended: bool,
}

impl Session {
    fn new(shared: Arc<Shared>, c: &SessionCreate) -> Result<Self, WireError> {
        let history = History::new(shared.engine.thinker_context());
        let cfg = &shared.config.server;
        let input = InputAudio::new(c.input_audio.codec, c.input_audio.sample_rate)
            .map_err(|e| {
                WireError::new(ErrorCode::BadField, format!("field `input_audio.sample_rate`: {e}"))
            })?
            .with_limit_s(cfg.max_input_audio_s);
        OutputAudio::new(c.output_audio.codec, c.output_audio.frame_ms()).map_err(|e| {
            WireError::new(ErrorCode::BadField, format!("field `output_audio.frame_ms`: {e}"))
        })?;
        let duplex = match (c.mode, &c.duplex) {
            (WireMode::Turn, Some(_)) => {
                return Err(WireError::new(
                    ErrorCode::BadField,
                    "field `duplex`: only for mode \"duplex\"",
                ))
            }
            (WireMode::Turn, None) => None,
            (WireMode::Duplex, p) => {
                let policy = match p {
                    None | Some(DuplexPolicy::Model) => EnginePolicy::Model,
                    Some(DuplexPolicy::SpeakEvery { k: 0 }) => {
                        return Err(WireError::new(
                            ErrorCode::BadField,
                            "field `duplex.k`: at least 1",
                        ))
                    }
                    Some(DuplexPolicy::SpeakEvery { k }) => EnginePolicy::SpeakEvery(*k as u64),
                };
                let unit_ms = shared.config.engine.duplex.unit_ms;
                let unit_in = (input.rate() as u64 * unit_ms as u64 / 1000) as usize;
                Some(DuplexState::new(policy, unit_in, unit_ms))
            }
        };
        let voice = resolve_voice(&shared, c.voice.as_ref())?;
        let mut tools = SessionTools::default();
        match (&c.tools, c.mode) {
            (Some(_), WireMode::Duplex) => {
                return Err(WireError::new(
                    ErrorCode::BadField,
                    "field `tools`: only for mode \"turn\"",
                ))
            }
            (Some(t), _) => tools.declare(t.clone(), shared.engine.serves_tools())?,
            (None, _) => {}
        }
        if let Some(g) = &c.generation {
            g.validate(&shared.engine.generation_limits())?;
            tools.check_choice(g)?;
        }
        shared.check_instructions(c.instructions.as_deref())?;
        let now = Instant::now();
        Ok(Self {
            journal: Journal::new(cfg.journal_max_bytes, cfg.journal_max_audio_s * 1000),
            shared,
            id: String::new(),
            token: String::new(),
            manager: None,
            me: None,
            mode: c.mode,
            input,
            output_format: OutputFormat {
                codec: c.output_audio.codec,
                frame_ms: Some(c.output_audio.frame_ms()),
            },
            pending_output: None,
            voice,
            instructions: c.instructions.clone(),
            generation: c.generation.clone().unwrap_or_default(),
            tools,
            transcription: c.input_transcription.unwrap_or(false) && c.mode == WireMode::Turn,
            transcripts: Vec::new(),
            history,
            next_seq: 1,
            applied_input: 0,
            input_since_ack: false,
            last_ack: now,
            conn: None,
            replayed: None,
            pump_waiting: None,
            parked_at: None,
            created: now,
            last_activity: now,
            responses: 0,
            current: None,
            older: Vec::new(),
            duplex,
            closing: false,
            ended: false,
        })
    }

    fn start(
        mut self,
        id: String,
        token: String,
        me: UnboundedSender<SessionMsg>,
        conn: Conn,
        manager: Arc<SessionManager>,
    ) -> Self {
        self.id = id;
        self.token = token;
        self.me = Some(me);
        self.manager = Some(manager);
        self.conn = Some(conn);
        self
    }

    async fn run(
        mut self,
        mut rx: UnboundedReceiver<SessionMsg>,
        mut input: tokio::sync::mpsc::Receiver<SessionMsg>,
    ) {
        let cfg = &self.shared.config.server;
        let created = ServerEvent::SessionCreated {
            seq: 0,
            session_id: self.id.clone(),
            resume_token: self.token.clone(),
            protocol: PROTOCOL_VERSION,
            mode: self.mode,
            output_audio: self.output_format.clone(),
            resume_grace_s: cfg.resume_grace_s,
            limits: Limits {
                max_text_frame: cfg.max_text_frame,
                max_binary_frame: cfg.max_binary_frame,
                journal_max_bytes: cfg.journal_max_bytes,
                journal_max_audio_ms: cfg.journal_max_audio_s * 1000,
            },
            synthetic_weights: self.shared.synthetic,
        };
        tracing::info!("session created");
        self.send_event(created);
        if self.duplex.is_some() {
            self.open_duplex();
        }
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        while !self.ended {
            tokio::select! {
                m = rx.recv() => match m {
                    Some(m) => self.handle(m),
                    None => break,
                },
                // (the manager holds a sender as long as the session exists: `None` only at the
                // end)
                // (a duplex session whose units run ahead of the model waits for it: the socket's
                // reader then waits too, and so does the client)
                Some(m) = input.recv(), if self.takes_input() => self.handle(m),
                _ = tick.tick() => self.handle(SessionMsg::Tick),
            }
        }
        tracing::info!("session ended");
    }

    // ------------------------------------------------------------------ sending

    fn emit(&mut self, seq: u64, msg: WireMsg, audio_ms: u64) {
        if self.journal.push(seq, msg.clone(), audio_ms).is_err() {
            // the client stopped acknowledging: the session cannot promise replay any more
            let e = ServerEvent::error(&WireError::fatal(
                ErrorCode::JournalOverflow,
                "the replay journal is full",
            ));
            if let Some(c) = &self.conn {
                c.send_event(&e);
            }
            self.shared.metrics.errors.at(ErrorCode::JournalOverflow.into()).inc();
            self.end(true, Some((1008, "journal overflow")));
            return;
        }
        if let Some(m) = &self.manager {
            m.set_journal_bytes(&self.id, self.journal.bytes());
        }
        // (while a resume replays, the journal's order is the replay's: it sends this too)
        if let Some(c) = self.conn.as_ref().filter(|_| self.replayed.is_none()) {
            c.send(match msg {
                WireMsg::Text(t) => Outbound::Text(t),
                WireMsg::Binary(b) => Outbound::Binary(b),
            });
        }
    }

    fn send_event(&mut self, e: ServerEvent) {
        if self.ended {
            return;
        }
        if e.is_connection_level() {
            if let Some(c) = &self.conn {
                c.send_event(&e);
            }
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.emit(seq, WireMsg::Text(e.with_seq(seq).to_json()), 0);
    }

    fn send_error(&mut self, e: WireError) {
        self.shared.metrics.errors.at(e.code.into()).inc();
        let fatal = e.fatal;
        self.send_event(ServerEvent::error(&e).with_seq(0));
        if fatal {
            self.end(false, Some((1008, e.code.as_str())));
        }
    }

    fn send_audio(&mut self, response_id: u32, payload: Vec<u8>, last: bool) {
        if self.ended {
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let frame = AudioFrame { kind: KIND_AUDIO, last, seq: seq as u32, response_id, payload };
        let ms = self.output_format.frame_ms() as u64;
        self.emit(seq, WireMsg::Binary(frame.encode()), ms);
    }

    /// Ends the session: cancels the response, forgets the session, closes the socket.
    fn end(&mut self, expired: bool, close: Option<(u16, &str)>) {
        if self.ended {
            return;
        }
        self.ended = true;
        for r in self.current.take().into_iter().chain(std::mem::take(&mut self.older)) {
            self.shared.engine.cancel(&r.engine_id);
        }
        for t in std::mem::take(&mut self.transcripts) {
            self.shared.engine.cancel(&t);
        }
        if self.duplex.is_some() {
            self.shared.engine.close_duplex(&self.id);
        }
        if let Some(m) = &self.manager {
            m.remove(&self.id, expired);
        }
        // (a resume still replaying: what is left of it goes before the close, as far as the
        // queue takes it, so a last error is read before the close frame)
        self.flush_replay();
        if let Some(c) = self.conn.take() {
            let (code, why) = close.unwrap_or((1000, "session closed"));
            c.send(Outbound::Close(code, why.to_string()));
        }
    }

    fn handle(&mut self, m: SessionMsg) {
        match m {
            SessionMsg::Event { seq, event } => {
                self.last_activity = Instant::now();
                // acks and pings are not conversation input
                let counted = !matches!(event, ClientEvent::Ack { .. } | ClientEvent::Ping { .. });
                if counted && self.seen(seq) {
                    return;
                }
                self.on_event(event);
            }
            SessionMsg::Audio { seq, kind, payload } => {
                self.last_activity = Instant::now();
                if self.seen(seq) || kind != KIND_AUDIO {
                    return;
                }
                if let Err(e) = self.input.push(&payload) {
                    self.send_error(WireError::new(
                        ErrorCode::BadAudio,
                        format!("packet dropped: {e}"),
                    ));
                }
                self.feed_units();
            }
            SessionMsg::Invalid(e) => self.send_error(e),
            SessionMsg::Refused { error, close } => {
                self.shared.metrics.errors.at(error.code.into()).inc();
                self.send_event(ServerEvent::error(&error).with_seq(0));
                if let Some(c) = &self.conn {
                    c.send(Outbound::Close(close.0, close.1));
                }
            }
            SessionMsg::Attach { conn, last_seq } => self.attach(conn, last_seq),
            SessionMsg::Pump { conn } => self.on_pump(conn),
            SessionMsg::Detach { conn } => {
                if self.conn.as_ref().is_some_and(|c| c.id == conn) {
                    self.conn = None;
                    self.replayed = None;
                    self.parked_at = Some(Instant::now());
                    if let Some(m) = &self.manager {
                        m.set_parked(&self.id, true);
                    }
                    tracing::info!("session parked");
                }
            }
            SessionMsg::Engine { response_id, event } => self.on_engine(response_id, event),
            SessionMsg::Transcript { response_id, event } => self.on_transcript(response_id, event),
            SessionMsg::Duplex(e) => self.on_duplex(e),
            SessionMsg::Shutdown { retry_after_ms } => {
                if !self.closing {
                    self.closing = true;
                    self.send_event(ServerEvent::SessionClosing {
                        seq: 0,
                        reason: ClosingReason::Shutdown,
                        retry_after_ms: Some(retry_after_ms),
                    });
                    if self.live_responses() == 0 {
                        self.end(false, Some((1001, "server shutting down")));
                    }
                }
            }
            SessionMsg::DrainDeadline => {
                self.closing = true;
                self.cancel_all_responses();
                // (the last cancelled response ends the session; with none, end it here)
                self.end(false, Some((1001, "server shutting down")));
            }
            SessionMsg::Tick => self.tick(),
        }
    }

    fn takes_input(&self) -> bool {
        self.duplex.as_ref().is_none_or(DuplexState::takes_input)
    }

    fn tick(&mut self) {
        // (a unit the engine had no room for is offered again)
        self.feed_units();
        let cfg = &self.shared.config.server;
        let now = Instant::now();
        if let Some(t) = self.parked_at {
            if now.duration_since(t) >= Duration::from_secs(cfg.resume_grace_s) {
                tracing::info!("session expired");
                self.end(true, None);
                return;
            }
        }
        if self.input_since_ack && now.duration_since(self.last_ack) >= Duration::from_millis(400) {
            if let Some(c) = &self.conn {
                c.send_event(&ServerEvent::Ack { input_seq: self.applied_input });
            }
            self.input_since_ack = false;
            self.last_ack = now;
        }
        let idle = cfg.idle_timeout_s > 0
            && self.live_responses() == 0
            && now.duration_since(self.last_activity) >= Duration::from_secs(cfg.idle_timeout_s);
        let old = cfg.max_duration_s > 0
            && now.duration_since(self.created) >= Duration::from_secs(cfg.max_duration_s);
        if idle || old {
            let reason = if idle { ClosingReason::Idle } else { ClosingReason::MaxDuration };
            self.send_event(ServerEvent::SessionClosing { seq: 0, reason, retry_after_ms: None });
            self.end(false, Some((1000, reason.as_str())));
        }
    }
}
