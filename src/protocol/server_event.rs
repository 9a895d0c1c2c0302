//! What the server says: its events, and the closed sets of words some of them carry (what
//! started a response, how it ended, why a session closes) as types, so that no layer matches
//! on strings.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{Limits, Mode, OutputAudio, WireError};

/// What started a response (`response.created`'s `trigger`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// `input.text`.
    Text,
    /// `input.commit` of spoken input.
    Commit,
    /// The model decided to speak in a duplex session.
    Duplex,
    /// `input.tool_result`: the model answers from the tools' outputs.
    ToolResult,
}

impl Trigger {
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Text => "text",
            Trigger::Commit => "commit",
            Trigger::Duplex => "duplex",
            Trigger::ToolResult => "tool_result",
        }
    }
}

/// How a response ended (`response.done`'s `status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DoneStatus {
    Completed,
    Cancelled,
    /// An `error` naming the response says why.
    Failed,
}

impl DoneStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            DoneStatus::Completed => "completed",
            DoneStatus::Cancelled => "cancelled",
            DoneStatus::Failed => "failed",
        }
    }
}

/// Why a call the response began is not one (`response.tool_call.invalid`'s `reason`; its
/// `message` says it in words).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallProblem {
    /// The response ended inside the call (no `</tool_call>`).
    Unclosed,
    /// The call is not JSON, or not a JSON object.
    NotJson,
    /// The call has no `name` string.
    NoName,
    /// The call names a function the session did not declare.
    UndeclaredTool,
    /// The call's `arguments` are not an object (nor a string holding one).
    BadArguments,
    /// A problem this client does not know (a newer server's); never sent.
    #[serde(other)]
    Other,
}

/// Why a turn's transcript did not come (`input.transcript.failed`'s `reason`; its `message` says
/// it in words).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TranscriptFailure {
    /// The response it belongs to was cancelled first.
    Cancelled,
    /// The server had no room for the transcript at the time.
    Capacity,
    /// The engine failed or refused it.
    Failed,
    /// A reason this client does not know (a newer server's); never sent.
    #[serde(other)]
    Other,
}

/// Why the server closes a session (`session.closing`'s `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClosingReason {
    /// A newer connection resumed the session (sent to the older one, connection-level).
    Replaced,
    /// The server is shutting down (with `retry_after_ms`).
    Shutdown,
    /// No input and no output for `server.idle_timeout_s`.
    Idle,
    /// The session outlived `server.max_duration_s`.
    MaxDuration,
    /// A duplex session's conversation filled the context it may use.
    ContextFull,
    /// The session's engine stream failed (an `error` says why).
    Failed,
    /// A reason this client does not know (a newer server's).
    #[serde(other)]
    Other,
}

impl ClosingReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ClosingReason::Replaced => "replaced",
            ClosingReason::Shutdown => "shutdown",
            ClosingReason::Idle => "idle",
            ClosingReason::MaxDuration => "max_duration",
            ClosingReason::ContextFull => "context_full",
            ClosingReason::Failed => "failed",
            ClosingReason::Other => "other",
        }
    }
}

impl std::fmt::Display for ClosingReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a response took and made, in the model's tokens (`response.done`'s `usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// The prompt's positions (instructions, voice, conversation, input), those that are audio
    /// (10 a second), and those whose KV was reused from earlier turns instead of computed.
    pub input_tokens: u64,
    pub input_audio_tokens: u64,
    pub cached_tokens: u64,
    /// The reply's text tokens and its speech tokens (25 a second).
    pub output_text_tokens: u64,
    pub output_audio_tokens: u64,
}

/// Server events. `seq` is filled in by the session when the event is sent.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "type")]
pub enum ServerEvent {
    #[serde(rename = "session.created")]
    SessionCreated {
        seq: u64,
        session_id: String,
        resume_token: String,
        protocol: u32,
        mode: Mode,
        output_audio: OutputAudio,
        resume_grace_s: u64,
        limits: Limits,
        synthetic_weights: bool,
    },
    #[serde(rename = "session.resumed")]
    SessionResumed { session_id: String, input_seq: u64 },
    #[serde(rename = "response.created")]
    ResponseCreated { seq: u64, response_id: u32, trigger: Trigger },
    #[serde(rename = "response.text.delta")]
    ResponseTextDelta { seq: u64, response_id: u32, text: String },
    /// The response called a tool (sent when the call is written; the response ends after it).
    #[serde(rename = "response.tool_call")]
    ResponseToolCall {
        seq: u64,
        response_id: u32,
        call_id: String,
        name: String,
        arguments: String,
    },
    /// The response began a call that is not one: what it wrote after `<tool_call>`, and why.
    #[serde(rename = "response.tool_call.invalid")]
    ResponseToolCallInvalid {
        seq: u64,
        response_id: u32,
        text: String,
        reason: ToolCallProblem,
        message: String,
    },
    /// What the caller said in the input `response_id` answers, as the model heard it (with
    /// `input_transcription`).
    #[serde(rename = "input.transcript.delta")]
    InputTranscriptDelta { seq: u64, response_id: u32, delta: String },
    #[serde(rename = "input.transcript.done")]
    InputTranscriptDone { seq: u64, response_id: u32, transcript: String },
    #[serde(rename = "input.transcript.failed")]
    InputTranscriptFailed {
        seq: u64,
        response_id: u32,
        /// Why no transcript came; `message` says it in words.
        reason: TranscriptFailure,
        message: String,
    },
    /// The conversation outgrew its context: its `turns` oldest turns were left out of
    /// this response's prompt, and the session has let them go.
    #[serde(rename = "conversation.trimmed")]
    ConversationTrimmed { seq: u64, response_id: u32, turns: usize },
    #[serde(rename = "response.done")]
    ResponseDone {
        seq: u64,
        response_id: u32,
        status: DoneStatus,
        audio_ms: u64,
        packets: u64,
        chunks: u64,
        usage: Usage,
    },
    #[serde(rename = "duplex.listen")]
    DuplexListen { seq: u64, unit: u64 },
    #[serde(rename = "duplex.speak")]
    DuplexSpeak { seq: u64, unit: u64 },
    #[serde(rename = "ack")]
    Ack { input_seq: u64 },
    #[serde(rename = "pong")]
    Pong {
        #[serde(skip_serializing_if = "Option::is_none")]
        id: Option<Value>,
    },
    #[serde(rename = "session.closing")]
    SessionClosing {
        seq: u64,
        reason: ClosingReason,
        #[serde(skip_serializing_if = "Option::is_none")]
        retry_after_ms: Option<u64>,
    },
    #[serde(rename = "error")]
    Error {
        #[serde(skip_serializing_if = "Option::is_none")]
        seq: Option<u64>,
        code: crate::ErrorCode,
        message: String,
        fatal: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        retry_after_ms: Option<u64>,
    },
}

impl ServerEvent {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("server events serialize")
    }

    /// Connection-level events carry no seq and are never journaled.
    pub fn is_connection_level(&self) -> bool {
        matches!(
            self,
            ServerEvent::SessionResumed { .. } | ServerEvent::Ack { .. } | ServerEvent::Pong { .. }
        ) || matches!(self, ServerEvent::Error { seq: None, .. })
    }

    /// Sets the session sequence number of an event that carries one.
    pub fn with_seq(mut self, n: u64) -> Self {
        match &mut self {
            ServerEvent::SessionCreated { seq, .. }
            | ServerEvent::ResponseCreated { seq, .. }
            | ServerEvent::ResponseTextDelta { seq, .. }
            | ServerEvent::ResponseToolCall { seq, .. }
            | ServerEvent::ResponseToolCallInvalid { seq, .. }
            | ServerEvent::InputTranscriptDelta { seq, .. }
            | ServerEvent::InputTranscriptDone { seq, .. }
            | ServerEvent::InputTranscriptFailed { seq, .. }
            | ServerEvent::ConversationTrimmed { seq, .. }
            | ServerEvent::ResponseDone { seq, .. }
            | ServerEvent::DuplexListen { seq, .. }
            | ServerEvent::DuplexSpeak { seq, .. }
            | ServerEvent::SessionClosing { seq, .. } => *seq = n,
            ServerEvent::Error { seq, .. } => *seq = Some(n),
            _ => {}
        }
        self
    }

    pub fn error(e: &WireError) -> Self {
        ServerEvent::Error {
            seq: None,
            code: e.code,
            message: e.message.clone(),
            fatal: e.fatal,
            retry_after_ms: e.retry_after_ms,
        }
    }
}
