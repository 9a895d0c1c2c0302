//! Wire protocol v1 (docs/protocol.md): the only crate that (de)serializes wire messages. Client
//! events arrive as JSON text frames, server events leave as JSON with a `seq` (except
//! connection-level ones), audio travels in binary frames with a 12-byte header.

use serde::{Deserialize, Serialize};
use serde_json::Value;

mod conversation;
mod generation;
pub mod openai;
mod received;
mod server_event;
mod tools;
pub use conversation::{validate_turns, PastCall, PastTurn, MAX_APPEND_TURNS};
pub use generation::{
    validate_instructions, Generation, GenerationLimits, MAX_INSTRUCTIONS_CHARS, MAX_PREFIX_CHARS,
    MAX_TEMPERATURE,
};
pub use received::{parse_server, Received};
pub use server_event::{
    ClosingReason, DoneStatus, ServerEvent, ToolCallProblem, TranscriptFailure, Trigger, Usage,
};
pub use tools::{
    valid_tool_name, validate_results, validate_tool_choice, validate_tools, ToolChoice, ToolDecl,
    ToolResult, MAX_TOOLS, MAX_TOOLS_BYTES, MAX_TOOL_NAME, MAX_TOOL_OUTPUT_CHARS, MAX_TOOL_RESULTS,
};

pub const PROTOCOL_VERSION: u32 = 1;
pub const FRAME_HEADER: usize = 12;
pub const KIND_AUDIO: u8 = 1;
pub const FLAG_LAST: u8 = 1;

/// Text tokens a spoken duplex unit carries at most (the reference policy's per-unit budget);
/// a duplex session's `max_text_tokens` is capped by it.
pub const DUPLEX_UNIT_MAX_TEXT_TOKENS: usize = 20;

/// Stable error codes (`error`'s `code`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    BadJson,
    UnknownEvent,
    BadField,
    NotInSession,
    SessionNotFound,
    BadResumeToken,
    SessionExpired,
    SessionInUse,
    Capacity,
    BadAudio,
    MessageTooLarge,
    JournalOverflow,
    Internal,
    /// A code this client does not know (a newer server's); never sent.
    #[serde(other)]
    Other,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 13] = [
        ErrorCode::BadJson,
        ErrorCode::UnknownEvent,
        ErrorCode::BadField,
        ErrorCode::NotInSession,
        ErrorCode::SessionNotFound,
        ErrorCode::BadResumeToken,
        ErrorCode::SessionExpired,
        ErrorCode::SessionInUse,
        ErrorCode::Capacity,
        ErrorCode::BadAudio,
        ErrorCode::MessageTooLarge,
        ErrorCode::JournalOverflow,
        ErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadJson => "bad_json",
            ErrorCode::UnknownEvent => "unknown_event",
            ErrorCode::BadField => "bad_field",
            ErrorCode::NotInSession => "not_in_session",
            ErrorCode::SessionNotFound => "session_not_found",
            ErrorCode::BadResumeToken => "bad_resume_token",
            ErrorCode::SessionExpired => "session_expired",
            ErrorCode::SessionInUse => "session_in_use",
            ErrorCode::Capacity => "capacity",
            ErrorCode::BadAudio => "bad_audio",
            ErrorCode::MessageTooLarge => "message_too_large",
            ErrorCode::JournalOverflow => "journal_overflow",
            ErrorCode::Internal => "internal",
            ErrorCode::Other => "other",
        }
    }
}

/// A protocol error: the code, a message, and whether it ends the session or connection.
#[derive(Debug, Clone, PartialEq)]
pub struct WireError {
    pub code: ErrorCode,
    pub message: String,
    pub fatal: bool,
    pub retry_after_ms: Option<u64>,
}

impl WireError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into(), fatal: false, retry_after_ms: None }
    }
    pub fn fatal(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into(), fatal: true, retry_after_ms: None }
    }
    pub fn retry_after(mut self, ms: u64) -> Self {
        self.retry_after_ms = Some(ms);
        self
    }
}

// ------------------------------------------------------------------------------------ client

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    Opus,
    Pcm16,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct InputAudio {
    pub codec: Codec,
    pub sample_rate: u32,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct OutputAudio {
    pub codec: Codec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame_ms: Option<u32>,
}

impl OutputAudio {
    /// The packet length when the client leaves `frame_ms` out.
    pub const DEFAULT_FRAME_MS: u32 = 20;

    /// The packet length asked for, or the default.
    pub fn frame_ms(&self) -> u32 {
        self.frame_ms.unwrap_or(Self::DEFAULT_FRAME_MS)
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Voice {
    Configured { id: String },
    Uploaded { ref_audio_b64: String, sample_rate: u32 },
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case")]
pub enum DuplexPolicy {
    Model,
    SpeakEvery { k: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Turn,
    Duplex,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct SessionCreate {
    pub mode: Mode,
    pub input_audio: InputAudio,
    pub output_audio: OutputAudio,
    #[serde(default)]
    pub voice: Option<Voice>,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub generation: Option<Generation>,
    #[serde(default)]
    pub duplex: Option<DuplexPolicy>,
    /// Functions the model may call (turn mode).
    #[serde(default)]
    pub tools: Option<Vec<ToolDecl>>,
    /// Each spoken turn is transcribed (`input.transcript.*` events; turn mode).
    #[serde(default)]
    pub input_transcription: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct SessionUpdate {
    #[serde(default)]
    pub input_audio: Option<InputAudio>,
    #[serde(default)]
    pub output_audio: Option<OutputAudio>,
    #[serde(default)]
    pub voice: Option<Voice>,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub generation: Option<Generation>,
    #[serde(default)]
    pub duplex: Option<DuplexPolicy>,
    /// Replaces the declared tools (`[]`: none).
    #[serde(default)]
    pub tools: Option<Vec<ToolDecl>>,
    #[serde(default)]
    pub input_transcription: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct SessionResume {
    pub session_id: String,
    pub resume_token: String,
    /// Required: without it a resume would replay everything, duplicating what the client holds.
    pub last_seq: u64,
}

/// A client event after parsing; `seq` is the client's own input sequence number, if given.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientEvent {
    SessionCreate(Box<SessionCreate>),
    SessionResume(SessionResume),
    SessionUpdate(Box<SessionUpdate>),
    InputText {
        text: String,
        generation: Option<Generation>,
    },
    InputCommit {
        generation: Option<Generation>,
    },
    /// Outputs of the tools the last response called: a response answers from them.
    InputToolResult {
        results: Vec<ToolResult>,
        generation: Option<Generation>,
    },
    InputClear,
    /// Earlier turns the conversation is to hold (after those it holds).
    ConversationAppend {
        turns: Vec<PastTurn>,
    },
    /// The conversation is forgotten: later prompts start without it.
    ConversationClear,
    ResponseCancel {
        response_id: Option<u32>,
    },
    Playback {
        response_id: u32,
        played_ms: u64,
    },
    Ack {
        seq: u64,
    },
    Ping {
        id: Option<Value>,
    },
    SessionClose,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Incoming {
    pub seq: Option<u64>,
    pub event: ClientEvent,
}

fn typed<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, WireError> {
    serde_path_to_error::deserialize::<_, T>(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        let field = if path == "." || path.is_empty() {
            // a missing field is named in the message: "missing field `mode`"
            inner.split('`').nth(1).unwrap_or("?").to_string()
        } else {
            path
        };
        WireError::new(ErrorCode::BadField, format!("field `{field}`: {inner}"))
    })
}

#[derive(Deserialize)]
struct TextBody {
    text: String,
    #[serde(default)]
    generation: Option<Generation>,
}
#[derive(Deserialize)]
struct CommitBody {
    #[serde(default)]
    generation: Option<Generation>,
}
#[derive(Deserialize)]
struct ToolResultBody {
    results: Vec<ToolResult>,
    #[serde(default)]
    generation: Option<Generation>,
}
#[derive(Deserialize)]
struct AppendBody {
    turns: Vec<PastTurn>,
}
#[derive(Deserialize)]
struct CancelBody {
    #[serde(default)]
    response_id: Option<u32>,
}
#[derive(Deserialize)]
struct PlaybackBody {
    response_id: u32,
    played_ms: u64,
}
#[derive(Deserialize)]
struct AckBody {
    seq: u64,
}
#[derive(Deserialize)]
struct PingBody {
    #[serde(default)]
    id: Option<Value>,
}

/// The largest integer every JSON client holds exactly (2^53 - 1): no count a client sends exceeds
/// it.
pub const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// Parses one text frame.
pub fn parse_client(text: &str) -> Result<Incoming, WireError> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| WireError::new(ErrorCode::BadJson, format!("not JSON: {e}")))?;
    let Value::Object(obj) = &v else {
        return Err(WireError::new(ErrorCode::BadJson, "a text frame must hold one JSON object"));
    };
    let ty = match obj.get("type") {
        Some(Value::String(t)) => t.clone(),
        Some(_) => {
            return Err(WireError::new(ErrorCode::BadField, "field `type`: must be a string"))
        }
        None => return Err(WireError::new(ErrorCode::BadField, "field `type`: missing")),
    };
    // (an input's seq counts audio packets and events alike: the packet header's u32 bounds it)
    let seq = match obj.get("seq") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n))
            if n.as_u64().is_some_and(|s| s <= u32::MAX as u64) && ty != "ack" =>
        {
            n.as_u64()
        }
        Some(Value::Number(_)) if ty == "ack" => None,
        Some(_) => {
            return Err(WireError::new(
                ErrorCode::BadField,
                format!("field `seq`: must be an integer from 0 to {}", u32::MAX),
            ))
        }
    };
    let event = match ty.as_str() {
        "session.create" => ClientEvent::SessionCreate(Box::new(typed(v)?)),
        "session.resume" => ClientEvent::SessionResume(typed(v)?),
        "session.update" => {
            if obj.contains_key("mode") {
                return Err(WireError::new(
                    ErrorCode::BadField,
                    "field `mode`: cannot change after session.create",
                ));
            }
            ClientEvent::SessionUpdate(Box::new(typed(v)?))
        }
        "input.text" => {
            let b: TextBody = typed(v)?;
            ClientEvent::InputText { text: b.text, generation: b.generation }
        }
        "input.commit" => {
            ClientEvent::InputCommit { generation: typed::<CommitBody>(v)?.generation }
        }
        "input.tool_result" => {
            let b: ToolResultBody = typed(v)?;
            validate_results(&b.results)?;
            ClientEvent::InputToolResult { results: b.results, generation: b.generation }
        }
        "input.clear" => ClientEvent::InputClear,
        "conversation.clear" => ClientEvent::ConversationClear,
        "conversation.append" => {
            let b: AppendBody = typed(v)?;
            validate_turns(&b.turns)?;
            ClientEvent::ConversationAppend { turns: b.turns }
        }
        "response.cancel" => {
            ClientEvent::ResponseCancel { response_id: typed::<CancelBody>(v)?.response_id }
        }
        "playback" => {
            let b: PlaybackBody = typed(v)?;
            if b.played_ms > MAX_SAFE_INTEGER {
                return Err(WireError::new(
                    ErrorCode::BadField,
                    format!("field `played_ms`: at most {MAX_SAFE_INTEGER}"),
                ));
            }
            ClientEvent::Playback { response_id: b.response_id, played_ms: b.played_ms }
        }
        "ack" => ClientEvent::Ack { seq: typed::<AckBody>(v)?.seq },
        "ping" => ClientEvent::Ping { id: typed::<PingBody>(v)?.id },
        "session.close" => ClientEvent::SessionClose,
        other => {
            return Err(WireError::new(
                ErrorCode::UnknownEvent,
                format!("unknown event type `{other}`"),
            ))
        }
    };
    Ok(Incoming { seq, event })
}

// ------------------------------------------------------------------------------------ server

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Limits {
    pub max_text_frame: usize,
    pub max_binary_frame: usize,
    pub journal_max_bytes: usize,
    pub journal_max_audio_ms: u64,
}

// ------------------------------------------------------------------------------------ binary

/// A binary frame: audio payload plus header fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AudioFrame {
    pub kind: u8,
    pub last: bool,
    pub seq: u32,
    pub response_id: u32,
    pub payload: Vec<u8>,
}

impl AudioFrame {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(FRAME_HEADER + self.payload.len());
        b.push(self.kind);
        b.push(if self.last { FLAG_LAST } else { 0 });
        b.extend_from_slice(&[0, 0]);
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.response_id.to_le_bytes());
        b.extend_from_slice(&self.payload);
        b
    }

    /// `None` for a frame shorter than its header.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < FRAME_HEADER {
            return None;
        }
        Some(Self {
            kind: b[0],
            last: b[1] & FLAG_LAST != 0,
            seq: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            response_id: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            payload: b[FRAME_HEADER..].to_vec(),
        })
    }
}

#[cfg(test)]
mod tests;
