//! The dialect's server events with the GA names and the fields the official SDKs' types and
//! pipecat's validators require (docs/openai-realtime-research.md §3.3): `event_id` on every
//! event, objects with their `object` tags.

use serde::Serialize;
use serde_json::{Map, Value};

use super::{
    AudioFormat, CancelReason, ItemStatus, MaxTokens, Modality, OaiErrorCode, ResponseStatus,
    TurnDetection,
};

fn format_json(f: AudioFormat) -> Value {
    match f {
        AudioFormat::Pcm24k => serde_json::json!({"type": "audio/pcm", "rate": 24000}),
        AudioFormat::Pcmu => serde_json::json!({"type": "audio/pcmu"}),
        AudioFormat::Pcma => serde_json::json!({"type": "audio/pcma"}),
    }
}

fn modalities_json(m: Modality) -> Vec<&'static str> {
    match m {
        Modality::Audio => vec!["audio"],
        Modality::Text => vec!["text"],
    }
}

fn max_tokens_json(m: MaxTokens) -> Value {
    match m {
        MaxTokens::Inf => Value::from("inf"),
        MaxTokens::N(n) => Value::from(n),
    }
}

/// The session as the server holds it (what `session.created` / `session.updated` echo).
#[derive(Debug, Clone, PartialEq)]
pub struct SessionView {
    pub id: String,
    pub model: String,
    pub instructions: String,
    pub output_modalities: Modality,
    pub input_format: AudioFormat,
    pub output_format: AudioFormat,
    pub turn_detection: Option<TurnDetection>,
    pub voice: String,
    pub max_output_tokens: MaxTokens,
    pub tools: Vec<Value>,
    /// As the client set it (a string, or an object naming a function).
    pub tool_choice: Value,
    /// `audio.input.transcription` as the client set it (`None`: off).
    pub transcription: Option<Value>,
}

impl SessionView {
    pub fn to_json(&self) -> Value {
        let td = self.turn_detection.as_ref().map(|t| {
            let mut v = serde_json::json!({
                "type": if t.semantic { "semantic_vad" } else { "server_vad" },
                "create_response": t.create_response,
                "interrupt_response": t.interrupt_response,
            });
            if t.semantic {
                v["eagerness"] = Value::from(t.eagerness.clone().unwrap_or_else(|| "auto".into()));
            } else {
                v["threshold"] = Value::from(t.threshold);
                v["prefix_padding_ms"] = Value::from(t.prefix_padding_ms);
                v["silence_duration_ms"] = Value::from(t.silence_duration_ms);
            }
            v
        });
        serde_json::json!({
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self.model,
            "output_modalities": modalities_json(self.output_modalities),
            "instructions": self.instructions,
            "audio": {
                "input": {"format": format_json(self.input_format),
                    "transcription": self.transcription, "noise_reduction": null,
                    "turn_detection": td},
                "output": {"format": format_json(self.output_format), "voice": self.voice,
                    "speed": 1.0},
            },
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "max_output_tokens": max_tokens_json(self.max_output_tokens),
            "tracing": null,
        })
    }
}

/// A content part in the server's items (`output_audio` / `output_text` / `input_*`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PartView {
    #[serde(rename = "type")]
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transcript: Option<String>,
}

impl PartView {
    pub fn of(kind: &'static str, text: Option<String>, transcript: Option<String>) -> Self {
        Self { kind, text, transcript }
    }
}

/// A conversation item as the server reports it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ItemView {
    pub id: String,
    pub object: &'static str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub status: ItemStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<Vec<PartView>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
}

impl ItemView {
    /// A `function_call` item (`arguments`: the call's JSON text).
    pub fn function_call(
        id: &str,
        status: ItemStatus,
        call_id: &str,
        name: &str,
        arguments: &str,
    ) -> Self {
        Self {
            id: id.to_string(),
            object: "realtime.item",
            kind: "function_call",
            status,
            role: None,
            content: None,
            call_id: Some(call_id.to_string()),
            name: Some(name.to_string()),
            arguments: Some(arguments.to_string()),
            output: None,
        }
    }

    pub fn message(
        id: &str,
        role: &'static str,
        status: ItemStatus,
        content: Vec<PartView>,
    ) -> Self {
        Self {
            id: id.to_string(),
            object: "realtime.item",
            kind: "message",
            status,
            role: Some(role),
            content: Some(content),
            call_id: None,
            name: None,
            arguments: None,
            output: None,
        }
    }
}

/// What `usage` reports: the reply's text tokens (one per text delta the Thinker emitted) and
/// speech tokens (the Talker's codes at 25 per second of audio).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct UsageView {
    /// Output: the reply's text and speech tokens.
    pub text_tokens: u64,
    pub audio_tokens: u64,
    /// Input: the prompt's text and audio positions, and those reused from earlier turns.
    pub input_text_tokens: u64,
    pub input_audio_tokens: u64,
    pub cached_tokens: u64,
}

/// Why a response failed (`status_details.error`): the v1 code behind it (`capacity` when the
/// server had no place for it, with the wait it suggests), and the reason in words.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub code: OaiErrorCode,
    pub message: String,
    pub retry_after_ms: Option<u64>,
}

/// An `error` event's error: the client's fault (`invalid_request_error`, naming the `param` and
/// the client's `event_id`) or the server's (`server_error`; with `capacity`, how long to wait).
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorView {
    pub code: OaiErrorCode,
    pub message: String,
    pub param: Option<String>,
    pub client_event_id: Option<String>,
    pub server_side: bool,
    pub retry_after_ms: Option<u64>,
}

impl ErrorView {
    /// The server's error, with no param and no wait.
    pub fn server(code: OaiErrorCode, message: String) -> Self {
        Self {
            code,
            message,
            param: None,
            client_event_id: None,
            server_side: true,
            retry_after_ms: None,
        }
    }
}

/// A response object.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponseView {
    pub id: String,
    pub status: ResponseStatus,
    /// `status_details` of a cancelled or a failed response.
    pub status_details: Option<StatusDetails>,
    pub output: Vec<ItemView>,
    pub modalities: Modality,
    pub output_format: AudioFormat,
    pub voice: String,
    pub max_output_tokens: MaxTokens,
    pub metadata: Option<Map<String, Value>>,
    pub conversation_id: Option<String>,
    pub usage: Option<UsageView>,
}

/// Why a response ended as it did (`status_details`).
#[derive(Debug, Clone, PartialEq)]
pub enum StatusDetails {
    Cancelled(CancelReason),
    Failed(Failure),
}

impl ResponseView {
    pub fn to_json(&self) -> Value {
        let details = self.status_details.as_ref().map(|d| match d {
            StatusDetails::Cancelled(reason) => serde_json::json!({"type": "cancelled",
                "reason": reason}),
            StatusDetails::Failed(e) => {
                let mut d = serde_json::json!({"type": "failed", "reason": null});
                d["error"] = serde_json::json!({"type": "server_error", "code": e.code,
                    "message": e.message});
                if let Some(ms) = e.retry_after_ms {
                    d["error"]["retry_after_ms"] = ms.into();
                }
                d
            }
        });
        let usage = self.usage.map(|u| {
            let (input, output) =
                (u.input_text_tokens + u.input_audio_tokens, u.text_tokens + u.audio_tokens);
            serde_json::json!({
                "total_tokens": input + output,
                "input_tokens": input,
                "output_tokens": output,
                "input_token_details": {"text_tokens": u.input_text_tokens,
                    "audio_tokens": u.input_audio_tokens, "cached_tokens": u.cached_tokens},
                "output_token_details": {"text_tokens": u.text_tokens,
                    "audio_tokens": u.audio_tokens},
            })
        });
        serde_json::json!({
            "id": self.id,
            "object": "realtime.response",
            "status": self.status,
            "status_details": details,
            "output": self.output,
            "output_modalities": modalities_json(self.modalities),
            "audio": {"output": {"format": format_json(self.output_format), "voice": self.voice}},
            "conversation_id": self.conversation_id,
            "max_output_tokens": max_tokens_json(self.max_output_tokens),
            "metadata": self.metadata,
            "usage": usage,
        })
    }
}

/// Where a response's content is: the five fields every delta event carries (less `delta`).
#[derive(Debug, Clone, PartialEq)]
pub struct ContentAt {
    pub response_id: String,
    pub item_id: String,
    pub output_index: u32,
    pub content_index: u32,
}

/// Which call of a response an argument event is about (the four fields both carry).
#[derive(Debug, Clone, PartialEq)]
pub struct CallAt {
    pub response_id: String,
    pub item_id: String,
    pub output_index: u32,
    pub call_id: String,
}

/// A server event of the dialect.
#[derive(Debug, Clone, PartialEq)]
pub enum OaiServerEvent {
    Error(ErrorView),
    SessionCreated(SessionView),
    SessionUpdated(SessionView),
    Committed { previous_item_id: Option<String>, item_id: String },
    Cleared,
    SpeechStarted { audio_start_ms: u64, item_id: String },
    SpeechStopped { audio_end_ms: u64, item_id: String },
    ItemAdded { previous_item_id: Option<String>, item: ItemView },
    ItemDone { previous_item_id: Option<String>, item: ItemView },
    ItemTruncated { item_id: String, content_index: u32, audio_end_ms: u64 },
    ItemDeleted { item_id: String },
    ItemRetrieved { item: ItemView },
    ResponseCreated(ResponseView),
    ResponseDone(ResponseView),
    OutputItemAdded { response_id: String, output_index: u32, item: ItemView },
    OutputItemDone { response_id: String, output_index: u32, item: ItemView },
    ContentPartAdded { at: ContentAt, part: PartView },
    ContentPartDone { at: ContentAt, part: PartView },
    AudioDelta { at: ContentAt, delta_b64: String },
    AudioDone { at: ContentAt },
    TranscriptDelta { at: ContentAt, delta: String },
    TranscriptDone { at: ContentAt, transcript: String },
    TextDelta { at: ContentAt, delta: String },
    TextDone { at: ContentAt, text: String },
    InputTranscriptionDelta { item_id: String, delta: String },
    InputTranscriptionCompleted { item_id: String, transcript: String, seconds: f64 },
    InputTranscriptionFailed { item_id: String, message: String },
    FunctionCallArgumentsDelta { at: CallAt, delta: String },
    FunctionCallArgumentsDone { at: CallAt, name: String, arguments: String },
}

impl OaiServerEvent {
    /// The event's JSON with its `event_id`.
    pub fn to_json(&self, event_id: &str) -> String {
        use OaiServerEvent as E;
        let at = |ty: &str, at: &ContentAt| {
            serde_json::json!({
                "type": ty, "response_id": at.response_id, "item_id": at.item_id,
                "output_index": at.output_index, "content_index": at.content_index,
            })
        };
        let with = |mut v: Value, k: &str, x: Value| {
            v[k] = x;
            v
        };
        let mut v = match self {
            E::Error(e) => {
                let mut v = serde_json::json!({
                    "type": "error",
                    "error": {
                        "type":
                            if e.server_side { "server_error" } else { "invalid_request_error" },
                        "code": e.code, "message": e.message, "param": e.param,
                        "event_id": e.client_event_id,
                    },
                });
                if let Some(ms) = e.retry_after_ms {
                    v["error"]["retry_after_ms"] = ms.into();
                }
                v
            }
            E::SessionCreated(s) => {
                serde_json::json!({"type": "session.created", "session": s.to_json()})
            }
            E::SessionUpdated(s) => {
                serde_json::json!({"type": "session.updated", "session": s.to_json()})
            }
            E::Committed { previous_item_id, item_id } => {
                serde_json::json!({"type": "input_audio_buffer.committed",
                    "previous_item_id": previous_item_id, "item_id": item_id})
            }
            E::Cleared => serde_json::json!({"type": "input_audio_buffer.cleared"}),
            E::SpeechStarted { audio_start_ms, item_id } => {
                serde_json::json!({"type": "input_audio_buffer.speech_started",
                    "audio_start_ms": audio_start_ms, "item_id": item_id})
            }
            E::SpeechStopped { audio_end_ms, item_id } => {
                serde_json::json!({"type": "input_audio_buffer.speech_stopped",
                    "audio_end_ms": audio_end_ms, "item_id": item_id})
            }
            E::ItemAdded { previous_item_id, item } => {
                serde_json::json!({"type": "conversation.item.added",
                    "previous_item_id": previous_item_id, "item": item})
            }
            E::ItemDone { previous_item_id, item } => {
                serde_json::json!({"type": "conversation.item.done",
                    "previous_item_id": previous_item_id, "item": item})
            }
            E::ItemTruncated { item_id, content_index, audio_end_ms } => serde_json::json!({
                "type": "conversation.item.truncated", "item_id": item_id,
                    "content_index": content_index, "audio_end_ms": audio_end_ms,
            }),
            E::ItemDeleted { item_id } => {
                serde_json::json!({"type": "conversation.item.deleted", "item_id": item_id})
            }
            E::ItemRetrieved { item } => {
                serde_json::json!({"type": "conversation.item.retrieved", "item": item})
            }
            E::ResponseCreated(r) => {
                serde_json::json!({"type": "response.created", "response": r.to_json()})
            }
            E::ResponseDone(r) => {
                serde_json::json!({"type": "response.done", "response": r.to_json()})
            }
            E::OutputItemAdded { response_id, output_index, item } => serde_json::json!({
                "type": "response.output_item.added", "response_id": response_id,
                    "output_index": output_index, "item": item,
            }),
            E::OutputItemDone { response_id, output_index, item } => serde_json::json!({
                "type": "response.output_item.done", "response_id": response_id,
                    "output_index": output_index, "item": item,
            }),
            E::ContentPartAdded { at: a, part } => {
                with(at("response.content_part.added", a), "part", serde_json::json!(part))
            }
            E::ContentPartDone { at: a, part } => {
                with(at("response.content_part.done", a), "part", serde_json::json!(part))
            }
            E::AudioDelta { at: a, delta_b64 } => {
                with(at("response.output_audio.delta", a), "delta", Value::from(delta_b64.as_str()))
            }
            E::AudioDone { at: a } => at("response.output_audio.done", a),
            E::TranscriptDelta { at: a, delta } => with(
                at("response.output_audio_transcript.delta", a),
                "delta",
                Value::from(delta.as_str()),
            ),
            E::TranscriptDone { at: a, transcript } => with(
                at("response.output_audio_transcript.done", a),
                "transcript",
                Value::from(transcript.as_str()),
            ),
            E::TextDelta { at: a, delta } => {
                with(at("response.output_text.delta", a), "delta", Value::from(delta.as_str()))
            }
            E::TextDone { at: a, text } => {
                with(at("response.output_text.done", a), "text", Value::from(text.as_str()))
            }
            E::InputTranscriptionDelta { item_id, delta } => serde_json::json!({
                "type": "conversation.item.input_audio_transcription.delta", "item_id": item_id,
                    "content_index": 0, "delta": delta,
            }),
            E::InputTranscriptionCompleted { item_id, transcript, seconds } => serde_json::json!({
                "type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
                    "content_index": 0,
                "transcript": transcript, "usage": {"type": "duration", "seconds": seconds},
            }),
            E::InputTranscriptionFailed { item_id, message } => serde_json::json!({
                "type": "conversation.item.input_audio_transcription.failed", "item_id": item_id,
                    "content_index": 0,
                "error": {"type": "server_error", "code": "transcription_failed",
                    "message": message},
            }),
            E::FunctionCallArgumentsDelta { at: a, delta } => serde_json::json!({
                "type": "response.function_call_arguments.delta", "response_id": a.response_id,
                    "item_id": a.item_id,
                "output_index": a.output_index, "call_id": a.call_id, "delta": delta,
            }),
            E::FunctionCallArgumentsDone { at: a, name, arguments } => serde_json::json!({
                "type": "response.function_call_arguments.done", "response_id": a.response_id,
                    "item_id": a.item_id,
                "output_index": a.output_index, "call_id": a.call_id, "name": name,
                    "arguments": arguments,
            }),
        };
        v["event_id"] = Value::from(event_id);
        v.to_string()
    }
}
