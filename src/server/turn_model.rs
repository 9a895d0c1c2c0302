//! The turn model behind the dialect's `semantic_vad`: Smart Turn v3 (`server.smart_turn_model`)
//! asked, at a pause in a caller's speech, whether their turn is complete
//! ([`crate::openai`]'s input buffer says when). It runs on the blocking pool, at most
//! `server.smart_turn_workers` at once: a pause that finds them busy waits for one.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use antiphon_engine::metric_labels::{CounterBy, Labeled, MetricLabel};
use antiphon_models::smart_turn::SmartTurn;
use anyhow::{Context, Result};
use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry};
use tokio::sync::Semaphore;

/// A probability at or above this says the turn is complete (pipecat's threshold).
const COMPLETE: f32 = 0.5;

pub struct TurnModel {
    model: Arc<SmartTurn>,
    workers: Arc<Semaphore>,
    verdicts: CounterBy<Verdict>,
    seconds: Histogram,
}

/// What the model said about a pause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Complete,
    Incomplete,
    /// The model could not answer (the error is logged): the pause ends the turn, as the silence
    /// detector would have.
    Failed,
}

/// `antiphon_turn_model_verdicts_total`'s `verdict` label.
impl MetricLabel for Verdict {
    const ALL: &'static [Self] = &[Verdict::Complete, Verdict::Incomplete, Verdict::Failed];
    fn label(self) -> &'static str {
        match self {
            Verdict::Complete => "complete",
            Verdict::Incomplete => "incomplete",
            Verdict::Failed => "failed",
        }
    }
}

impl Verdict {
    /// Whether the turn ends at the pause.
    pub fn ends_turn(self) -> bool {
        self != Verdict::Incomplete
    }
}

impl TurnModel {
    /// The model from its ONNX file, its metrics in `registry`.
    pub fn load(path: &Path, workers: usize, registry: &Registry) -> Result<Self> {
        let m = antiphon_assets::onnx::read_model(path)?;
        let model = SmartTurn::from_model(&m)
            .with_context(|| format!("server.smart_turn_model = {}", path.display()))?;
        let verdicts = IntCounterVec::new(
            Opts::new(
                "antiphon_turn_model_verdicts_total",
                "semantic_vad: what the turn model said at a pause in a caller's speech",
            ),
            &["verdict"],
        )?;
        let seconds = Histogram::with_opts(
            HistogramOpts::new(
                "antiphon_turn_model_seconds",
                "semantic_vad: from a pause to the turn model's verdict (waiting for a worker \
                included)",
            )
            .buckets(vec![0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0]),
        )?;
        registry.register(Box::new(verdicts.clone()))?;
        registry.register(Box::new(seconds.clone()))?;
        let verdicts = Labeled::with_every_series(verdicts);
        Ok(Self {
            model: Arc::new(model),
            workers: Arc::new(Semaphore::new(workers)),
            verdicts,
            seconds,
        })
    }

    /// Whether the turn in `audio` (24 kHz, the turn so far) is complete.
    pub async fn verdict(&self, audio: Vec<i16>) -> Verdict {
        let t0 = Instant::now();
        let model = self.model.clone();
        let run = async {
            let _worker = self
                .workers
                .clone()
                .acquire_owned()
                .await
                .context("the turn model's workers are closed")?;
            tokio::task::spawn_blocking(move || {
                let x: Vec<f32> = audio.iter().map(|&s| antiphon_audio::i16_to_f32(s)).collect();
                let x = antiphon_audio::resample(&x, 24_000, SmartTurn::SAMPLE_RATE as u32)?;
                model.end_of_turn(&x)
            })
            .await
            .context("the turn model's task")?
        };
        let v = match run.await {
            Ok(p) if p >= COMPLETE => Verdict::Complete,
            Ok(_) => Verdict::Incomplete,
            Err(e) => {
                tracing::warn!(
                    "semantic_vad: the turn model failed, the pause ends the turn: {e:#}"
                );
                Verdict::Failed
            }
        };
        self.seconds.observe(t0.elapsed().as_secs_f64());
        self.verdicts.at(v).inc();
        v
    }
}
