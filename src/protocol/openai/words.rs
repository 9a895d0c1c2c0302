//! The dialect's closed sets of words as types: an error's `code`, an item's and a response's
//! `status`, why a response was cancelled. Every layer matches on these, never on strings; each
//! is written as the word OpenAI's API uses.

use serde::{Serialize, Serializer};

use crate::ErrorCode;

/// An `error`'s `code` (and a failed response's `status_details.error.code`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OaiErrorCode {
    InvalidJson,
    InvalidEvent,
    InvalidValue,
    MissingRequiredParameter,
    InputAudioBufferFull,
    InputAudioBufferCommitEmpty,
    ConversationAlreadyHasActiveResponse,
    ResponseCancelNotActive,
    ItemTruncateInvalidItemId,
    ItemRetrieveInvalidItemId,
    ItemDeleteInvalidItemId,
    MessageTooLarge,
    SessionClosing,
    /// The server had no place for the response (with the wait it suggests).
    Capacity,
    /// The response failed for a reason of the server's.
    ResponseFailed,
    ServerError,
    /// A v1 error the session reported, named by its v1 code.
    V1(ErrorCode),
}

impl OaiErrorCode {
    /// The dialect's own codes (every one but [`OaiErrorCode::V1`]).
    pub const OWN: [OaiErrorCode; 16] = [
        OaiErrorCode::InvalidJson,
        OaiErrorCode::InvalidEvent,
        OaiErrorCode::InvalidValue,
        OaiErrorCode::MissingRequiredParameter,
        OaiErrorCode::InputAudioBufferFull,
        OaiErrorCode::InputAudioBufferCommitEmpty,
        OaiErrorCode::ConversationAlreadyHasActiveResponse,
        OaiErrorCode::ResponseCancelNotActive,
        OaiErrorCode::ItemTruncateInvalidItemId,
        OaiErrorCode::ItemRetrieveInvalidItemId,
        OaiErrorCode::ItemDeleteInvalidItemId,
        OaiErrorCode::MessageTooLarge,
        OaiErrorCode::SessionClosing,
        OaiErrorCode::Capacity,
        OaiErrorCode::ResponseFailed,
        OaiErrorCode::ServerError,
    ];

    /// A v1 session's failure as the dialect names it: `capacity` stays `capacity` (the caller
    /// retries after the wait it is given), any other code is `otherwise`.
    pub fn from_v1_failure(code: ErrorCode, otherwise: OaiErrorCode) -> OaiErrorCode {
        if code == ErrorCode::Capacity {
            OaiErrorCode::Capacity
        } else {
            otherwise
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OaiErrorCode::InvalidJson => "invalid_json",
            OaiErrorCode::InvalidEvent => "invalid_event",
            OaiErrorCode::InvalidValue => "invalid_value",
            OaiErrorCode::MissingRequiredParameter => "missing_required_parameter",
            OaiErrorCode::InputAudioBufferFull => "input_audio_buffer_full",
            OaiErrorCode::InputAudioBufferCommitEmpty => "input_audio_buffer_commit_empty",
            OaiErrorCode::ConversationAlreadyHasActiveResponse => {
                "conversation_already_has_active_response"
            }
            OaiErrorCode::ResponseCancelNotActive => "response_cancel_not_active",
            OaiErrorCode::ItemTruncateInvalidItemId => "item_truncate_invalid_item_id",
            OaiErrorCode::ItemRetrieveInvalidItemId => "item_retrieve_invalid_item_id",
            OaiErrorCode::ItemDeleteInvalidItemId => "item_delete_invalid_item_id",
            OaiErrorCode::MessageTooLarge => "message_too_large",
            OaiErrorCode::SessionClosing => "session_closing",
            OaiErrorCode::Capacity => "capacity",
            OaiErrorCode::ResponseFailed => "response_failed",
            OaiErrorCode::ServerError => "server_error",
            // (a newer session's code this server does not know is a server error)
            OaiErrorCode::V1(ErrorCode::Other) => "server_error",
            OaiErrorCode::V1(c) => c.as_str(),
        }
    }
}

impl Serialize for OaiErrorCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// An item's `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemStatus {
    InProgress,
    Completed,
    /// A reply cut short (cancelled or failed).
    Incomplete,
}

/// A response's `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ResponseStatus {
    InProgress,
    Completed,
    Cancelled,
    Failed,
}

/// Why a response was cancelled (`status_details.reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CancelReason {
    /// `response.cancel`, or the client's v1 cancel.
    ClientCancelled,
    /// The caller started speaking over it (server VAD).
    TurnDetected,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_words_are_openais() {
        assert_eq!(
            serde_json::to_value(OaiErrorCode::InputAudioBufferCommitEmpty).unwrap(),
            "input_audio_buffer_commit_empty"
        );
        assert_eq!(
            serde_json::to_value(OaiErrorCode::V1(ErrorCode::BadAudio)).unwrap(),
            "bad_audio"
        );
        assert_eq!(
            serde_json::to_value(OaiErrorCode::V1(ErrorCode::Other)).unwrap(),
            "server_error"
        );
        assert_eq!(serde_json::to_value(ItemStatus::InProgress).unwrap(), "in_progress");
        assert_eq!(serde_json::to_value(ResponseStatus::Cancelled).unwrap(), "cancelled");
        assert_eq!(serde_json::to_value(CancelReason::TurnDetected).unwrap(), "turn_detected");
    }
}
