//! The translator between one OpenAI Realtime connection and the v1 session behind it: it holds
//! what the dialect has and v1 has not (the session as the client configured it, the
//! conversation's items, the input audio buffer and turn detection, the response in progress)
//! and turns client events into v1 session messages. Its other half, v1 events into the
//! dialect's response events, is in `respond.rs`.

use std::sync::Arc;

use antiphon_protocol::openai::server::{ErrorView, OaiServerEvent as S, SessionView};
use antiphon_protocol::openai::{
    AudioFormat, CancelReason, MaxTokens, Modality, OaiClientEvent, OaiError, OaiErrorCode,
    ResponseParams, SessionPatch,
};
use antiphon_protocol::{ClientEvent, Codec, InputAudio, SessionUpdate};
use tokio::sync::mpsc::Sender;

use super::input::{decode_input, InputBuffer, InputEvent};
use super::items::ConvItem;
use super::respond::Active;
use super::Out;
use crate::session::{random_token, SessionMsg};
use crate::Shared;

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

pub(super) fn err(code: OaiErrorCode, message: impl Into<String>) -> OaiError {
    OaiError::new(code, message)
}

impl Translator {
    pub fn new(
        shared: Arc<Shared>,
        v1: Sender<SessionMsg>,
        out: Out,
        session_id: String,
        model: String,
    ) -> Self {
        let default_voice = shared.config.voices[0].id.clone();
        let mut input =
            InputBuffer::new(shared.config.server.max_input_audio_s, shared.turn_model.is_some());
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
        self.shared.metrics.errors.at(e.code.into()).inc();
        let (code, message, param) = (e.code, e.message, e.param);
        self.out.event(&S::Error(ErrorView {
            code,
            message,
            param,
            client_event_id: client_event,
            server_side: false,
            retry_after_ms: None,
        }));
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
                let events =
                    self.input.push(&x).map_err(|m| err(OaiErrorCode::InputAudioBufferFull, m))?;
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
                        format!(
                            "buffer too small: a commit takes at least {least} ms of audio; \
                            the buffer holds {ms} ms"
                        ),
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
            OaiClientEvent::ItemCreate { item, previous_item_id } => {
                self.create_item(item, previous_item_id.as_deref())
            }
            OaiClientEvent::ItemTruncate { item_id, content_index, audio_end_ms } => {
                self.truncate(&item_id, content_index, audio_end_ms).await
            }
            OaiClientEvent::ItemDelete { item_id } => {
                let i = self.find(&item_id).ok_or_else(|| {
                    OaiError::param(
                        OaiErrorCode::ItemDeleteInvalidItemId,
                        "item_id",
                        format!("no item {item_id}"),
                    )
                })?;
                // (the model remembers it: before the next response it is told the conversation
                // again, without it)
                self.forgotten |= self.items.remove(i).in_v1;
                self.out.event(&S::ItemDeleted { item_id });
                Ok(())
            }
            OaiClientEvent::ItemRetrieve { item_id } => {
                let i = self.find(&item_id).ok_or_else(|| {
                    OaiError::param(
                        OaiErrorCode::ItemRetrieveInvalidItemId,
                        "item_id",
                        format!("no item {item_id}"),
                    )
                })?;
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
                let live = self.active.as_ref().is_some_and(|a| {
                    !a.cancelling && response_id.as_ref().is_none_or(|r| *r == a.id)
                });
                if !live {
                    return Err(err(
                        OaiErrorCode::ResponseCancelNotActive,
                        "Cancellation failed: no active response found",
                    ));
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
            self.shared.check_instructions(Some(&self.joined_instructions(i, &[]))).map_err(
                |e| OaiError::param(OaiErrorCode::InvalidValue, "session.instructions", e.message),
            )?;
        }
        let tools = super::start::v1_tools(
            p.tools.as_deref().unwrap_or(&self.session.tools),
            "session.tools",
        )?;
        if !tools.is_empty() && !self.shared.engine.serves_tools() {
            return Err(OaiError::param(
                OaiErrorCode::InvalidValue,
                "session.tools",
                "this model's tokenizer has no tool tokens",
            ));
        }
        super::start::v1_tool_choice(
            p.tool_choice.as_ref().unwrap_or(&self.session.tool_choice),
            &tools,
            "session.tool_choice",
        )?;
        if let Some(t) = p.turn_detection {
            self.input.set_turn_detection(t.clone()).map_err(|e| {
                OaiError::param(
                    OaiErrorCode::InvalidValue,
                    "session.audio.input.turn_detection",
                    e.to_string(),
                )
            })?;
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
                if let Some(InputEvent::Stopped { audio_end_ms, audio }) =
                    self.input.pause_decided(at, verdict.ends_turn())
                {
                    self.turn_stopped(td, audio_end_ms, audio).await;
                }
            }
            InputEvent::Stopped { audio_end_ms, audio } => {
                self.turn_stopped(td, audio_end_ms, audio).await
            }
        }
    }

    /// A turn's end: `speech_stopped`, its user item, and (as turn detection says) a response.
    async fn turn_stopped(
        &mut self,
        td: antiphon_protocol::openai::TurnDetection,
        audio_end_ms: u64,
        audio: Vec<i16>,
    ) {
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

    /// The instructions a response runs under: `base`, then every system item's text, then `more`.
    pub(super) fn joined_instructions(&self, base: &str, more: &[&str]) -> String {
        let mut joined = base.to_string();
        let system = self
            .items
            .iter()
            .filter(|i| i.view.role == Some("system"))
            .flat_map(|i| i.view.content.iter().flatten());
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
