//! Admission by load: how many streams the engine runs at once, and what happens to the next one.
//!
//! A *stream* is what holds a place in every stage for as long as it plays: a turn-mode response
//! from the moment the Thinker takes it until its `Done`, or a duplex session for its whole life
//! (its units are due in real time). Places are bounded by the KV slots of the stages (a stream
//! beyond them would run beside the batched step and slow every stream down) and by what the GPU
//! sustains, which the engine learns online from its own playback deadlines: a chunk that reaches
//! a listener after their buffer ran dry lowers the limit below the streams running then (no new
//! stream starts until enough have ended), and a while without a late chunk raises it again, one
//! place at a time, up to the slots.
//!
//! A response that finds no place waits in a bounded queue (its own first audio grows, nobody
//! else's); beyond the queue's bound it is refused at once with [`Busy`] (the server's
//! `capacity`, with `retry_after_ms`). A new call is refused while a response waits for a place or
//! fewer than `call_headroom` places are free beyond the queued ones: the places left are for the
//! next turns of the calls already admitted. A duplex session takes its place when it opens, or is
//! refused.

use std::collections::HashSet;
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{RequestId, ThinkerMsg};
use crate::metric_labels::{AdmissionGauge, GaugeBy};

/// What holds a place.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Holder {
    /// A turn-mode response, until its `Done`.
    Response(RequestId),
    /// A duplex session (by its id), until it closes.
    Duplex(String),
}

/// The engine has no place for one more stream now; ask again after `retry_after_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy {
    pub retry_after_ms: u64,
}

impl std::fmt::Display for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the engine is at capacity; retry after {} ms", self.retry_after_ms)
    }
}

impl std::error::Error for Busy {}

/// The limits, from the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Streams at once at most (the slots).
    pub max_streams: usize,
    /// Responses waiting for a place at most.
    pub max_queued: usize,
    /// Places kept free for admitted calls' next turns: a new call needs at least this many free.
    pub call_headroom: usize,
    /// Late chunks lower the limit (else it stays at `max_streams`).
    pub adaptive: bool,
    /// With `adaptive`: while the recent responses' first audio comes later than this after they
    /// took their places (a moving mean), each one lowers the limit as a late chunk does
    /// (`engine.first_audio_target_ms`).
    pub first_audio_target: Option<Duration>,
}

/// The online limit: multiplicative decrease on a late chunk, additive increase after a quiet
/// while. Pure (the time comes in), so its rule is unit-tested.
#[derive(Debug, Clone)]
pub struct LoadLimit {
    max: usize,
    limit: usize,
    last_late: Option<Instant>,
    last_decrease: Option<Instant>,
    last_change: Option<Instant>,
}

/// After a late chunk, the limit is not lowered again for this long (the streams started before
/// it need a while to end).
const DECREASE_EVERY: Duration = Duration::from_secs(2);
/// The limit rises by one place per this long without a late chunk.
const INCREASE_EVERY: Duration = Duration::from_millis(500);

impl LoadLimit {
    pub fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            limit: max.max(1),
            last_late: None,
            last_decrease: None,
            last_change: None,
        }
    }

    pub fn get(&self) -> usize {
        self.limit
    }

    /// A chunk reached its listener after their buffer ran dry while `running` streams ran: the
    /// limit goes to 7/8 of them (at least one), at most once per [`DECREASE_EVERY`].
    pub fn late(&mut self, running: usize, now: Instant) {
        self.last_late = Some(now);
        if self.last_decrease.is_some_and(|t| now.duration_since(t) < DECREASE_EVERY) {
            return;
        }
        let to = (running.min(self.limit) * 7 / 8).max(1);
        if to < self.limit {
            self.limit = to;
            self.last_decrease = Some(now);
            self.last_change = Some(now);
        }
    }

    /// A listener's buffer is about to run dry while `running` streams run: the limit goes to them
    /// (at least one; no new stream starts), and rises again only a quiet while after the last
    /// such sign, as after a late chunk.
    pub fn tight(&mut self, running: usize, now: Instant) {
        self.last_late = Some(now);
        let to = running.max(1);
        if to < self.limit {
            self.limit = to;
            self.last_change = Some(now);
        }
    }

    /// Time passes: one place more per [`INCREASE_EVERY`] without a late chunk, up to the max.
    pub fn tick(&mut self, now: Instant) {
        if self.limit >= self.max {
            return;
        }
        let quiet_since = match (self.last_late, self.last_change) {
            (Some(a), Some(b)) => a.max(b),
            (a, b) => a.or(b).unwrap_or(now),
        };
        if now.duration_since(quiet_since) >= INCREASE_EVERY {
            self.limit += 1;
            self.last_change = Some(now);
        }
    }
}

struct State {
    limits: AdmissionLimits,
    load: LoadLimit,
    running: HashSet<Holder>,
    queued: HashSet<RequestId>,
    /// Recent stream lengths (admission to end), for `retry_after_ms`.
    mean_stream: Duration,
    /// Recent responses' first audio, from their places (a moving mean; `None` before the first).
    mean_first_audio: Option<Duration>,
    started: std::collections::HashMap<Holder, Instant>,
}

impl State {
    fn free(&self) -> usize {
        self.load.get().saturating_sub(self.running.len())
    }

    /// A guess at when a place frees up for a caller that asks again: the queue ahead of it
    /// served at the rate streams end.
    fn retry_after(&self) -> Busy {
        let per_place = self.mean_stream.as_millis() as u64 / self.load.get().max(1) as u64;
        let ms = per_place.saturating_mul(self.queued.len() as u64 + 1).clamp(250, 30_000);
        Busy { retry_after_ms: ms }
    }
}

/// A moving mean over the recent values (each new one weighs 1/8), the first value itself.
fn moving_mean(mean: Option<Duration>, value: Duration) -> Duration {
    match mean {
        Some(m) => (m * 7 + value) / 8,
        None => value,
    }
}

/// The engine's admission state, shared by the server (submit, calls) and the stages (start,
/// end, late chunks).
#[derive(Clone)]
pub struct Admission {
    state: Arc<Mutex<State>>,
    /// The Thinker waits for a place with its queue; a place freed wakes it.
    wake: Arc<Mutex<Option<SyncSender<ThinkerMsg>>>>,
    gauges: GaugeBy<AdmissionGauge>,
}

impl Admission {
    pub fn new(limits: AdmissionLimits, gauges: GaugeBy<AdmissionGauge>) -> Self {
        let state = State {
            load: LoadLimit::new(limits.max_streams),
            limits,
            running: HashSet::new(),
            queued: HashSet::new(),
            mean_stream: Duration::from_secs(4),
            mean_first_audio: None,
            started: Default::default(),
        };
        let a = Self { state: Arc::new(Mutex::new(state)), wake: Arc::default(), gauges };
        a.publish(&a.state.lock().expect("admission"));
        a
    }

    pub(crate) fn set_wake(&self, to_thinker: SyncSender<ThinkerMsg>) {
        *self.wake.lock().expect("wake") = Some(to_thinker);
    }

    /// Lets go of the Thinker's sender (the engine is stopping: the Thinker ends with its last
    /// sender).
    pub(crate) fn clear_wake(&self) {
        self.wake.lock().expect("wake").take();
    }

    pub fn limits(&self) -> AdmissionLimits {
        self.state.lock().expect("admission").limits
    }

    fn publish(&self, s: &State) {
        let g = &self.gauges;
        g.at(AdmissionGauge::Running).set(s.running.len() as i64);
        g.at(AdmissionGauge::Queued).set(s.queued.len() as i64);
        g.at(AdmissionGauge::Limit).set(s.load.get() as i64);
        g.at(AdmissionGauge::Max).set(s.limits.max_streams as i64);
        g.at(AdmissionGauge::Headroom).set(Self::headroom_of(s) as i64);
    }

    fn headroom_of(s: &State) -> usize {
        s.free().saturating_sub(s.queued.len())
    }

    /// Places free now beyond the responses waiting (what /readyz reports).
    pub fn headroom(&self) -> usize {
        Self::headroom_of(&self.state.lock().expect("admission"))
    }

    /// (running, queued, limit)
    pub fn counts(&self) -> (usize, usize, usize) {
        let s = self.state.lock().expect("admission");
        (s.running.len(), s.queued.len(), s.load.get())
    }

    /// When a caller refused now may ask again (the queue ahead served at the rate streams end).
    pub fn retry_after(&self) -> Busy {
        self.state.lock().expect("admission").retry_after()
    }

    /// Whether this duplex session holds its place (it has not closed): a stage forgets the
    /// session's stream once it does not.
    pub fn holds_duplex(&self, session: &str) -> bool {
        let s = self.state.lock().expect("admission");
        s.running.contains(&Holder::Duplex(session.to_string()))
    }

    /// A response asks for a place: queued (it starts when the Thinker finds one free), or
    /// refused when the queue is full.
    pub fn enqueue(&self, id: &RequestId) -> Result<(), Busy> {
        let mut s = self.state.lock().expect("admission");
        s.load.tick(Instant::now());
        // (the queued ones take the free places first; beyond them, `max_queued` may wait)
        if s.queued.len() >= s.free() + s.limits.max_queued {
            return Err(s.retry_after());
        }
        s.queued.insert(id.clone());
        self.publish(&s);
        Ok(())
    }

    /// Whether a new call may begin: every queued response has a free place (none waits for one)
    /// and at least `call_headroom` more are free.
    pub fn accepts_call(&self) -> Result<(), Busy> {
        let mut s = self.state.lock().expect("admission");
        s.load.tick(Instant::now());
        if s.queued.len() <= s.free() && Self::headroom_of(&s) >= s.limits.call_headroom {
            Ok(())
        } else {
            Err(s.retry_after())
        }
    }

    /// The Thinker takes a queued response if a place is free (in queue order: it asks for the
    /// oldest first).
    pub fn try_start(&self, id: &RequestId) -> bool {
        let mut s = self.state.lock().expect("admission");
        s.load.tick(Instant::now());
        if s.free() == 0 {
            return false;
        }
        s.queued.remove(id);
        let h = Holder::Response(id.clone());
        s.started.insert(h.clone(), Instant::now());
        s.running.insert(h);
        self.publish(&s);
        true
    }

    /// A duplex session takes its place for its life, or is refused (it cannot wait: its audio
    /// comes in real time).
    pub fn open_duplex(&self, session: &str) -> Result<(), Busy> {
        let mut s = self.state.lock().expect("admission");
        s.load.tick(Instant::now());
        let h = Holder::Duplex(session.to_string());
        if s.running.contains(&h) {
            return Ok(());
        }
        if Self::headroom_of(&s) == 0 {
            return Err(s.retry_after());
        }
        s.running.insert(h);
        self.publish(&s);
        Ok(())
    }

    /// A holder ended (a response's `Done`, queued or running; a duplex session's close): its
    /// place is free, and the Thinker is woken if responses wait. Idempotent.
    pub fn release(&self, h: &Holder) {
        let waiting = {
            let mut s = self.state.lock().expect("admission");
            let was_running = s.running.remove(h);
            if let Holder::Response(id) = h {
                s.queued.remove(id);
            }
            if let Some(t) = s.started.remove(h) {
                let took = t.elapsed();
                s.mean_stream = (s.mean_stream * 7 + took) / 8;
            }
            if !was_running {
                self.publish(&s);
                return;
            }
            self.publish(&s);
            !s.queued.is_empty()
        };
        if waiting {
            if let Some(w) = self.wake.lock().expect("wake").as_ref() {
                let _ = w.try_send(ThinkerMsg::Wake);
            }
        }
    }

    /// A chunk reached its listener after their buffer had run dry.
    pub fn late_chunk(&self) {
        self.adapt(LoadLimit::late);
    }

    /// A response's first audio went out: it joins the moving mean of the recent responses' first
    /// audio (from their places), and while that mean is past `first_audio_target` the engine
    /// answers too slowly for the streams it runs: the limit falls as on a late chunk. (A mean, not
    /// each reply: a reply slower than the target now and then is the tail of any load, and taking
    /// each one as a sign cut a closed loop of 16 callers on an H100 from 60.5 to 23.1
    /// audio-s/s, run 80.) Whether it did.
    pub fn first_audio(&self, id: &RequestId) -> bool {
        let mut s = self.state.lock().expect("admission");
        let (Some(target), true) = (s.limits.first_audio_target, s.limits.adaptive) else {
            return false;
        };
        let now = Instant::now();
        let Some(&start) = s.started.get(&Holder::Response(id.clone())) else { return false };
        let mean = moving_mean(s.mean_first_audio, now.saturating_duration_since(start));
        s.mean_first_audio = Some(mean);
        if mean < target {
            return false;
        }
        let running = s.running.len();
        s.load.late(running, now);
        self.publish(&s);
        true
    }

    /// A chunk waits in Code2Wav while its listener's buffer is about to run dry
    /// (`engine.admission_slack_ms`): no new stream starts for now.
    pub fn tight(&self) {
        self.adapt(LoadLimit::tight);
    }

    /// A sign of load, given the streams running now, when the limit is adaptive.
    fn adapt(&self, sign: fn(&mut LoadLimit, usize, Instant)) {
        let mut s = self.state.lock().expect("admission");
        if !s.limits.adaptive {
            return;
        }
        let running = s.running.len();
        sign(&mut s.load, running, Instant::now());
        self.publish(&s);
    }

    /// Whether responses wait for a place (the Thinker then looks again soon: the limit also rises
    /// with time).
    pub fn has_queued(&self) -> bool {
        !self.state.lock().expect("admission").queued.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(max_streams: usize, max_queued: usize, call_headroom: usize) -> Admission {
        admission_with(AdmissionLimits {
            max_streams,
            max_queued,
            call_headroom,
            adaptive: true,
            first_audio_target: None,
        })
    }

    fn admission_with(limits: AdmissionLimits) -> Admission {
        let g = crate::metric_labels::Labeled::new(
            prometheus::IntGaugeVec::new(prometheus::Opts::new("t", "t"), &["state"]).unwrap(),
        );
        Admission::new(limits, g)
    }

    /// One slow first audio moves the mean an eighth of the way; slow ones one after another
    /// bring it to them.
    #[test]
    fn one_slow_first_audio_moves_the_mean_an_eighth_of_the_way() {
        let ms = Duration::from_millis;
        assert_eq!(moving_mean(None, ms(900)), ms(900));
        assert_eq!(moving_mean(Some(ms(500)), ms(2100)), ms(700), "one slow reply: below 1 s");
        let mut m = Some(ms(500));
        for _ in 0..16 {
            m = Some(moving_mean(m, ms(2100)));
        }
        assert!(m.unwrap() > ms(1800), "slow replies one after another: the mean follows them");
    }

    /// With a first-audio target, a response whose first audio brings the recent mean (here its
    /// own: the first) at or past it lowers the limit as a late chunk does (7/8 of the streams
    /// running); in time, with the target off, or for a response that never took a place, it
    /// does not.
    #[test]
    fn a_first_audio_past_the_target_lowers_the_limit() {
        let running = |target: Option<Duration>| {
            let a = admission_with(AdmissionLimits {
                max_streams: 8,
                max_queued: 8,
                call_headroom: 0,
                adaptive: true,
                first_audio_target: target,
            });
            for k in 0..8 {
                let r = id(&format!("r{k}"));
                a.enqueue(&r).unwrap();
                assert!(a.try_start(&r));
            }
            a
        };
        let off = running(None);
        assert!(!off.first_audio(&id("r0")));
        assert_eq!(off.counts(), (8, 0, 8));
        let in_time = running(Some(Duration::from_secs(86_400)));
        assert!(!in_time.first_audio(&id("r0")));
        assert_eq!(in_time.counts(), (8, 0, 8));
        let slow = running(Some(Duration::ZERO));
        assert!(!slow.first_audio(&id("never-started")), "no place taken: no sign");
        assert!(slow.first_audio(&id("r0")));
        assert_eq!(slow.counts(), (8, 0, 7), "7/8 of the 8 running");
        slow.enqueue(&id("next")).unwrap();
        assert!(!slow.try_start(&id("next")), "the next response waits for a place");
        let mut limits = slow.limits();
        limits.adaptive = false;
        let fixed = admission_with(limits);
        fixed.enqueue(&id("a")).unwrap();
        assert!(fixed.try_start(&id("a")));
        assert!(!fixed.first_audio(&id("a")), "a fixed limit takes no signs");
    }

    fn id(s: &str) -> RequestId {
        RequestId(s.into())
    }

    #[test]
    fn responses_beyond_the_places_wait_and_beyond_the_queue_are_refused() {
        let a = admission(2, 1, 0);
        for r in ["a", "b", "c"] {
            a.enqueue(&id(r)).unwrap();
        }
        assert!(a.try_start(&id("a")) && a.try_start(&id("b")));
        assert!(!a.try_start(&id("c")), "no third place");
        let busy = a.enqueue(&id("d")).unwrap_err();
        assert!(busy.retry_after_ms >= 250);
        a.release(&Holder::Response(id("a")));
        assert!(a.try_start(&id("c")));
        assert_eq!(a.counts(), (2, 0, 2));
        // a queued response that ends (cancelled) frees its queue place
        a.enqueue(&id("e")).unwrap();
        a.release(&Holder::Response(id("e")));
        assert_eq!(a.counts(), (2, 0, 2));
    }

    #[test]
    fn calls_need_headroom_beyond_the_queue() {
        let a = admission(4, 8, 2);
        assert!(a.accepts_call().is_ok());
        for r in ["a", "b", "c"] {
            a.enqueue(&id(r)).unwrap();
            assert!(a.try_start(&id(r)));
        }
        assert!(a.accepts_call().is_err(), "one place left, two kept for admitted calls");
        a.release(&Holder::Response(id("a")));
        assert!(a.accepts_call().is_ok());
        a.enqueue(&id("q")).unwrap();
        assert!(a.accepts_call().is_err(), "one place left beyond the queued response");
        assert!(a.open_duplex("s1").is_ok(), "the place beyond the queued response");
        assert!(a.open_duplex("s2").is_err(), "none left beyond the queued response");
        assert!(a.try_start(&id("q")));
        assert!(a.open_duplex("s2").is_err(), "no place left");
        a.release(&Holder::Response(id("b")));
        assert!(a.open_duplex("s2").is_ok());
        a.release(&Holder::Duplex("s1".into()));
        assert_eq!(a.counts().0, 3);
    }

    #[test]
    fn a_late_chunk_lowers_the_limit_and_quiet_raises_it() {
        let t0 = Instant::now();
        let mut l = LoadLimit::new(64);
        l.late(64, t0);
        assert_eq!(l.get(), 56);
        // not again right away
        l.late(56, t0 + Duration::from_millis(100));
        assert_eq!(l.get(), 56);
        // late chunks keep it from rising
        l.tick(t0 + Duration::from_millis(400));
        assert_eq!(l.get(), 56);
        l.late(50, t0 + Duration::from_millis(2500));
        assert_eq!(l.get(), 43);
        let quiet = t0 + Duration::from_millis(2500);
        l.tick(quiet + Duration::from_millis(499));
        assert_eq!(l.get(), 43);
        l.tick(quiet + Duration::from_millis(500));
        assert_eq!(l.get(), 44);
        l.tick(quiet + Duration::from_millis(900));
        assert_eq!(l.get(), 44, "one place per half second");
        let mut t = quiet + Duration::from_millis(1000);
        for _ in 0..100 {
            l.tick(t);
            t += Duration::from_millis(500);
        }
        assert_eq!(l.get(), 64, "never above the max");
        l.late(1, t);
        assert_eq!(l.get(), 1, "at least one place");
    }

    /// A buffer about to run dry holds the limit at the streams running (none starts, none is
    /// cut), as often as it comes, and the limit rises only after a quiet while since the last.
    #[test]
    fn a_tight_buffer_holds_the_limit_at_the_streams_running() {
        let t0 = Instant::now();
        let ms = |m: u64| t0 + Duration::from_millis(m);
        let mut l = LoadLimit::new(64);
        l.tight(40, t0);
        assert_eq!(l.get(), 40);
        l.tight(38, ms(100));
        assert_eq!(l.get(), 38, "no decrease interval: it follows the streams running");
        l.tight(50, ms(200));
        assert_eq!(l.get(), 38, "never raised by it");
        l.tick(ms(600));
        assert_eq!(l.get(), 38, "the last sign was 400 ms ago");
        l.tick(ms(700));
        assert_eq!(l.get(), 39);
        l.tight(0, ms(800));
        assert_eq!(l.get(), 1, "at least one place");
        // and in the engine's admission: a full limit refuses the next start
        let a = admission(4, 4, 0);
        for i in 0..2 {
            a.enqueue(&id(&format!("r{i}"))).unwrap();
            assert!(a.try_start(&id(&format!("r{i}"))));
        }
        a.tight();
        a.enqueue(&id("r2")).unwrap();
        assert!(!a.try_start(&id("r2")), "held at the two running");
    }
}
