//! Server-side turn detection: WebRTC's voice-activity detector (libfvad, through the
//! `webrtc-vad` crate) decides speech or not for each 10 ms frame; [`TurnDetector`] turns those
//! decisions into speech edges with the OpenAI Realtime `server_vad` knobs (threshold, silence
//! duration). Times are in milliseconds of input audio since the detector was made, so they do
//! not depend on when the audio arrived.

use anyhow::{bail, Result};
use webrtc_vad::{SampleRate, Vad, VadMode};

/// Speech starts once a run of voiced frames is longer than libfvad's short-burst hangover by
/// this many frames (so a click and its hangover never open a turn); the edge is the run's first
/// frame.
const START_FRAMES: u64 = 3;
const FRAME_MS: u64 = 10;

/// The `server_vad` knobs a session may set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VadConfig {
    /// 0.0–1.0: how sure the detector must be (below 0.75 libfvad's aggressive mode, from 0.75
    /// its very aggressive one).
    pub threshold: f32,
    /// Silence that ends a turn.
    pub silence_duration_ms: u32,
}

impl Default for VadConfig {
    fn default() -> Self {
        Self { threshold: 0.5, silence_duration_ms: 500 }
    }
}

/// A speech edge, in ms of input audio since the start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VadEvent {
    /// Speech began at `at_ms` (the first voiced frame).
    SpeechStarted { at_ms: u64 },
    /// Speech ended at `at_ms` (the end of the last voiced frame); reported once the configured
    /// silence has followed it.
    SpeechStopped { at_ms: u64 },
}

/// libfvad's state is plain heap memory owned by this value alone, so moving it to another thread
/// is sound; the crate's wrapper holds a raw pointer and so is not `Send` by itself.
struct SendVad(Vad);
// SAFETY: the `Vad` owns its libfvad instance exclusively (no shared or thread-local state), and it
// is only ever used through `&mut self`.
unsafe impl Send for SendVad {}
// SAFETY: nothing reaches the `Vad` through a shared reference (`TurnDetector` uses it only
// through `&mut self`), so sharing `&SendVad` between threads shares nothing.
unsafe impl Sync for SendVad {}

/// Speech edges from a stream of mono samples, pushed in pieces of any size.
pub struct TurnDetector {
    vad: SendVad,
    config: VadConfig,
    /// Input rate and the rate libfvad runs at (24 kHz input is interpolated to 48 kHz).
    rate: u32,
    vad_rate: u32,
    frame: Vec<i16>,
    frame_len: usize,
    /// The previous input sample (for the 2× interpolation).
    last: Option<f32>,
    frames: u64,
    in_speech: bool,
    /// End of the last voiced frame while in speech (ms), and how many voiced frames in a row
    /// led up to it.
    last_voiced_end: u64,
    voiced_run: u64,
    /// libfvad's hangover after a burst of speech and after a short one, in frames (see
    /// [`HANGOVER_FRAMES`]).
    hangover: u64,
    short_hangover: u64,
}

/// The threshold picks one of libfvad's two aggressive modes. Its permissive modes (quality,
/// low bitrate) take the first 150 ms of a stream of faint noise for speech while their noise
/// model settles (tested), which would open a turn at every session's start.
fn mode_for(threshold: f32) -> VadMode {
    if threshold < 0.75 {
        VadMode::Aggressive
    } else {
        VadMode::VeryAggressive
    }
}

/// After a burst of more than 6 speech frames libfvad keeps answering "voiced" for a fixed number
/// of 10 ms frames (`kOverHangMax2AGG` / `kOverHangMax2VAG` in its `vad_core.c`: 9 in both
/// aggressive modes), after a shorter burst for fewer (`kOverHangMax1*`: 6). The end of speech is
/// that many frames before the end of the last voiced one.
const HANGOVER_FRAMES: u64 = 9;
const SHORT_HANGOVER_FRAMES: u64 = 6;

impl TurnDetector {
    /// A detector for mono input at `rate` (8, 16, 24, 32 or 48 kHz).
    pub fn new(rate: u32, config: VadConfig) -> Result<Self> {
        if !(0.0..=1.0).contains(&config.threshold) {
            bail!("threshold {} is outside 0.0–1.0", config.threshold);
        }
        let (vad_rate, sr) = match rate {
            8000 => (8000, SampleRate::Rate8kHz),
            16000 => (16000, SampleRate::Rate16kHz),
            24000 | 48000 => (48000, SampleRate::Rate48kHz),
            32000 => (32000, SampleRate::Rate32kHz),
            r => bail!("voice activity detection at {r} Hz (8, 16, 24, 32 or 48 kHz)"),
        };
        let frame_len = (vad_rate as u64 * FRAME_MS / 1000) as usize;
        Ok(Self {
            vad: SendVad(Vad::new_with_rate_and_mode(sr, mode_for(config.threshold))),
            config,
            rate,
            vad_rate,
            frame: Vec::with_capacity(frame_len),
            frame_len,
            last: None,
            frames: 0,
            in_speech: false,
            last_voiced_end: 0,
            voiced_run: 0,
            hangover: HANGOVER_FRAMES,
            short_hangover: SHORT_HANGOVER_FRAMES,
        })
    }

    pub fn config(&self) -> VadConfig {
        self.config
    }

    pub fn in_speech(&self) -> bool {
        self.in_speech
    }

    /// Input audio seen so far, in ms (whole 10 ms frames).
    pub fn audio_ms(&self) -> u64 {
        self.frames * FRAME_MS
    }

    /// Feeds samples in [-1, 1]; returns the edges they complete, in order.
    pub fn push(&mut self, x: &[f32]) -> Vec<VadEvent> {
        let mut events = Vec::new();
        for &s in x {
            if self.rate == 24000 && self.vad_rate == 48000 {
                // 2× by linear interpolation: libfvad band-limits 48 kHz to 8 kHz itself, so the
                // images above 12 kHz never reach its filter bank
                let mid = self.last.map_or(s, |p| 0.5 * (p + s));
                self.sample(mid, &mut events);
                self.sample(s, &mut events);
                self.last = Some(s);
            } else {
                self.sample(s, &mut events);
            }
        }
        events
    }

    fn sample(&mut self, s: f32, events: &mut Vec<VadEvent>) {
        self.frame.push(crate::f32_to_i16(s));
        if self.frame.len() == self.frame_len {
            // (a frame of 10 ms at a supported rate: libfvad cannot refuse it)
            let voiced = self.vad.0.is_voice_segment(&self.frame).unwrap_or(false);
            self.frame.clear();
            self.decide(voiced, events);
        }
    }

    fn decide(&mut self, voiced: bool, events: &mut Vec<VadEvent>) {
        let k = self.frames;
        self.frames += 1;
        if !self.in_speech {
            self.voiced_run = if voiced { self.voiced_run + 1 } else { 0 };
            if self.voiced_run >= self.short_hangover + START_FRAMES {
                self.in_speech = true;
                self.last_voiced_end = (k + 1) * FRAME_MS;
                events
                    .push(VadEvent::SpeechStarted { at_ms: (k + 1 - self.voiced_run) * FRAME_MS });
            }
            return;
        }
        let end = (k + 1) * FRAME_MS;
        if voiced {
            // (a voiced frame after a pause starts a new run)
            if self.last_voiced_end != k * FRAME_MS {
                self.voiced_run = 0;
            }
            self.last_voiced_end = end;
            self.voiced_run += 1;
            return;
        }
        // the speech itself ended before libfvad's hangover (never before the run began)
        let held = self.hangover.min(self.voiced_run.saturating_sub(1)) * FRAME_MS;
        let speech_end = self.last_voiced_end - held;
        if end - speech_end >= self.config.silence_duration_ms as u64 {
            self.in_speech = false;
            self.voiced_run = 0;
            events.push(VadEvent::SpeechStopped { at_ms: speech_end });
        }
    }
}

#[cfg(test)]
#[path = "vad_tests.rs"]
mod tests;
