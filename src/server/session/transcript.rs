//! Transcripts of what the caller said. With `input_transcription`, a spoken turn's audio is
//! written down by the Thinker itself (an engine request of `Task::Transcribe` over the same
//! clip), asked for once the reply's first audio is out, or when the reply ends without any, so
//! it never delays the reply's first audio; its deltas and its end go out as `input.transcript.*`
//! naming the response that answered the turn.

use antiphon_engine::{GenerationParams, SpokenClip, Task};
use antiphon_protocol::TranscriptFailure;

use super::*;

/// The longest transcript, in the Thinker's tokens (a turn holds at most a minute of speech).
const TRANSCRIPT_MAX_TOKENS: usize = 256;

/// A transcript's tokens at most for a clip of `samples` at 16 kHz: 16, and 8 a second of audio
/// (fast speech is about four; more is a runaway, which would only take Thinker steps from the
/// replies: at C8 on an H200, transcripts capped at 256 tokens alone doubled first audio,
/// docs/performance.md), within [`TRANSCRIPT_MAX_TOKENS`].
pub(super) fn transcript_tokens(samples: usize) -> usize {
    (16 + samples.div_ceil(16_000) * 8).min(TRANSCRIPT_MAX_TOKENS)
}

impl Session {
    /// Asks for the transcript of `clip`, the turn response `rid` answers.
    pub(super) fn transcribe(&mut self, rid: u32, clip: SpokenClip) {
        let id = RequestId::transcript(&self.id, rid);
        let limit = self
            .shared
            .engine
            .generation_limits()
            .max_text_tokens
            .min(transcript_tokens(clip.samples().len()));
        let spec = RequestSpec {
            id: id.clone(),
            mode: Mode::Turn,
            input: UserInput::Audio(clip),
            instructions: None,
            history: Vec::new(),
            voice: self.voice.clone(),
            // (greedy: a transcript is the likeliest reading, not a sample)
            generation: GenerationParams {
                max_text_tokens: Some(limit),
                temperature: Some(0.0),
                seed: Some(0),
                ..Default::default()
            },
            tools: Default::default(),
            text_only: true,
            task: Task::Transcribe,
        };
        let me = self.me.clone().expect("started");
        let sink = Arc::new(move |event: EngineEvent| {
            let _ = me.send(SessionMsg::Transcript { response_id: rid, event });
        });
        match self.shared.engine.submit(spec, sink) {
            Ok(()) => self.transcripts.push(id),
            Err(e) => {
                let reason = match e {
                    antiphon_engine::SubmitError::Busy(_) => TranscriptFailure::Capacity,
                    _ => TranscriptFailure::Failed,
                };
                self.send_event(ServerEvent::InputTranscriptFailed {
                    seq: 0,
                    response_id: rid,
                    reason,
                    message: e.to_string(),
                });
            }
        }
    }

    /// The transcript request's events, as the client's.
    pub(super) fn on_transcript(&mut self, response_id: u32, event: EngineEvent) {
        match event {
            EngineEvent::TextDelta(delta) => {
                self.send_event(ServerEvent::InputTranscriptDelta { seq: 0, response_id, delta })
            }
            EngineEvent::Done { status, text, .. } => {
                let id = RequestId::transcript(&self.id, response_id);
                self.transcripts.retain(|t| *t != id);
                let failed = |reason, message| ServerEvent::InputTranscriptFailed {
                    seq: 0,
                    response_id,
                    reason,
                    message,
                };
                let e = match status {
                    Status::Completed => {
                        ServerEvent::InputTranscriptDone { seq: 0, response_id, transcript: text }
                    }
                    Status::Cancelled => failed(
                        TranscriptFailure::Cancelled,
                        "the response was cancelled first".into(),
                    ),
                    Status::Failed(why) | Status::Refused(why) => {
                        failed(TranscriptFailure::Failed, why)
                    }
                    Status::Busy(_) => {
                        failed(TranscriptFailure::Capacity, "the server is at capacity".into())
                    }
                };
                self.send_event(e);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_transcript_is_bounded_by_its_audio() {
        assert_eq!(super::transcript_tokens(0), 16);
        assert_eq!(super::transcript_tokens(16_000 * 2), 32, "2 s: 16 + 2 × 8");
        assert_eq!(super::transcript_tokens(16_000 * 2 + 1), 40, "a started second counts");
        assert_eq!(
            super::transcript_tokens(16_000 * 60),
            super::TRANSCRIPT_MAX_TOKENS,
            "a minute: the cap"
        );
    }
}
