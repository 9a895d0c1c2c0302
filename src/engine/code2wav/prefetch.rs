//! Reference prefetch in Code2Wav's idle steps: phase A (materialize + prepare) and phase B (setup)
//! for the references that wait, a burst of them together (one batched preparation, one batched
//! setup), within the gates of the module's documentation.

use std::time::Instant;

use anyhow::anyhow;

use super::{Code2WavStage, IdleOutcome, Phase};
use crate::metric_labels::{PrefetchEvent, PrefetchSkip, StepKind};
use crate::RequestId;
use antiphon_models::code2wav::prompt::Reference;

impl Code2WavStage {
    /// One phase of prefetch, if the gates allow it: phase A for every waiting reference not yet
    /// prepared (up to the pin cap), else phase B for every prepared one not yet set up (up to the
    /// setup cache's capacity).
    pub fn idle_step(&mut self) -> IdleOutcome {
        let double = self.prev_idle;
        self.prev_idle = true;
        if !self.cfg.prefetch.enabled {
            return IdleOutcome::Nothing;
        }
        let with_setup = self.cfg.prefetch.setup;
        let candidates: Vec<usize> =
            (0..self.waiting.len()).filter(|&i| self.waiting[i].needs_phase(with_setup)).collect();
        if candidates.is_empty() {
            return IdleOutcome::Nothing;
        }
        if !double {
            return self.skip(PrefetchSkip::SingleIdle);
        }
        if !self.live.is_empty() || !self.duplex.is_empty() {
            return self.skip(PrefetchSkip::Busy);
        }
        let (queued, prepared): (Vec<usize>, Vec<usize>) =
            candidates.iter().partition(|&&i| self.waiting[i].phase == Phase::Queued);
        let room = self.cache.capacity().max(1).saturating_sub(self.cache.pin_count());
        if !queued.is_empty() && room > 0 {
            return self.phase_a(&queued[..queued.len().min(room)]);
        }
        // (the references beyond the pin cap wait for pins to go; those prepared go on)
        if prepared.is_empty() {
            return self.skip(PrefetchSkip::PinCap);
        }
        self.phase_b(&prepared)
    }

    fn skip(&self, reason: PrefetchSkip) -> IdleOutcome {
        self.metrics.prefetch_skips.at(reason).inc();
        IdleOutcome::Skipped(reason)
    }

    /// The waiting entry of request `id`, if it still waits.
    fn waiter(&mut self, id: &RequestId) -> Option<&mut super::Waiting> {
        self.waiting.iter_mut().find(|w| &w.id == id)
    }

    fn fail_phase(&mut self, id: &RequestId, why: &str) {
        tracing::debug!(request = %id, "prefetch failed: {why}");
        self.cache.unpin(id);
        if let Some(w) = self.waiter(id) {
            w.phase = Phase::Failed;
        }
        self.count(PrefetchEvent::Failed);
    }

    /// Materializes and prepares the references of `waiting[i]` for each `i`: a registered voice's
    /// kept features, one already in the cache, the rest prepared in one batch; each pinned.
    fn phase_a(&mut self, idx: &[usize]) -> IdleOutcome {
        let t0 = Instant::now();
        let jobs: Vec<(RequestId, crate::RefInput)> = idx
            .iter()
            .map(|&i| {
                (
                    self.waiting[i].id.clone(),
                    self.waiting[i].reference.clone().expect("a candidate has a reference"),
                )
            })
            .collect();
        let mut keyed: Vec<(RequestId, String)> = Vec::with_capacity(jobs.len());
        let mut failed: Vec<RequestId> = Vec::new();
        // (several references resampled and keyed side by side, off this thread)
        let materialized: Vec<anyhow::Result<Reference>> = if jobs.len() == 1 {
            vec![Reference::materialize(&jobs[0].1.samples, jobs[0].1.sample_rate)]
        } else {
            std::thread::scope(|scope| {
                let handles: Vec<_> = jobs
                    .iter()
                    .map(|(_, r)| {
                        scope.spawn(move || Reference::materialize(&r.samples, r.sample_rate))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| Err(anyhow!("a reference thread panicked")))
                    })
                    .collect()
            })
        };
        let mut unprepared: Vec<String> = Vec::new();
        for ((id, _), r) in jobs.into_iter().zip(materialized) {
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    self.fail_phase(&id, &format!("{e:#}"));
                    failed.push(id);
                    continue;
                }
            };
            let k = r.key.clone();
            if self.cache.entry(r).features.is_none() && !unprepared.contains(&k) {
                unprepared.push(k.clone());
            }
            // (pinned now, so that no trim takes the entry while the batch is prepared)
            self.cache.pin(&k, &id);
            keyed.push((id, k));
        }
        for (k, why) in self.prepare_entries(&unprepared, None) {
            let lost: Vec<RequestId> =
                keyed.iter().filter(|(_, kk)| *kk == k).map(|(id, _)| id.clone()).collect();
            for id in lost {
                self.fail_phase(&id, &why);
                failed.push(id);
            }
            self.cache.evict(&k);
        }
        for gone in self.cache.trim() {
            self.setup.remove(&gone);
        }
        let mut ok = Vec::new();
        for (id, k) in keyed {
            if failed.contains(&id) {
                continue;
            }
            if let Some(w) = self.waiter(&id) {
                w.phase = Phase::Prepared(k);
            }
            self.count(PrefetchEvent::PhaseA);
            ok.push(id);
        }
        self.metrics.step_seconds.at(StepKind::Prefetch).observe(t0.elapsed().as_secs_f64());
        if ok.is_empty() {
            IdleOutcome::Failed(failed)
        } else {
            IdleOutcome::PhaseA(ok)
        }
    }

    /// Sets up the prepared references of `waiting[i]` for each `i` (in `Prepared`) in one batch,
    /// at most as many voices as the setup cache has room for beside the states of the requests
    /// that still wait.
    fn phase_b(&mut self, idx: &[usize]) -> IdleOutcome {
        // (states set up for requests still waiting are not pushed out by later ones)
        let held: std::collections::HashSet<&String> = self
            .waiting
            .iter()
            .filter_map(|w| if let Phase::SetUp(k) = &w.phase { Some(k) } else { None })
            .collect();
        let room = self.setup.capacity().max(1).saturating_sub(held.len());
        if room == 0 {
            return self.skip(PrefetchSkip::SetupCap);
        }
        let t0 = Instant::now();
        let mut keys: Vec<String> = Vec::new();
        let mut ids: Vec<(RequestId, String)> = Vec::new();
        for &i in idx {
            let Phase::Prepared(k) = &self.waiting[i].phase else { continue };
            let k = k.clone();
            if !self.setup.contains(&k) && !keys.contains(&k) {
                if keys.len() == room {
                    continue;
                }
                keys.push(k.clone());
            }
            ids.push((self.waiting[i].id.clone(), k));
        }
        let features = keys
            .iter()
            .map(|k| {
                self.cache
                    .get(k)
                    .and_then(|e| e.features.clone())
                    .ok_or_else(|| anyhow!("prefetched entry gone"))
            })
            .collect::<anyhow::Result<Vec<_>>>();
        let done = if keys.is_empty() {
            Ok(Vec::new())
        } else {
            features.and_then(|fs| self.model.setup_batch(&fs.iter().collect::<Vec<_>>()))
        };
        self.metrics.step_seconds.at(StepKind::Prefetch).observe(t0.elapsed().as_secs_f64());
        match done {
            Ok(states) => {
                for (k, s) in keys.iter().zip(states) {
                    self.setup.put(k.clone(), s);
                }
                let mut out = Vec::new();
                for (id, k) in ids {
                    if let Some(w) = self.waiter(&id) {
                        w.phase = Phase::SetUp(k);
                    }
                    self.count(PrefetchEvent::PhaseB);
                    out.push(id);
                }
                IdleOutcome::PhaseB(out)
            }
            Err(e) => {
                let why = format!("{e:#}");
                let out: Vec<RequestId> = ids.into_iter().map(|(id, _)| id).collect();
                for id in &out {
                    self.fail_phase(id, &why);
                }
                IdleOutcome::Failed(out)
            }
        }
    }
}
