//! The Thinker's duplex streams (model-native full duplex).
//!
//! A duplex session is one long-lived Thinker stream whose KV cache persists between units. The
//! session feeds it units of 16 kHz audio (1 s by default). Per unit, in order:
//!
//! 1. encode the unit with the streaming audio encoder against the session's encoder cache
//!    (batched with the other sessions' units of this step);
//! 2. prefill `</unit>` (closing the previous unit, from the second unit on), `<unit>` and the
//!    unit's audio embeddings (10 for 1 s);
//! 3. decide: `<|listen|>` (silence) or speak — the model's own token, or forced by the
//!    `speak_every` policy;
//! 4. when speaking: decode at most [`MAX_UNIT_TEXT_TOKENS`] text tokens, ending with
//!    `<|chunk_eos|>` (the turn goes on next unit) or `<|turn_eos|>` (the turn is over); every
//!    sampled token is fed back, so the KV holds exactly what was said;
//! 5. hand the unit's text (ids and last-layer hidden rows, `<|turn_eos|>` included, `<|speak|>`
//!    and `<|chunk_eos|>` not) to the Talker as one segment. A listening unit closes an open turn.
//!
//! A spoken turn is an ordinary engine request (`{session}/t{n}`) from the Talker on: its text
//! deltas, audio and `Done` reach the session through [`DuplexEvent::Response`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};

use super::{to_host, Ctx, ThinkerStream};
use crate::caches::StageCaches;
use crate::metric_labels::RequestOutcome;
use crate::{
    DuplexEnd, DuplexEvent, DuplexPolicy, DuplexSink, DuplexSpec, EngineEvent, Mode, RequestId,
    Status, TalkerMsg,
};
use antiphon_models::decoder::{KvCache, PooledCache};
use antiphon_models::sampling::{LengthPolicy, Sampler};
use antiphon_models::tokenizer::TextStream;
use antiphon_models::top_k::LogitsRow;

/// Text tokens a spoken unit carries at most (the reference policy's per-unit budget; part of the
/// wire contract, so it lives in the protocol crate).
pub use antiphon_protocol::DUPLEX_UNIT_MAX_TEXT_TOKENS as MAX_UNIT_TEXT_TOKENS;
/// Text tokens per spoken unit under `speak_every` when the session does not force a number.
pub const DEFAULT_FORCED_UNIT_TOKENS: usize = 8;

enum Phase {
    /// The system prompt is being prefilled.
    System,
    /// Waiting for the next unit.
    Idle,
    /// Unit `unit` is being prefilled.
    Unit { unit: u64, arrived: Instant },
    /// Decoding in `unit`: `next` is the token to feed; `end` when feeding it closes the unit.
    Decode { unit: u64, next: u32, speaking: bool, end: bool },
}

struct OpenTurn {
    id: RequestId,
    text: TextStream,
    seg_ids: Vec<u32>,
    seg_rows: Vec<Tensor>,
    /// The segment being written ends the turn.
    turn_end: bool,
}

/// Input audio a duplex stream holds queued before its units are decided, at most (16 kHz).
pub const MAX_UNITS_AHEAD_MS: usize = 30_000;

pub struct DuplexStream {
    spec: DuplexSpec,
    sink: DuplexSink,
    /// A KV slot while the session's context fits one (batched decode), then a cache of its own.
    cache: PooledCache,
    enc: KvCache,
    units: VecDeque<(Vec<f32>, Instant)>,
    next_unit: u64,
    prefill: Option<Tensor>,
    prefill_pos: usize,
    phase: Phase,
    sampler: Sampler,
    length: LengthPolicy,
    turn: Option<OpenTurn>,
    turns: u64,
    /// Ended (closed, context full or failed): removed after the step.
    gone: bool,
}

impl DuplexStream {
    pub fn session(&self) -> &str {
        &self.spec.session
    }

    /// Has a forward to run this step.
    pub fn has_work(&self) -> bool {
        !self.gone && (self.prefill.is_some() || matches!(self.phase, Phase::Decode { .. }))
    }

    /// Opens a duplex stream: the system prompt (with the reference voice's embeddings when the
    /// Thinker hears the reference) is queued for prefill. `None` when it could not be built (the
    /// session is told, with `Closed`).
    pub fn open(
        ctx: &mut Ctx,
        caches: &StageCaches,
        spec: DuplexSpec,
        sink: DuplexSink,
    ) -> Option<Self> {
        let built: Result<(Vec<u32>, Tensor)> = (|| {
            let s = *ctx.tok.special();
            let instructions =
                spec.instructions.clone().unwrap_or_else(|| "Streaming Omni Conversation.".into());
            let mut audio = Vec::new();
            let mut parts: Vec<Result<&str, u32>> =
                vec![Err(s.im_start), Ok("system\n"), Ok(instructions.as_str())];
            if ctx.cfg.thinker.hears_reference {
                let emb = ctx.reference_embeddings(&spec.voice)?;
                parts.push(Ok("\n"));
                parts.push(Err(s.audio_start));
                parts.extend(std::iter::repeat_n(Err(s.unk), emb.dim(0)?));
                parts.push(Err(s.audio_end));
                audio.push(emb);
            }
            parts.push(Err(s.im_end));
            parts.push(Ok("\n"));
            let ids = ctx.tok.render_parts(&parts)?;
            let embeds = ctx.thinker.embed_with_audio(&ids, &s.audio_markers(), &audio)?;
            Ok((ids, embeds))
        })();
        let (ids, embeds) = match built.context("building the duplex system prompt") {
            Ok(v) => v,
            Err(e) => {
                sink(DuplexEvent::Closed { reason: DuplexEnd::Failed(format!("{e:#}")) });
                return None;
            }
        };
        let mut params = ctx.cfg.thinker.sampling.clone();
        if let Some(t) = spec.generation.temperature {
            params.temperature = t;
        }
        let mut sampler = Sampler::new(params, spec.generation.seed.unwrap_or(0));
        sampler.observe(&ids);
        // a slot when one is free and holds the system prompt, else a cache of its own
        let cache = match caches.take(ctx.thinker.llm.decoder(), ids.len() + 1) {
            Ok(c) => c,
            Err(e) => {
                sink(DuplexEvent::Closed {
                    reason: DuplexEnd::Failed(format!("thinker cache: {e:#}")),
                });
                return None;
            }
        };
        Some(DuplexStream {
            cache,
            enc: ctx.thinker.apm.new_cache(),
            units: VecDeque::new(),
            next_unit: 0,
            prefill: Some(embeds),
            prefill_pos: 0,
            phase: Phase::System,
            sampler,
            length: LengthPolicy::new(vec![], 0, 0),
            turn: None,
            turns: 0,
            gone: false,
            spec,
            sink,
        })
    }

    /// Queues a unit of 16 kHz audio. A session whose audio runs more than
    /// [`MAX_UNITS_AHEAD_MS`] ahead of the units decided fails (the server holds its units back
    /// well before: this is the bound of the stream's queue, not flow control).
    pub fn push_unit(&mut self, ctx: &mut Ctx, samples: Vec<f32>, arrived: Instant) {
        let queued: usize = self.units.iter().map(|(u, _)| u.len()).sum::<usize>() + samples.len();
        if queued > MAX_UNITS_AHEAD_MS * 16 {
            let why = format!(
                "its input audio ran more than {} s ahead of the units decided",
                MAX_UNITS_AHEAD_MS / 1000
            );
            self.end(ctx, DuplexEnd::Failed(why));
            return;
        }
        self.units.push_back((samples, arrived));
    }

    /// Ends the stream: its open turn is cancelled and `Closed { reason }` is its last event.
    pub fn end(&mut self, ctx: &mut Ctx, reason: DuplexEnd) {
        if self.gone {
            return;
        }
        self.gone = true;
        if let Some(t) = self.turn.take() {
            if ctx.registry.finish(&t.id, Status::Cancelled).is_some() {
                ctx.metrics.requests.at(RequestOutcome::Cancelled).inc();
            }
        }
        (self.sink)(DuplexEvent::Closed { reason });
    }

    /// The unit was decided: listen, or speak (opening a turn when none is open).
    fn decide(
        &mut self,
        ctx: &mut Ctx,
        unit: u64,
        arrived: Instant,
        logits: &LogitsRow,
    ) -> Result<()> {
        let s = *ctx.tok.special();
        let specials = s.all();
        let lag_ms = arrived.elapsed().as_secs_f64() * 1000.0;
        let (speak, first) = match self.spec.policy {
            DuplexPolicy::SpeakEvery(k) => {
                let sp = (unit + 1).is_multiple_of(k.max(1));
                (sp, if sp { s.speak } else { s.listen })
            }
            DuplexPolicy::Model => {
                let t = self.sampler.sample_row(logits, &ctx.forbidden.duplex_decision)?;
                (t != s.listen, t)
            }
        };
        if matches!(self.spec.policy, DuplexPolicy::SpeakEvery(_)) {
            self.sampler.observe(&[first]);
        }
        let context = self.cache.len();
        if !speak {
            if let Some(t) = self.turn.take() {
                // listening closes the open turn: the Talker drains it
                if ctx.registry.is_live(&t.id) {
                    ctx.registry.mark(&t.id, |x| x.handoff = Some(Instant::now()));
                    let _ = ctx.to_talker.send(TalkerMsg::Segment {
                        id: t.id,
                        ids: vec![],
                        hidden: None,
                        turn_end: true,
                    });
                }
            }
            (self.sink)(DuplexEvent::Listen { unit, context, lag_ms });
            self.phase = Phase::Decode { unit, next: s.listen, speaking: false, end: true };
            return Ok(());
        }
        // speaking: continue the open turn, or open one
        if self.turn.as_ref().is_some_and(|t| !ctx.registry.is_live(&t.id)) {
            self.turn = None;
        }
        let new_turn = self.turn.is_none();
        if new_turn {
            self.turns += 1;
            let id = RequestId::duplex_turn(&self.spec.session, self.turns);
            let sink = self.sink.clone();
            let tid = id.clone();
            let turn_sink: crate::EventSink = Arc::new(move |event: EngineEvent| {
                sink(DuplexEvent::Response { turn: tid.clone(), event })
            });
            if !ctx.registry.insert(id.clone(), turn_sink) {
                anyhow::bail!("duplex turn {id} is already live");
            }
            let g = &self.spec.generation;
            let _ = ctx.to_talker.send(TalkerMsg::Begin {
                id: id.clone(),
                mode: Mode::Duplex,
                voice: self.spec.voice.clone(),
                min_codes: g.min_audio_tokens.unwrap_or(0),
                max_codes: g.max_audio_tokens.unwrap_or(ctx.cfg.duplex.drain_codes),
                text_tokens: None,
                text_chunk: 0,
                seed: g.seed.unwrap_or(0).wrapping_add(self.turns),
            });
            self.turn = Some(OpenTurn {
                id,
                text: TextStream::new(),
                seg_ids: vec![],
                seg_rows: vec![],
                turn_end: false,
            });
        }
        let turn = self.turn.as_ref().expect("open").id.clone();
        (self.sink)(DuplexEvent::Speak { unit, turn: turn.clone(), new_turn, context, lag_ms });
        let g = &self.spec.generation;
        let first_is_text = !specials.contains(&first);
        self.length = match self.spec.policy {
            DuplexPolicy::SpeakEvery(_) => {
                let n = g
                    .min_text_tokens
                    .or(g.max_text_tokens)
                    .unwrap_or(DEFAULT_FORCED_UNIT_TOKENS)
                    .min(MAX_UNIT_TEXT_TOKENS);
                LengthPolicy::new(vec![s.chunk_eos], n, n)
            }
            DuplexPolicy::Model => {
                let max = g
                    .max_text_tokens
                    .unwrap_or(MAX_UNIT_TEXT_TOKENS)
                    .min(MAX_UNIT_TEXT_TOKENS)
                    .saturating_sub(usize::from(first_is_text));
                let min = g.min_text_tokens.unwrap_or(0).min(max);
                LengthPolicy::new(
                    vec![s.chunk_eos, s.chunk_tts_eos, s.turn_eos, s.im_end],
                    min,
                    max,
                )
            }
        };
        if let Some(t) = self.turn.as_mut() {
            t.turn_end = false;
            if first_is_text {
                let delta = t.text.push(&ctx.tok, first)?;
                if !delta.is_empty() {
                    ctx.registry.emit(&turn, EngineEvent::TextDelta(delta));
                }
            }
        }
        self.phase = Phase::Decode { unit, next: first, speaking: true, end: false };
        Ok(())
    }

    /// The next text token of a spoken unit.
    fn speak(&mut self, ctx: &mut Ctx, unit: u64, logits: &LogitsRow) -> Result<()> {
        let s = *ctx.tok.special();
        let forbid = match self.spec.policy {
            DuplexPolicy::SpeakEvery(_) => &ctx.forbidden.duplex_speech_forced,
            DuplexPolicy::Model => &ctx.forbidden.duplex_speech,
        };
        let t = self.length.next_row(&mut self.sampler, logits, forbid)?;
        let ends = [s.chunk_eos, s.chunk_tts_eos, s.turn_eos, s.im_end];
        if ends.contains(&t) {
            if let Some(turn) = self.turn.as_mut() {
                turn.turn_end = t == s.turn_eos || t == s.im_end;
            }
            self.phase = Phase::Decode { unit, next: t, speaking: true, end: true };
            return Ok(());
        }
        if let Some(turn) = self.turn.as_mut() {
            let delta = turn.text.push(&ctx.tok, t)?;
            if !delta.is_empty() {
                ctx.registry.emit(&turn.id, EngineEvent::TextDelta(delta));
            }
        }
        self.phase = Phase::Decode { unit, next: t, speaking: true, end: false };
        Ok(())
    }
}

/// Starts the next unit of every idle stream that has one: the units are encoded in one batch,
/// then queued for prefill.
pub fn intake(ctx: &mut Ctx, streams: &mut [DuplexStream]) {
    let context = ctx.context();
    let limit = ctx.cfg.duplex.max_context.map_or(context, |c| c.min(context));
    let mut picked: Vec<(usize, Vec<f32>, Instant, u64)> = Vec::new();
    for (j, d) in streams.iter_mut().enumerate() {
        if !matches!(d.phase, Phase::Idle) || d.gone {
            continue;
        }
        let Some((x, t)) = d.units.pop_front() else {
            continue;
        };
        let need = crate::fit::duplex_rows_after_unit(d.cache.len(), x.len(), MAX_UNIT_TEXT_TOKENS);
        if need > limit {
            tracing::info!(session = %d.spec.session, "duplex context full");
            d.end(ctx, DuplexEnd::ContextFull);
            continue;
        }
        // a session that outgrows its slot goes on in a cache of its own (decoded beside the batch)
        if d.cache.fixed_capacity().is_some_and(|cap| need > cap) {
            match d.cache.copy_prefix(d.cache.len(), need) {
                Ok(own) => d.cache = PooledCache::alone(own),
                Err(e) => {
                    d.end(ctx, DuplexEnd::Failed(format!("thinker cache: {e:#}")));
                    continue;
                }
            }
        }
        picked.push((j, x, t, d.next_unit));
        d.next_unit += 1;
    }
    if picked.is_empty() {
        return;
    }
    let encoded = {
        let mut items: Vec<(&mut KvCache, &[f32])> = Vec::with_capacity(picked.len());
        let mut it = picked.iter().peekable();
        for (j, d) in streams.iter_mut().enumerate() {
            if let Some(p) = it.next_if(|p| p.0 == j) {
                items.push((&mut d.enc, p.1.as_slice()));
            }
        }
        ctx.thinker.encode_units(&mut items)
    };
    let encoded = match encoded {
        Ok(e) => e,
        Err(e) => {
            let why = format!("audio encoder: {e:#}");
            for (j, ..) in picked {
                streams[j].end(ctx, DuplexEnd::Failed(why.clone()));
            }
            return;
        }
    };
    let s = *ctx.tok.special();
    for ((j, _, arrived, unit), rows) in picked.into_iter().zip(encoded) {
        let ids: Vec<u32> = if unit > 0 { vec![s.unit_end, s.unit] } else { vec![s.unit] };
        let built = ctx.thinker.llm.embed(&ids).and_then(|e| {
            let rows = rows.to_dtype(e.dtype())?;
            Tensor::cat(&[e, rows], 0)
        });
        let d = &mut streams[j];
        match built {
            Ok(embeds) => {
                d.sampler.observe(&ids);
                d.prefill = Some(embeds);
                d.prefill_pos = 0;
                d.phase = Phase::Unit { unit, arrived };
            }
            Err(e) => d.end(ctx, DuplexEnd::Failed(e.to_string())),
        }
    }
}

impl ThinkerStream for DuplexStream {
    /// The embeddings this stream feeds next (at most `budget` prefill rows).
    fn input(&self, ctx: &Ctx, budget: &mut usize) -> Result<Option<Tensor>> {
        if let Some(p) = &self.prefill {
            let n = (p.dim(0)? - self.prefill_pos).min(*budget);
            if n == 0 {
                return Ok(None);
            }
            *budget -= n;
            return Ok(Some(p.narrow(0, self.prefill_pos, n)?));
        }
        match self.phase {
            Phase::Decode { next, .. } => Ok(Some(ctx.thinker.llm.embed(&[next])?)),
            _ => Ok(None),
        }
    }

    fn cache(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    /// After a forward (its new rows `hidden`): the row to sample from, if any.
    fn after_forward(&mut self, ctx: &mut Ctx, hidden: &Tensor) -> Result<Option<Tensor>> {
        let s = *ctx.tok.special();
        let specials = s.all();
        let rows = hidden.dim(0)?;
        let last = hidden.narrow(0, rows - 1, 1)?;
        match self.phase {
            Phase::Idle => Ok(None),
            Phase::System | Phase::Unit { .. } => {
                self.prefill_pos += rows;
                let total = self.prefill.as_ref().map(|p| p.dim(0)).transpose()?.unwrap_or(0);
                if self.prefill_pos < total {
                    return Ok(None);
                }
                self.prefill = None;
                if matches!(self.phase, Phase::System) {
                    self.phase = Phase::Idle;
                    return Ok(None);
                }
                Ok(Some(last))
            }
            Phase::Decode { next, speaking, end, .. } => {
                if speaking {
                    if let Some(t) = self.turn.as_mut() {
                        if !specials.contains(&next) || next == s.turn_eos {
                            t.seg_ids.push(next);
                            t.seg_rows.push(last.to_dtype(DType::F32)?);
                        }
                    }
                }
                if !end {
                    return Ok(Some(last));
                }
                // the unit is over: a spoken unit becomes one Talker segment
                self.phase = Phase::Idle;
                if speaking {
                    if let Some(t) = self.turn.as_mut() {
                        let ids = std::mem::take(&mut t.seg_ids);
                        let rows = std::mem::take(&mut t.seg_rows);
                        let turn_end = t.turn_end;
                        let hidden = if rows.is_empty() {
                            None
                        } else {
                            Some(to_host(&Tensor::cat(&rows, 0)?)?)
                        };
                        let id = t.id.clone();
                        if turn_end {
                            self.turn = None;
                            ctx.registry.mark(&id, |t| t.handoff = Some(Instant::now()));
                        }
                        let _ =
                            ctx.to_talker.send(TalkerMsg::Segment { id, ids, hidden, turn_end });
                    }
                }
                Ok(None)
            }
        }
    }

    /// The decision of a unit, or the next text token of a spoken unit.
    fn on_logits(&mut self, ctx: &mut Ctx, logits: &LogitsRow) -> Result<()> {
        match self.phase {
            Phase::Unit { unit, arrived } => self.decide(ctx, unit, arrived, logits),
            Phase::Decode { unit, speaking: true, end: false, .. } => self.speak(ctx, unit, logits),
            _ => Ok(()),
        }
    }

    fn fail(&mut self, ctx: &mut Ctx, why: &str) {
        self.end(ctx, DuplexEnd::Failed(why.to_string()));
    }

    fn ended(&self, _ctx: &Ctx) -> bool {
        self.gone
    }
}
