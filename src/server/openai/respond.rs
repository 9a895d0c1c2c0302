//! The v1 session's events turned into the dialect's: a v1 response becomes a response with one
//! assistant message item and one content part (audio with its transcript, or text), its PCM16
//! frames audio deltas (joined up to 100 ms, converted to the session's output format), its
//! `response.done` the closing sequence of `*.done` events with usage. A response that may call
//! opens its message item at its first text or audio (a call alone has none), and its calls
//! become `function_call` items after the message, when the v1 response is done. Every v1 message
//! is acked, so the v1 journal stays empty: this dialect has no resume.

use antiphon_audio::g711::{alaw_encode, ulaw_encode, Downsample24kTo8k};
use antiphon_protocol::openai::server::{
    CallAt, ContentAt, ErrorView, Failure, ItemView, OaiServerEvent as S, PartView, ResponseView,
    StatusDetails, UsageView,
};
use antiphon_protocol::openai::{
    AudioFormat, CancelReason, ItemStatus, MaxTokens, Modality, OaiErrorCode, ResponseParams,
    ResponseStatus,
};
use antiphon_protocol::{parse_server, AudioFrame, ClientEvent, DoneStatus, Received};
use base64::Engine as _;
use serde_json::{Map, Value};

use super::items::{cut_transcript, ConvItem};
use super::translate::{new_id, Translator};

/// Output audio is sent once this much is gathered (or the v1 queue runs dry).
const DELTA_SAMPLES: usize = 2400;
/// Acks go back after this many v1 messages (and at every response's end).
const ACK_EVERY: u64 = 32;

/// The response in progress.
pub(super) struct Active {
    pub id: String,
    pub item_id: String,
    /// The v1 response, once v1 has created it.
    pub v1: Option<u32>,
    modality: Modality,
    voice: String,
    format: AudioFormat,
    max_tokens: MaxTokens,
    metadata: Option<Map<String, Value>>,
    out_of_band: bool,
    transcript: String,
    pending_audio: Vec<i16>,
    narrow: Downsample24kTo8k,
    pub cancelling: bool,
    pub cancel_reason: Option<CancelReason>,
    failure: Option<Failure>,
    pub truncate_ms: Option<u64>,
    started: bool,
    /// The message item is opened at the first text or audio (the response may call a tool).
    lazy_message: bool,
    message_open: bool,
    /// The calls v1 reported: `(call_id, name, arguments)`.
    calls: Vec<(String, String, String)>,
    /// The spoken item it answers, and its seconds of audio (for the transcript's events).
    pub heard: Option<(String, f64)>,
}

impl Active {
    pub(super) fn new(t: &Translator, p: &ResponseParams, voice: String, may_call: bool) -> Self {
        Self {
            id: new_id("resp"),
            item_id: new_id("item"),
            v1: None,
            modality: p.output_modalities.unwrap_or(t.session.output_modalities),
            voice,
            format: p.output_format.unwrap_or(t.session.output_format),
            max_tokens: p.max_output_tokens.unwrap_or(t.session.max_output_tokens),
            metadata: p.metadata.clone(),
            out_of_band: p.out_of_band,
            transcript: String::new(),
            pending_audio: Vec::new(),
            narrow: Downsample24kTo8k::default(),
            cancelling: false,
            cancel_reason: None,
            failure: None,
            truncate_ms: None,
            started: false,
            lazy_message: may_call,
            message_open: false,
            calls: Vec::new(),
            heard: None,
        }
    }

    fn at(&self) -> ContentAt {
        ContentAt {
            response_id: self.id.clone(),
            item_id: self.item_id.clone(),
            output_index: 0,
            content_index: 0,
        }
    }

    fn part(&self) -> PartView {
        match self.modality {
            Modality::Audio => PartView::of("audio", None, Some(self.transcript.clone())),
            Modality::Text => PartView::of("text", Some(self.transcript.clone()), None),
        }
    }

    fn item(&self, status: ItemStatus) -> ItemView {
        let content = match (status, self.modality) {
            (ItemStatus::InProgress, _) => Vec::new(),
            (_, Modality::Audio) => {
                vec![PartView::of("output_audio", None, Some(self.transcript.clone()))]
            }
            (_, Modality::Text) => {
                vec![PartView::of("output_text", Some(self.transcript.clone()), None)]
            }
        };
        ItemView::message(&self.item_id, "assistant", status, content)
    }

    fn view(
        &self,
        status: ResponseStatus,
        output: Vec<ItemView>,
        usage: Option<UsageView>,
    ) -> ResponseView {
        let status_details = match status {
            ResponseStatus::Cancelled => Some(StatusDetails::Cancelled(
                self.cancel_reason.unwrap_or(CancelReason::ClientCancelled),
            )),
            ResponseStatus::Failed => {
                Some(StatusDetails::Failed(self.failure.clone().unwrap_or_else(|| Failure {
                    code: OaiErrorCode::ResponseFailed,
                    message: "the response failed".into(),
                    retry_after_ms: None,
                })))
            }
            ResponseStatus::InProgress | ResponseStatus::Completed => None,
        };
        ResponseView {
            id: self.id.clone(),
            status,
            status_details,
            output,
            modalities: self.modality,
            output_format: self.format,
            voice: self.voice.clone(),
            max_output_tokens: self.max_tokens,
            metadata: self.metadata.clone(),
            conversation_id: (!self.out_of_band).then(|| "conv_default".to_string()),
            usage,
        }
    }
}

impl Translator {
    fn saw(&mut self, seq: Option<u64>) {
        if let Some(s) = seq {
            self.seen_seq = self.seen_seq.max(s);
        }
    }

    async fn ack(&mut self, now: bool) {
        if self.seen_seq > self.acked_seq && (now || self.seen_seq - self.acked_seq >= ACK_EVERY) {
            self.acked_seq = self.seen_seq;
            self.to_v1_event(ClientEvent::Ack { seq: self.seen_seq }).await;
        }
    }

    /// A v1 text frame.
    pub async fn on_v1_text(&mut self, text: &str) {
        let Some(r) = parse_server(text) else { return };
        self.saw(r.seq());
        self.flush_audio();
        let mut done = false;
        match r {
            Received::SessionCreated { .. } => {
                self.out.event(&S::SessionCreated(self.session.clone()))
            }
            Received::ResponseCreated { response_id, .. } => {
                if let Some(a) = self.active.as_mut().filter(|a| a.v1.is_none()) {
                    a.v1 = Some(response_id);
                    if let Some((item, seconds)) = a.heard.take() {
                        if self.heard.len() >= 16 {
                            self.heard.pop_front();
                        }
                        self.heard.push_back((response_id, item, seconds));
                    }
                    self.begin();
                }
            }
            Received::TranscriptDelta { response_id, delta, .. } => {
                if let Some((_, item_id, _)) = self.heard.iter().find(|h| h.0 == response_id) {
                    self.out.event(&S::InputTranscriptionDelta { item_id: item_id.clone(), delta });
                }
            }
            Received::TranscriptDone { response_id, transcript, .. } => {
                if let Some(k) = self.heard.iter().position(|h| h.0 == response_id) {
                    let (_, item_id, seconds) = self.heard.remove(k).expect("found");
                    // the transcript fills the item's audio part, as the service does
                    if let Some(i) = self.items.iter_mut().find(|i| i.view.id == item_id) {
                        for part in
                            i.view.content.iter_mut().flatten().filter(|p| p.kind == "input_audio")
                        {
                            part.transcript = Some(transcript.clone());
                        }
                    }
                    self.out.event(&S::InputTranscriptionCompleted {
                        item_id,
                        transcript,
                        seconds,
                    });
                }
            }
            Received::TranscriptFailed { response_id, message, .. } => {
                if let Some(k) = self.heard.iter().position(|h| h.0 == response_id) {
                    let (_, item_id, _) = self.heard.remove(k).expect("found");
                    self.out.event(&S::InputTranscriptionFailed { item_id, message });
                }
            }
            Received::ToolCall { response_id, call_id, name, arguments, .. } => {
                if let Some(a) = self.active.as_mut().filter(|a| a.v1 == Some(response_id)) {
                    a.calls.push((call_id, name, arguments));
                }
            }
            Received::ToolCallInvalid { reason, message, .. } => {
                // (the dialect has no event for it: the response ends with what was said)
                tracing::info!(?reason, "the model wrote a tool call that is not one: {message}");
            }
            Received::TextDelta { response_id, text, .. } => {
                if self.active.as_ref().is_some_and(|a| a.v1 == Some(response_id)) {
                    self.open_message();
                }
                if let Some(a) = self.active.as_mut().filter(|a| a.v1 == Some(response_id)) {
                    a.transcript.push_str(&text);
                    let e = match a.modality {
                        Modality::Audio => S::TranscriptDelta { at: a.at(), delta: text },
                        Modality::Text => S::TextDelta { at: a.at(), delta: text },
                    };
                    self.out.event(&e);
                }
            }
            Received::ResponseDone { response_id, status, audio_ms, usage, .. } => {
                if self.active.as_ref().is_some_and(|a| a.v1 == Some(response_id)) {
                    self.finish(status, audio_ms, usage).await;
                }
                done = true;
            }
            Received::SessionClosing { reason, .. } => {
                self.out.event(&S::Error(ErrorView::server(
                    OaiErrorCode::SessionClosing,
                    format!("the server is closing this session ({reason})"),
                )));
            }
            Received::Error { code, message, fatal, retry_after_ms, .. } => {
                use antiphon_protocol::ErrorCode;
                let unstarted = self.active.as_ref().is_some_and(|a| a.v1.is_none());
                let ours = self
                    .active
                    .as_ref()
                    .and_then(|a| a.v1)
                    .is_some_and(|v| message.starts_with(&format!("response {v}")));
                if (unstarted && !fatal) || ours {
                    // the response failed: its response.done says why (pipecat hangs up on any
                    // `error`)
                    if let Some(a) = self.active.as_mut() {
                        // (capacity says so, with its wait; any other failure is the response's)
                        let code =
                            OaiErrorCode::from_v1_failure(code, OaiErrorCode::ResponseFailed);
                        a.failure = Some(Failure { code, message, retry_after_ms });
                    }
                    if unstarted {
                        self.finish(DoneStatus::Failed, 0, Default::default()).await;
                    }
                } else {
                    self.shared.metrics.errors.at(crate::ErrorLabel::OpenAiForwarded).inc();
                    let server_side = code == ErrorCode::Internal || fatal;
                    self.out.event(&S::Error(ErrorView {
                        server_side,
                        retry_after_ms,
                        ..ErrorView::server(OaiErrorCode::V1(code), message)
                    }));
                }
            }
            Received::Other => {}
        }
        self.ack(done).await;
    }

    /// A v1 binary frame: the active response's PCM16 audio.
    pub async fn on_v1_audio(&mut self, bytes: &[u8]) {
        let Some(f) = AudioFrame::decode(bytes) else { return };
        self.saw((f.seq != 0).then_some(f.seq as u64));
        if let Some(a) = self
            .active
            .as_mut()
            .filter(|a| a.v1 == Some(f.response_id) && a.modality == Modality::Audio)
        {
            a.pending_audio
                .extend(f.payload.chunks_exact(2).map(|b| i16::from_le_bytes([b[0], b[1]])));
            if a.pending_audio.len() >= DELTA_SAMPLES {
                self.flush_audio();
            }
        }
        self.ack(false).await;
    }

    /// The gathered output audio as one delta, in the response's format.
    pub fn flush_audio(&mut self) {
        if self.active.as_ref().is_some_and(|a| !a.pending_audio.is_empty()) {
            self.open_message();
        }
        let Some(a) = self.active.as_mut().filter(|a| !a.pending_audio.is_empty()) else { return };
        let pcm = std::mem::take(&mut a.pending_audio);
        let bytes: Vec<u8> = match a.format {
            AudioFormat::Pcm24k => pcm.iter().flat_map(|s| s.to_le_bytes()).collect(),
            law => {
                let f: Vec<f32> = pcm.iter().map(|&s| antiphon_audio::i16_to_f32(s)).collect();
                let narrow = a.narrow.push(&f);
                narrow
                    .iter()
                    .map(
                        |&s| if law == AudioFormat::Pcmu { ulaw_encode(s) } else { alaw_encode(s) },
                    )
                    .collect()
            }
        };
        if bytes.is_empty() {
            return;
        }
        let delta_b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
        self.out.event(&S::AudioDelta { at: a.at(), delta_b64 });
    }

    /// The response's opening events, once v1 has created it (its message item's too, unless it
    /// may call).
    fn begin(&mut self) {
        let Some(a) = self.active.as_mut() else { return };
        a.started = true;
        self.out.event(&S::ResponseCreated(a.view(ResponseStatus::InProgress, Vec::new(), None)));
        if !a.lazy_message {
            self.open_message();
        }
    }

    /// The message item's opening events (once).
    fn open_message(&mut self) {
        let Some(a) = self.active.as_mut().filter(|a| a.started && !a.message_open) else { return };
        a.message_open = true;
        let item = a.item(ItemStatus::InProgress);
        self.out.event(&S::OutputItemAdded {
            response_id: a.id.clone(),
            output_index: 0,
            item: item.clone(),
        });
        if !a.out_of_band {
            let previous_item_id = self.items.last().map(|i| i.view.id.clone());
            self.out.event(&S::ItemAdded { previous_item_id, item });
        }
        self.out.event(&S::ContentPartAdded { at: a.at(), part: a.part() });
    }

    /// The response's closing events (by its v1 status): its message item's (a response with
    /// neither speech nor a call still has one), then each call's item.
    async fn finish(
        &mut self,
        v1_status: DoneStatus,
        audio_ms: u64,
        v1_usage: antiphon_protocol::Usage,
    ) {
        if self.active.as_ref().is_some_and(|a| !a.started) {
            self.begin();
        }
        if self.active.as_ref().is_some_and(|a| a.calls.is_empty()) {
            self.open_message();
        }
        let Some(a) = self.active.take() else { return };
        let (status, item_status) = match v1_status {
            DoneStatus::Completed => (ResponseStatus::Completed, ItemStatus::Completed),
            DoneStatus::Cancelled => (ResponseStatus::Cancelled, ItemStatus::Incomplete),
            DoneStatus::Failed => (ResponseStatus::Failed, ItemStatus::Incomplete),
        };
        let kept = !a.out_of_band && status != ResponseStatus::Failed;
        let mut output = Vec::new();
        if a.message_open {
            let at = a.at();
            match a.modality {
                Modality::Audio => {
                    self.out.event(&S::AudioDone { at: at.clone() });
                    self.out.event(&S::TranscriptDone {
                        at: at.clone(),
                        transcript: a.transcript.clone(),
                    });
                }
                Modality::Text => {
                    self.out.event(&S::TextDone { at: at.clone(), text: a.transcript.clone() })
                }
            }
            self.out.event(&S::ContentPartDone { at, part: a.part() });
            let item = a.item(item_status);
            if !a.out_of_band {
                let previous_item_id = self.items.last().map(|i| i.view.id.clone());
                self.out.event(&S::ItemDone { previous_item_id, item: item.clone() });
            }
            self.out.event(&S::OutputItemDone {
                response_id: a.id.clone(),
                output_index: 0,
                item: item.clone(),
            });
            output.push(item.clone());
            if kept {
                let mut view = item;
                if let (Some(ms), Some(rid)) = (a.truncate_ms, a.v1) {
                    cut_transcript(&mut view, ms, audio_ms);
                    self.to_v1_event(ClientEvent::Playback {
                        response_id: rid,
                        played_ms: ms.min(audio_ms),
                    })
                    .await;
                }
                self.push_item(ConvItem {
                    view,
                    pending: None,
                    v1_response: a.v1,
                    audio_ms,
                    in_v1: true,
                });
            }
        }
        self.v1_calls = a.calls.iter().map(|(call_id, ..)| call_id.clone()).collect();
        for (call_id, name, arguments) in &a.calls {
            let output_index = output.len() as u32;
            let item_id = new_id("item");
            let at = CallAt {
                response_id: a.id.clone(),
                item_id: item_id.clone(),
                output_index,
                call_id: call_id.clone(),
            };
            let opening =
                ItemView::function_call(&item_id, ItemStatus::InProgress, call_id, name, "");
            self.out.event(&S::OutputItemAdded {
                response_id: a.id.clone(),
                output_index,
                item: opening.clone(),
            });
            if !a.out_of_band {
                self.out.event(&S::ItemAdded {
                    previous_item_id: self.items.last().map(|i| i.view.id.clone()),
                    item: opening,
                });
            }
            self.out
                .event(&S::FunctionCallArgumentsDelta { at: at.clone(), delta: arguments.clone() });
            self.out.event(&S::FunctionCallArgumentsDone {
                at,
                name: name.clone(),
                arguments: arguments.clone(),
            });
            let item =
                ItemView::function_call(&item_id, ItemStatus::Completed, call_id, name, arguments);
            if !a.out_of_band {
                self.out.event(&S::ItemDone {
                    previous_item_id: self.items.last().map(|i| i.view.id.clone()),
                    item: item.clone(),
                });
            }
            self.out.event(&S::OutputItemDone {
                response_id: a.id.clone(),
                output_index,
                item: item.clone(),
            });
            output.push(item.clone());
            if kept {
                self.push_item(ConvItem {
                    view: item,
                    pending: None,
                    v1_response: None,
                    audio_ms: 0,
                    in_v1: true,
                });
            }
        }
        // (a response cancelled here ends before the engine reports its usage: its text is counted)
        let written = match v1_usage.output_text_tokens {
            0 => self.shared.count_tokens(&a.transcript).map(|n| n as u64).unwrap_or(0),
            n => n,
        };
        let usage = UsageView {
            text_tokens: written,
            audio_tokens: audio_ms * 25 / 1000,
            input_text_tokens: v1_usage.input_tokens.saturating_sub(v1_usage.input_audio_tokens),
            input_audio_tokens: v1_usage.input_audio_tokens,
            cached_tokens: v1_usage.cached_tokens,
        };
        self.out.event(&S::ResponseDone(a.view(status, output, Some(usage))));
        if let Some((p, event_id)) = self.queued.take() {
            if let Err(e) = self.start_response(p).await {
                self.error(event_id, e);
            }
        }
    }
}
