//! The dialect's input audio buffer: 24 kHz PCM16 since the last commit, and with turn detection
//! on, WebRTC's VAD ([`antiphon_audio::vad`]) over everything appended. Times are in ms of all
//! audio the session was sent (`audio_start_ms` / `audio_end_ms` count from there).
//!
//! `semantic_vad` (where the server has a turn model): a pause of [`SEMANTIC_PAUSE_MS`] is only a
//! candidate end. The buffer reports it ([`InputEvent::Paused`]) with the turn's audio so far;
//! the caller asks the model whether the turn is complete and answers
//! ([`InputBuffer::pause_decided`]). A complete turn ends at the pause; otherwise the turn goes
//! on, through more speech, until a pause the model calls complete or until the eagerness's
//! longest wait of silence ([`max_wait_ms`]).

use antiphon_audio::vad::{TurnDetector, VadConfig, VadEvent};
use antiphon_protocol::openai::{AudioFormat, OaiError, OaiErrorCode, TurnDetection};

use super::items::Pending;

pub const RATE: u64 = 24_000;
const PER_MS: u64 = RATE / 1000;
/// Audio kept before a turn, beyond the prefix padding: the detector reports a start ~90 ms
/// after it happened.
const KEEP_MS: u64 = 1000;
/// The least audio a commit takes (OpenAI's own minimum): less is refused and left in the buffer,
/// where it would have made a turn the model cannot hear.
pub const MIN_COMMIT_MS: u64 = 100;
/// With `semantic_vad`, the silence after which the turn model is asked (Smart Turn's own
/// integration asks after 200 ms).
pub const SEMANTIC_PAUSE_MS: u32 = 200;

/// What a pause's question carries of its turn at most: the 8 s the turn model hears, and half a
/// second for the resampler to settle before them.
const PAUSE_AUDIO_SAMPLES: usize = (8_500 * PER_MS) as usize;

/// With `semantic_vad`, the longest silence before a turn ends whatever the model said: OpenAI
/// documents 8 s, 4 s and 2 s for low, medium and high eagerness (auto is medium).
pub fn max_wait_ms(eagerness: Option<&str>) -> u64 {
    match eagerness {
        Some("low") => 8000,
        Some("high") => 2000,
        _ => 4000,
    }
}

/// What turn detection saw in appended audio.
#[derive(Debug, Clone, PartialEq)]
pub enum InputEvent {
    Started {
        audio_start_ms: u64,
    },
    /// A turn ended: its audio (prefix padding included).
    Stopped {
        audio_end_ms: u64,
        audio: Vec<i16>,
    },
    /// `semantic_vad`: speech paused. Is the turn complete? Its audio so far (prefix padding and
    /// the pause included, its last 8.5 s at most); the answer goes to
    /// [`InputBuffer::pause_decided`].
    Paused {
        /// The stream sample the speech paused at (names the pause to the answer).
        at: u64,
        audio: Vec<i16>,
    },
}

/// A pause the turn model was asked about, or said was not the turn's end.
#[derive(Debug, Clone, Copy)]
struct Pause {
    /// The stream sample the speech ended at, and the same in the detector's ms.
    end: u64,
    at_ms: u64,
}

struct Detection {
    detector: TurnDetector,
    settings: TurnDetection,
    /// The stream sample at the detector's time 0.
    origin: u64,
    /// The stream sample a turn in progress starts at (prefix padding included).
    speech: Option<u64>,
    /// The detector's next stop belongs to a turn already ended (committed, cleared or cut at
    /// the size limit).
    skip_stop: bool,
    /// `semantic_vad` served by the turn model (else the silence detector serves it).
    semantic: bool,
    /// The pause of the turn in progress that has not ended it (yet).
    pause: Option<Pause>,
}

pub struct InputBuffer {
    samples: Vec<i16>,
    /// The stream sample of `samples[0]`, and all samples appended so far.
    base: u64,
    total: u64,
    max: usize,
    detection: Option<Detection>,
    /// Whether `semantic_vad` has a turn model (the server's `smart_turn_model`).
    semantic_served: bool,
}

impl InputBuffer {
    /// A buffer holding at most `max_s` seconds; `semantic_served`: whether `semantic_vad` has
    /// a turn model.
    pub fn new(max_s: u64, semantic_served: bool) -> Self {
        Self {
            samples: Vec::new(),
            base: 0,
            total: 0,
            max: (max_s * RATE) as usize,
            detection: None,
            semantic_served,
        }
    }

    pub fn turn_detection(&self) -> Option<&TurnDetection> {
        self.detection.as_ref().map(|d| &d.settings)
    }

    /// Turns detection on (anew, with these settings) or off.
    pub fn set_turn_detection(&mut self, t: Option<TurnDetection>) -> anyhow::Result<()> {
        self.detection = match t {
            None => None,
            Some(settings) => {
                let semantic = settings.semantic && self.semantic_served;
                let silence_duration_ms =
                    if semantic { SEMANTIC_PAUSE_MS } else { settings.silence_duration_ms };
                let config = VadConfig { threshold: settings.threshold, silence_duration_ms };
                let detector = TurnDetector::new(RATE as u32, config)?;
                Some(Detection {
                    detector,
                    settings,
                    origin: self.total,
                    speech: None,
                    skip_stop: false,
                    semantic,
                    pause: None,
                })
            }
        };
        // a manual buffer's audio is not a detected turn's prefix: it starts over
        self.samples.clear();
        self.base = self.total;
        Ok(())
    }

    /// Appends audio. Without turn detection, audio beyond the limit is refused; with it, a turn
    /// that reaches the limit ends there.
    pub fn push(&mut self, x: &[i16]) -> Result<Vec<InputEvent>, String> {
        if self.detection.is_none() && self.samples.len() + x.len() > self.max {
            return Err(format!(
                "the input audio buffer holds at most {} s: commit or clear it",
                self.max as u64 / RATE
            ));
        }
        self.samples.extend_from_slice(x);
        self.total += x.len() as u64;
        let Some(d) = self.detection.as_mut() else { return Ok(Vec::new()) };
        let f: Vec<f32> = x.iter().map(|&s| antiphon_audio::i16_to_f32(s)).collect();
        let mut out = Vec::new();
        for e in d.detector.push(&f) {
            match e {
                // (semantic: speech again after a pause that was not the end: the turn goes on)
                VadEvent::SpeechStarted { .. } if d.pause.is_some() && d.speech.is_some() => {
                    d.pause = None
                }
                VadEvent::SpeechStarted { at_ms } => {
                    d.pause = None;
                    let at = d.origin + at_ms * PER_MS;
                    let start = at
                        .saturating_sub(d.settings.prefix_padding_ms as u64 * PER_MS)
                        .max(self.base);
                    d.speech = Some(start);
                    out.push(InputEvent::Started { audio_start_ms: start / PER_MS });
                }
                VadEvent::SpeechStopped { .. } if d.skip_stop => d.skip_stop = false,
                VadEvent::SpeechStopped { at_ms } if d.semantic => {
                    let end = (d.origin + at_ms * PER_MS).min(self.total);
                    d.pause = Some(Pause { end, at_ms });
                    let start = d.speech.unwrap_or(self.base);
                    let s = (start.saturating_sub(self.base) as usize).min(self.samples.len());
                    // (the model hears the last 8 s: a long turn's earlier audio is not copied)
                    let s = s.max(self.samples.len().saturating_sub(PAUSE_AUDIO_SAMPLES));
                    out.push(InputEvent::Paused { at: end, audio: self.samples[s..].to_vec() });
                }
                VadEvent::SpeechStopped { at_ms } => {
                    let end = (d.origin + at_ms * PER_MS).min(self.total);
                    let start = d.speech.take().unwrap_or(self.base);
                    out.push(InputEvent::Stopped {
                        audio_end_ms: end / PER_MS,
                        audio: take(&mut self.samples, &mut self.base, start, end),
                    });
                }
            }
        }
        // (semantic: a pause the model did not call the end, as long as the eagerness waits)
        if let Some(p) = d.pause.filter(|p| {
            d.detector.audio_ms() >= p.at_ms + max_wait_ms(d.settings.eagerness.as_deref())
        }) {
            d.pause = None;
            let start = d.speech.take().unwrap_or(self.base);
            out.push(InputEvent::Stopped {
                audio_end_ms: p.end / PER_MS,
                audio: take(&mut self.samples, &mut self.base, start, p.end),
            });
        }
        match d.speech {
            Some(start) if self.samples.len() > self.max => {
                // the turn is as long as a turn may be: it ends here
                d.speech = None;
                d.pause = None;
                d.skip_stop = d.detector.in_speech();
                let end = self.total;
                out.push(InputEvent::Stopped {
                    audio_end_ms: end / PER_MS,
                    audio: take(&mut self.samples, &mut self.base, start, end),
                });
            }
            Some(_) => {}
            None => {
                let keep = ((d.settings.prefix_padding_ms as u64 + KEEP_MS) * PER_MS) as usize;
                if self.samples.len() > keep {
                    let cut = self.samples.len() - keep;
                    self.samples.drain(..cut);
                    self.base += cut as u64;
                }
            }
        }
        Ok(out)
    }

    /// `semantic_vad`: the turn model's answer about the pause at stream sample `at`
    /// ([`InputEvent::Paused`]). A complete turn ends there (its audio, as
    /// [`InputEvent::Stopped`]); otherwise the turn goes on. An answer about a pause the turn has
    /// gone past (speech came again, or it was committed or cleared) changes nothing.
    pub fn pause_decided(&mut self, at: u64, complete: bool) -> Option<InputEvent> {
        let d = self.detection.as_mut()?;
        let p = d.pause.filter(|p| p.end == at && complete)?;
        d.pause = None;
        let start = d.speech.take().unwrap_or(self.base);
        Some(InputEvent::Stopped {
            audio_end_ms: p.end / PER_MS,
            audio: take(&mut self.samples, &mut self.base, start, p.end),
        })
    }

    /// `input_audio_buffer.commit`: the audio of the turn so far (with turn detection: of the
    /// turn in progress, if any). Less than [`MIN_COMMIT_MS`] is refused and changes nothing:
    /// `Err` holds the ms there are.
    pub fn commit(&mut self) -> Result<Vec<i16>, u64> {
        let start = match &self.detection {
            None => self.base,
            Some(d) => d.speech.ok_or(0u64)?,
        };
        let end = self.total;
        if end - start < MIN_COMMIT_MS * PER_MS {
            return Err((end - start) / PER_MS);
        }
        if let Some(d) = self.detection.as_mut() {
            d.speech = None;
            d.pause = None;
            d.skip_stop = d.detector.in_speech();
        }
        Ok(take(&mut self.samples, &mut self.base, start, end))
    }

    /// `input_audio_buffer.clear`: the buffered audio and any turn in progress are dropped.
    pub fn clear(&mut self) {
        self.samples.clear();
        self.base = self.total;
        if let Some(d) = self.detection.as_mut() {
            d.pause = None;
            if d.speech.take().is_some() {
                d.skip_stop = d.detector.in_speech();
            }
        }
    }
}

/// Stream samples `start..end` out of the buffer; everything before `end` is dropped.
fn take(samples: &mut Vec<i16>, base: &mut u64, start: u64, end: u64) -> Vec<i16> {
    let s = (start.saturating_sub(*base) as usize).min(samples.len());
    let e = (end.saturating_sub(*base) as usize).clamp(s, samples.len());
    let audio = samples[s..e].to_vec();
    samples.drain(..e);
    *base += e as u64;
    audio
}

/// What a response's input joins so far (text bytes, audio samples), against what one turn may
/// hold.
pub(super) struct Joined {
    text: usize,
    audio: usize,
    max_text: usize,
    max_audio: usize,
}

impl Joined {
    pub(super) fn new(max_text: usize, max_audio: usize) -> Self {
        Self { text: 0, audio: 0, max_text, max_audio }
    }

    /// Counts one more input item before it is copied; refuses it when the input would outgrow a
    /// turn.
    pub(super) fn count(&mut self, p: Option<&Pending>) -> Result<(), OaiError> {
        match p {
            Some(Pending::Text(t) | Pending::Prefix(t) | Pending::ToolResult { output: t, .. }) => {
                self.text += t.len() + 1;
                if self.text > self.max_text {
                    return Err(OaiError::param(
                        OaiErrorCode::InvalidValue,
                        "response.input",
                        format!(
                            "the input's text, its references joined, is over the {} bytes a \
                            turn may hold",
                            self.max_text
                        ),
                    ));
                }
            }
            Some(Pending::Audio(a)) => {
                self.audio += a.len();
                if self.audio > self.max_audio {
                    return Err(OaiError::new(
                        OaiErrorCode::InputAudioBufferFull,
                        format!(
                            "the input's audio, its references joined, is over the {} s a \
                            turn may hold",
                            self.max_audio / 24_000
                        ),
                    ));
                }
            }
            None => {}
        }
        Ok(())
    }
}

/// 24 kHz samples of audio in `format` (G.711 is 8 kHz: interpolated up).
pub(super) fn decode_input(
    format: AudioFormat,
    bytes: &[u8],
    param: &str,
) -> Result<Vec<i16>, OaiError> {
    match format {
        AudioFormat::Pcm24k => {
            if !bytes.len().is_multiple_of(2) {
                return Err(OaiError::param(
                    OaiErrorCode::InvalidValue,
                    param,
                    "PCM16 audio of an odd number of bytes",
                ));
            }
            Ok(bytes.chunks_exact(2).map(|b| i16::from_le_bytes([b[0], b[1]])).collect())
        }
        AudioFormat::Pcmu | AudioFormat::Pcma => {
            let narrow: Vec<i16> = bytes
                .iter()
                .map(|&b| {
                    if format == AudioFormat::Pcmu {
                        antiphon_audio::g711::ulaw_decode(b)
                    } else {
                        antiphon_audio::g711::alaw_decode(b)
                    }
                })
                .collect();
            Ok(antiphon_audio::g711::upsample_8k_to_24k(&narrow))
        }
    }
}

/// A user's text (one item, or what a response's input joins) within what one turn holds, in the
/// Thinker's tokens (`Shared::check_user_text`): refused now rather than failing the response.
pub(super) fn check_text(shared: &crate::Shared, text: &str, param: &str) -> Result<(), OaiError> {
    shared.check_user_text(text).map_err(|m| OaiError::param(OaiErrorCode::InvalidValue, param, m))
}

#[cfg(test)]
#[path = "input_tests.rs"]
mod tests;
