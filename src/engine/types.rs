//! What goes into the engine and what comes out: request specifications, events, per-request
//! timestamps, and the shared registry through which every stage checks that a request is still
//! live (not done, not cancelled) before it does work or emits output.

use crate::metric_labels::{Milestone, RequestOutcome};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use crate::clips::{NonFiniteAudio, RefInput, SpokenClip};
pub use antiphon_models::tools::{FunctionTool, ToolCall, ToolChoice, ToolSet};

/// A request id chosen by the caller (the session layer), unique among live requests.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub String);

impl RequestId {
    /// The `n`th turn-mode response of a session: `{session}/{n}`.
    pub fn response(session: &str, n: u32) -> Self {
        Self(format!("{session}/{n}"))
    }

    /// The `n`th turn a duplex session's model spoke: `{session}/t{n}` (apart from its responses).
    pub fn duplex_turn(session: &str, n: u64) -> Self {
        Self(format!("{session}/t{n}"))
    }

    /// The transcript of what the caller said for a session's `n`th response:
    /// `{session}/{n}/heard`.
    pub fn transcript(session: &str, n: u32) -> Self {
        Self(format!("{session}/{n}/heard"))
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for RequestId {
    fn from(s: &str) -> Self {
        Self(s.to_string())
    }
}

/// Turn mode answers one input; duplex requests belong to a long-lived duplex session (never
/// prefetched).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Turn,
    Duplex,
}

/// What the user said.
#[derive(Debug, Clone)]
pub enum UserInput {
    Text(String),
    Audio(SpokenClip),
    /// The outputs of the tools the previous reply called, in the order of its calls.
    ToolResults(Vec<String>),
}

/// An earlier turn of the conversation (for the prompt): what the caller said, as it was said (a
/// spoken turn is its audio, never a transcript or a stand-in), and what the assistant said.
#[derive(Debug, Clone)]
pub struct Turn {
    pub user: UserInput,
    pub assistant: String,
    /// The tools the reply called, after what it said.
    pub calls: Vec<ToolCall>,
}

impl Turn {
    /// A turn the caller typed.
    pub fn text(user: impl Into<String>, assistant: impl Into<String>) -> Self {
        Self { user: UserInput::Text(user.into()), assistant: assistant.into(), calls: Vec::new() }
    }
}

/// Generation parameters (the protocol's `generation`). `None` = the engine's default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationParams {
    pub max_text_tokens: Option<usize>,
    pub min_text_tokens: Option<usize>,
    pub max_audio_tokens: Option<usize>,
    pub min_audio_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub seed: Option<u64>,
    /// The reply begins with this text (the model continues from it, as if it had written it).
    pub prefix: Option<String>,
}

/// The tools a reply may call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tools {
    /// Declared tools (`None`: the prompt has no tools block and no reply calls).
    pub set: Option<Arc<ToolSet>>,
    pub choice: ToolChoice,
}

impl Tools {
    /// Whether the reply may write a call.
    pub fn may_call(&self) -> bool {
        self.set.is_some() && self.choice != ToolChoice::None
    }
}

/// One request (one response).
#[derive(Debug, Clone)]
pub struct RequestSpec {
    pub id: RequestId,
    pub mode: Mode,
    pub input: UserInput,
    pub instructions: Option<String>,
    pub history: Vec<Turn>,
    /// The voice: conditions the Thinker's system prompt and is the Code2Wav reference.
    pub voice: RefInput,
    pub generation: GenerationParams,
    pub tools: Tools,
    /// Text only: the reply is written, not spoken (no Talker, no Code2Wav).
    pub text_only: bool,
    pub task: Task,
}

/// What a request asks of the model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Task {
    /// A reply to the input, after the conversation.
    #[default]
    Reply,
    /// What the caller said in the input (spoken), written down by the Thinker: its text deltas
    /// are the transcript; nothing is spoken, no conversation is in the prompt.
    Transcribe,
}

/// How a response ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Status {
    Completed,
    Cancelled,
    Failed(String),
    /// The request asks for more than the engine can hold (a prompt beyond the context, counts
    /// that do not fit it): the client's to change, not a fault. The message names the field.
    Refused(String),
    /// The engine had no place for it and its queue was full (admission.rs): never started.
    Busy(super::Busy),
}

/// Per-request timestamps.
#[derive(Debug, Clone, Default)]
pub struct Timings {
    pub admitted: Option<Instant>,
    /// The Thinker's first reply token: the prompt is in (its prefill, or the prefix store).
    pub first_token: Option<Instant>,
    pub first_text: Option<Instant>,
    pub handoff: Option<Instant>,
    pub first_code: Option<Instant>,
    /// The Talker sends chunk 0's codes to Code2Wav (from `first_code`: the Talker's share; to
    /// `first_chunk`: the wait for a Code2Wav step, the one running when they came included).
    pub chunk0_codes: Option<Instant>,
    pub first_chunk: Option<Instant>,
    pub first_audio: Option<Instant>,
    pub done: Option<Instant>,
}

impl Timings {
    fn ms(&self, t: Option<Instant>) -> Option<f64> {
        Some(t?.duration_since(self.admitted?).as_secs_f64() * 1000.0)
    }
    pub fn first_text_ms(&self) -> Option<f64> {
        self.ms(self.first_text)
    }
    pub fn first_audio_ms(&self) -> Option<f64> {
        self.ms(self.first_audio)
    }
    /// Every milestone reached so far, in order, as ms since admission.
    pub fn phases_ms(&self) -> Vec<(Milestone, f64)> {
        [
            (Milestone::FirstToken, self.first_token),
            (Milestone::FirstText, self.first_text),
            (Milestone::Handoff, self.handoff),
            (Milestone::FirstCode, self.first_code),
            (Milestone::Chunk0Codes, self.chunk0_codes),
            (Milestone::FirstChunk, self.first_chunk),
            (Milestone::FirstAudio, self.first_audio),
        ]
        .into_iter()
        .filter_map(|(name, t)| Some((name, self.ms(t)?)))
        .collect()
    }
}

/// What a request took and made, in tokens (a response's `usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// The prompt's positions: all of them, those that are audio, and those whose KV came from
    /// the prefix store instead of a prefill.
    pub input: usize,
    pub input_audio: usize,
    pub cached: usize,
    /// Text tokens the reply wrote (a call's too, and a given beginning's).
    pub output_text: usize,
}

/// What a request produces, in order; `Done` is always last and comes exactly once.
#[derive(Debug, Clone)]
pub enum EngineEvent {
    /// The conversation outgrew the context: its `turns` oldest turns are not in this reply's
    /// prompt (sent before anything else of the reply). The caller's history should let them go.
    HistoryTrimmed {
        turns: usize,
    },
    TextDelta(String),
    /// The reply called a tool (sent when the call closes; what was said before it is in the
    /// text deltas, and the reply ends after it).
    ToolCall(ToolCall),
    /// The reply began a call that is not one: `text` is what it wrote after `<tool_call>`.
    ToolCallInvalid {
        text: String,
        reason: antiphon_protocol::ToolCallProblem,
        message: String,
    },
    /// 24 kHz mono samples; `chunk` counts Code2Wav chunks from 0.
    Audio {
        samples: Vec<f32>,
        chunk: usize,
        last: bool,
    },
    Done {
        status: Status,
        text: String,
        codes: usize,
        audio_samples: usize,
        chunks: usize,
        /// (boxed: every other event stays small)
        timings: Box<Timings>,
        usage: Usage,
    },
}

/// Where a request's events go.
pub type EventSink = Arc<dyn Fn(EngineEvent) + Send + Sync>;

/// Who decides, unit by unit, whether a duplex session listens or speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DuplexPolicy {
    /// The model's own `<|listen|>` / `<|speak|>` decision.
    Model,
    /// Speak in every k-th unit (units k, 2k, …, counting from 1) and listen in the others;
    /// consecutive speaking units form one turn (for synthetic weights, whose decisions are noise).
    SpeakEvery(u64),
}

/// A duplex session as the engine sees it: one long-lived Thinker stream fed 1 s units.
#[derive(Debug, Clone)]
pub struct DuplexSpec {
    /// Unique among open duplex sessions; turn requests are named `{session}/t{n}`.
    pub session: String,
    pub policy: DuplexPolicy,
    pub instructions: Option<String>,
    /// The Code2Wav reference of every spoken turn (and, if configured, the Thinker's voice
    /// prompt).
    pub voice: RefInput,
    /// Per spoken unit: `max_text_tokens` (capped at the per-unit budget) and `min_text_tokens`;
    /// per turn: the drain's `min_audio_tokens` / `max_audio_tokens`; `temperature`, `seed`.
    pub generation: GenerationParams,
}

/// What a duplex session produces. `Response` carries the events of one spoken turn, exactly as a
/// turn-mode request's (its `Done` ends that turn); `Closed` is last and comes once.
#[derive(Debug, Clone)]
pub enum DuplexEvent {
    /// The model stays silent in `unit` (counted from 0). `context`: Thinker positions after it.
    Listen {
        unit: u64,
        context: usize,
        lag_ms: f64,
    },
    /// The model speaks in `unit`; `turn` is the turn request the speech belongs to (`new_turn`
    /// when this unit opened it).
    Speak {
        unit: u64,
        turn: RequestId,
        new_turn: bool,
        context: usize,
        lag_ms: f64,
    },
    Response {
        turn: RequestId,
        event: EngineEvent,
    },
    /// The session's engine stream ended; its last event.
    Closed {
        reason: DuplexEnd,
    },
}

/// Why a duplex session's engine stream ended.
#[derive(Debug, Clone, PartialEq)]
pub enum DuplexEnd {
    /// The session closed it (`close_duplex`).
    Closed,
    /// The conversation filled the positions the session may use.
    ContextFull,
    /// It failed; what failed.
    Failed(String),
}

impl std::fmt::Display for DuplexEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DuplexEnd::Closed => f.write_str("closed"),
            DuplexEnd::ContextFull => f.write_str("context_full"),
            DuplexEnd::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

/// Where a duplex session's events go.
pub type DuplexSink = Arc<dyn Fn(DuplexEvent) + Send + Sync>;

#[derive(Debug, Default)]
struct Progress {
    text: String,
    codes: usize,
    audio_samples: usize,
    chunks: usize,
    timings: Timings,
    usage: Usage,
    done: bool,
}

struct Entry {
    sink: EventSink,
    progress: Mutex<Progress>,
}

/// Live requests, shared by the stages: a stage checks liveness before working and emits through
/// here, so nothing is emitted after a request is done or cancelled.
#[derive(Clone, Default)]
pub struct Registry {
    inner: Arc<Mutex<HashMap<RequestId, Arc<Entry>>>>,
    /// Called once for every request that ends, just before its `Done` (admission frees its place).
    on_end: Option<EndHook>,
}

/// What the registry calls when a request ends (just before its `Done`).
pub type EndHook = Arc<dyn Fn(&RequestId) + Send + Sync>;

impl Registry {
    /// A registry that tells `f` of every request's end.
    pub fn with_end_hook(f: EndHook) -> Self {
        Self { inner: Arc::default(), on_end: Some(f) }
    }

    pub fn insert(&self, id: RequestId, sink: EventSink) -> bool {
        let mut m = self.inner.lock().expect("registry");
        if m.contains_key(&id) {
            return false;
        }
        let progress = Progress {
            timings: Timings { admitted: Some(Instant::now()), ..Default::default() },
            ..Default::default()
        };
        m.insert(id, Arc::new(Entry { sink, progress: Mutex::new(progress) }));
        true
    }

    fn get(&self, id: &RequestId) -> Option<Arc<Entry>> {
        self.inner.lock().expect("registry").get(id).cloned()
    }

    /// Live: not done and not cancelled (work of a request that is not is dropped).
    pub fn is_live(&self, id: &RequestId) -> bool {
        self.get(id).is_some_and(|e| !e.progress.lock().expect("progress").done)
    }

    pub fn live_count(&self) -> usize {
        self.inner.lock().expect("registry").len()
    }

    /// Emits a non-final event and updates the counters; false if the request is gone.
    pub fn emit(&self, id: &RequestId, ev: EngineEvent) -> bool {
        let Some(e) = self.get(id) else { return false };
        {
            let mut p = e.progress.lock().expect("progress");
            if p.done {
                return false;
            }
            let now = Instant::now();
            match &ev {
                EngineEvent::TextDelta(t) => {
                    p.text.push_str(t);
                    p.timings.first_text.get_or_insert(now);
                }
                EngineEvent::Audio { samples, chunk, .. } => {
                    p.audio_samples += samples.len();
                    p.chunks = p.chunks.max(chunk + 1);
                    if !samples.is_empty() {
                        p.timings.first_audio.get_or_insert(now);
                    }
                }
                EngineEvent::HistoryTrimmed { .. }
                | EngineEvent::ToolCall(_)
                | EngineEvent::ToolCallInvalid { .. } => {}
                EngineEvent::Done { .. } => return false,
            }
            // emitted under the lock: a concurrent finish cannot overtake it
            (e.sink)(ev);
        }
        true
    }

    /// Records a timestamp or a code count.
    pub fn mark(&self, id: &RequestId, f: impl FnOnce(&mut Timings)) {
        if let Some(e) = self.get(id) {
            f(&mut e.progress.lock().expect("progress").timings);
        }
    }

    /// Records what the request took and made.
    pub fn usage(&self, id: &RequestId, f: impl FnOnce(&mut Usage)) {
        if let Some(e) = self.get(id) {
            f(&mut e.progress.lock().expect("progress").usage);
        }
    }

    pub fn add_codes(&self, id: &RequestId, n: usize) {
        if let Some(e) = self.get(id) {
            let mut p = e.progress.lock().expect("progress");
            p.codes += n;
            if n > 0 {
                p.timings.first_code.get_or_insert(Instant::now());
            }
        }
    }

    /// Audio chunks delivered so far, while the request is live.
    pub fn chunks_if_live(&self, id: &RequestId) -> Option<usize> {
        let e = self.get(id)?;
        let p = e.progress.lock().expect("progress");
        (!p.done).then_some(p.chunks)
    }

    pub fn timings(&self, id: &RequestId) -> Option<Timings> {
        self.get(id).map(|e| e.progress.lock().expect("progress").timings.clone())
    }

    /// Forgets a request that never reached the stages (the engine could not hand it on): no event
    /// is emitted and the end hook is not called; the caller frees its place. The stages drop
    /// whatever of it they got (it is not live).
    pub fn withdraw(&self, id: &RequestId) {
        self.inner.lock().expect("registry").remove(id);
    }

    /// Ends a request: emits `Done` once and forgets it. Returns the
    /// timings when this call ended it.
    pub fn finish(&self, id: &RequestId, status: Status) -> Option<Timings> {
        self.end(id, status, None)
    }

    /// [`Registry::finish`] that counts the request in `counter` (by status label) before its
    /// `Done` goes out: whoever sees `Done` sees it counted.
    pub fn finish_counted(
        &self,
        id: &RequestId,
        status: Status,
        counter: &crate::metric_labels::CounterBy<RequestOutcome>,
    ) -> Option<Timings> {
        self.end(id, status, Some(counter))
    }

    fn end(
        &self,
        id: &RequestId,
        status: Status,
        counter: Option<&crate::metric_labels::CounterBy<RequestOutcome>>,
    ) -> Option<Timings> {
        let e = self.get(id)?;
        let out = {
            let mut p = e.progress.lock().expect("progress");
            if p.done {
                return None;
            }
            p.done = true;
            if let Some(c) = counter {
                let label = match &status {
                    Status::Completed => RequestOutcome::Completed,
                    Status::Cancelled => RequestOutcome::Cancelled,
                    Status::Failed(_) | Status::Refused(_) | Status::Busy(_) => {
                        RequestOutcome::Failed
                    }
                };
                c.at(label).inc();
            }
            p.timings.done = Some(Instant::now());
            // (its place is free before its Done goes out: whoever sees the Done finds it free)
            if let Some(f) = &self.on_end {
                f(id);
            }
            let ev = EngineEvent::Done {
                status,
                text: p.text.clone(),
                codes: p.codes,
                audio_samples: p.audio_samples,
                chunks: p.chunks,
                timings: Box::new(p.timings.clone()),
                usage: p.usage,
            };
            (e.sink)(ev);
            p.timings.clone()
        };
        self.inner.lock().expect("registry").remove(id);
        Some(out)
    }
}
