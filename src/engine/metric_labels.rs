//! The engine's metric labels as types: each labelled series takes one enum, so a value a
//! dashboard reads is spelled once, here, and a call site cannot invent another.

use std::marker::PhantomData;

use prometheus::core::Collector;
use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

/// The closed set of values one metric's label takes.
pub trait MetricLabel: Copy + 'static {
    /// Every value.
    const ALL: &'static [Self];
    /// The value as /metrics shows it.
    fn label(self) -> &'static str;
}

/// An enum of label values and its [`MetricLabel`] impl (the server's labels use it too).
#[macro_export]
macro_rules! metric_label {
    ($(#[$doc:meta])* $name:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($variant),+
        }

        impl $crate::metric_labels::MetricLabel for $name {
            const ALL: &'static [Self] = &[$(Self::$variant),+];
            fn label(self) -> &'static str {
                match self {
                    $(Self::$variant => $text),+
                }
            }
        }
    };
}

metric_label!(
    /// What a `step_seconds` sample timed (the `stage` label).
    StepKind {
        Thinker => "thinker",
        ThinkerPrefill => "thinker_prefill",
        ThinkerPrompt => "thinker_prompt",
        ThinkerHear => "thinker_hear",
        Talker => "talker",
        Code2Wav => "code2wav",
        Prepare => "prepare",
        Prefetch => "prefetch",
    }
);

metric_label!(
    /// A stage, for its batch sizes and the requests it holds.
    StageName {
        Thinker => "thinker",
        Talker => "talker",
        Code2Wav => "code2wav",
    }
);

metric_label!(
    /// What happened to a reference voice in Code2Wav (reference prefetch and its caches).
    PrefetchEvent {
        PhaseA => "phase_a",
        PhaseB => "phase_b",
        Claimed => "claimed",
        SetupHit => "setup_hit",
        CacheHit => "cache_hit",
        Inline => "inline",
        Registered => "registered",
        Evicted => "evicted",
        Retired => "retired",
        Failed => "failed",
    }
);

metric_label!(
    /// Why an idle Code2Wav step did not prefetch.
    PrefetchSkip {
        SingleIdle => "single_idle",
        Busy => "busy",
        PinCap => "pin_cap",
        SetupCap => "setup_cap",
    }
);

metric_label!(
    /// How a request ended.
    RequestOutcome {
        Completed => "completed",
        Failed => "failed",
        Cancelled => "cancelled",
    }
);

metric_label!(
    /// A milestone of a request, timed from its admission.
    Milestone {
        FirstToken => "first_token",
        FirstText => "first_text",
        Handoff => "handoff",
        FirstCode => "first_code",
        Chunk0Codes => "chunk0_codes",
        FirstChunk => "first_chunk",
        FirstAudio => "first_audio",
    }
);

metric_label!(
    /// A prompt-prefix lookup in the Thinker's prefix store.
    PrefixLookup {
        Hit => "hit",
        Miss => "miss",
    }
);

metric_label!(
    /// Where a prompt position's KV came from.
    PromptSource {
        Reused => "reused",
        Prefilled => "prefilled",
    }
);

metric_label!(
    /// Admission's gauges.
    AdmissionGauge {
        Running => "running",
        Queued => "queued",
        Limit => "limit",
        Max => "max",
        Headroom => "headroom",
    }
);

metric_label!(
    /// What admission refused.
    RefusedKind {
        Response => "response",
        Call => "call",
        Duplex => "duplex",
    }
);

metric_label!(
    /// A tool call a reply wrote.
    ToolCallOutcome {
        Valid => "valid",
        Invalid => "invalid",
        Unterminated => "unterminated",
    }
);

/// A Prometheus vector of one label, as [`Labeled`] uses it.
pub trait LabelVec: Clone + Collector + 'static {
    type Series;
    fn series(&self, value: &str) -> Self::Series;
}

impl LabelVec for HistogramVec {
    type Series = Histogram;
    fn series(&self, value: &str) -> Histogram {
        self.with_label_values(&[value])
    }
}

impl LabelVec for IntCounterVec {
    type Series = IntCounter;
    fn series(&self, value: &str) -> IntCounter {
        self.with_label_values(&[value])
    }
}

impl LabelVec for IntGaugeVec {
    type Series = IntGauge;
    fn series(&self, value: &str) -> IntGauge {
        self.with_label_values(&[value])
    }
}

/// A Prometheus vector with one label whose values are `L`.
pub struct Labeled<V, L> {
    vec: V,
    label: PhantomData<L>,
}

/// A labelled histogram, integer counter and integer gauge.
pub type HistogramBy<L> = Labeled<HistogramVec, L>;
pub type CounterBy<L> = Labeled<IntCounterVec, L>;
pub type GaugeBy<L> = Labeled<IntGaugeVec, L>;

impl<V: Clone, L> Clone for Labeled<V, L> {
    fn clone(&self) -> Self {
        Self { vec: self.vec.clone(), label: PhantomData }
    }
}

impl<V: LabelVec, L: MetricLabel> Labeled<V, L> {
    /// `vec`, each series made when first used.
    pub fn new(vec: V) -> Self {
        Self { vec, label: PhantomData }
    }

    /// `vec` with the series of every value of `L` there from the start (at 0): those a
    /// dashboard or an alert reads.
    pub fn with_every_series(vec: V) -> Self {
        for l in L::ALL {
            vec.series(l.label());
        }
        Self::new(vec)
    }

    /// The series of `l`.
    pub fn at(&self, l: L) -> V::Series {
        self.vec.series(l.label())
    }

    /// The vector, to register.
    pub fn collector(&self) -> Box<dyn Collector> {
        Box::new(self.vec.clone())
    }
}
