//! Chunk 0s in Code2Wav: each request's reference resolved (claimed from prefetch, found in the
//! cache, or prepared now), the voices with no setup state yet set up together in one batch (one
//! solve over all their prompts rather than one each), then the streams opened.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{anyhow, Result};

use super::{ChunkWork, Code2WavStage, Live, Phase, Status};
use crate::metric_labels::PrefetchEvent;
use antiphon_models::code2wav::flow::FlowState;
use antiphon_models::code2wav::prompt::Reference;

impl Code2WavStage {
    /// This step's chunk 0s, their streams opened. A chunk 0 whose reference cannot be resolved,
    /// set up or opened is finished as failed and left out of what comes back.
    pub(super) fn start_streams(&mut self, chunk0s: Vec<ChunkWork>) -> Vec<ChunkWork> {
        let mut keyed = Vec::with_capacity(chunk0s.len());
        for c in chunk0s {
            match self.resolve(&c) {
                Ok(k) => keyed.push((c, k)),
                Err(e) => self.finish(&c.id, Status::Failed(format!("reference voice: {e:#}"))),
            }
        }
        // the references with no features yet, prepared together
        let mut unprepared: Vec<String> = Vec::new();
        for (_, k) in &keyed {
            if !unprepared.contains(k) && self.cache.get(k).is_some_and(|e| e.features.is_none()) {
                unprepared.push(k.clone());
            }
        }
        if !unprepared.is_empty() {
            let failed = self.prepare_entries(&unprepared, Some(PrefetchEvent::Inline));
            let (lost, kept): (Vec<_>, Vec<_>) =
                keyed.into_iter().partition(|(_, k)| failed.iter().any(|(f, _)| f == k));
            keyed = kept;
            for (c, k) in lost {
                let why = failed
                    .iter()
                    .find(|(f, _)| *f == k)
                    .map(|(_, why)| why.clone())
                    .unwrap_or_default();
                self.finish(&c.id, Status::Failed(format!("reference voice: {why}")));
                if self.cache.get(&k).is_some_and(|e| e.features.is_none()) && self.cache.evict(&k)
                {
                    self.setup.remove(&k);
                }
            }
        }
        // each voice with no setup state yet, once, in one batch
        let mut states: HashMap<String, FlowState> = HashMap::new();
        let mut todo: Vec<String> = Vec::new();
        for (_, k) in &keyed {
            if states.contains_key(k) || todo.contains(k) {
                self.count(PrefetchEvent::SetupHit);
            } else if let Some(s) = self.setup.get(k) {
                self.count(PrefetchEvent::SetupHit);
                states.insert(k.clone(), s);
            } else {
                todo.push(k.clone());
            }
        }
        if !todo.is_empty() {
            let t0 = std::time::Instant::now();
            let done = todo
                .iter()
                .map(|k| {
                    self.cache
                        .get(k)
                        .and_then(|e| e.features.clone())
                        .ok_or_else(|| anyhow!("reference features vanished"))
                })
                .collect::<Result<Vec<_>>>()
                .and_then(|fs| self.model.setup_batch(&fs.iter().collect::<Vec<_>>()));
            match done {
                Ok(set) => {
                    tracing::debug!(
                        voices = todo.len(),
                        ms = t0.elapsed().as_secs_f64() * 1e3,
                        "code2wav: voices set up in one batch (ms: queued)"
                    );
                    for (k, s) in todo.iter().zip(set) {
                        self.setup.put(k.clone(), s.clone());
                        states.insert(k.clone(), s);
                    }
                }
                Err(e) => {
                    let why = format!("reference voice: setup: {e:#}");
                    let (failed, kept): (Vec<_>, Vec<_>) =
                        keyed.into_iter().partition(|(_, k)| todo.contains(k));
                    keyed = kept;
                    for (c, _) in failed {
                        self.finish(&c.id, Status::Failed(why.clone()));
                    }
                }
            }
        }
        let mut opened = Vec::with_capacity(keyed.len());
        for (c, k) in keyed {
            let Some(state) = states.get(&k) else {
                self.finish(&c.id, Status::Failed("reference voice: no setup state".into()));
                continue;
            };
            match self.open(&c, &k, state) {
                Ok(()) => opened.push(c),
                Err(e) => self.finish(&c.id, Status::Failed(format!("reference voice: {e:#}"))),
            }
        }
        opened
    }

    /// Chunk 0's reference: claimed from prefetch, or found in (or prepared into) the reference
    /// cache, owned by the request. Returns its cache key.
    fn resolve(&mut self, c: &ChunkWork) -> Result<String> {
        let pos = self.waiting.iter().position(|w| w.id == c.id);
        let w = pos.map(|i| self.waiting.remove(i));
        let reference = c
            .reference
            .clone()
            .or_else(|| w.as_ref().and_then(|w| w.reference.clone()))
            .ok_or_else(|| anyhow!("chunk 0 came without a reference voice"))?;
        let mut key = None;
        if let Some(w) = &w {
            match (w.pinned_key(), &w.reference) {
                (Some(k), Some(pre))
                    if pre.same_as(&reference)
                        && self.cache.get(k).is_some_and(|e| e.features.is_some()) =>
                {
                    // claim: the pin becomes ownership
                    let k = k.to_string();
                    self.cache.unpin(&c.id);
                    self.cache.own(&k, &c.id);
                    self.count(PrefetchEvent::Claimed);
                    key = Some(k);
                }
                (Some(k), _) => {
                    // a different reference at chunk 0: drop the prefetched one
                    let k = k.to_string();
                    self.cache.unpin(&c.id);
                    if self.cache.evict(&k) {
                        self.setup.remove(&k);
                    }
                    self.count(PrefetchEvent::Evicted);
                }
                (None, _) => {
                    if w.phase == Phase::Queued && w.reference.is_some() {
                        self.count(PrefetchEvent::Retired);
                    }
                }
            }
        }
        Ok(match key {
            Some(k) => k,
            None => {
                // (a reference with no features yet is prepared with the step's others)
                let r = Reference::materialize(&reference.samples, reference.sample_rate)?;
                let k = r.key.clone();
                if self.cache.entry(r).features.is_some() {
                    self.count(PrefetchEvent::CacheHit);
                }
                self.cache.own(&k, &c.id);
                for gone in self.cache.trim() {
                    self.setup.remove(&gone);
                }
                k
            }
        })
    }

    /// Features for the cache's entries `keys` (held, none prepared yet): a registered voice's
    /// kept ones, the others prepared in one batch, each preparation counted as `event` when
    /// given. Returns the keys that failed, with why. (Chunk 0s prepare inline with it; prefetch's
    /// phase A too.)
    pub(super) fn prepare_entries(
        &mut self,
        keys: &[String],
        event: Option<PrefetchEvent>,
    ) -> Vec<(String, String)> {
        let mut failed = Vec::new();
        let mut todo: Vec<(String, Reference)> = Vec::new();
        for k in keys {
            let Some(r) = self.cache.get(k).map(|e| e.reference.clone()) else {
                failed.push((k.clone(), "reference entry vanished".to_string()));
                continue;
            };
            match self.prepared.get(k) {
                Some(f) => {
                    self.count(PrefetchEvent::Registered);
                    let f = f.clone();
                    self.cache.entry_mut(k).expect("present").features = Some(f);
                }
                None => todo.push((k.clone(), r)),
            }
        }
        let refs: Vec<&Reference> = todo.iter().map(|(_, r)| r).collect();
        let t0 = std::time::Instant::now();
        let done = self.model.prepare_batch(&refs);
        tracing::debug!(
            voices = refs.len(),
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "code2wav: references prepared (one batch; ms until their codes were read back)"
        );
        for ((k, _), f) in todo.iter().zip(done) {
            self.metrics.voice_preparations.inc();
            match f {
                Ok(f) => {
                    self.cache.entry_mut(k).expect("present").features = Some(f);
                    if let Some(event) = event {
                        self.count(event);
                    }
                }
                Err(e) => failed.push((k.clone(), format!("{e:#}"))),
            }
        }
        failed
    }

    /// A new stream for chunk 0 from its voice's features (in the cache under `key`) and setup
    /// state.
    fn open(&mut self, c: &ChunkWork, key: &str, state: &FlowState) -> Result<()> {
        let features = self
            .cache
            .get(key)
            .and_then(|e| e.features.clone())
            .ok_or_else(|| anyhow!("reference features vanished"))?;
        if !self.graphs_warm {
            // (the server's own warm-up request comes first: it pays this before `ready`)
            self.graphs_warm = true;
            let top = self.cfg.code2wav.max_batch.min(self.cfg.code2wav.slots).max(1);
            let batches: Vec<usize> =
                (0..).map(|i| 1usize << i).take_while(|&b| b <= top).collect();
            let t0 = std::time::Instant::now();
            let sequences = super::super::chunker::warm_sequences(&self.cfg);
            match self.model.warm_graphs(&features, state, &batches, &sequences) {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    "code2wav graphs warm: {n} chunks at batches {batches:?}, payloads \
                    {sequences:?}, in {:.0} ms",
                    t0.elapsed().as_secs_f64() * 1e3
                ),
                Err(e) => tracing::warn!(
                    "code2wav graph warm-up failed (shapes are captured as \
                    they come): {e:#}"
                ),
            }
            if let Some(Err(e)) = self.cache.get(key).map(|e| self.model.warm_prepare(&e.reference))
            {
                tracing::warn!("reference preparation warm-up failed: {e:#}");
            }
        }
        let stream = self.model.start(&features, state)?;
        self.live.insert(
            c.id.clone(),
            Live { stream, next_seq: 0, played: None, heard_gaps: Duration::ZERO },
        );
        Ok(())
    }
}
