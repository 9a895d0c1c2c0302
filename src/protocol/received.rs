//! What a client receives, typed: the v1 server events a program that speaks v1 to a session
//! (the OpenAI dialect's translator) acts on. Fields it does not need are left out.

use serde::Deserialize;

/// A v1 server event as a client reads it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type")]
pub enum Received {
    #[serde(rename = "session.created")]
    SessionCreated { seq: u64, session_id: String },
    #[serde(rename = "response.created")]
    ResponseCreated { seq: u64, response_id: u32 },
    #[serde(rename = "response.text.delta")]
    TextDelta { seq: u64, response_id: u32, text: String },
    #[serde(rename = "response.tool_call")]
    ToolCall { seq: u64, response_id: u32, call_id: String, name: String, arguments: String },
    #[serde(rename = "response.tool_call.invalid")]
    ToolCallInvalid {
        seq: u64,
        response_id: u32,
        reason: crate::ToolCallProblem,
        #[serde(default)]
        message: String,
    },
    #[serde(rename = "input.transcript.delta")]
    TranscriptDelta { seq: u64, response_id: u32, delta: String },
    #[serde(rename = "input.transcript.done")]
    TranscriptDone { seq: u64, response_id: u32, transcript: String },
    #[serde(rename = "input.transcript.failed")]
    TranscriptFailed {
        seq: u64,
        response_id: u32,
        reason: crate::TranscriptFailure,
        #[serde(default)]
        message: String,
    },
    #[serde(rename = "response.done")]
    ResponseDone {
        seq: u64,
        response_id: u32,
        status: crate::DoneStatus,
        audio_ms: u64,
        #[serde(default)]
        usage: crate::Usage,
    },
    #[serde(rename = "session.closing")]
    SessionClosing { seq: u64, reason: crate::ClosingReason },
    #[serde(rename = "error")]
    Error {
        #[serde(default)]
        seq: Option<u64>,
        code: crate::ErrorCode,
        message: String,
        fatal: bool,
        #[serde(default)]
        retry_after_ms: Option<u64>,
    },
    /// Anything else (acks, pongs, duplex events): no action needed.
    #[serde(other)]
    Other,
}

impl Received {
    /// The event's session seq, for an ack (`None` for connection-level events).
    pub fn seq(&self) -> Option<u64> {
        match self {
            Received::SessionCreated { seq, .. }
            | Received::ResponseCreated { seq, .. }
            | Received::TextDelta { seq, .. }
            | Received::ToolCall { seq, .. }
            | Received::ToolCallInvalid { seq, .. }
            | Received::TranscriptDelta { seq, .. }
            | Received::TranscriptDone { seq, .. }
            | Received::TranscriptFailed { seq, .. }
            | Received::ResponseDone { seq, .. }
            | Received::SessionClosing { seq, .. } => Some(*seq),
            Received::Error { seq, .. } => seq.filter(|s| *s > 0),
            Received::Other => None,
        }
    }
}

/// Parses a v1 server text frame (`None` if it is not one).
pub fn parse_server(text: &str) -> Option<Received> {
    serde_json::from_str(text).ok()
}
