//! Engine metrics in a Prometheus registry of their own (the server exposes it at /metrics).

use prometheus::{
    Counter, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry,
};

use crate::metric_labels::{
    AdmissionGauge, CounterBy, GaugeBy, HistogramBy, Labeled, Milestone, PrefetchEvent,
    PrefetchSkip, PrefixLookup, PromptSource, RefusedKind, RequestOutcome, StageName, StepKind,
    ToolCallOutcome,
};

/// Every figure the stages report.
#[derive(Clone)]
pub struct EngineMetrics {
    pub registry: Registry,
    pub step_seconds: HistogramBy<StepKind>,
    pub batch_size: HistogramBy<StageName>,
    pub queue_depth: GaugeBy<StageName>,
    pub prefetch: CounterBy<PrefetchEvent>,
    pub prefetch_skips: CounterBy<PrefetchSkip>,
    pub requests: CounterBy<RequestOutcome>,
    pub first_audio_seconds: Histogram,
    /// Where the first-audio time goes: each milestone of a request, from its admission.
    pub phase_seconds: HistogramBy<Milestone>,
    /// Thinker prompt-prefix cache lookups (`hit`, `miss`).
    pub prefix_cache: CounterBy<PrefixLookup>,
    /// Prompt positions taken from the prefix store (`reused`) or prefilled (`prefilled`).
    pub prompt_positions: CounterBy<PromptSource>,
    /// Audio chunks that went out after the listener's buffer had run dry (a real-time listener
    /// from the first audio on), and the gaps they left, in seconds.
    pub playback_late: IntCounter,
    pub playback_late_seconds: Counter,
    /// Reference voices Code2Wav prepared (S3 codes, speaker embedding, prompt mel), on any path.
    pub voice_preparations: IntCounter,
    /// Admission (admission.rs): streams `running`, responses `queued`, the online `limit`, the
    /// slots' `max`, and `headroom` (places free beyond the queue).
    pub admission: GaugeBy<AdmissionGauge>,
    /// What admission refused: a `response` (its queue was full), a `call` or a `duplex` session.
    pub admission_refused: CounterBy<RefusedKind>,
    /// Tool calls replies made: `valid`, `invalid` (not a declared tool's JSON) or `unterminated`.
    pub tool_calls: CounterBy<ToolCallOutcome>,
    /// Messages the server offered a stage whose inbox was full (`inbox.rs`), by stage: a stage a
    /// whole inbox behind, which should stay at 0.
    pub inbox_full: CounterBy<StageName>,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl EngineMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let step_seconds = HistogramVec::new(
            HistogramOpts::new(
                "antiphon_stage_step_seconds",
                "Duration of one batched step per stage",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ]),
            &["stage"],
        )
        .expect("valid metric");
        let batch_size = HistogramVec::new(
            HistogramOpts::new(
                "antiphon_stage_batch_size",
                "Streams advanced by one step per stage",
            )
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
            &["stage"],
        )
        .expect("valid metric");
        let queue_depth = IntGaugeVec::new(
            Opts::new("antiphon_stage_queue_depth", "Requests held by a stage"),
            &["stage"],
        )
        .expect("valid metric");
        let prefetch = IntCounterVec::new(
            Opts::new(
                "antiphon_prefetch_total",
                "Reference prefetch events (phase runs, chunk-0 claims, inline preparations)",
            ),
            &["event"],
        )
        .expect("valid metric");
        let prefetch_skips = IntCounterVec::new(
            Opts::new("antiphon_prefetch_skips_total", "Idle steps that did not prefetch, by gate"),
            &["reason"],
        )
        .expect("valid metric");
        let requests = IntCounterVec::new(
            Opts::new("antiphon_engine_requests_total", "Finished requests by status"),
            &["status"],
        )
        .expect("valid metric");
        let first_audio_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "antiphon_engine_first_audio_seconds",
                "Engine-side time from admission to the first audio samples",
            )
            .buckets(vec![0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0]),
        )
        .expect("valid metric");
        let phase_seconds = HistogramVec::new(
            HistogramOpts::new(
                "antiphon_engine_phase_seconds",
                "Time from admission to each milestone of a request: first_token (prompt in), \
                first_text, handoff (Thinker done), first_code, chunk0_codes (the Talker \
                sends chunk 0's codes to Code2Wav), first_chunk (Code2Wav starts chunk \
                0), first_audio",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                5.0, 10.0,
            ]),
            &["phase"],
        )
        .expect("valid metric");
        let prefix_cache = IntCounterVec::new(
            Opts::new("antiphon_prefix_cache_total", "Thinker prompt-prefix cache lookups"),
            &["event"],
        )
        .expect("valid metric");
        let prompt_positions = IntCounterVec::new(
            Opts::new(
                "antiphon_prompt_positions_total",
                "Thinker prompt positions, taken from the prefix cache (reused) or prefilled",
            ),
            &["source"],
        )
        .expect("valid metric");
        let playback_late = IntCounter::new(
            "antiphon_playback_late_total",
            "Audio chunks sent after a real-time listener's buffer ran dry (stalls)",
        )
        .expect("valid metric");
        let playback_late_seconds = Counter::new(
            "antiphon_playback_late_seconds_total",
            "Silence those late chunks left a real-time listener, in seconds",
        )
        .expect("valid metric");
        let voice_preparations = IntCounter::new(
            "antiphon_voice_preparations_total",
            "Reference voices prepared by Code2Wav (S3 codes, speaker embedding, prompt mel): \
            inline, by prefetch or at registration",
        )
        .expect("valid metric");
        let admission = IntGaugeVec::new(
            Opts::new(
                "antiphon_admission_streams",
                "Admission by load: streams running, responses queued, the online limit, the \
                slots (max), headroom",
            ),
            &["state"],
        )
        .expect("valid metric");
        let admission_refused = IntCounterVec::new(
            Opts::new(
                "antiphon_admission_refused_total",
                "Refused for want of capacity: responses (queue full), calls, duplex sessions",
            ),
            &["what"],
        )
        .expect("valid metric");
        let tool_calls = IntCounterVec::new(
            Opts::new(
                "antiphon_tool_calls_total",
                "Tool calls replies wrote: valid, invalid (not \
                a declared tool's JSON), unterminated",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        let inbox_full = IntCounterVec::new(
            Opts::new(
                "antiphon_engine_inbox_full_total",
                "Messages offered to a stage whose inbox was full (a response refused, a duplex \
                unit handed back, a cancel left to the stage's sweep)",
            ),
            &["stage"],
        )
        .expect("valid metric");
        let step_seconds = Labeled::new(step_seconds);
        let batch_size = Labeled::new(batch_size);
        let queue_depth = Labeled::new(queue_depth);
        let prefetch = Labeled::new(prefetch);
        let prefetch_skips = Labeled::new(prefetch_skips);
        let phase_seconds = Labeled::new(phase_seconds);
        let admission = Labeled::new(admission);
        // every series a dashboard or an alert reads is there from the start, at 0
        let requests = Labeled::with_every_series(requests);
        let prefix_cache = Labeled::with_every_series(prefix_cache);
        let prompt_positions = Labeled::with_every_series(prompt_positions);
        let admission_refused = Labeled::with_every_series(admission_refused);
        let tool_calls = Labeled::with_every_series(tool_calls);
        let inbox_full = Labeled::with_every_series(inbox_full);
        for c in [
            inbox_full.collector(),
            tool_calls.collector(),
            step_seconds.collector(),
            admission.collector(),
            admission_refused.collector(),
            Box::new(voice_preparations.clone()),
            Box::new(playback_late.clone()),
            Box::new(playback_late_seconds.clone()),
            batch_size.collector(),
            queue_depth.collector(),
            prefetch.collector(),
            prefetch_skips.collector(),
            requests.collector(),
            Box::new(first_audio_seconds.clone()),
            phase_seconds.collector(),
            prefix_cache.collector(),
            prompt_positions.collector(),
        ] {
            registry.register(c).expect("unique metric");
        }
        Self {
            registry,
            step_seconds,
            batch_size,
            queue_depth,
            prefetch,
            prefetch_skips,
            requests,
            first_audio_seconds,
            phase_seconds,
            prefix_cache,
            prompt_positions,
            playback_late,
            playback_late_seconds,
            voice_preparations,
            admission,
            admission_refused,
            tool_calls,
            inbox_full,
        }
    }

    /// Steps of one kind run so far.
    pub fn step_count(&self, kind: StepKind) -> u64 {
        self.step_seconds.at(kind).get_sample_count()
    }

    pub fn prefetch_count(&self, event: PrefetchEvent) -> u64 {
        self.prefetch.at(event).get()
    }

    pub fn skip_count(&self, reason: PrefetchSkip) -> u64 {
        self.prefetch_skips.at(reason).get()
    }

    /// The registry in Prometheus text format.
    pub fn render(&self) -> String {
        use prometheus::Encoder;
        let mut buf = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding");
        String::from_utf8(buf).expect("utf-8")
    }
}
