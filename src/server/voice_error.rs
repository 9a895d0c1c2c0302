//! A voice request's refusal: its HTTP status, a stable code from a closed set, and a message
//! that names the limit or the field (docs/voices.md).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// The `code` of a refused voice request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VoiceErrorCode {
    /// A field or query parameter is missing or malformed.
    BadField,
    /// The request is not one the API takes (the framework's own refusal).
    BadRequest,
    /// The audio cannot make a voice (not WAV, unreadable, silent, too short).
    BadAudio,
    /// More seconds of audio than `server.max_voice_s`.
    TooLong,
    /// An upload over `server.max_voice_bytes`.
    TooLarge,
    /// `server.max_voices` voices are registered already.
    TooManyVoices,
    /// A `[[voices]]` voice cannot be deleted.
    ConfiguredVoice,
    NotFound,
    /// The engine is preparing others: try again after `Retry-After`.
    Busy,
    /// The engine has stopped or did not answer in time.
    Unavailable,
    Internal,
}

/// A refusal: its HTTP status, a stable code and a message that names the limit or the field.
#[derive(Debug)]
pub struct VoiceError {
    pub status: StatusCode,
    pub code: VoiceErrorCode,
    pub message: String,
    /// Seconds to wait before trying again (`Retry-After`), for a busy server.
    pub retry_after_s: Option<u64>,
}

impl VoiceError {
    pub(crate) fn new(
        status: StatusCode,
        code: VoiceErrorCode,
        message: impl Into<String>,
    ) -> Self {
        Self { status, code, message: message.into(), retry_after_s: None }
    }

    /// What Code2Wav's refusal means for the caller: busy is 503 with `Retry-After`, audio that
    /// cannot make a voice is 400 `bad_audio`.
    pub fn from_refusal(r: antiphon_engine::voices::PrepareRefused) -> Self {
        use antiphon_engine::voices::PrepareRefused;
        match r {
            PrepareRefused::Busy { .. } => Self {
                retry_after_s: Some(BUSY_RETRY_AFTER_S),
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    VoiceErrorCode::Busy,
                    format!("{r}: try again in {BUSY_RETRY_AFTER_S} s"),
                )
            },
            PrepareRefused::Unusable(why) => Self::new(
                StatusCode::BAD_REQUEST,
                VoiceErrorCode::BadAudio,
                format!("the audio cannot be prepared as a voice: {why}"),
            ),
        }
    }
}

/// When a busy server asks a registration to come back (a preparation takes tens of ms on a GPU).
const BUSY_RETRY_AFTER_S: u64 = 1;

impl IntoResponse for VoiceError {
    fn into_response(self) -> Response {
        let body = Json(serde_json::json!({"error": {"code": self.code, "message": self.message}}));
        match self.retry_after_s {
            Some(s) => (self.status, [(axum::http::header::RETRY_AFTER, s.to_string())], body)
                .into_response(),
            None => (self.status, body).into_response(),
        }
    }
}
