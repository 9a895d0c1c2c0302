//! The translator between one OpenAI Realtime connection and the v1 session behind it: it holds
//! what the dialect has and v1 has not (the session as the client configured it, the
//! conversation's items, the input audio buffer and turn detection, the response in progress)
//! and turns client events into v1 session messages. Its other half, v1 events into the
//! dialect's response events, is in `respond.rs`.

use std::sync::Arc;

use antiphon_protocol::openai::server::{ErrorView, ItemView, OaiServerEvent as S, PartView, SessionView};
use antiphon_protocol::openai::{
    AudioFormat, CancelReason, Item, ItemStatus, MaxTokens, Modality, OaiClientEvent, OaiError, OaiErrorCode, Part, ResponseParams, Role,
    SessionPatch,
};
use antiphon_protocol::{ClientEvent, Codec, InputAudio, SessionUpdate};
use tokio::sync::mpsc::Sender;

use super::input::{check_text, decode_input, InputBuffer, InputEvent};
use super::respond::Active;
use super::Out;
use crate::session::{random_token, SessionMsg};
use crate::Shared;

/// The most items a conversation keeps, and the most text they hold together (the oldest give
/// way); an answered item keeps its text only.
pub const MAX_ITEMS: usize = 1024;
pub const MAX_ITEM_TEXT: usize = 1 << 20;

/// A conversation item and what the translator needs of it.
pub(super) struct ConvItem {
    pub view: ItemView,
    /// A user item not yet answered: its input (text, or 24 kHz audio).
    pub pending: Option<Pending>,
    /// An assistant item: the v1 response behind it and its audio length.
    pub v1_response: Option<u32>,
    pub audio_ms: u64,
    /// What the model remembers has it: a response's output, an input a response answered, or a
    /// turn given to v1 (`conversation.append`).
    pub in_v1: bool,
}

impl ConvItem {
    fn text_bytes(&self) -> usize {
        let v = &self.view;
        let parts: usize =
            v.content.iter().flatten().map(|p| p.text.as_ref().map_or(0, String::len) + p.transcript.as_ref().map_or(0, String::len)).sum();
        let pending = match &self.pending {
            Some(Pending::Text(t) | Pending::Prefix(t)) => t.len(),
            _ => 0,
        };
        parts + pending + [&v.arguments, &v.output, &v.name, &v.call_id].iter().map(|s| s.as_ref().map_or(0, String::len)).sum::<usize>()
    }
}

#[derive(Clone)]
pub(super) enum Pending {
    Text(String),
    Audio(Vec<i16>),
    /// An assistant message created `incomplete`: the next response begins with its text.
    Prefix(String),
    /// A tool's output for a call.
    ToolResult {
        call_id: String,
        output: String,
    },
}

pub struct Translator {
    pub(super) shared: Arc<Shared>,
    pub(super) v1: Sender<SessionMsg>,
    pub(super) out: Out,
    pub(super) session: SessionView,
    pub(super) temperature: Option<f32>,
    /// What the v1 session holds now (synchronised lazily, before a response).
    pub(super) v1_instructions: Option<String>,
    pub(super) v1_voice: String,
    pub(super) v1_tools: Vec<antiphon_protocol::ToolDecl>,
    /// The call ids of the latest v1 response's calls (a result for them goes to v1 as one).
    pub(super) v1_calls: Vec<String>,
    pub(super) v1_transcription: bool,
    /// An item the model remembers was deleted: v1's conversation is given again, whole.
    pub(super) forgotten: bool,
    /// The user audio items whose transcripts v1 will send, by the v1 response that answered
    /// them: `(v1 response, item id, seconds of audio)`, the latest few.
    pub(super) heard: std::collections::VecDeque<(u32, String, f64)>,
    pub(super) items: Vec<ConvItem>,
    pub(super) input: InputBuffer,
    /// The item id a turn in progress will get (sent with `speech_started`).
    turn_item: Option<String>,
    pub(super) active: Option<Active>,
    /// A response asked for while the previous one was still ending.
    pub(super) queued: Option<(ResponseParams, Option<String>)>,
    /// Highest v1 seq seen and the last acked.
    pub(super) seen_seq: u64,
    pub(super) acked_seq: u64,
    /// When the v1 session last heard of the client: audio held here (turn detection) reaches v1
    /// only with a turn, so client activity is passed on as a ping at most once a second, and a
    /// configured `server.idle_timeout_s` sees a client that streams silence as active.
    keepalive: std::time::Instant,
}

pub(super) fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", random_token(12))
}

fn err(code: OaiErrorCode, message: impl Into<String>) -> OaiError {
    OaiError::new(code, message)
}

impl Translator {
    pub fn new(shared: Arc<Shared>, v1: Sender<SessionMsg>, out: Out, session_id: String, model: String) -> Self {
        let default_voice = shared.config.voices[0].id.clone();
        let mut input = InputBuffer::new(shared.config.server.max_input_audio_s, shared.turn_model.is_some());
        let td = antiphon_protocol::openai::TurnDetection::default();
        // (the detector is libfvad with fixed settings: it cannot fail to start)
        let vad_ok = input.set_turn_detection(Some(td.clone())).is_ok();
        let session = SessionView {
            id: session_id,
            model,
            instructions: antiphon_engine::DEFAULT_INSTRUCTIONS.to_string(),
            output_modalities: Modality::Audio,
            input_format: AudioFormat::Pcm24k,
            output_format: AudioFormat::Pcm24k,
            turn_detection: vad_ok.then_some(td),
            voice: default_voice.clone(),
            max_output_tokens: MaxTokens::Inf,
            tools: Vec::new(),
            tool_choice: "auto".into(),
            transcription: None,
        };
        Self {
            shared,
            v1,
            out,
            session,
            temperature: None,
            v1_instructions: Some(antiphon_engine::DEFAULT_INSTRUCTIONS.to_string()),
            v1_voice: default_voice,
            v1_tools: Vec::new(),
            v1_calls: Vec::new(),
            v1_transcription: false,
            forgotten: false,
            heard: Default::default(),
            items: Vec::new(),
            input,
            turn_item: None,
            active: None,
            queued: None,
            seen_seq: 0,
            acked_seq: 0,
            keepalive: std::time::Instant::now(),
        }
    }

    pub(super) async fn to_v1(&self, m: SessionMsg) {
        // (a session that ended has dropped its inbox; the socket then closes on its own)
        let _ = self.v1.send(m).await;
    }

    pub(super) async fn to_v1_event(&self, event: ClientEvent) {
        self.to_v1(SessionMsg::Event { seq: None, event }).await
    }

    pub(super) fn error(&self, client_event: Option<String>, e: OaiError) {
        self.shared.metrics.errors.with_label_values(&[e.code.as_str()]).inc();
        let (code, message, param) = (e.code, e.message, e.param);
        self.out.event(&S::Error(ErrorView { code, message, param, client_event_id: client_event, server_side: false, retry_after_ms: None }));
    }

    pub async fn on_client(&mut self, event_id: Option<String>, event: OaiClientEvent) {
        if self.keepalive.elapsed() >= std::time::Duration::from_secs(1) {
            self.keepalive = std::time::Instant::now();
            self.to_v1_event(ClientEvent::Ping { id: None }).await;
        }
        if let Err(e) = self.client(event).await {
            self.error(event_id, e);
        }
    }

    async fn client(&mut self, event: OaiClientEvent) -> Result<(), OaiError> {
        match event {
            OaiClientEvent::SessionUpdate(p) => self.update(*p),
            OaiClientEvent::Append(bytes) => {
                let x = decode_input(self.session.input_format, &bytes, "audio")?;
                let events = self.input.push(&x).map_err(|m| err(OaiErrorCode::InputAudioBufferFull, m))?;
                for e in events {
                    self.turn_event(e).await;
                }
                Ok(())
            }
            OaiClientEvent::Commit => {
                let audio = self.input.commit().map_err(|ms| {
                    let least = super::input::MIN_COMMIT_MS;
                    err(
                        OaiErrorCode::InputAudioBufferCommitEmpty,
                        format!("buffer too small: a commit takes at least {least} ms of audio; the buffer holds {ms} ms"),
                    )
                })?;
                let id = self.turn_item.take().unwrap_or_else(|| new_id("item"));
                self.commit_audio(id, audio);
                Ok(())
            }
            OaiClientEvent::Clear => {
                self.input.clear();
                self.turn_item = None;
                self.out.event(&S::Cleared);
                Ok(())
            }
            OaiClientEvent::ItemCreate { item, previous_item_id } => self.create_item(item, previous_item_id.as_deref()),
            OaiClientEvent::ItemTruncate { item_id, content_index, audio_end_ms } => self.truncate(&item_id, content_index, audio_end_ms).await,
            OaiClientEvent::ItemDelete { item_id } => {
                let i = self
                    .find(&item_id)
                    .ok_or_else(|| OaiError::param(OaiErrorCode::ItemDeleteInvalidItemId, "item_id", format!("no item {item_id}")))?;
                // (the model remembers it: before the next response it is told the conversation
                // again, without it)
                self.forgotten |= self.items.remove(i).in_v1;
                self.out.event(&S::ItemDeleted { item_id });
                Ok(())
            }
            OaiClientEvent::ItemRetrieve { item_id } => {
                let i = self
                    .find(&item_id)
                    .ok_or_else(|| OaiError::param(OaiErrorCode::ItemRetrieveInvalidItemId, "item_id", format!("no item {item_id}")))?;
                self.out.event(&S::ItemRetrieved { item: self.items[i].view.clone() });
                Ok(())
            }
            OaiClientEvent::ResponseCreate(p) => {
                if self.active.is_some() {
                    return Err(err(
                        OaiErrorCode::ConversationAlreadyHasActiveResponse,
                        "a response is in progress: cancel it or wait for its response.done",
                    ));
                }
                self.start_response(*p).await
            }
            OaiClientEvent::ResponseCancel { response_id } => {
                let live = self.active.as_ref().is_some_and(|a| !a.cancelling && response_id.as_ref().is_none_or(|r| *r == a.id));
                if !live {
                    return Err(err(OaiErrorCode::ResponseCancelNotActive, "Cancellation failed: no active response found"));
                }
                self.cancel(CancelReason::ClientCancelled).await;
                Ok(())
            }
            OaiClientEvent::OutputAudioClear => {
                if self.active.as_ref().is_some_and(|a| !a.cancelling) {
                    self.cancel(CancelReason::ClientCancelled).await;
                }
                Ok(())
            }
        }
    }

    fn update(&mut self, p: SessionPatch) -> Result<(), OaiError> {
        // checked before any part of the update applies
        if let Some(i) = &p.instructions {
            self.shared
                .check_instructions(Some(&self.joined_instructions(i, &[])))
                .map_err(|e| OaiError::param(OaiErrorCode::InvalidValue, "session.instructions", e.message))?;
        }
        let tools = super::start::v1_tools(p.tools.as_deref().unwrap_or(&self.session.tools), "session.tools")?;
        if !tools.is_empty() && !self.shared.engine.serves_tools() {
            return Err(OaiError::param(OaiErrorCode::InvalidValue, "session.tools", "this model's tokenizer has no tool tokens"));
        }
        super::start::v1_tool_choice(p.tool_choice.as_ref().unwrap_or(&self.session.tool_choice), &tools, "session.tool_choice")?;
        if let Some(t) = p.turn_detection {
            self.input
                .set_turn_detection(t.clone())
                .map_err(|e| OaiError::param(OaiErrorCode::InvalidValue, "session.audio.input.turn_detection", e.to_string()))?;
            self.turn_item = None;
            self.session.turn_detection = t;
        }
        let s = &mut self.session;
        if let Some(i) = p.instructions {
            s.instructions = i;
        }
        if let Some(m) = p.output_modalities {
            s.output_modalities = m;
        }
        if let Some(f) = p.input_format {
            s.input_format = f;
        }
        if let Some(f) = p.output_format {
            s.output_format = f;
        }
        if let Some(v) = p.voice {
            s.voice = v;
        }
        if let Some(m) = p.max_output_tokens {
            s.max_output_tokens = m;
        }
        if let Some(t) = p.tools {
            s.tools = t;
        }
        if let Some(c) = p.tool_choice {
            s.tool_choice = c;
        }
        if let Some(t) = p.transcription {
            s.transcription = t;
        }
        if p.temperature.is_some() {
            self.temperature = p.temperature;
        }
        self.out.event(&S::SessionUpdated(self.session.clone()));
        Ok(())
    }

    /// Turn detection's edges: `speech_started` (barge-in when a response is playing) and
    /// `speech_stopped` → a committed user item → a response.
    async fn turn_event(&mut self, e: InputEvent) {
        let td = self.input.turn_detection().cloned().unwrap_or_default();
        match e {
            InputEvent::Started { audio_start_ms } => {
                let item_id = new_id("item");
                self.turn_item = Some(item_id.clone());
                self.out.event(&S::SpeechStarted { audio_start_ms, item_id });
                if td.interrupt_response && self.active.as_ref().is_some_and(|a| !a.cancelling) {
                    self.cancel(CancelReason::TurnDetected).await;
                }
            }
            InputEvent::Paused { at, audio } => {
                // (semantic_vad: the buffer asks only where the server has a turn model)
                let Some(model) = self.shared.turn_model.as_ref() else { return };
                let verdict = model.verdict(audio).await;
                if let Some(InputEvent::Stopped { audio_end_ms, audio }) = self.input.pause_decided(at, verdict.ends_turn()) {
                    self.turn_stopped(td, audio_end_ms, audio).await;
                }
            }
            InputEvent::Stopped { audio_end_ms, audio } => self.turn_stopped(td, audio_end_ms, audio).await,
        }
    }

    /// A turn's end: `speech_stopped`, its user item, and (as turn detection says) a response.
    async fn turn_stopped(&mut self, td: antiphon_protocol::openai::TurnDetection, audio_end_ms: u64, audio: Vec<i16>) {
        let item_id = self.turn_item.take().unwrap_or_else(|| new_id("item"));
        self.out.event(&S::SpeechStopped { audio_end_ms, item_id: item_id.clone() });
        if audio.is_empty() {
            return;
        }
        self.commit_audio(item_id, audio);
        if td.create_response {
            if self.active.is_some() {
                self.queued = Some((ResponseParams::default(), None));
            } else if let Err(e) = self.start_response(ResponseParams::default()).await {
                self.error(None, e);
            }
        }
    }

    fn last_id(&self) -> Option<String> {
        self.items.last().map(|i| i.view.id.clone())
    }

    pub(super) fn find(&self, id: &str) -> Option<usize> {
        self.items.iter().position(|i| i.view.id == id)
    }

    pub(super) fn push_item(&mut self, item: ConvItem) {
        self.items.push(item);
        self.bound_items();
    }

    /// The oldest items give way beyond the bounds.
    fn bound_items(&mut self) {
        let mut text: usize = self.items.iter().map(ConvItem::text_bytes).sum();
        while self.items.len() > 1 && (self.items.len() > MAX_ITEMS || text > MAX_ITEM_TEXT) {
            text -= self.items.remove(0).text_bytes();
        }
    }

    /// User audio waiting for a response, in samples.
    fn pending_audio(&self) -> usize {
        self.items.iter().map(|i| if let Some(Pending::Audio(a)) = &i.pending { a.len() } else { 0 }).sum()
    }

    /// Refuses `more` samples of user audio beyond what a turn may hold.
    fn check_pending_audio(&self, more: usize) -> Result<(), OaiError> {
        let max = self.shared.config.server.max_input_audio_s as usize * super::input::RATE as usize;
        if self.pending_audio() + more > max {
            return Err(err(
                OaiErrorCode::InputAudioBufferFull,
                format!("the user audio waiting for a response would be over the {} s a turn may hold", max / 24_000),
            ));
        }
        Ok(())
    }

    fn commit_audio(&mut self, id: String, audio: Vec<i16>) {
        if let Err(e) = self.check_pending_audio(audio.len()) {
            return self.error(None, e);
        }
        let previous = self.last_id();
        self.out.event(&S::Committed { previous_item_id: previous.clone(), item_id: id.clone() });
        let view = ItemView::message(&id, "user", ItemStatus::Completed, vec![PartView::of("input_audio", None, None)]);
        self.out.event(&S::ItemAdded { previous_item_id: previous.clone(), item: view.clone() });
        self.out.event(&S::ItemDone { previous_item_id: previous, item: view.clone() });
        self.push_item(ConvItem { view, pending: Some(Pending::Audio(audio)), v1_response: None, audio_ms: 0, in_v1: false });
    }

    /// The item as the conversation holds it, and its input if it is a user's.
    pub(super) fn item_of(&self, item: Item) -> Result<(ItemView, Option<Pending>), OaiError> {
        let id = item.id().map(str::to_string).unwrap_or_else(|| new_id("item"));
        Ok(match item {
            Item::Message { role, content, incomplete, .. } => {
                let mut parts = Vec::new();
                let (mut text, mut audio) = (String::new(), Vec::new());
                for p in content {
                    match p {
                        Part::InputText(t) => {
                            text.push_str(&t);
                            parts.push(PartView::of("input_text", Some(t), None));
                        }
                        Part::InputAudio { audio: bytes, transcript } => {
                            audio.extend(decode_input(self.session.input_format, &bytes, "item.content.audio")?);
                            parts.push(PartView::of("input_audio", None, transcript));
                        }
                        Part::Text(t) => {
                            text.push_str(&t);
                            parts.push(PartView::of("output_text", Some(t), None));
                        }
                        Part::Audio { transcript } => parts.push(PartView::of("output_audio", None, transcript)),
                    }
                }
                let pending = match role {
                    Role::User if !audio.is_empty() => Some(Pending::Audio(audio)),
                    Role::User => Some(Pending::Text(text)),
                    Role::Assistant if incomplete => {
                        let n = text.chars().count();
                        if n > antiphon_protocol::MAX_PREFIX_CHARS {
                            let why = format!(
                                "an incomplete assistant message begins the next response: {n} characters, at most {}",
                                antiphon_protocol::MAX_PREFIX_CHARS
                            );
                            return Err(OaiError::param(OaiErrorCode::InvalidValue, "item.content", why));
                        }
                        Some(Pending::Prefix(text))
                    }
                    _ => None,
                };
                let status =
                    if pending.as_ref().is_some_and(|p| matches!(p, Pending::Prefix(_))) { ItemStatus::Incomplete } else { ItemStatus::Completed };
                (ItemView::message(&id, role.as_str(), status, parts), pending)
            }
            Item::FunctionCall { call_id, name, arguments, .. } => {
                let mut v = ItemView::message(&id, "assistant", ItemStatus::Completed, Vec::new());
                (v.kind, v.role, v.content, v.call_id, v.name, v.arguments) = ("function_call", None, None, call_id, Some(name), Some(arguments));
                (v, None)
            }
            Item::FunctionCallOutput { call_id, output, .. } => {
                let mut v = ItemView::message(&id, "user", ItemStatus::Completed, Vec::new());
                (v.kind, v.role, v.content, v.call_id, v.output) = ("function_call_output", None, None, Some(call_id.clone()), Some(output.clone()));
                (v, Some(Pending::ToolResult { call_id, output }))
            }
            Item::Reference { id } => {
                return Err(OaiError::param(OaiErrorCode::InvalidValue, "item.type", format!("item_reference {id}: only in response.input")))
            }
        })
    }

    /// A client's item, after `previous` (`"root"`: first; none: last). One placed before items
    /// the model remembers has the conversation given again, in the new order, before the next
    /// response.
    fn create_item(&mut self, item: Item, previous: Option<&str>) -> Result<(), OaiError> {
        if let Some(id) = item.id() {
            if self.find(id).is_some() {
                return Err(OaiError::param(OaiErrorCode::InvalidValue, "item.id", format!("the conversation already has an item {id}")));
            }
        }
        let at = match previous {
            None => self.items.len(),
            Some("root") => 0,
            Some(p) => {
                let i = self.find(p).ok_or_else(|| OaiError::param(OaiErrorCode::InvalidValue, "previous_item_id", format!("no item {p}")))?;
                i + 1
            }
        };
        let (view, pending) = self.item_of(item)?;
        match &pending {
            Some(Pending::Audio(a)) => self.check_pending_audio(a.len())?,
            // the user text waiting for a response, with this, is answered as one input
            Some(Pending::Text(t)) => {
                let waiting = self.items.iter().filter_map(|i| if let Some(Pending::Text(w)) = &i.pending { Some(w.as_str()) } else { None });
                check_text(&self.shared, &waiting.chain([t.as_str()]).collect::<Vec<_>>().join("\n"), "item.content")?;
            }
            Some(Pending::ToolResult { output, .. }) => {
                let n = output.chars().count();
                if n > antiphon_protocol::MAX_TOOL_OUTPUT_CHARS {
                    let why = format!("a function's output of {n} characters; at most {}", antiphon_protocol::MAX_TOOL_OUTPUT_CHARS);
                    return Err(OaiError::param(OaiErrorCode::InvalidValue, "item.output", why));
                }
            }
            Some(Pending::Prefix(_)) | None => {}
        }
        if view.role == Some("system") {
            // a system item joins every response's instructions: checked now, not at the next response
            let text: Vec<&str> = view.content.iter().flatten().map(|p| p.text.as_deref().unwrap_or("")).collect();
            let joined = self.joined_instructions(&self.session.instructions, &text);
            self.shared.check_instructions(Some(&joined)).map_err(|e| {
                OaiError::param(
                    OaiErrorCode::InvalidValue,
                    "item.content",
                    format!("with the session's instructions and system items: {}", e.message),
                )
            })?;
        }
        let previous = at.checked_sub(1).map(|i| self.items[i].view.id.clone());
        self.out.event(&S::ItemAdded { previous_item_id: previous.clone(), item: view.clone() });
        self.out.event(&S::ItemDone { previous_item_id: previous, item: view.clone() });
        self.forgotten |= self.items[at..].iter().any(|i| i.in_v1);
        self.items.insert(at, ConvItem { view, pending, v1_response: None, audio_ms: 0, in_v1: false });
        self.bound_items();
        Ok(())
    }

    async fn truncate(&mut self, item_id: &str, content_index: u32, audio_end_ms: u64) -> Result<(), OaiError> {
        let bad = |m: String| OaiError::param(OaiErrorCode::InvalidValue, "audio_end_ms", m);
        if let Some(a) = self.active.as_mut().filter(|a| a.item_id == item_id) {
            // the response is still ending: the cut applies when it is done
            a.truncate_ms = Some(audio_end_ms);
        } else {
            let i = self
                .find(item_id)
                .ok_or_else(|| OaiError::param(OaiErrorCode::ItemTruncateInvalidItemId, "item_id", format!("no item {item_id}")))?;
            let it = &mut self.items[i];
            let Some(rid) = it.v1_response else {
                return Err(OaiError::param(OaiErrorCode::InvalidValue, "item_id", format!("item {item_id} is not an assistant's audio")));
            };
            if audio_end_ms > it.audio_ms {
                return Err(bad(format!("audio_end_ms {audio_end_ms} is beyond the item's {} ms of audio", it.audio_ms)));
            }
            cut_transcript(&mut it.view, audio_end_ms, it.audio_ms);
            self.to_v1_event(ClientEvent::Playback { response_id: rid, played_ms: audio_end_ms }).await;
        }
        self.out.event(&S::ItemTruncated { item_id: item_id.to_string(), content_index, audio_end_ms });
        Ok(())
    }

    /// The instructions a response runs under: `base`, then every system item's text, then `more`.
    pub(super) fn joined_instructions(&self, base: &str, more: &[&str]) -> String {
        let mut joined = base.to_string();
        let system = self.items.iter().filter(|i| i.view.role == Some("system")).flat_map(|i| i.view.content.iter().flatten());
        for text in system.map(|p| p.text.as_deref().unwrap_or("")).chain(more.iter().copied()) {
            joined.push('\n');
            joined.push_str(text);
        }
        joined
    }

    /// The user audio one turn may hold, in samples.
    pub(super) fn max_audio_samples(&self) -> usize {
        self.shared.config.server.max_input_audio_s as usize * super::input::RATE as usize
    }

    pub(super) async fn cancel(&mut self, reason: CancelReason) {
        let Some(a) = self.active.as_mut() else { return };
        a.cancelling = true;
        a.cancel_reason = Some(reason);
        let response_id = a.v1;
        self.to_v1_event(ClientEvent::ResponseCancel { response_id }).await;
    }
}

/// An empty v1 session.update (the input is fixed: PCM16 at 24 kHz).
pub(super) fn update() -> SessionUpdate {
    SessionUpdate {
        input_audio: None,
        output_audio: None,
        voice: None,
        instructions: None,
        generation: None,
        duplex: None,
        tools: None,
        input_transcription: None,
    }
}

/// The v1 session this dialect runs on: turns, PCM16 at 24 kHz both ways.
pub(super) fn v1_create(instructions: &str) -> antiphon_protocol::SessionCreate {
    antiphon_protocol::SessionCreate {
        mode: antiphon_protocol::Mode::Turn,
        input_audio: InputAudio { codec: Codec::Pcm16, sample_rate: 24_000 },
        output_audio: antiphon_protocol::OutputAudio { codec: Codec::Pcm16, frame_ms: Some(20) },
        voice: None,
        instructions: Some(instructions.to_string()),
        generation: None,
        duplex: None,
        tools: None,
        input_transcription: None,
    }
}

/// The transcript of an assistant item cut to what `played_ms` of `audio_ms` carried.
pub(super) fn cut_transcript(view: &mut ItemView, played_ms: u64, audio_ms: u64) {
    if audio_ms == 0 || played_ms >= audio_ms {
        return;
    }
    for part in view.content.iter_mut().flatten() {
        for t in [&mut part.transcript, &mut part.text].into_iter().flatten() {
            let chars: Vec<char> = t.chars().collect();
            let keep = (chars.len() as u64 * played_ms / audio_ms) as usize;
            *t = chars[..keep].iter().collect();
        }
    }
}
