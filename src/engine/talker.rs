//! Talker, the Talker loop: per request, prefill the condition (the Thinker's text rows, then the
//! text-end and audio-start embeddings), then decode one code per step for every stream at once;
//! codes are chunked and handed to Code2Wav (chunk 0 with the reference voice).

use std::collections::HashMap;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Tensor};

use super::caches::StageCaches;
use super::chunker::{Chunker, Payload};
use super::gate::PrefillGate;
use super::{
    Code2WavMsg, EngineConfig, EngineMetrics, Mode, Registry, RequestId, StageLoop, Status,
    TalkerMsg,
};
use antiphon_models::decoder::{KvCache, PooledCache, StreamStep};
use antiphon_models::sampling::{LengthPolicy, Sampler};
use antiphon_models::talker::{ConditionMode, Talker};

mod chunks;
mod stage_loop;
mod stream;
use crate::metric_labels::{StageName, StepKind};
use chunks::TextChunks;
pub use chunks::{chunk_condition, segment_window};
use stream::{DuplexTalk, Feed, NewStream, Phase, TalkerStream};

pub struct TalkerStage {
    talker: Talker,
    cfg: Arc<EngineConfig>,
    registry: Registry,
    metrics: EngineMetrics,
    to_c2w: SyncSender<Code2WavMsg>,
    reqs: HashMap<RequestId, TalkerStream>,
    /// Admission order, for fair batching.
    order: Vec<RequestId>,
    /// The last step held a stream back (pacing) until Code2Wav delivers its audio
    /// (`TalkerMsg::Delivered` wakes the stage then).
    paced: bool,
    /// Caches of finished streams, for the next ones (their decode graphs with them).
    caches: StageCaches,
    /// Held while a prefill for a reply's first code is on the GPU: the Thinker waits for it.
    gate: PrefillGate,
    /// The holds first text chunks came with, dropped once the next step has taken its own.
    bridge: Vec<crate::gate::Held>,
    /// The stages' paces, for a first chunk on a busy engine (`code2wav.small_first_chunk_slack`).
    pace: crate::pace::StagePace,
}

impl TalkerStage {
    pub fn new(
        talker: Talker,
        cfg: Arc<EngineConfig>,
        registry: Registry,
        metrics: EngineMetrics,
        to_c2w: SyncSender<Code2WavMsg>,
        gate: PrefillGate,
    ) -> anyhow::Result<Self> {
        let caches = StageCaches::new(
            talker.decoder(),
            cfg.talker.max_batch,
            256,
            cfg.idle_cache_mib << 20,
            cfg.talker.slots,
            cfg.talker.slot_context,
        )?;
        let pace = crate::pace::StagePace::default();
        let (reqs, order, bridge) = (HashMap::new(), Vec::new(), Vec::new());
        Ok(Self {
            talker,
            cfg,
            registry,
            metrics,
            to_c2w,
            reqs,
            order,
            paced: false,
            caches,
            gate,
            bridge,
            pace,
        })
    }

    /// The paces it shares with Code2Wav (it writes the Talker's).
    pub fn with_pace(mut self, pace: crate::pace::StagePace) -> Self {
        self.pace = pace;
        self
    }

    /// New codes in the first chunk of a turn stream that finds the engine busy: a full chunk,
    /// or with `code2wav.small_first_chunk_slack` the smallest the paces allow ([`crate::pace`]).
    fn busy_first_chunk(&self) -> usize {
        if self.cfg.code2wav.small_first_chunk_slack {
            self.pace
                .first_chunk(self.cfg.code2wav.first_chunk_codes, self.cfg.code2wav.chunk_codes)
        } else {
            self.cfg.code2wav.chunk_codes
        }
    }

    /// Codes a turn-mode stream whose first chunk holds `first` codes may have made once Code2Wav
    /// delivered `delivered` chunks: the chunks up to the next one, plus `lead` more — none
    /// before a small first chunk is delivered when `talker.hold_first_chunk` is on (that chunk 0
    /// then has the GPU to itself as far as this stream is concerned; a full first chunk's second
    /// of audio would have to cover the next chunk's whole wait, so it keeps its lead).
    fn pacing_limit(&self, first: usize, hold_first: bool, delivered: usize, lead: usize) -> usize {
        let size = self.cfg.code2wav.chunk_codes.max(1);
        let lead =
            if delivered == 0 && first < size && hold_first && self.cfg.talker.hold_first_chunk {
                0
            } else {
                lead
            };
        first + (delivered + lead) * size
    }

    fn remove(&mut self, id: &RequestId) {
        self.reqs.remove(id);
        self.order.retain(|x| x != id);
    }

    fn fail(&mut self, id: &RequestId, why: String) {
        if self.reqs.contains_key(id) {
            tracing::warn!(request = %id, "talker failed: {why}");
            self.registry.finish_counted(id, Status::Failed(why), &self.metrics.requests);
        }
        self.remove(id);
    }

    fn send(&self, id: &RequestId, r: &TalkerStream, p: Payload) {
        let reference = (p.seq == 0).then(|| r.voice.clone());
        if p.seq == 0 {
            // (marked as it leaves: Code2Wav reads its messages only between its steps)
            self.registry.mark(id, |t| {
                t.chunk0_codes.get_or_insert_with(Instant::now);
            });
        }
        let _ = self.to_c2w.send(Code2WavMsg::Chunk {
            id: id.clone(),
            seq: p.seq,
            codes: p.codes,
            last: p.last,
            reference,
        });
    }

    /// The stream made its last code: it leaves the Talker, and its codes not yet chunked go to
    /// Code2Wav as its last chunk.
    fn end_stream(&mut self, id: &RequestId) {
        let Some(mut r) = self.reqs.remove(id) else { return };
        self.order.retain(|x| x != id);
        if let Some(p) = r.chunker.flush() {
            self.send(id, &r, p);
        }
    }

    /// Starts the next waiting segment of every idle duplex turn; a turn with nothing left to
    /// feed at its end is flushed at once.
    fn start_segments(&mut self) -> Result<()> {
        let mut done = Vec::new();
        for id in &self.order {
            let r = self.reqs.get_mut(id).expect("listed");
            if r.phase() != Phase::Between {
                continue;
            }
            let Some((cond, turn_end)) = r.duplex.as_mut().and_then(|dx| dx.queue.pop_front())
            else {
                continue;
            };
            let mut parts = Vec::new();
            if let Some(c) = r.last_code {
                parts.push(self.talker.embed_codes(&[c])?);
            }
            parts.extend(cond);
            if parts.is_empty() {
                done.push(id.clone());
                continue;
            }
            r.open_segment(parts);
            let dx = r.duplex.as_mut().expect("a duplex stream");
            dx.left = (!turn_end).then_some(self.cfg.duplex.codes_per_unit());
            if turn_end {
                r.length =
                    LengthPolicy::new(vec![self.talker.eos_code()], r.length.min, r.length.max);
            }
        }
        for id in done {
            self.end_stream(&id);
        }
        Ok(())
    }

    fn run(&mut self) -> Result<bool> {
        // (the Thinker waits while the first chunks' conditions are made, up to this step's hold)
        let bridge = std::mem::take(&mut self.bridge);
        self.start_segments()?;
        self.start_text_segments()?;
        let mut ids = Vec::new();
        let mut embeds = Vec::new();
        // per stream of the step: its pending rows left for later steps (a segment fed by rows)
        let mut rests: Vec<Option<Tensor>> = Vec::new();
        self.paced = false;
        for id in &self.order {
            if ids.len() >= self.cfg.talker.max_batch {
                break;
            }
            let r = &self.reqs[id];
            let mut rest = None;
            let e = match r.phase().feed(!r.pending.is_empty(), r.last_code.is_some()) {
                Some(Feed::Rows) => {
                    // (one tensor, as a segment fed by rows leaves it: no copy)
                    let all = if let [one] = r.pending.as_slice() {
                        one.clone()
                    } else {
                        Tensor::cat(&r.pending, 0)?
                    };
                    let rows = all.dim(0)?;
                    if self.cfg.talker.segment_rows
                        && (r.chunks.is_some() || r.duplex.is_some())
                        && r.chunker.sent() > 0
                        && rows > 1
                    {
                        rest = Some(all.narrow(0, 1, rows - 1)?);
                        all.narrow(0, 0, 1)?
                    } else {
                        all
                    }
                }
                Some(Feed::LastCode) => {
                    if let (Some(lead), None) = (self.cfg.talker.lead_chunks, &r.duplex) {
                        // (a request that just ended is dropped by the next step's sweep)
                        let Some(delivered) = self.registry.chunks_if_live(id) else { continue };
                        let limit =
                            self.pacing_limit(r.chunker.first(), r.hold_first, delivered, lead);
                        if r.codes >= limit + r.chunker.held_codes() {
                            self.paced = true;
                            continue;
                        }
                    }
                    self.talker.embed_codes(&[r.last_code.expect("a speaking stream's code")])?
                }
                None => continue,
            };
            ids.push(id.clone());
            embeds.push(e);
            rests.push(rest);
        }
        if ids.is_empty() {
            return Ok(false);
        }
        let t0 = Instant::now();
        let n = ids.len();
        // the Thinker waits while this step makes a first chunk's codes (a prefill for one, or a
        // step of a few streams), or prefills a text chunk's window in a step of a few streams (a
        // stream speaking on a lightly loaded engine would otherwise wait for the Thinker's last
        // token: 16 of 16 replies of 128 tokens stalled at C1); under load the Thinker keeps its
        // priority
        // (a segment fed by rows counts as its prefill: in a step of a few streams each of its
        // rows would otherwise wait behind the Thinker's graph at the same priority)
        let small = ids.len() <= self.cfg.gated_streams;
        let gated = ids.iter().zip(&embeds).zip(&rests).any(|((id, e), rest)| {
            let prefill = e.dim(0).unwrap_or(1) > 1 || rest.is_some();
            (self.reqs[id].chunker.sent() == 0 && (prefill || small)) || (prefill && small)
        });
        // (held until the step's codes are on the host, at its end)
        let held = gated.then(|| self.gate.hold());
        drop(bridge);
        let hidden = {
            let mut caches: Vec<(RequestId, PooledCache)> = ids
                .iter()
                .map(|id| {
                    (
                        id.clone(),
                        std::mem::replace(
                            &mut self.reqs.get_mut(id).expect("listed").cache,
                            PooledCache::alone(KvCache::new(0)),
                        ),
                    )
                })
                .collect();
            let mut steps: Vec<StreamStep> = caches
                .iter_mut()
                .zip(embeds)
                .map(|((_, c), e)| StreamStep { cache: c, embeds: e })
                .collect();
            let out = self.forward_step(&mut steps);
            drop(steps);
            for (id, c) in caches {
                self.reqs.get_mut(&id).expect("listed").cache = c;
            }
            out
        };
        let mut failed = 0;
        let hidden: Vec<Option<Tensor>> = ids
            .iter()
            .zip(hidden)
            .map(|(id, o)| match o {
                Ok(h) => Some(h),
                Err(e) => {
                    failed += 1;
                    self.fail(id, format!("talker step: {e}"));
                    None
                }
            })
            .collect();
        if failed == n {
            anyhow::bail!("the talker's forward failed for every stream of the step");
        }
        // which streams sample a code now
        let mut sample = Vec::new();
        for ((k, id), rest) in ids.iter().enumerate().zip(rests) {
            let Some(h) = &hidden[k] else { continue };
            let r = self.reqs.get_mut(id).expect("listed");
            // (a segment fed by rows: its next row in the next step, no code before its last)
            if r.stepped(rest) {
                let rows = h.dim(0)?;
                sample.push((id.clone(), h.narrow(0, rows - 1, 1)?));
            }
        }
        if held.is_some() && sample.is_empty() {
            // (no codes read back: the gate opens once the prefill is done all the same)
            if let Err(e) = self.talker.decoder().device().synchronize() {
                tracing::warn!("talker: waiting for a prefill: {e}");
            }
        }
        if !sample.is_empty() {
            let last = Tensor::cat(&sample.iter().map(|(_, h)| h.clone()).collect::<Vec<_>>(), 0)?;
            let logits = self.talker.logits(&last)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let eos = self.talker.eos_code();
            for ((id, _), l) in sample.into_iter().zip(logits) {
                let r = self.reqs.get_mut(&id).expect("listed");
                if !self.registry.is_live(&id) {
                    self.remove(&id);
                    continue;
                }
                // a unit's segment: exactly its codes, then wait for the next segment
                let unit_code = match r.duplex.as_mut() {
                    Some(DuplexTalk { left: Some(left), .. }) => {
                        *left -= 1;
                        Some((r.sampler.sample(&l, &[eos]), *left == 0))
                    }
                    _ => None,
                };
                let code = match unit_code {
                    Some((c, unit_over)) => {
                        if unit_over {
                            r.segment_over();
                        }
                        c
                    }
                    None => r.length.next(&mut r.sampler, &l, &[]),
                };
                // the reply ends on its end code; with text chunks, a segment ends on its end code
                // or its last code (without a step more), and the reply when its last one does
                let mut end_reply = code == eos;
                if let Some(ch) = r.chunks.as_mut() {
                    let segment_over = code == eos || r.length.generated() >= r.length.max;
                    if code != eos {
                        ch.made(code);
                    }
                    if segment_over {
                        ch.end_segment();
                    }
                    end_reply = segment_over && ch.finished(r.codes + usize::from(code != eos));
                    if segment_over {
                        r.segment_over();
                    }
                }
                if code != eos {
                    r.codes += 1;
                    r.last_code = Some(code);
                    self.registry.add_codes(&id, 1);
                    if let Some(p) = r.chunker.push(code) {
                        let r = &self.reqs[&id];
                        tracing::debug!(request = %id, seq = p.seq, codes = p.codes.len(),
                            "talker chunk out");
                        self.send(&id, r, p);
                    }
                }
                if end_reply {
                    self.end_stream(&id);
                }
            }
        }
        tracing::debug!(
            streams = n,
            paced = self.paced,
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "talker step"
        );
        self.pace.record_talker_step(t0.elapsed());
        self.metrics.step_seconds.at(StepKind::Talker).observe(t0.elapsed().as_secs_f64());
        self.metrics.batch_size.at(StageName::Talker).observe(n as f64);
        Ok(true)
    }

    /// The step's forward: the streams decoding one code each as one batch (the batched decode
    /// step, a CUDA graph on a GPU), the streams prefilling several rows as another (op by op), so
    /// that a prefill beside them does not take the decoding streams off their graph. A batch that
    /// fails runs again stream by stream: one stream's error fails it alone.
    fn forward_step(&self, steps: &mut [StreamStep]) -> Vec<crate::contain::Outcome> {
        // (with prefills in captured steps, decoding and prefilling streams together as the rows
        // of one, when they fit its largest bucket: one launch, the weights read once)
        if self.talker.decoder().rows_fit_a_bucket(steps) {
            return crate::contain::forward_contained(steps, |s| self.talker.forward(s));
        }
        let (mut one, mut many, mut at) = (Vec::new(), Vec::new(), Vec::with_capacity(steps.len()));
        for s in steps.iter_mut() {
            let step = StreamStep { cache: &mut *s.cache, embeds: s.embeds.clone() };
            if step.embeds.dim(0).unwrap_or(1) > 1 {
                at.push((true, many.len()));
                many.push(step);
            } else {
                at.push((false, one.len()));
                one.push(step);
            }
        }
        let forward = |s: &mut [StreamStep]| self.talker.forward(s);
        let decoded = if one.is_empty() {
            Vec::new()
        } else {
            crate::contain::forward_contained(&mut one, forward)
        };
        let prefilled = if many.is_empty() {
            Vec::new()
        } else {
            crate::contain::forward_contained(&mut many, forward)
        };
        at.into_iter()
            .map(|(m, i)| if m { prefilled[i].clone() } else { decoded[i].clone() })
            .collect()
    }

    /// Whether more than `code2wav.small_first_chunk_streams` requests are in the engine (in any
    /// stage), counting `joining` more streams in the Talker than it holds now.
    fn busy(&self, joining: usize) -> bool {
        let engaged = (self.reqs.len() + joining).max(self.registry.live_count());
        !self.cfg.code2wav.small_first_chunk_for(engaged)
    }
}

#[cfg(test)]
#[path = "talker/tests.rs"]
mod tests;
