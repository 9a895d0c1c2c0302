//! The Thinker gives way to the steps that make a reply's first audio.
//!
//! On one GPU with `stage_priorities`, the Thinker's and the Talker's decode steps are CUDA graphs
//! whose kernels run at the highest stream priority; every other kernel (a step run op by op, and
//! Code2Wav's) runs at the default one. The block scheduler takes the high-priority blocks first,
//! and a decoding Thinker keeps them coming, so a Talker prefill (a reply's condition, a text
//! chunk's window), which runs op by op, made no progress until the Thinker stopped: on an H200 the
//! first code of a chunked reply came when its text ended (hand-off 91 ms, first code 245 ms, at
//! C1), whatever the chunk. A chunk 0 in Code2Wav waits the same way, and the Talker's own decode
//! graphs, beside the Thinker's at the same priority, took ~12 ms a step instead of ~1.
//!
//! The gate: a stage holds it while such a step is on the GPU (from its launch until its results
//! are on the host), and the Thinker launches no step while it is held, up to [`MAX_WAIT`] (so a
//! busy stage never stops the Thinker for long). Held by a Talker step that makes some reply's
//! first chunk of codes (a prefill, whatever the step's size; a decode step of a few streams), by a
//! Talker step of a few streams with a prefill in it (a text chunk's window), and by a Code2Wav
//! step of a few chunk 0s and nothing else; "a few" is `engine.gated_streams` (4): a Talker step
//! that small holds it while a stream makes its first chunk's codes or prefills (a prefill for a
//! first chunk holds it whatever the step's size), and a Thinker step that small sends a reply's
//! first text chunk with it. Later chunks have audio buffered to wait
//! on, and under load the Thinker keeps its priority. Off on a CPU.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest the Thinker waits for the gate before it steps anyway.
pub const MAX_WAIT: Duration = Duration::from_millis(30);

#[derive(Clone)]
pub struct PrefillGate {
    /// Talker steps holding the gate; `None`: the gate is off (the CPU, or no stream priorities).
    held: Option<Arc<AtomicUsize>>,
}

/// The gate held until this is dropped.
#[must_use = "the gate is open again once this drops"]
pub struct Held(Option<Arc<AtomicUsize>>);

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl PrefillGate {
    pub fn new(on: bool) -> Self {
        Self { held: on.then(|| Arc::new(AtomicUsize::new(0))) }
    }

    /// Holds the gate (a no-op when it is off).
    pub fn hold(&self) -> Held {
        Held(self.held.as_ref().map(|h| {
            h.fetch_add(1, Ordering::AcqRel);
            h.clone()
        }))
    }

    pub fn is_held(&self) -> bool {
        self.held.as_ref().is_some_and(|h| h.load(Ordering::Acquire) > 0)
    }

    /// Waits while the gate is held, at most `max`; how long it waited.
    pub fn wait_open(&self, max: Duration) -> Duration {
        let t0 = Instant::now();
        while self.is_held() && t0.elapsed() < max {
            std::thread::sleep(Duration::from_micros(50));
        }
        t0.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_gate_opens_when_its_holder_drops_and_waits_are_bounded() {
        let gate = PrefillGate::new(true);
        assert!(!gate.is_held());
        let a = gate.hold();
        let b = gate.hold();
        assert!(gate.is_held());
        drop(a);
        assert!(gate.is_held(), "one holder left");
        assert!(
            gate.wait_open(Duration::from_millis(5)) >= Duration::from_millis(5),
            "held: the wait runs to its bound"
        );
        drop(b);
        assert!(!gate.is_held());
        let off = PrefillGate::new(false);
        let _h = off.hold();
        assert!(!off.is_held(), "an off gate is never held");
    }
}
