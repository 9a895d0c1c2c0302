//! The server's metrics, beside the engine's on `/metrics`. A labelled series takes a label type
//! (the engine's [`MetricLabel`]): each value a dashboard reads is spelled once, here.

use antiphon_engine::metric_labels::{CounterBy, GaugeBy, Labeled, MetricLabel};
use antiphon_protocol::openai::OaiErrorCode;
use antiphon_protocol::{DoneStatus, ErrorCode};
use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// What `antiphon_errors_total` counts (its `code` label): an error event sent with its code (v1's
/// or the OpenAI dialect's), a socket closed because its reader fell behind, an error the OpenAI
/// dialect forwarded from the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorLabel {
    Sent(ErrorCode),
    Dialect(OaiErrorCode),
    SlowReader,
    OpenAiForwarded,
}

impl MetricLabel for ErrorLabel {
    const ALL: &'static [Self] = &{
        const V1: usize = ErrorCode::ALL.len();
        let mut all = [ErrorLabel::SlowReader; V1 + OaiErrorCode::OWN.len() + 2];
        let mut i = 0;
        while i < V1 {
            all[i] = ErrorLabel::Sent(ErrorCode::ALL[i]);
            i += 1;
        }
        while i < V1 + OaiErrorCode::OWN.len() {
            all[i] = ErrorLabel::Dialect(OaiErrorCode::OWN[i - V1]);
            i += 1;
        }
        all[i] = ErrorLabel::OpenAiForwarded;
        all
    };
    fn label(self) -> &'static str {
        match self {
            ErrorLabel::Sent(code) => code.as_str(),
            ErrorLabel::Dialect(code) => code.as_str(),
            ErrorLabel::SlowReader => "slow_reader",
            ErrorLabel::OpenAiForwarded => "openai_forwarded",
        }
    }
}

impl From<ErrorCode> for ErrorLabel {
    fn from(code: ErrorCode) -> Self {
        ErrorLabel::Sent(code)
    }
}

impl From<OaiErrorCode> for ErrorLabel {
    fn from(code: OaiErrorCode) -> Self {
        ErrorLabel::Dialect(code)
    }
}

antiphon_engine::metric_label!(
    /// A response's final status (`antiphon_responses_total`'s `status` label), as
    /// `response.done` says it.
    ResponseLabel {
        Completed => "completed",
        Cancelled => "cancelled",
        Failed => "failed",
    }
);

impl From<DoneStatus> for ResponseLabel {
    fn from(s: DoneStatus) -> Self {
        match s {
            DoneStatus::Completed => ResponseLabel::Completed,
            DoneStatus::Cancelled => ResponseLabel::Cancelled,
            DoneStatus::Failed => ResponseLabel::Failed,
        }
    }
}

antiphon_engine::metric_label!(
    /// The model device's memory (`antiphon_device_memory_bytes`'s `state` label).
    DeviceMemory {
        Used => "used",
        Total => "total",
    }
);

/// Server-side metrics (the engine's are rendered beside them).
#[derive(Clone)]
pub struct ServerMetrics {
    pub registry: Registry,
    pub sessions: IntGauge,
    pub parked: IntGauge,
    pub journal_bytes: IntGauge,
    pub sessions_created: IntCounter,
    pub connections: IntCounter,
    /// WebSockets open now: from the upgrade until the socket is closed (a kicked slow reader's
    /// too, until its close is done or given up), as they count against `server.max_connections`.
    pub connections_open: IntGauge,
    pub errors: CounterBy<ErrorLabel>,
    pub responses: CounterBy<ResponseLabel>,
    pub ttfa: Histogram,
    pub resumes: IntCounter,
    /// 1 for this replica's id (the label, free-form: [`ServerMetrics::mark_replica`]), so
    /// dashboards can tell replicas apart.
    replica: IntGaugeVec,
    pub draining: IntGauge,
    /// The model device's memory (`used`, `total`): the GPU's, or on the CPU the process's resident
    /// set and the host's memory; read at each scrape.
    pub device_memory: GaugeBy<DeviceMemory>,
}

impl ServerMetrics {
    pub(crate) fn new() -> Self {
        let registry = Registry::new();
        let sessions = IntGauge::new("antiphon_sessions", "Live sessions (attached or parked)")
            .expect("metric");
        let parked = IntGauge::new("antiphon_sessions_parked", "Sessions waiting for a resume")
            .expect("metric");
        let journal_bytes =
            IntGauge::new("antiphon_journal_bytes", "Bytes held by all replay journals")
                .expect("metric");
        let sessions_created =
            IntCounter::new("antiphon_sessions_created_total", "Sessions created").expect("metric");
        let connections =
            IntCounter::new("antiphon_connections_total", "WebSocket connections accepted")
                .expect("metric");
        let connections_open = IntGauge::new(
            "antiphon_connections_open",
            "WebSockets open now (each holds a place of server.max_connections)",
        )
        .expect("metric");
        let errors = IntCounterVec::new(
            Opts::new("antiphon_errors_total", "Protocol errors sent, by code"),
            &["code"],
        )
        .expect("metric");
        let responses = IntCounterVec::new(
            Opts::new("antiphon_responses_total", "Responses by final status"),
            &["status"],
        )
        .expect("metric");
        let ttfa = Histogram::with_opts(
            HistogramOpts::new(
                "antiphon_ttfa_seconds",
                "Server-side time from a turn's input to its first audio packet",
            )
            .buckets(vec![
                0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
            ]),
        )
        .expect("metric");
        let resumes = IntCounter::new("antiphon_resumes_total", "Sessions resumed on a new socket")
            .expect("metric");
        let replica = IntGaugeVec::new(
            Opts::new("antiphon_replica_info", "This replica (its id in the label)"),
            &["replica"],
        )
        .expect("metric");
        let draining = IntGauge::new("antiphon_draining", "1 while the server drains for shutdown")
            .expect("metric");
        let device_memory = IntGaugeVec::new(
            Opts::new("antiphon_device_memory_bytes", "Memory of the model's device (used, total)"),
            &["state"],
        )
        .expect("metric");
        for c in [
            Box::new(sessions.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(resumes.clone()),
            Box::new(replica.clone()),
            Box::new(draining.clone()),
            Box::new(device_memory.clone()),
            Box::new(parked.clone()),
            Box::new(journal_bytes.clone()),
            Box::new(sessions_created.clone()),
            Box::new(connections.clone()),
            Box::new(connections_open.clone()),
            Box::new(errors.clone()),
            Box::new(responses.clone()),
            Box::new(ttfa.clone()),
        ] {
            registry.register(c).expect("unique metric");
        }
        // every error code and final status at 0 from the start (alerts read their rates)
        let errors = Labeled::with_every_series(errors);
        let responses = Labeled::with_every_series(responses);
        let device_memory = Labeled::new(device_memory);
        Self {
            registry,
            sessions,
            parked,
            journal_bytes,
            sessions_created,
            connections,
            connections_open,
            errors,
            responses,
            ttfa,
            resumes,
            replica,
            draining,
            device_memory,
        }
    }

    /// Marks this replica's id (`server.replica_id`, the configuration's: not a closed set).
    pub(crate) fn mark_replica(&self, id: &str) {
        self.replica.with_label_values(&[id]).set(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_match_the_wire() {
        for code in ErrorCode::ALL {
            assert!(ErrorLabel::ALL.contains(&ErrorLabel::Sent(code)), "{code:?}");
            assert_eq!(ErrorLabel::from(code).label(), code.as_str());
        }
        for code in OaiErrorCode::OWN {
            assert!(ErrorLabel::ALL.contains(&ErrorLabel::Dialect(code)), "{code:?}");
            assert_eq!(ErrorLabel::from(code).label(), code.as_str());
        }
        assert_eq!(ErrorLabel::ALL.len(), ErrorCode::ALL.len() + OaiErrorCode::OWN.len() + 2);
        for s in [DoneStatus::Completed, DoneStatus::Cancelled, DoneStatus::Failed] {
            assert_eq!(ResponseLabel::from(s).label(), s.as_str());
        }
        let m = ServerMetrics::new();
        let text = {
            use prometheus::Encoder;
            let mut buf = Vec::new();
            prometheus::TextEncoder::new().encode(&m.registry.gather(), &mut buf).unwrap();
            String::from_utf8(buf).unwrap()
        };
        for l in ErrorLabel::ALL {
            let series = format!("antiphon_errors_total{{code=\"{}\"}} 0", l.label());
            assert!(text.contains(&series), "{series} missing");
        }
    }
}
