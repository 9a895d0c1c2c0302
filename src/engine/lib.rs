//! The engine: three stages, each one OS thread running a blocking loop — gather the ready work
//! of all its streams, run one batched step, hand results on. Async code never runs model code and
//! never waits on a stage: the server calls [`Engine::submit`] / [`Engine::cancel`], which only
//! offer messages to the stages' bounded inboxes ([`inbox`]), and receives events through the
//! request's sink.
//!
//! ```text
//!  submit ──► Thinker ──handoff──► Talker ──chunks──► Code2Wav ──► audio
//!    └──────────── placeholder (the reference voice, at admission)
//!    ─────────►┘
//! ```
//!
//! Every hand-off carries the request id (unique per response); a stage drops work whose request
//! is no longer live. Code2Wav uses its idle steps to prepare a waiting request's reference voice
//! (reference prefetch, see [`code2wav`]).

pub mod admission;
pub mod caches;
pub mod capacity;
pub mod chunker;
pub mod clips;
pub mod code2wav;
pub mod config;
pub mod contain;
pub mod device_setup;
pub mod fit;
pub mod gate;
pub mod inbox;
pub mod messages;
pub mod metric_labels;
pub mod metrics;
pub mod pace;
pub mod prefix;
pub mod profile;
pub mod refcache;
pub mod talker;
pub mod thinker;
pub mod types;
pub mod voices;

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{bail, Result};

pub use admission::{Admission, Busy};
pub use config::{
    legacy_key, Code2WavConfig, DuplexConfig, EngineConfig, PrefetchConfig, TalkerConfig,
    ThinkerConfig,
};
pub use messages::{Code2WavMsg, TalkerMsg, TalkerWake, ThinkerMsg};
pub use metrics::EngineMetrics;
pub use types::*;

use crate::inbox::Offer;
use crate::metric_labels::{RefusedKind, StageName};

pub use antiphon_models::Models;

/// The system prompt of a turn whose session gave no `instructions`.
pub const DEFAULT_INSTRUCTIONS: &str = "You are a helpful assistant with the above voice style.";

/// Positions of a prompt's system turn beside its instructions and its voice (the chat template's
/// markers and the voice's own sentence), at most.
pub const SYSTEM_TURN_TOKENS: usize = 64;

/// Why [`Engine::submit`] did not take a request.
#[derive(Debug)]
pub enum SubmitError {
    /// No place now and the queue is full: the client may ask again later (`capacity`).
    Busy(Busy),
    /// The request cannot be run as given (the message says why).
    Invalid(String),
    /// The engine's stages have stopped.
    Stopped,
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::Busy(b) => b.fmt(f),
            SubmitError::Invalid(why) => f.write_str(why),
            SubmitError::Stopped => f.write_str("the engine has stopped"),
        }
    }
}

/// Why [`Engine::duplex_unit`] did not take a unit.
#[derive(Debug)]
pub enum UnitRefused {
    /// Not audio the Thinker can hear as a unit (the message says why).
    Invalid(String),
    /// The Thinker is a whole inbox behind: the unit comes back, to be offered again.
    Full(Vec<f32>),
    /// The engine's stages have stopped.
    Stopped,
}

impl std::fmt::Display for UnitRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UnitRefused::Invalid(why) => f.write_str(why),
            UnitRefused::Full(_) => {
                f.write_str("the engine is behind (the Thinker's inbox is full)")
            }
            UnitRefused::Stopped => f.write_str("the engine has stopped"),
        }
    }
}

impl std::error::Error for SubmitError {}

/// What a stage does between messages.
pub trait StageLoop: Send + 'static {
    type Msg: Send + 'static;
    fn on_message(&mut self, m: Self::Msg);
    /// Runs one step if there is work; false when idle.
    fn step(&mut self) -> bool;
    /// When idle: how long to wait for a message before calling [`StageLoop::idle`]
    /// (`None` = until a message comes).
    fn idle_wait(&self) -> Option<Duration> {
        None
    }
    fn idle(&mut self) {}
    /// After a panic inside a step: end every request this stage holds, as failed.
    fn fail_all(&mut self, why: &str);
}

fn run_stage<S: StageLoop>(mut s: S, rx: Receiver<S::Msg>) {
    loop {
        loop {
            match rx.try_recv() {
                Ok(m) => s.on_message(m),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.step()));
        match stepped {
            Ok(true) => continue,
            Ok(false) => {}
            Err(p) => {
                let what = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                tracing::error!("a stage step panicked: {}", what.as_deref().unwrap_or("?"));
                s.fail_all("internal error");
                continue;
            }
        }
        let got = match s.idle_wait() {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(d) => rx.recv_timeout(d),
        };
        match got {
            Ok(m) => s.on_message(m),
            Err(RecvTimeoutError::Timeout) => s.idle(),
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// The running engine. Dropping it stops the stage threads.
pub struct Engine {
    to_thinker: Option<SyncSender<ThinkerMsg>>,
    to_talker: Option<SyncSender<TalkerMsg>>,
    to_code2wav: Option<SyncSender<Code2WavMsg>>,
    /// Code2Wav's sender to the Talker, taken back at the end.
    talker_wake: TalkerWake,
    registry: Registry,
    metrics: EngineMetrics,
    admission: Admission,
    cfg: Arc<EngineConfig>,
    limits: antiphon_protocol::GenerationLimits,
    /// The Thinker's context, in positions.
    thinker_context: usize,
    /// Positions a voice takes in the system turn (0 when the Thinker does not hear it).
    voice_rows: usize,
    /// The Thinker's tokenizer, for what the server must count in tokens before admitting it.
    tokenizer: Arc<antiphon_models::tokenizer::TextTokenizer>,
    threads: Vec<JoinHandle<()>>,
}

impl Engine {
    /// Prepares the models on their devices ([`device_setup::prepare`]: stream count, graph
    /// capture and warm-up; blocking, seconds on a GPU) and starts the three stages' threads.
    pub fn start(mut models: Models, mut cfg: EngineConfig) -> Result<Self> {
        device_setup::prepare(&mut models, &mut cfg)?;
        // what a request may ask for: a reply (with room for a prompt) that fits the Thinker's
        // context and the Talker's, and codes that fit the Talker's beside the longest default text
        let (ctx0, ctx1) = (
            fit::conversation_context(
                models.thinker.llm.decoder().config().max_positions,
                cfg.thinker.context,
            ),
            models.talker.decoder().config().max_positions,
        );
        let voice_rows = if cfg.thinker.hears_reference {
            models.thinker.clip_embeddings_for(
                (16_000.0 * antiphon_models::code2wav::prompt::PROMPT_SECONDS) as usize,
            )
        } else {
            0
        };
        let limits = antiphon_protocol::GenerationLimits {
            max_text_tokens: fit::max_reply(ctx0, ctx1),
            max_audio_tokens: fit::max_codes(ctx1, cfg.default_max_text_tokens),
        };
        let cfg = Arc::new(cfg);
        let metrics = EngineMetrics::new();
        let admission = Admission::new(
            admission::AdmissionLimits {
                max_streams: cfg.stream_places(),
                max_queued: cfg.max_queued,
                call_headroom: cfg.call_headroom,
                adaptive: cfg.adaptive_stream_limit,
                first_audio_target: (cfg.first_audio_target_ms > 0)
                    .then(|| Duration::from_millis(cfg.first_audio_target_ms)),
            },
            metrics.admission.clone(),
        );
        let registry = {
            let a = admission.clone();
            Registry::with_end_hook(Arc::new(move |id| {
                a.release(&admission::Holder::Response(id.clone()))
            }))
        };
        let cap = cfg.channel_capacity;
        let (tx0, rx0) = mpsc::sync_channel::<ThinkerMsg>(cap);
        admission.set_wake(tx0.clone());
        let (tx1, rx1) = mpsc::sync_channel::<TalkerMsg>(cap);
        let (tx2, rx2) = mpsc::sync_channel::<Code2WavMsg>(cap);
        let talker_wake = TalkerWake::new(tx1.clone());
        let tokenizer = Arc::new(models.tokenizer.clone());
        // (on a GPU whose decode graphs run at a raised priority, see gate.rs)
        let gate = gate::PrefillGate::new(
            cfg.stage_priorities && models.thinker.llm.decoder().device().is_cuda(),
        );
        let s0 = thinker::ThinkerStage::new(
            models.thinker,
            models.tokenizer,
            cfg.clone(),
            registry.clone(),
            metrics.clone(),
            tx1.clone(),
            admission.clone(),
        )?
        .with_gate(gate.clone());
        let pace = pace::StagePace::default();
        let s1 = talker::TalkerStage::new(
            models.talker,
            cfg.clone(),
            registry.clone(),
            metrics.clone(),
            tx2.clone(),
            gate.clone(),
        )?
        .with_pace(pace.clone());
        let s2 = code2wav::Code2WavStage::new(
            models.code2wav,
            cfg.clone(),
            registry.clone(),
            metrics.clone(),
        )
        .with_admission(admission.clone())
        .with_gate(gate.clone())
        .with_pace(pace)
        .with_talker_wake(talker_wake.clone());
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new().name(name.to_string()).spawn(f)
        };
        let threads = vec![
            spawn("thinker", Box::new(move || run_stage(s0, rx0)))?,
            spawn("talker", Box::new(move || run_stage(s1, rx1)))?,
            spawn("code2wav", Box::new(move || run_stage(s2, rx2)))?,
        ];
        Ok(Self {
            to_thinker: Some(tx0),
            to_talker: Some(tx1),
            to_code2wav: Some(tx2),
            talker_wake,
            registry,
            metrics,
            admission,
            cfg,
            limits,
            thinker_context: ctx0,
            voice_rows,
            tokenizer,
            threads,
        })
    }

    /// Admission by load: places, the queue, the headroom.
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// Whether a new call (a turn-mode session) may begin now; counted when refused.
    pub fn accepts_call(&self) -> Result<(), Busy> {
        self.admission
            .accepts_call()
            .inspect_err(|_| self.metrics.admission_refused.at(RefusedKind::Call).inc())
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// `text` in the Thinker's tokens (special-token text is not recognized).
    pub fn count_tokens(&self, text: &str) -> Result<usize> {
        Ok(self.tokenizer.encode(text)?.len())
    }

    /// Whether the model's tokenizer has the tool template's tags (replies can call tools).
    pub fn serves_tools(&self) -> bool {
        self.tokenizer.tool_tokens().is_some()
    }

    /// The most a request's generation may ask for (the models' contexts).
    pub fn generation_limits(&self) -> antiphon_protocol::GenerationLimits {
        self.limits
    }

    /// The Thinker's context, in positions (a prompt, the conversation in it, and a reply).
    pub fn thinker_context(&self) -> usize {
        self.thinker_context
    }

    /// The most tokens a turn's text input may hold beside `instructions_tokens` of instructions:
    /// what the Thinker's context leaves after them, the voice's system turn and a reply of the
    /// default length. Such an input always fits: the conversation's oldest turns give way to it.
    pub fn max_input_tokens(&self, instructions_tokens: usize) -> usize {
        fit::max_input(
            self.thinker_context,
            instructions_tokens + self.voice_rows + SYSTEM_TURN_TOKENS,
            self.cfg.default_max_text_tokens,
        )
    }

    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    /// Live requests.
    pub fn active(&self) -> usize {
        self.registry.live_count()
    }

    /// Admits a request; its events go to `sink`. Code2Wav learns of it at once (with its
    /// reference, unless it is a duplex request). It starts when a place is free (admission.rs):
    /// until then it waits in the queue, and with the queue full it is refused
    /// ([`SubmitError::Busy`]).
    pub fn submit(&self, spec: RequestSpec, sink: EventSink) -> Result<(), SubmitError> {
        if let Some(why) = spec.voice.fault() {
            return Err(SubmitError::Invalid(why.into()));
        }
        if self.registry.is_live(&spec.id) {
            return Err(SubmitError::Invalid(format!("request {} is already live", spec.id)));
        }
        if let Err(b) = self.admission.enqueue(&spec.id) {
            self.metrics.admission_refused.at(RefusedKind::Response).inc();
            return Err(SubmitError::Busy(b));
        }
        if !self.registry.insert(spec.id.clone(), sink) {
            self.admission.release(&admission::Holder::Response(spec.id.clone()));
            return Err(SubmitError::Invalid(format!("request {} is already live", spec.id)));
        }
        let prefetch = (spec.mode == Mode::Turn).then(|| spec.voice.clone());
        let placeholder = Code2WavMsg::Placeholder { id: spec.id.clone(), prefetch };
        let id = spec.id.clone();
        match self.offer_code2wav_then_thinker(placeholder, ThinkerMsg::Admit(spec)) {
            Offer::Taken => Ok(()),
            Offer::Full(_) => {
                // a stage is a whole inbox behind: as at capacity (Code2Wav's step sweeps the
                // placeholder of a request that is not live)
                self.registry.withdraw(&id);
                self.admission.release(&admission::Holder::Response(id));
                self.metrics.admission_refused.at(RefusedKind::Response).inc();
                Err(SubmitError::Busy(self.admission.retry_after()))
            }
            Offer::Stopped => {
                self.registry.finish(&id, Status::Failed("engine stopped".into()));
                Err(SubmitError::Stopped)
            }
        }
    }

    /// Takes a place for a duplex session (admission.rs) until [`Engine::close_duplex`]: a session
    /// that gets none is refused when it is created, before anything is opened.
    pub fn reserve_duplex(&self, session: &str) -> Result<(), Busy> {
        self.admission
            .open_duplex(session)
            .inspect_err(|_| self.metrics.admission_refused.at(RefusedKind::Duplex).inc())
    }

    /// Opens a duplex session: a long-lived Thinker stream fed with [`Engine::duplex_unit`]; its
    /// decisions, spoken turns and end come through `sink`. Code2Wav counts it as a live duplex
    /// stream (no prefetch while any is open) until [`Engine::close_duplex`]. It holds a place
    /// (taken here unless [`Engine::reserve_duplex`] took it) until then.
    pub fn open_duplex(&self, spec: DuplexSpec, sink: DuplexSink) -> Result<()> {
        if let Some(why) = spec.voice.fault() {
            bail!(why);
        }
        if let DuplexPolicy::SpeakEvery(0) = spec.policy {
            bail!("speak_every needs k >= 1");
        }
        self.reserve_duplex(&spec.session)?;
        let session = spec.session.clone();
        let to_code2wav = Code2WavMsg::DuplexOpen(session.clone());
        let offered = self
            .offer_code2wav_then_thinker(to_code2wav, ThinkerMsg::DuplexOpen(spec, sink))
            .or_refused("a stage");
        if offered.is_err() {
            // (Code2Wav's step forgets a session that holds no place)
            self.admission.release(&admission::Holder::Duplex(session));
        }
        offered
    }

    /// The next unit of a duplex session: 16 kHz mono, a whole number of 100 ms (1 s by default).
    /// A unit the Thinker has no room for now comes back ([`UnitRefused::Full`]), to be offered
    /// again once it has decided one of the session's earlier units.
    pub fn duplex_unit(&self, session: &str, samples: Vec<f32>) -> Result<(), UnitRefused> {
        if samples.is_empty() || !samples.len().is_multiple_of(fit::UNIT_SAMPLES_PER_POSITION) {
            return Err(UnitRefused::Invalid(format!(
                "a duplex unit is a whole number of 100 ms at 16 kHz, not {} samples",
                samples.len()
            )));
        }
        if samples.iter().any(|s| !s.is_finite()) {
            return Err(UnitRefused::Invalid("input audio holds non-finite samples".into()));
        }
        let m = ThinkerMsg::DuplexUnit {
            session: session.to_string(),
            samples,
            arrived: std::time::Instant::now(),
        };
        match self.offer(StageName::Thinker, &self.to_thinker, m) {
            Offer::Taken => Ok(()),
            Offer::Full(ThinkerMsg::DuplexUnit { samples, .. }) => Err(UnitRefused::Full(samples)),
            Offer::Full(_) | Offer::Stopped => Err(UnitRefused::Stopped),
        }
    }

    /// Ends a duplex session: its open turn is cancelled, `Closed` is its last event, and Code2Wav
    /// stops counting it. (Its place is the authority: a stage whose inbox is full drops the
    /// message and its step forgets a session that holds no place.)
    pub fn close_duplex(&self, session: &str) {
        self.admission.release(&admission::Holder::Duplex(session.to_string()));
        let _ = self.offer(
            StageName::Thinker,
            &self.to_thinker,
            ThinkerMsg::DuplexClose(session.to_string()),
        );
        let _ = self.offer(
            StageName::Code2Wav,
            &self.to_code2wav,
            Code2WavMsg::DuplexClose(session.to_string()),
        );
    }

    /// Prepares a reference voice in Code2Wav (in a step when no chunk is due) and keeps its
    /// features there until [`Engine::forget_voice`]; the features (host copies, to be saved) come
    /// on the returned channel.
    pub fn prepare_voice(
        &self,
        voice: RefInput,
    ) -> Result<Receiver<Result<voices::PreparedVoice, voices::PrepareRefused>>> {
        if let Some(why) = voice.fault() {
            bail!(why);
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let prepare = Code2WavMsg::Prepare { voice, reply: tx };
        self.offer(StageName::Code2Wav, &self.to_code2wav, prepare).or_refused("Code2Wav")?;
        Ok(rx)
    }

    /// Hands Code2Wav features prepared by an earlier run (see [`voices::PreparedVoice::tensors`]):
    /// requests with that voice use them instead of preparing it.
    pub fn install_voice(&self, voice: voices::PreparedVoice) -> Result<()> {
        let install = Code2WavMsg::Install(voice);
        self.offer(StageName::Code2Wav, &self.to_code2wav, install).or_refused("Code2Wav")
    }

    /// Code2Wav drops the features it keeps for the voice of this reference key. (With its inbox
    /// full the message is dropped: the features stay among the prepared voices Code2Wav keeps,
    /// a bounded store that lets the oldest go.)
    pub fn forget_voice(&self, key: &str) {
        let _ = self.offer(
            StageName::Code2Wav,
            &self.to_code2wav,
            Code2WavMsg::Forget(key.to_string()),
        );
    }

    /// Offers `m` to a stage's inbox without waiting ([`inbox::offer`]), counting a full one
    /// (`antiphon_engine_inbox_full_total`).
    fn offer<M>(&self, stage: StageName, to: &Option<SyncSender<M>>, m: M) -> Offer<M> {
        let offered = inbox::offer(to.as_ref(), m);
        if matches!(offered, Offer::Full(_)) {
            self.metrics.inbox_full.at(stage).inc();
        }
        offered
    }

    /// A new stream's two messages: Code2Wav's first (it learns of the stream before any chunk
    /// can come), then the Thinker's; the Thinker's comes back unless both were taken.
    fn offer_code2wav_then_thinker(
        &self,
        to_code2wav: Code2WavMsg,
        to_thinker: ThinkerMsg,
    ) -> Offer<ThinkerMsg> {
        match self.offer(StageName::Code2Wav, &self.to_code2wav, to_code2wav) {
            Offer::Taken => self.offer(StageName::Thinker, &self.to_thinker, to_thinker),
            Offer::Full(_) => Offer::Full(to_thinker),
            Offer::Stopped => Offer::Stopped,
        }
    }

    /// Cancels a request at any point: `Done { Cancelled }` is its last event, and every stage
    /// frees its state. (The registry is the authority: a stage whose inbox is full drops the
    /// message, and its next step sweeps the request away.)
    pub fn cancel(&self, id: &RequestId) -> bool {
        let ended =
            self.registry.finish_counted(id, Status::Cancelled, &self.metrics.requests).is_some();
        let _ = self.offer(StageName::Thinker, &self.to_thinker, ThinkerMsg::Cancel(id.clone()));
        let _ = self.offer(StageName::Talker, &self.to_talker, TalkerMsg::Cancel(id.clone()));
        let _ = self.offer(StageName::Code2Wav, &self.to_code2wav, Code2WavMsg::Cancel(id.clone()));
        ended
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // (admission's wake-up sender too: the Thinker ends when its last sender is gone; and
        // Code2Wav's to the Talker, which holds Code2Wav's inbox open)
        self.admission.clear_wake();
        self.talker_wake.close();
        self.to_thinker.take();
        self.to_talker.take();
        self.to_code2wav.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
