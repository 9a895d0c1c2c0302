//! Registered voices in Code2Wav: their kept features, and the preparation of a new registration
//! in a step with no chunk due.

use std::time::Instant;

use anyhow::Result;

use super::super::voices::PreparedVoice;
use super::Code2WavStage;
use crate::metric_labels::{PrefetchEvent, StepKind};
use antiphon_models::code2wav::prompt::{PromptFeatures, Reference};

impl Code2WavStage {
    /// A reference's features from a registered voice's kept ones, else prepared now (true when
    /// they were kept).
    pub(super) fn features_for(&mut self, r: &Reference) -> Result<(PromptFeatures, bool)> {
        if let Some(f) = self.prepared.get(&r.key) {
            self.count(PrefetchEvent::Registered);
            return Ok((f.clone(), true));
        }
        self.metrics.voice_preparations.inc();
        Ok((self.model.prepare(r)?, false))
    }

    /// One waiting registration: its features (kept, cached or prepared now) kept and sent back.
    pub(super) fn prepare_one(&mut self) -> bool {
        let Some((voice, reply)) = self.prepare_jobs.pop_front() else { return false };
        let t0 = Instant::now();
        let done = (|| -> Result<PreparedVoice> {
            let r = Reference::materialize(&voice.samples, voice.sample_rate)?;
            let cached = self.cache.get(&r.key).and_then(|e| e.features.clone());
            let f = match cached {
                Some(f) => f,
                None => self.features_for(&r)?.0,
            };
            self.prepared.insert(r.key.clone(), f.clone());
            PreparedVoice::from_features(&r.key, &f)
        })();
        self.metrics.step_seconds.at(StepKind::Prepare).observe(t0.elapsed().as_secs_f64());
        let _ = reply.try_send(
            done.map_err(|e| super::super::voices::PrepareRefused::Unusable(format!("{e:#}"))),
        );
        true
    }
}
