//! Stage 0's duplex streams (model-native full duplex).
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
//! 4. when speaking: decode at most [`MAX_UNIT_TEXT_TOKENS`] text tokens, ending with `<|chunk_eos|>`
//!    (the turn goes on next unit) or `<|turn_eos|>` (the turn is over); every sampled token is fed
//!    back, so the KV holds exactly what was said;
//! 5. hand the unit's text (ids and last-layer hidden rows, `<|turn_eos|>` included, `<|speak|>` and
//!    `<|chunk_eos|>` not) to the Talker as one segment. A listening unit closes an open turn.
//!
//! A spoken turn is an ordinary engine request (`{session}/t{n}`) from the Talker on: its text
//! deltas, audio and `Done` reach the session through [`DuplexEvent::Response`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};

use super::stage0::Stage0;
use super::{DuplexEvent, DuplexPolicy, DuplexSink, DuplexSpec, EngineEvent, Mode, RequestId, Stage1Msg, Status};
use antiphon_models::decoder::KvCache;
use antiphon_models::sampling::{LengthPolicy, Sampler};
use antiphon_models::tokenizer::TextStream;

/// Text tokens a spoken unit carries at most (the reference policy's per-unit budget; part of the
/// wire contract, so it lives in the protocol crate).
pub use antiphon_protocol::DUPLEX_UNIT_MAX_TEXT_TOKENS as MAX_UNIT_TEXT_TOKENS;
/// Text tokens per spoken unit under `speak_every` when the session does not force a number.
pub const DEFAULT_FORCED_UNIT_TOKENS: usize = 8;

pub(super) enum Phase {
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

pub(super) struct DuplexStream {
    pub spec: DuplexSpec,
    sink: DuplexSink,
    pub cache: KvCache,
    enc: KvCache,
    units: VecDeque<(Vec<f32>, Instant)>,
    next_unit: u64,
    pub prefill: Option<Tensor>,
    pub prefill_pos: usize,
    pub phase: Phase,
    sampler: Sampler,
    length: LengthPolicy,
    turn: Option<OpenTurn>,
    turns: u64,
    /// Ended (closed, context full or failed): removed after the step.
    pub gone: bool,
}

impl DuplexStream {
    /// Has a forward to run this step.
    pub fn has_work(&self) -> bool {
        self.prefill.is_some() || matches!(self.phase, Phase::Decode { .. })
    }

    /// The embeddings this stream feeds next (at most `budget` prefill rows).
    pub fn next_embeds(&self, thinker: &antiphon_models::thinker::Thinker, budget: &mut usize) -> Result<Option<Tensor>> {
        if let Some(p) = &self.prefill {
            let n = (p.dim(0)? - self.prefill_pos).min(*budget);
            if n == 0 {
                return Ok(None);
            }
            *budget -= n;
            return Ok(Some(p.narrow(0, self.prefill_pos, n)?));
        }
        match self.phase {
            Phase::Decode { next, .. } => Ok(Some(thinker.llm.embed(&[next])?)),
            _ => Ok(None),
        }
    }
}

impl Stage0 {
    /// Opens a duplex stream: the system prompt (with the reference voice's embeddings when the
    /// Thinker hears the reference) is queued for prefill.
    pub(super) fn duplex_open(&mut self, spec: DuplexSpec, sink: DuplexSink) {
        let built: Result<(Vec<u32>, Tensor)> = (|| {
            let s = *self.tok.special();
            let instructions = spec.instructions.clone().unwrap_or_else(|| "Streaming Omni Conversation.".into());
            let mut audio = Vec::new();
            let mut parts: Vec<Result<&str, u32>> = vec![Err(s.im_start), Ok("system\n"), Ok(instructions.as_str())];
            if self.cfg.thinker_hears_reference {
                let r16 = antiphon_audio::resample(&spec.voice.samples, spec.voice.sample_rate, 16_000)?;
                let emb = self.thinker.encode_clip(&r16[..r16.len().min(16_000 * 6)])?;
                parts.push(Ok("\n"));
                parts.push(Err(s.audio_start));
                parts.extend(std::iter::repeat_n(Err(s.unk), emb.dim(0)?));
                parts.push(Err(s.audio_end));
                audio.push(emb);
            }
            parts.push(Err(s.im_end));
            parts.push(Ok("\n"));
            let ids = self.tok.render_parts(&parts)?;
            let embeds = self.thinker.embed_with_audio(&ids, &s.audio_markers(), &audio)?;
            Ok((ids, embeds))
        })();
        let (ids, embeds) = match built.context("building the duplex system prompt") {
            Ok(v) => v,
            Err(e) => return sink(DuplexEvent::Closed { reason: format!("failed: {e:#}") }),
        };
        let mut params = self.cfg.thinker_sampling.clone();
        if let Some(t) = spec.generation.temperature {
            params.temperature = t;
        }
        let mut sampler = Sampler::new(params, spec.generation.seed.unwrap_or(0));
        sampler.observe(&ids);
        self.duplex.retain(|d| d.spec.session != spec.session);
        self.duplex.push(DuplexStream {
            cache: self.thinker.llm.new_cache(),
            enc: self.thinker.apm.new_cache(),
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
        });
    }

    pub(super) fn duplex_unit(&mut self, session: &str, samples: Vec<f32>, arrived: Instant) {
        if let Some(d) = self.duplex.iter_mut().find(|d| d.spec.session == session) {
            d.units.push_back((samples, arrived));
        }
    }

    /// Ends a stream: its open turn is cancelled and `Closed { reason }` is its last event.
    pub(super) fn duplex_end(&mut self, j: usize, reason: &str) {
        let d = &mut self.duplex[j];
        if d.gone {
            return;
        }
        d.gone = true;
        if let Some(t) = d.turn.take() {
            if self.registry.finish(&t.id, 0, Status::Cancelled).is_some() {
                self.metrics.requests.with_label_values(&["cancelled"]).inc();
            }
        }
        (d.sink)(DuplexEvent::Closed { reason: reason.to_string() });
    }

    pub(super) fn duplex_close(&mut self, session: &str) {
        if let Some(j) = self.duplex.iter().position(|d| d.spec.session == session) {
            self.duplex_end(j, "closed");
            self.duplex.remove(j);
        }
    }

    /// Starts the next unit of every idle stream that has one: the units are encoded in one
    /// batch, then queued for prefill.
    pub(super) fn duplex_intake(&mut self) {
        let ctx = self.thinker.llm.decoder().config().max_positions;
        let limit = self.cfg.duplex_max_context.map_or(ctx, |c| c.min(ctx));
        let mut picked: Vec<(usize, Vec<f32>, Instant, u64)> = Vec::new();
        let mut full = Vec::new();
        for (j, d) in self.duplex.iter_mut().enumerate() {
            if !matches!(d.phase, Phase::Idle) || d.gone {
                continue;
            }
            let Some((x, t)) = d.units.pop_front() else {
                continue;
            };
            // the unit's markers and audio, and a whole spoken unit after it
            let need = d.cache.len() + 2 + x.len() / 1600 + MAX_UNIT_TEXT_TOKENS + 2;
            if need > limit {
                full.push(j);
                continue;
            }
            picked.push((j, x, t, d.next_unit));
            d.next_unit += 1;
        }
        for j in full {
            tracing::info!(session = %self.duplex[j].spec.session, "duplex context full");
            self.duplex_end(j, "context_full");
        }
        if picked.is_empty() {
            return;
        }
        let encoded = {
            let mut items: Vec<(&mut KvCache, &[f32])> = Vec::with_capacity(picked.len());
            let mut it = picked.iter().peekable();
            for (j, d) in self.duplex.iter_mut().enumerate() {
                if let Some(p) = it.next_if(|p| p.0 == j) {
                    items.push((&mut d.enc, p.1.as_slice()));
                }
            }
            self.thinker.encode_units(&mut items)
        };
        let encoded = match encoded {
            Ok(e) => e,
            Err(e) => {
                let why = format!("failed: audio encoder: {e:#}");
                for (j, ..) in picked {
                    self.duplex_end(j, &why);
                }
                return;
            }
        };
        let s = *self.tok.special();
        for ((j, _, arrived, unit), rows) in picked.into_iter().zip(encoded) {
            let ids: Vec<u32> = if unit > 0 { vec![s.unit_end, s.unit] } else { vec![s.unit] };
            let built = self.thinker.llm.embed(&ids).and_then(|e| {
                let rows = rows.to_dtype(e.dtype())?;
                Tensor::cat(&[e, rows], 0)
            });
            let d = &mut self.duplex[j];
            match built {
                Ok(embeds) => {
                    d.sampler.observe(&ids);
                    d.prefill = Some(embeds);
                    d.prefill_pos = 0;
                    d.phase = Phase::Unit { unit, arrived };
                }
                Err(e) => self.duplex_end(j, &format!("failed: {e}")),
            }
        }
    }

    /// After a forward of stream `j` (its new rows `hidden`): the row to sample from, if any.
    pub(super) fn duplex_after_forward(&mut self, j: usize, hidden: &Tensor) -> Result<Option<Tensor>> {
        let s = *self.tok.special();
        let specials = s.all();
        let rows = hidden.dim(0)?;
        let last = hidden.narrow(0, rows - 1, 1)?;
        let d = &mut self.duplex[j];
        match d.phase {
            Phase::Idle => Ok(None),
            Phase::System | Phase::Unit { .. } => {
                d.prefill_pos += rows;
                let total = d.prefill.as_ref().map(|p| p.dim(0)).transpose()?.unwrap_or(0);
                if d.prefill_pos < total {
                    return Ok(None);
                }
                d.prefill = None;
                if matches!(d.phase, Phase::System) {
                    d.phase = Phase::Idle;
                    return Ok(None);
                }
                Ok(Some(last))
            }
            Phase::Decode { next, speaking, end, .. } => {
                if speaking {
                    if let Some(t) = d.turn.as_mut() {
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
                d.phase = Phase::Idle;
                if speaking {
                    if let Some(t) = d.turn.as_mut() {
                        let ids = std::mem::take(&mut t.seg_ids);
                        let rows = std::mem::take(&mut t.seg_rows);
                        let turn_end = t.turn_end;
                        let hidden = if rows.is_empty() { None } else { Some(super::stage0::to_host(&Tensor::cat(&rows, 0)?)?) };
                        let id = t.id.clone();
                        if turn_end {
                            d.turn = None;
                            self.registry.mark(&id, |t| t.handoff = Some(Instant::now()));
                        }
                        let _ = self.to_talker.send(Stage1Msg::Segment { id, epoch: 0, ids, hidden, turn_end });
                    }
                }
                Ok(None)
            }
        }
    }

    /// Samples stream `j`'s next token from `logits` (the decision of a unit, or the next text
    /// token of a spoken unit).
    pub(super) fn duplex_sample(&mut self, j: usize, logits: &[f32]) -> Result<()> {
        let s = *self.tok.special();
        let specials = s.all();
        let d = &mut self.duplex[j];
        match d.phase {
            Phase::Unit { unit, arrived } => {
                let lag_ms = arrived.elapsed().as_secs_f64() * 1000.0;
                let (speak, first) = match d.spec.policy {
                    DuplexPolicy::SpeakEvery(k) => {
                        let sp = (unit + 1) % k.max(1) == 0;
                        (sp, if sp { s.speak } else { s.listen })
                    }
                    DuplexPolicy::Model => {
                        let forbid = [
                            s.tts_pad,
                            s.tts_bos,
                            s.tts_eos,
                            s.unit,
                            s.unit_end,
                            s.audio_start,
                            s.audio_end,
                            s.im_start,
                            s.im_end,
                            s.think,
                            s.think_end,
                            s.unk,
                            s.endoftext,
                            s.chunk_eos,
                            s.chunk_tts_eos,
                            s.turn_eos,
                        ];
                        let t = d.sampler.sample(logits, &forbid);
                        (t != s.listen, t)
                    }
                };
                if matches!(d.spec.policy, DuplexPolicy::SpeakEvery(_)) {
                    d.sampler.observe(&[first]);
                }
                let context = d.cache.len();
                if !speak {
                    if let Some(t) = d.turn.take() {
                        // listening closes the open turn: the Talker drains it
                        if self.registry.is_live(&t.id, 0) {
                            self.registry.mark(&t.id, |x| x.handoff = Some(Instant::now()));
                            let _ = self.to_talker.send(Stage1Msg::Segment { id: t.id, epoch: 0, ids: vec![], hidden: None, turn_end: true });
                        }
                    }
                    (d.sink)(DuplexEvent::Listen { unit, context, lag_ms });
                    d.phase = Phase::Decode { unit, next: s.listen, speaking: false, end: true };
                    return Ok(());
                }
                // speaking: continue the open turn, or open one
                if d.turn.as_ref().is_some_and(|t| !self.registry.is_live(&t.id, 0)) {
                    d.turn = None;
                }
                let new_turn = d.turn.is_none();
                if new_turn {
                    d.turns += 1;
                    let id = RequestId(format!("{}/t{}", d.spec.session, d.turns));
                    let sink = d.sink.clone();
                    let tid = id.clone();
                    let turn_sink: super::EventSink = Arc::new(move |event: EngineEvent| sink(DuplexEvent::Response { turn: tid.clone(), event }));
                    if !self.registry.insert(id.clone(), 0, turn_sink) {
                        anyhow::bail!("duplex turn {id} is already live");
                    }
                    let g = &d.spec.generation;
                    let _ = self.to_talker.send(Stage1Msg::Begin {
                        id: id.clone(),
                        epoch: 0,
                        mode: Mode::Duplex,
                        voice: d.spec.voice.clone(),
                        min_codes: g.min_audio_tokens.unwrap_or(0),
                        max_codes: g.max_audio_tokens.unwrap_or(self.cfg.duplex_drain_codes),
                        seed: g.seed.unwrap_or(0).wrapping_add(d.turns),
                    });
                    d.turn = Some(OpenTurn { id, text: TextStream::new(), seg_ids: vec![], seg_rows: vec![], turn_end: false });
                }
                let turn = d.turn.as_ref().expect("open").id.clone();
                (d.sink)(DuplexEvent::Speak { unit, turn: turn.clone(), new_turn, context, lag_ms });
                let g = &d.spec.generation;
                let first_is_text = !specials.contains(&first);
                d.length = match d.spec.policy {
                    DuplexPolicy::SpeakEvery(_) => {
                        let n = g.min_text_tokens.or(g.max_text_tokens).unwrap_or(DEFAULT_FORCED_UNIT_TOKENS).min(MAX_UNIT_TEXT_TOKENS);
                        LengthPolicy::new(vec![s.chunk_eos], n, n)
                    }
                    DuplexPolicy::Model => {
                        let max = g.max_text_tokens.unwrap_or(MAX_UNIT_TEXT_TOKENS).min(MAX_UNIT_TEXT_TOKENS) - usize::from(first_is_text);
                        let min = g.min_text_tokens.unwrap_or(0).min(max);
                        LengthPolicy::new(vec![s.chunk_eos, s.chunk_tts_eos, s.turn_eos, s.im_end], min, max)
                    }
                };
                if let Some(t) = d.turn.as_mut() {
                    t.turn_end = false;
                    if first_is_text {
                        let delta = t.text.push(&self.tok, first)?;
                        if !delta.is_empty() {
                            self.registry.emit(&turn, 0, EngineEvent::TextDelta(delta));
                        }
                    }
                }
                d.phase = Phase::Decode { unit, next: first, speaking: true, end: false };
            }
            Phase::Decode { unit, speaking: true, end: false, .. } => {
                let mut forbid = vec![
                    s.listen,
                    s.speak,
                    s.unit,
                    s.unit_end,
                    s.tts_pad,
                    s.tts_bos,
                    s.tts_eos,
                    s.audio_start,
                    s.audio_end,
                    s.im_start,
                    s.think,
                    s.think_end,
                    s.unk,
                    s.endoftext,
                ];
                if matches!(d.spec.policy, DuplexPolicy::SpeakEvery(_)) {
                    forbid.extend([s.turn_eos, s.chunk_tts_eos, s.im_end]);
                }
                let t = d.length.next(&mut d.sampler, logits, &forbid);
                let ends = [s.chunk_eos, s.chunk_tts_eos, s.turn_eos, s.im_end];
                if ends.contains(&t) {
                    if let Some(turn) = d.turn.as_mut() {
                        turn.turn_end = t == s.turn_eos || t == s.im_end;
                    }
                    d.phase = Phase::Decode { unit, next: t, speaking: true, end: true };
                    return Ok(());
                }
                if let Some(turn) = d.turn.as_mut() {
                    let delta = turn.text.push(&self.tok, t)?;
                    if !delta.is_empty() {
                        self.registry.emit(&turn.id, 0, EngineEvent::TextDelta(delta));
                    }
                }
                d.phase = Phase::Decode { unit, next: t, speaking: true, end: false };
            }
            _ => {}
        }
        Ok(())
    }
}
