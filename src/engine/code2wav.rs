//! Code2Wav, the Code2Wav loop, and reference prefetch.
//!
//! Work: chunks of codes, in order per request, earliest playback deadline first, in one batch
//! per step whatever their lengths, voices and cache lengths (one flow solve). Chunk 0
//! of a request resolves its reference voice: it **claims** a prefetched cache entry, or
//! **retires** a placeholder that was never prefetched and prepares the reference **inline**; a
//! chunk 0 whose reference differs from the prefetched one prepares inline and **evicts** the
//! prefetched entry. Setup caches are reused from the setup cache when present.
//!
//! Reference prefetch: at admission Code2Wav receives a placeholder carrying the reference (never
//! for duplex requests). On its idle steps it runs one phase of preparation for a waiting
//! reference: phase A = materialize + prepare (on by default), phase B = setup (off by default). A
//! phase runs only on an idle step that follows an idle step, only while no stream is live in this
//! stage (the busy gate; an open duplex session counts as a live stream), and only while pins stay
//! below the reference cache's capacity (the pin cap). Several waiting references (a burst of new
//! callers) go through a phase together: phase A prepares them in one batch, phase B sets them up
//! in one (at most as many as the setup cache holds). A failed phase is dropped and its pin
//! released (chunk 0 then prepares inline); a cancelled request releases its pins. Chunk 0 of a
//! lone waiter is bit-identical with or without prefetch: the same deterministic computation, done
//! earlier; a burst's differs only by rounding (CAM++ sums a batch in another order than one
//! voice).

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::refcache::{RefCache, SetupCache};
use super::voices::{PreparedStore, PreparedVoice};
use super::{
    Code2WavMsg, EngineConfig, EngineEvent, EngineMetrics, RefInput, Registry, RequestId,
    StageLoop, Status,
};
use antiphon_models::code2wav::{Code2Wav, StreamState};

mod plan;
mod prefetch;
mod prepare;
mod start;

use crate::metric_labels::{PrefetchEvent, PrefetchSkip, StageName, StepKind};
use plan::{due, due_within, first_chunks_apart, horizon, other_batches, put_back};

#[derive(Debug, Clone, PartialEq)]
enum Phase {
    Queued,
    Prepared(String),
    SetUp(String),
    Failed,
}

struct Waiting {
    id: RequestId,
    /// The reference to prefetch (`None`: never prefetched, e.g. duplex).
    reference: Option<RefInput>,
    phase: Phase,
}

impl Waiting {
    fn needs_phase(&self, with_setup: bool) -> bool {
        self.reference.is_some()
            && (self.phase == Phase::Queued
                || (with_setup && matches!(self.phase, Phase::Prepared(_))))
    }
    fn pinned_key(&self) -> Option<&str> {
        match &self.phase {
            Phase::Prepared(k) | Phase::SetUp(k) => Some(k),
            _ => None,
        }
    }
}

struct Live {
    stream: StreamState,
    next_seq: usize,
    /// When the stream's first audio went out and how much audio it has delivered since:
    /// its playback deadline (the moment a listener's buffer runs dry) is their sum.
    played: Option<(Instant, Duration)>,
    /// Silence a real-time listener has heard so far (each late chunk's gap): its buffer runs
    /// dry at the playback deadline plus this.
    heard_gaps: Duration,
}

impl Live {
    fn deadline(&self) -> Option<Instant> {
        self.played.map(|(first, audio)| first + audio)
    }

    /// When a real-time listener's buffer runs dry (the deadline, after the gaps heard so far).
    fn dry_at(&self) -> Option<Instant> {
        self.deadline().map(|d| d + self.heard_gaps)
    }
}

struct ChunkWork {
    id: RequestId,
    seq: usize,
    codes: Vec<u32>,
    last: bool,
    reference: Option<RefInput>,
    /// When it reached Code2Wav.
    queued: Instant,
}

/// What an idle step did (for tests and metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdleOutcome {
    Nothing,
    Skipped(PrefetchSkip),
    /// Phase A ran for these requests' references (a burst together).
    PhaseA(Vec<RequestId>),
    /// Phase B ran for these requests' references (a burst together).
    PhaseB(Vec<RequestId>),
    /// Every reference the phase took failed.
    Failed(Vec<RequestId>),
}

pub struct Code2WavStage {
    model: Code2Wav,
    cfg: Arc<EngineConfig>,
    registry: Registry,
    metrics: EngineMetrics,
    cache: RefCache,
    setup: SetupCache,
    waiting: Vec<Waiting>,
    live: HashMap<RequestId, Live>,
    queue: VecDeque<ChunkWork>,
    prev_idle: bool,
    /// Whether the graphs of every batch size were captured (at the first setup).
    graphs_warm: bool,
    /// Recent work-step time (a moving average): how long before a playing stream's buffer runs
    /// dry its next chunk must start.
    step_estimate: Duration,
    /// Open duplex sessions (each a live duplex stream for the busy gate).
    duplex: std::collections::HashSet<String>,
    /// Registered voices' features, by reference key.
    prepared: PreparedStore,
    /// Registrations waiting for a step with no chunk due.
    prepare_jobs:
        VecDeque<(RefInput, SyncSender<Result<PreparedVoice, super::voices::PrepareRefused>>)>,
    /// Told of every late chunk (the online stream limit).
    admission: Option<super::Admission>,
    /// When the earliest chunk left for a later step is due (the loop wakes a horizon before).
    next_due: Option<Instant>,
    /// The Talker's inbox, told after each batch (`TalkerMsg::Delivered`).
    talker_wake: super::TalkerWake,
    /// Held through a step that serves only a few replies' first audio: the Thinker waits for it
    /// (`gate.rs`; Code2Wav's kernels run at the default priority, behind the Thinker's graphs).
    gate: super::gate::PrefillGate,
    /// Written after each step: its time and the least audio a speaking stream has buffered
    /// (the Talker reads them for a new stream's first chunk, `pace.rs`).
    pace: super::pace::StagePace,
}

/// A step of at most this many chunks, every one a chunk 0, holds the gate (a bigger one would
/// hold the Thinker up for long: it steps anyway after `gate::MAX_WAIT`, at every step).
const GATED_FIRST_CHUNKS: usize = 4;

/// Registrations waiting to be prepared at most (beyond, one is refused at once).
const PREPARE_QUEUE: usize = 16;
/// Registered voices' features kept at most (each ~100 KB).
const PREPARED_VOICES: usize = 1024;

impl Code2WavStage {
    pub fn new(
        model: Code2Wav,
        cfg: Arc<EngineConfig>,
        registry: Registry,
        metrics: EngineMetrics,
    ) -> Self {
        Self {
            cache: RefCache::new(cfg.prefetch.ref_cache_capacity),
            setup: SetupCache::new(cfg.prefetch.setup_cache_capacity),
            model,
            cfg,
            registry,
            metrics,
            waiting: Vec::new(),
            live: HashMap::new(),
            queue: VecDeque::new(),
            prev_idle: false,
            graphs_warm: false,
            step_estimate: Duration::ZERO,
            duplex: Default::default(),
            prepared: PreparedStore::new(PREPARED_VOICES),
            prepare_jobs: VecDeque::new(),
            admission: None,
            next_due: None,
            talker_wake: Default::default(),
            gate: super::gate::PrefillGate::new(false),
            pace: super::pace::StagePace::default(),
        }
    }

    /// The paces it shares with the Talker (it writes Code2Wav's).
    pub fn with_pace(mut self, pace: super::pace::StagePace) -> Self {
        self.pace = pace;
        self
    }

    /// The Thinker waits for a step that serves only first audio (gate.rs).
    pub fn with_gate(mut self, gate: super::gate::PrefillGate) -> Self {
        self.gate = gate;
        self
    }

    /// After each batch it ran, the Talker is told (`TalkerMsg::Delivered`): a stream held back
    /// until its audio is delivered may go on.
    pub fn with_talker_wake(mut self, talker: super::TalkerWake) -> Self {
        self.talker_wake = talker;
        self
    }

    /// Late chunks lower the engine's stream limit (admission.rs).
    pub fn with_admission(mut self, a: super::Admission) -> Self {
        self.admission = Some(a);
        self
    }

    /// Reference cache (inspection for tests and metrics).
    pub fn ref_cache(&self) -> &RefCache {
        &self.cache
    }

    pub fn setup_cache(&self) -> &SetupCache {
        &self.setup
    }

    pub fn live_streams(&self) -> usize {
        self.live.len()
    }

    fn count(&self, event: PrefetchEvent) {
        self.metrics.prefetch.at(event).inc();
    }

    /// Frees everything a request holds in this stage.
    fn abort(&mut self, id: &RequestId) {
        self.waiting.retain(|w| &w.id != id);
        self.live.remove(id);
        self.queue.retain(|c| &c.id != id);
        let gone = self.cache.release(id);
        for k in gone {
            self.setup.remove(&k);
        }
    }

    fn finish(&mut self, id: &RequestId, status: Status) {
        if let Status::Failed(why) = &status {
            tracing::warn!(request = %id, "code2wav failed: {why}");
        }
        self.registry.finish_counted(id, status, &self.metrics.requests);
        self.abort(id);
    }

    /// One work step: every chunk that is next in its request's order (up to the batch), in one
    /// batch.
    fn work(&mut self) -> bool {
        // drop work of requests that ended elsewhere
        let registry = self.registry.clone();
        let stale: Vec<RequestId> = self
            .waiting
            .iter()
            .filter(|w| !registry.is_live(&w.id))
            .map(|w| w.id.clone())
            .chain(self.live.keys().filter(|id| !registry.is_live(id)).cloned())
            .chain(self.queue.iter().filter(|c| !registry.is_live(&c.id)).map(|c| c.id.clone()))
            .collect();
        for id in stale {
            self.abort(&id);
        }
        // a duplex session that holds no place has closed (its close may have found the inbox
        // full)
        if let Some(a) = &self.admission {
            self.duplex.retain(|s| a.holds_duplex(s));
        }
        self.metrics
            .queue_depth
            .at(StageName::Code2Wav)
            .set((self.live.len() + self.waiting.len()) as i64);
        // the chunks that are next in order, earliest playback deadline first: chunk 0s (no audio
        // yet) before all, then the streams whose listeners run dry soonest
        let mut next = Vec::new();
        let mut rest = VecDeque::new();
        let mut taken = std::collections::HashSet::new();
        while let Some(c) = self.queue.pop_front() {
            let expected = self.live.get(&c.id).map(|l| l.next_seq).unwrap_or(0);
            if c.seq == expected && !taken.contains(&c.id) {
                taken.insert(c.id.clone());
                next.push(c);
            } else {
                rest.push_back(c);
            }
        }
        // (stable: equal deadlines keep their arrival order)
        let lead = self.step_estimate;
        let due_of =
            |c: &ChunkWork| due(self.live.get(&c.id).and_then(Live::deadline), c.queued, lead);
        next.sort_by_key(due_of);
        // what is due within the horizon: a chunk 0 never waits behind a long step of streams that
        // have seconds of audio buffered, and those run when their deadlines need them
        let now = Instant::now();
        // a chunk that came with more than the margin to spare and lost it waiting here: Code2Wav
        // is behind, and no new stream starts until it has caught up (admission.rs). (A chunk
        // that came with less was late from the Talker, or is a duplex unit's, made in real time.)
        if let (Some(a), Some(margin)) = (&self.admission, self.cfg.admission_slack()) {
            let behind = next.iter().any(|c| {
                self.live
                    .get(&c.id)
                    .and_then(Live::dry_at)
                    .is_some_and(|d| d >= c.queued + margin && d < now + margin)
            });
            if behind {
                a.tight();
            }
        }
        let dues: Vec<Instant> = next.iter().map(due_of).collect();
        let cut = due_within(&dues, now, horizon(self.step_estimate), self.cfg.code2wav.max_batch)
            // (a small step may run ahead: audio sent early covers a client's network jitter)
            .max(dues.len().min(self.cfg.code2wav.early_batch).min(self.cfg.code2wav.max_batch));
        let keep = next.split_off(cut);
        self.next_due = dues.get(cut).copied();
        let mut ready = next;
        for c in keep.into_iter().rev() {
            rest.push_front(c);
        }
        if self.cfg.code2wav.first_chunks_apart {
            let seqs: Vec<usize> = ready.iter().map(|c| c.seq).collect();
            let later =
                first_chunks_apart(&seqs, &dues[..ready.len()], now, horizon(self.step_estimate));
            ready = put_back(ready, &later, &mut rest);
        }
        if self.cfg.code2wav.one_batch_per_step && !self.cfg.code2wav.mixed_steps {
            let shapes: Vec<(usize, bool)> =
                ready.iter().map(|c| (c.codes.len(), c.last)).collect();
            ready = put_back(ready, &other_batches(&shapes), &mut rest);
        }
        self.queue = rest;
        if ready.is_empty() {
            return false;
        }
        self.prev_idle = false;
        let t0 = Instant::now();
        // chunk 0s: resolve the references, set up the new voices together, open the streams
        let (zeros, others): (Vec<ChunkWork>, Vec<ChunkWork>) =
            ready.into_iter().partition(|c| c.seq == 0);
        // (held until the step's audio is on the host, at its end)
        let _held =
            (others.is_empty() && zeros.len() <= GATED_FIRST_CHUNKS).then(|| self.gate.hold());
        for c in &zeros {
            self.registry.mark(&c.id, |t| t.first_chunk = Some(Instant::now()));
        }
        let mut runnable = self.start_streams(zeros);
        runnable.extend(others);
        // one batch: streams at different points of their histories, with different voices and
        // chunk lengths, last or not (the flow pads their caches and chunks to the longest); a
        // chunk the model cannot take fails alone, before it could fail the batch
        let mut group = Vec::with_capacity(runnable.len());
        for c in runnable {
            match self.model.check_chunk(&c.codes, c.last) {
                Ok(()) => group.push(c),
                Err(e) => self.finish(&c.id, Status::Failed(format!("code2wav chunk: {e:#}"))),
            }
        }
        let batch_total = group.len();
        if self.cfg.code2wav.mixed_steps {
            if !group.is_empty() {
                self.run_batch(group);
            }
        } else {
            // one batch per (chunk length, last)
            let mut groups: Vec<Vec<ChunkWork>> = Vec::new();
            for c in group {
                match groups
                    .iter_mut()
                    .find(|g| g[0].codes.len() == c.codes.len() && g[0].last == c.last)
                {
                    Some(g) => g.push(c),
                    None => groups.push(vec![c]),
                }
            }
            for g in groups {
                self.run_batch(g);
            }
        }
        let took = t0.elapsed();
        self.step_estimate =
            if self.step_estimate.is_zero() { took } else { (self.step_estimate * 3 + took) / 4 };
        let now = Instant::now();
        let least_buffered = self
            .live
            .values()
            .filter_map(Live::dry_at)
            .map(|d| d.saturating_duration_since(now))
            .min();
        self.pace.record_code2wav(self.step_estimate, least_buffered);
        self.metrics.step_seconds.at(StepKind::Code2Wav).observe(took.as_secs_f64());
        self.metrics.batch_size.at(StageName::Code2Wav).observe(batch_total as f64);
        true
    }

    /// Runs one batch of chunks (each next in its stream's order, the stream started) and emits
    /// their audio; the last ones finish their requests.
    fn run_batch(&mut self, group: Vec<ChunkWork>) {
        let tg = Instant::now();
        let mut states: Vec<(RequestId, Live)> =
            group.iter().map(|c| (c.id.clone(), self.live.remove(&c.id).expect("live"))).collect();
        let out = {
            let mut refs: Vec<&mut StreamState> =
                states.iter_mut().map(|(_, l)| &mut l.stream).collect();
            let codes: Vec<&[u32]> = group.iter().map(|c| c.codes.as_slice()).collect();
            let lasts: Vec<bool> = group.iter().map(|c| c.last).collect();
            self.model.chunk_mixed(&mut refs, &codes, &lasts)
        };
        if tracing::enabled!(tracing::Level::DEBUG) {
            let chunks: Vec<String> = group
                .iter()
                .map(|c| {
                    format!("{}#{}:{}{}", c.id, c.seq, c.codes.len(), if c.last { "L" } else { "" })
                })
                .collect();
            let ms = tg.elapsed().as_secs_f64() * 1e3;
            tracing::debug!(batch = group.len(), ms, chunks = %chunks.join(" "), "code2wav batch \
            (ms: its flow and vocoder; chunks id#seq:codes, L = last)");
        }
        let audio = match out {
            Ok(audio) => audio,
            Err(e) => {
                let msg = format!("code2wav chunk: {e:#}");
                for c in group {
                    self.finish(&c.id, Status::Failed(msg.clone()));
                }
                self.talker_wake.delivered();
                return;
            }
        };
        for ((c, (id, mut live)), a) in group.into_iter().zip(states).zip(audio) {
            live.next_seq += 1;
            let samples = match a.to_vec1::<f32>() {
                Ok(s) => s,
                Err(e) => {
                    self.finish(&id, Status::Failed(e.to_string()));
                    continue;
                }
            };
            let first = c.seq == 0;
            let audio =
                Duration::from_secs_f64(samples.len() as f64 / self.model.sample_rate() as f64);
            if let Some(dry) = live.dry_at() {
                let gap = Instant::now().saturating_duration_since(dry);
                if gap > Duration::ZERO {
                    self.metrics.playback_late.inc();
                    self.metrics.playback_late_seconds.inc_by(gap.as_secs_f64());
                    live.heard_gaps += gap;
                    if let Some(a) = &self.admission {
                        a.late_chunk();
                    }
                }
            }
            live.played = match live.played {
                Some((t, a)) => Some((t, a + audio)),
                None if audio > Duration::ZERO => Some((Instant::now(), audio)),
                None => None,
            };
            self.registry.emit(&id, EngineEvent::Audio { samples, chunk: c.seq, last: c.last });
            if first {
                if let Some(a) = &self.admission {
                    a.first_audio(&id);
                }
                if let Some(t) = self.registry.timings(&id) {
                    if let Some(ms) = t.first_audio_ms() {
                        self.metrics.first_audio_seconds.observe(ms / 1000.0);
                    }
                    for (phase, ms) in t.phases_ms() {
                        self.metrics.phase_seconds.at(phase).observe(ms / 1000.0);
                    }
                }
            }
            if c.last {
                self.finish(&id, Status::Completed);
            } else {
                self.live.insert(id, live);
            }
        }
        self.talker_wake.delivered();
    }
}

impl StageLoop for Code2WavStage {
    type Msg = Code2WavMsg;

    fn fail_all(&mut self, why: &str) {
        let mut all: Vec<RequestId> = self.waiting.iter().map(|w| w.id.clone()).collect();
        all.extend(self.live.keys().cloned());
        all.extend(self.queue.iter().map(|c| c.id.clone()));
        for id in all {
            self.finish(&id, Status::Failed(why.to_string()));
        }
    }

    fn on_message(&mut self, m: Code2WavMsg) {
        match m {
            Code2WavMsg::Placeholder { id, prefetch } => {
                let reference = if self.cfg.prefetch.enabled { prefetch } else { None };
                self.waiting.push(Waiting { id, reference, phase: Phase::Queued });
            }
            Code2WavMsg::Chunk { id, seq, codes, last, reference } => {
                self.queue.push_back(ChunkWork {
                    id,
                    seq,
                    codes,
                    last,
                    reference,
                    queued: Instant::now(),
                });
            }
            Code2WavMsg::Cancel(id) => self.abort(&id),
            Code2WavMsg::Prepare { voice, reply } => {
                if self.prepare_jobs.len() >= PREPARE_QUEUE {
                    let _ = reply.try_send(Err(super::voices::PrepareRefused::Busy {
                        waiting: PREPARE_QUEUE,
                    }));
                } else {
                    self.prepare_jobs.push_back((voice, reply));
                }
            }
            Code2WavMsg::Install(v) => match v.to_features(self.model.device()) {
                Ok(f) => self.prepared.insert(v.key, f),
                Err(e) => tracing::warn!("a saved voice's features were not taken: {e:#}"),
            },
            Code2WavMsg::Forget(key) => {
                self.prepared.remove(&key);
            }
            Code2WavMsg::DuplexOpen(s) => {
                self.duplex.insert(s);
            }
            Code2WavMsg::DuplexClose(s) => {
                self.duplex.remove(&s);
            }
        }
    }

    fn step(&mut self) -> bool {
        // (a registration's preparation only in a step with no chunk due)
        self.work() || self.prepare_one()
    }

    fn idle_wait(&self) -> Option<Duration> {
        let with_setup = self.cfg.prefetch.setup;
        let prefetch = (self.cfg.prefetch.enabled
            && self.waiting.iter().any(|w| w.needs_phase(with_setup)))
        .then_some(self.cfg.code2wav.idle_tick);
        // a chunk left for later is woken for a horizon before it is due
        let chunk = self.next_due.filter(|_| !self.queue.is_empty()).map(|d| {
            let wake = d.checked_sub(horizon(self.step_estimate)).unwrap_or(d);
            wake.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
        });
        match (prefetch, chunk) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn idle(&mut self) {
        self.idle_step();
    }
}
