//! What one stage knows of another's pace, for a decision it makes for a stream the other will
//! serve: Talker picks a new turn stream's first chunk from the Talker's step time, Code2Wav's
//! step time, and how much audio the streams already speaking have buffered (written by Code2Wav
//! after each step).
//!
//! A small first chunk brings first audio sooner, and costs an extra Code2Wav step before the
//! stream's next chunk; on a busy engine it is used only when that step fits
//! (`engine.code2wav.small_first_chunk_slack`, [`first_chunk_under_load`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One code's audio (25 codes a second).
const CODE_AUDIO: Duration = Duration::from_millis(40);
/// No stream speaking (the buffer figure's "none").
const NONE: u64 = u64::MAX;

#[derive(Clone, Debug)]
pub struct StagePace {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// The Talker's recent step time and Code2Wav's, in µs (0: none measured yet).
    talker_step_us: AtomicU64,
    code2wav_step_us: AtomicU64,
    /// The least audio any speaking stream had buffered after Code2Wav's last step, in µs.
    least_buffered_us: AtomicU64,
}

impl Default for StagePace {
    fn default() -> Self {
        let inner = Inner {
            talker_step_us: AtomicU64::new(0),
            code2wav_step_us: AtomicU64::new(0),
            least_buffered_us: AtomicU64::new(NONE),
        };
        Self { inner: Arc::new(inner) }
    }
}

fn us(d: Duration) -> u64 {
    d.as_micros().min(NONE as u128 - 1) as u64
}

impl StagePace {
    /// A Talker step took `took` (kept as a moving average: a quarter of each new step).
    pub fn record_talker_step(&self, took: Duration) {
        let old = self.inner.talker_step_us.load(Ordering::Relaxed);
        let new = if old == 0 { us(took) } else { (old * 3 + us(took)) / 4 };
        self.inner.talker_step_us.store(new, Ordering::Relaxed);
    }

    /// After a Code2Wav step: its recent step time, and the least audio a speaking stream has
    /// buffered (`None`: no stream is speaking).
    pub fn record_code2wav(&self, step: Duration, least_buffered: Option<Duration>) {
        self.inner.code2wav_step_us.store(us(step), Ordering::Relaxed);
        self.inner.least_buffered_us.store(least_buffered.map_or(NONE, us), Ordering::Relaxed);
    }

    pub fn talker_step(&self) -> Duration {
        Duration::from_micros(self.inner.talker_step_us.load(Ordering::Relaxed))
    }

    pub fn code2wav_step(&self) -> Duration {
        Duration::from_micros(self.inner.code2wav_step_us.load(Ordering::Relaxed))
    }

    pub fn least_buffered(&self) -> Option<Duration> {
        let v = self.inner.least_buffered_us.load(Ordering::Relaxed);
        (v != NONE).then(|| Duration::from_micros(v))
    }

    /// [`first_chunk_under_load`] with the paces as they are now.
    pub fn first_chunk(&self, small: usize, full: usize) -> usize {
        first_chunk_under_load(
            small,
            full,
            self.talker_step(),
            self.code2wav_step(),
            self.least_buffered(),
        )
    }
}

/// The first chunk size halfway from `small` to `full` (rounded up).
pub fn halfway(small: usize, full: usize) -> usize {
    small + full.saturating_sub(small).div_ceil(2)
}

/// The first chunk of a turn stream that starts on a busy engine: `small`, halfway to `full`, or
/// `full` new codes (three sizes, so that Code2Wav meets few new shapes), the smallest of them
/// that two conditions allow:
/// - every stream already speaking can wait two more Code2Wav steps (the small chunk's own step,
///   and the one running when it comes) before its listener runs dry;
/// - the chunk's own audio lasts until its next chunk can be heard: the Talker's `full` steps,
///   then up to two Code2Wav steps.
///
/// Paces not yet measured give `full`.
pub fn first_chunk_under_load(
    small: usize,
    full: usize,
    talker_step: Duration,
    code2wav_step: Duration,
    least_buffered: Option<Duration>,
) -> usize {
    if small >= full || talker_step.is_zero() || code2wav_step.is_zero() {
        return full;
    }
    if least_buffered.is_some_and(|b| b < code2wav_step * 2) {
        return full;
    }
    let next_chunk_heard = talker_step * full as u32 + code2wav_step * 2;
    [small, halfway(small, full)]
        .into_iter()
        .find(|&n| CODE_AUDIO * n as u32 >= next_chunk_heard)
        .unwrap_or(full)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn a_first_chunk_is_as_small_as_its_own_next_chunk_allows() {
        // a quick engine: 25 Talker steps of 2 ms and two steps of 40 ms (130 ms) are covered by
        // 8 codes' 320 ms
        assert_eq!(first_chunk_under_load(8, 25, MS(2), MS(40), Some(MS(2000))), 8);
        // 25 × 6 ms + 2 × 120 ms = 390 ms: more than 8 codes (320 ms), within 17 (680 ms)
        assert_eq!(first_chunk_under_load(8, 25, MS(6), MS(120), Some(MS(2000))), 17);
        // 25 × 12 ms + 2 × 250 ms = 800 ms: more than 17 codes hold
        assert_eq!(first_chunk_under_load(8, 25, MS(12), MS(250), None), 25);
    }

    #[test]
    fn a_speaking_stream_short_of_two_steps_of_audio_keeps_first_chunks_full() {
        assert_eq!(first_chunk_under_load(8, 25, MS(2), MS(40), Some(MS(79))), 25);
        assert_eq!(first_chunk_under_load(8, 25, MS(2), MS(40), Some(MS(80))), 8);
        assert_eq!(
            first_chunk_under_load(8, 25, MS(2), MS(40), None),
            8,
            "nobody speaking: nobody to wait"
        );
    }

    #[test]
    fn unmeasured_paces_and_no_small_size_give_a_full_chunk() {
        assert_eq!(first_chunk_under_load(8, 25, Duration::ZERO, MS(40), None), 25);
        assert_eq!(first_chunk_under_load(8, 25, MS(2), Duration::ZERO, None), 25);
        assert_eq!(first_chunk_under_load(25, 25, MS(2), MS(40), None), 25);
    }

    #[test]
    fn the_shared_figures_are_what_the_stages_wrote() {
        let p = StagePace::default();
        assert_eq!(
            (p.talker_step(), p.code2wav_step(), p.least_buffered()),
            (Duration::ZERO, Duration::ZERO, None)
        );
        p.record_talker_step(MS(4));
        p.record_talker_step(MS(8));
        assert_eq!(p.talker_step(), MS(5), "a quarter of each new step");
        p.record_code2wav(MS(100), Some(MS(900)));
        assert_eq!((p.code2wav_step(), p.least_buffered()), (MS(100), Some(MS(900))));
        p.record_code2wav(MS(100), None);
        assert_eq!(p.least_buffered(), None);
        assert_eq!(
            p.first_chunk(8, 25),
            17,
            "25 × 5 ms + 2 × 100 ms = 325 ms: more than 8 codes' 320 ms"
        );
    }
}
