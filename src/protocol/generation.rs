//! A response's `generation`: what the client may ask of a reply (lengths, sampling, a given
//! beginning, tool choice, text only), checked against what the models hold before a response
//! starts; and the bounds of `instructions`.

use serde::{Deserialize, Serialize};

use crate::{ErrorCode, ToolChoice, WireError};

#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
pub struct Generation {
    pub max_text_tokens: Option<usize>,
    pub min_text_tokens: Option<usize>,
    pub max_audio_tokens: Option<usize>,
    pub min_audio_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub seed: Option<u64>,
    /// The reply begins with this text; the model continues from it (at most
    /// [`MAX_PREFIX_CHARS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// Which of the session's tools the reply may call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// The reply is written, not spoken: text only, no audio.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_only: Option<bool>,
    /// `false`: the turn (its input and its reply) is not kept in the conversation; later
    /// prompts do not hear it (an out-of-band response).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remember: Option<bool>,
}

/// The longest `generation.prefix`, in characters.
pub const MAX_PREFIX_CHARS: usize = 2048;

/// The most a `generation` may ask for: what the models' contexts hold (the server fills it in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenerationLimits {
    pub max_text_tokens: usize,
    pub max_audio_tokens: usize,
}

/// The longest `instructions` (system prompt) accepted, in characters: well inside the Thinker's
/// context beside a reply and the conversation.
pub const MAX_INSTRUCTIONS_CHARS: usize = 8192;

/// `instructions` within [`MAX_INSTRUCTIONS_CHARS`] (`bad_field` naming the field and the limit).
pub fn validate_instructions(i: Option<&str>) -> Result<(), WireError> {
    match i.map(|i| i.chars().count()) {
        Some(n) if n > MAX_INSTRUCTIONS_CHARS => Err(WireError::new(
            ErrorCode::BadField,
            format!(
                "field `instructions`: {n} characters, more than this server takes (at most \
                {MAX_INSTRUCTIONS_CHARS})"
            ),
        )),
        _ => Ok(()),
    }
}

/// The highest sampling temperature accepted.
pub const MAX_TEMPERATURE: f32 = 2.0;

impl Generation {
    /// Every field within what the server can hold: counts within `limits`, each minimum at most
    /// its maximum, a finite temperature in 0..=[`MAX_TEMPERATURE`]. The error names the field
    /// and the limit (`bad_field`).
    pub fn validate(&self, limits: &GenerationLimits) -> Result<(), WireError> {
        let bad = |m: String| Err(WireError::new(ErrorCode::BadField, m));
        let counts = [
            ("max_text_tokens", self.max_text_tokens, limits.max_text_tokens),
            ("min_text_tokens", self.min_text_tokens, limits.max_text_tokens),
            ("max_audio_tokens", self.max_audio_tokens, limits.max_audio_tokens),
            ("min_audio_tokens", self.min_audio_tokens, limits.max_audio_tokens),
        ];
        for (name, v, limit) in counts {
            if let Some(v) = v.filter(|&v| v > limit) {
                return bad(format!(
                    "field `generation.{name}`: {v} is more than this server holds \
                    (at most {limit})"
                ));
            }
        }
        for (what, min, max) in [
            ("text", self.min_text_tokens, self.max_text_tokens),
            ("audio", self.min_audio_tokens, self.max_audio_tokens),
        ] {
            if let (Some(lo), Some(hi)) = (min, max) {
                if lo > hi {
                    return bad(format!(
                        "field `generation.min_{what}_tokens`: {lo} is more than \
                        `max_{what}_tokens` ({hi})"
                    ));
                }
            }
        }
        if let Some(t) =
            self.temperature.filter(|t| !(t.is_finite() && (0.0..=MAX_TEMPERATURE).contains(t)))
        {
            return bad(format!(
                "field `generation.temperature`: {t} is not in 0..={MAX_TEMPERATURE}"
            ));
        }
        if let Some(n) =
            self.prefix.as_ref().map(|p| p.chars().count()).filter(|&n| n > MAX_PREFIX_CHARS)
        {
            return bad(format!(
                "field `generation.prefix`: {n} characters, more than this server \
                takes (at most {MAX_PREFIX_CHARS})"
            ));
        }
        Ok(())
    }
}
