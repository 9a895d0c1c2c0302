//! A turn-mode request as a Thinker stream: its prompt is built at admission (`prompt.rs`),
//! prefilled in chunks from the longest prefix the prefix store already holds, then the reply is
//! decoded token by token with text deltas, and handed to the Talker at `<|tts_eos|>` (or, with
//! streaming prefill, row by row as it is written). A tool call is cut from the speech, reported,
//! and ends the reply; a reply with nothing to speak ends here, without the Talker.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};

use super::prompt::{build_prompt, embed_prompt, reply_opening};
use super::{to_host, Ctx, ThinkerStream};
use crate::caches::StageCaches;
use crate::metric_labels::{PrefixLookup, PromptSource, StepKind, ToolCallOutcome};
use crate::{
    EngineEvent, Mode, RequestId, RequestSpec, Status, TalkerMsg, Task, ToolCall, ToolSet,
};
use antiphon_models::decoder::{KvCache, PooledCache};
use antiphon_models::sampling::{LengthPolicy, Sampler};
use antiphon_models::tokenizer::{handoff_range, TextStream};
use antiphon_models::tools::CallError;
use antiphon_models::top_k::LogitsRow;
use antiphon_protocol::ToolCallProblem;

/// The fewest shared positions worth a copy from the prefix store.
const MIN_SHARED: usize = 8;

pub struct TurnStream {
    id: RequestId,
    cache: PooledCache,
    /// The prompt's embeddings from `prefill_from` (the positions before were held already);
    /// those from `prefill_pos` are not prefilled yet.
    prefill: Option<Tensor>,
    prefill_from: usize,
    prefill_pos: usize,
    /// Prompt + generated ids.
    ids: Vec<u32>,
    /// The prompt's ids as the prefix store knows them (spoken clips keyed by their content).
    key: Vec<u32>,
    prompt_len: usize,
    next: Option<u32>,
    sampler: Sampler,
    length: LengthPolicy,
    text: TextStream,
    /// Last-layer hidden rows of generated tokens (f32), for the Talker.
    rows: Vec<Tensor>,
    /// Rows already sent to the Talker (streaming prefill, or text chunks).
    streamed: usize,
    /// Text chunks of this many rows go to the Talker as they are written (0: the whole reply at
    /// its end).
    text_chunk: usize,
    /// The reference voice's content key (0 when the Thinker does not hear it).
    voice: u64,
    /// The system turn's length, when its KV should go into the prefix store once prefilled.
    store_system: Option<usize>,
    /// Handed off to the Talker, or failed.
    done: bool,
    /// Tokens the reply begins with, taken before sampling (`generation.prefix`, then the opening
    /// of a call `tool_choice` requires).
    forced: VecDeque<u32>,
    /// The tools the reply may call (`None`: it calls none; their tags are forbidden).
    calling: Option<Arc<ToolSet>>,
    /// Where the reply's `<tool_call>` is in `ids`: the speech ends before it.
    call_at: Option<usize>,
    /// Text only: nothing goes to the Talker, and the Thinker ends the request.
    text_only: bool,
    /// The turn's KV goes to the prefix store when it is handed off (a reply's does: the next
    /// prompt starts with it).
    kept: bool,
    /// Handed off this step: the turn's KV goes to the prefix store once every stream of the
    /// step has handed off (a copy of ~4 ms at full size, which held back the later Ends of a
    /// wave: 29 hand-offs took a 135 ms step at C32 on the H200).
    prefix_due: bool,
}

/// Stores a prompt prefix's KV in the prefix store. Only an optimisation: a failed copy is logged,
/// and the stream goes on.
fn store_prefix(ctx: &mut Ctx, voice: u64, key: Vec<u32>, cache: &KvCache) {
    match cache.snapshot(key.len()) {
        Ok(kv) => {
            let bytes = kv.bytes();
            ctx.prefixes.insert(voice, key, kv, bytes)
        }
        Err(e) => tracing::warn!("prefix store copy failed: {e:#}"),
    }
}

impl TurnStream {
    pub fn id(&self) -> &RequestId {
        &self.id
    }

    /// Builds the request's prompt, tells the Talker to expect it, and finds the longest prompt
    /// prefix whose KV is already held. `None` when it failed (its `Done` is sent) or is gone.
    pub fn admit(ctx: &mut Ctx, caches: &StageCaches, spec: RequestSpec) -> Option<Self> {
        if !ctx.registry.is_live(&spec.id) {
            return None;
        }
        let t0 = Instant::now();
        let prompt = match build_prompt(ctx, &spec).context("building the prompt") {
            Ok(v) => v,
            Err(e) => {
                ctx.fail(&spec.id, format!("{e:#}"));
                return None;
            }
        };
        if prompt.dropped > 0 {
            ctx.registry
                .emit(&spec.id, crate::EngineEvent::HistoryTrimmed { turns: prompt.dropped });
        }
        let ids = &prompt.ids;
        let context = ctx.context();
        if ids.len() >= context {
            let why = format!(
                "the prompt (`instructions`, the conversation and `text`) has {} \
                tokens; the context holds {context}",
                ids.len()
            );
            ctx.refuse(&spec.id, why);
            return None;
        }
        let g = &spec.generation;
        let s = *ctx.tok.special();
        let max = g.max_text_tokens.unwrap_or(ctx.cfg.default_max_text_tokens);
        let min = g.min_text_tokens.unwrap_or(0);
        if !crate::fit::prompt_and_reply_fit(ids.len(), max, context) {
            let why = format!(
                "field `generation.max_text_tokens`: {max}; the prompt ({} positions) and the \
                reply do not fit the context ({context})",
                ids.len()
            );
            ctx.refuse(&spec.id, why);
            return None;
        }
        let mut params = ctx.cfg.thinker.sampling.clone();
        if let Some(t) = g.temperature {
            params.temperature = t;
        }
        let seed = g.seed.unwrap_or(0);
        let mut sampler = Sampler::new(params, seed);
        sampler.observe(ids);
        // (a transcript is written, from the input alone: nothing begins it, nothing is spoken,
        // and its KV serves no later prompt)
        let transcript = spec.task == Task::Transcribe;
        let text_only = spec.text_only || transcript;
        let forced = match reply_opening(ctx, &spec) {
            Ok(_) if transcript => VecDeque::new(),
            Ok(f) => f,
            Err(e) => {
                ctx.refuse(&spec.id, format!("{e:#}"));
                return None;
            }
        };
        // (text chunks only on an engine that holds few requests: `talker.text_chunk_streams`)
        let text_chunk = match spec.mode {
            Mode::Turn => ctx.cfg.talker.text_chunk_for(ctx.registry.live_count()),
            Mode::Duplex => 0,
        };
        if !text_only {
            let _ = ctx.to_talker.send(TalkerMsg::Begin {
                id: spec.id.clone(),
                mode: spec.mode,
                voice: spec.voice.clone(),
                min_codes: g.min_audio_tokens.unwrap_or(match spec.mode {
                    Mode::Turn => ctx.cfg.default_min_audio_tokens,
                    Mode::Duplex => 0,
                }),
                max_codes: g.max_audio_tokens.unwrap_or(ctx.cfg.default_max_audio_tokens),
                text_tokens: (min == max).then_some(max),
                text_chunk,
                seed: seed.wrapping_add(1),
            });
        }
        let prompt_len = ids.len();
        // the KV of the longest prompt prefix seen before (the system turn with the voice, or
        // this conversation up to its last turn, its spoken turns included, or another voice's
        // system turn up to the voice)
        let voice = if ctx.cfg.thinker.hears_reference { spec.voice.content_key() } else { 0 };
        let system = ids
            .iter()
            .position(|&t| t == s.im_end)
            .map(|end| end + 1)
            .filter(|&len| len < prompt_len);
        // a finished stream's cache (its buffers and captured decode step) when one fits
        let mut cache = match caches.take(ctx.thinker.llm.decoder(), prompt_len + max + 8) {
            Ok(c) => c,
            Err(e) => {
                ctx.fail(&spec.id, format!("thinker cache: {e:#}"));
                return None;
            }
        };
        let mut prefill_pos = 0;
        if ctx.cfg.thinker.prefix_cache > 0 {
            // (at least one prompt position is prefilled: its logits start the reply)
            // (another voice's entry serves the head before this voice's rows: a new voice's
            // system turn starts from the template and text every system turn begins with)
            let voice_free =
                ids.iter().position(|&t| t == s.audio_markers().placeholder).unwrap_or(ids.len());
            match ctx.prefixes.lookup(voice, &prompt.key, prompt_len - 1, voice_free, MIN_SHARED) {
                Some((hit, len)) => match cache.load_prefix(hit, len) {
                    Ok(()) => {
                        prefill_pos = len;
                        ctx.metrics.prefix_cache.at(PrefixLookup::Hit).inc();
                    }
                    Err(e) => {
                        tracing::warn!("prefix cache copy failed: {e:#}");
                        cache.truncate(0);
                    }
                },
                None => ctx.metrics.prefix_cache.at(PrefixLookup::Miss).inc(),
            }
        }
        let embeds = embed_prompt(ctx, &prompt, prefill_pos).context("embedding the prompt");
        ctx.metrics.step_seconds.at(StepKind::ThinkerPrompt).observe(t0.elapsed().as_secs_f64());
        let embeds = match embeds {
            Ok(e) => e,
            Err(e) => {
                ctx.fail(&spec.id, format!("{e:#}"));
                return None;
            }
        };
        let audio_positions = prompt.ids.iter().filter(|&&t| t == s.unk).count();
        ctx.registry.usage(&spec.id, |u| {
            (u.input, u.input_audio, u.cached) = (prompt_len, audio_positions, prefill_pos)
        });
        ctx.metrics.prompt_positions.at(PromptSource::Reused).inc_by(prefill_pos as u64);
        ctx.metrics
            .prompt_positions
            .at(PromptSource::Prefilled)
            .inc_by((prompt_len - prefill_pos) as u64);
        let store_system = system.filter(|&len| {
            !transcript
                && ctx.cfg.thinker.prefix_cache > 0
                && len > prefill_pos
                && !ctx.prefixes.covers(voice, &prompt.key[..len])
        });
        Some(TurnStream {
            id: spec.id,
            cache,
            prefill: Some(embeds),
            prefill_from: prefill_pos,
            prefill_pos,
            ids: prompt.ids,
            key: prompt.key,
            prompt_len,
            next: None,
            sampler,
            length: LengthPolicy::new(vec![s.tts_eos, s.im_end], min, max),
            text: TextStream::new(),
            rows: Vec::new(),
            streamed: 0,
            text_chunk,
            voice,
            store_system,
            forced,
            calling: spec
                .tools
                .may_call()
                .then(|| spec.tools.set.clone())
                .flatten()
                .filter(|_| ctx.tok.tool_tokens().is_some() && !transcript),
            call_at: None,
            text_only,
            kept: !transcript,
            done: false,
            prefix_due: false,
        })
    }

    /// Sends the text's hidden rows written since the last call (up to `upto`) to the Talker.
    fn send_rows(&mut self, ctx: &Ctx, upto: usize) -> Result<()> {
        if upto <= self.streamed {
            return Ok(());
        }
        let ids = self.ids[self.prompt_len + self.streamed..self.prompt_len + upto].to_vec();
        let hidden = to_host(&Tensor::cat(&self.rows[self.streamed..upto], 0)?)?;
        let _ = ctx.to_talker.send(TalkerMsg::Rows { id: self.id.clone(), ids, hidden });
        self.streamed = upto;
        Ok(())
    }

    /// Sends rows `streamed..upto` as the next text chunk (`last` when the text ends with it).
    fn send_chunk(&mut self, ctx: &Ctx, upto: usize, last: bool) -> Result<()> {
        let upto = upto.max(self.streamed);
        let ids = self.ids[self.prompt_len + self.streamed..self.prompt_len + upto].to_vec();
        let hidden = match upto > self.streamed {
            true => to_host(&Tensor::cat(&self.rows[self.streamed..upto], 0)?)?,
            false => Tensor::zeros(
                (0, ctx.thinker.llm.decoder().config().hidden_size),
                DType::F32,
                &candle_core::Device::Cpu,
            )?,
        };
        // (a lightly loaded Thinker launches nothing until the Talker has taken the first chunk)
        let first = self.streamed == 0;
        let hold = (first && ctx.step_streams <= ctx.cfg.gated_streams).then(|| ctx.gate.hold());
        if first {
            ctx.registry.mark(&self.id, |t| t.handoff = Some(Instant::now()));
        }
        let _ = ctx.to_talker.send(TalkerMsg::TextChunk {
            id: self.id.clone(),
            ids,
            hidden,
            last,
            hold,
        });
        self.streamed = upto;
        Ok(())
    }

    /// With text chunks: a chunk's rows go to the Talker once the token after them is written and
    /// does not end the text (as the model's streaming mode does: the last chunk is the one the
    /// text ends in).
    fn send_full_chunks(&mut self, ctx: &Ctx) -> Result<()> {
        let s = *ctx.tok.special();
        // (rows of generated tokens before a hand-off boundary; the newest token has none yet)
        let upto = (handoff_range(&self.ids, self.prompt_len, &s).end - self.prompt_len)
            .min(self.speech_rows());
        while self.text_chunk > 0
            && upto >= self.streamed + self.text_chunk
            && self.ids.len() > self.prompt_len + upto
        {
            self.send_chunk(ctx, self.streamed + self.text_chunk, false)?;
        }
        Ok(())
    }

    /// Rows of the reply's speech written so far: those before its call, if it makes one.
    fn speech_rows(&self) -> usize {
        self.call_at.map_or(self.rows.len(), |at| at - self.prompt_len).min(self.rows.len())
    }

    /// The reply is written: its rows and the end go to the Talker (or its last text chunk), and
    /// the turn's KV to the prefix store for the conversation's next prompt, which starts with it.
    /// A reply with nothing to speak (text only, or a call with nothing said before it) ends here.
    fn hand_off(&mut self, ctx: &mut Ctx) -> Result<()> {
        self.done = true;
        self.prefix_due = true;
        let written = self.length.generated();
        ctx.registry.usage(&self.id, |u| u.output_text = written);
        let s = *ctx.tok.special();
        let range = handoff_range(&self.ids, self.prompt_len, &s);
        // (rows exist for every generated token fed back, i.e. all before the end)
        let upto = (range.end - self.prompt_len).min(self.speech_rows());
        let silent_call = self.call_at.is_some()
            && ctx
                .tok
                .decode(&self.ids[self.prompt_len..self.prompt_len + upto])?
                .trim()
                .is_empty();
        if self.text_only || silent_call {
            let _ = ctx.to_talker.send(TalkerMsg::Cancel(self.id.clone()));
            ctx.registry.finish_counted(&self.id, Status::Completed, &ctx.metrics.requests);
            return Ok(());
        }
        if self.text_chunk > 0 {
            self.send_chunk(ctx, upto, true)?;
        } else {
            self.send_rows(ctx, upto)?;
            ctx.registry.mark(&self.id, |t| t.handoff = Some(Instant::now()));
            let _ = ctx.to_talker.send(TalkerMsg::End { id: self.id.clone() });
        }
        Ok(())
    }

    /// The reply's call closed (or could not): the call, or why it is none, goes to the client.
    fn report_call(&self, ctx: &Ctx, closed: bool) -> Result<()> {
        let (Some(at), Some(tools)) = (self.call_at, &self.calling) else { return Ok(()) };
        let text = ctx.tok.decode(&self.ids[at + 1..])?;
        let event = match closed {
            true => match ToolCall::parse(&text, tools) {
                Ok(call) => EngineEvent::ToolCall(call),
                Err(e) => EngineEvent::ToolCallInvalid {
                    text,
                    reason: call_problem(&e),
                    message: e.to_string(),
                },
            },
            false => EngineEvent::ToolCallInvalid {
                text,
                reason: ToolCallProblem::Unclosed,
                message: "the reply ended inside its call (no `</tool_call>`)".into(),
            },
        };
        let outcome = match &event {
            EngineEvent::ToolCall(_) => ToolCallOutcome::Valid,
            _ if closed => ToolCallOutcome::Invalid,
            _ => ToolCallOutcome::Unterminated,
        };
        ctx.metrics.tool_calls.at(outcome).inc();
        ctx.registry.emit(&self.id, event);
        Ok(())
    }
}

impl ThinkerStream for TurnStream {
    fn input(&self, ctx: &Ctx, budget: &mut usize) -> Result<Option<Tensor>> {
        if let Some(p) = &self.prefill {
            let total = p.dim(0)?;
            if *budget == 0 {
                return Ok(None);
            }
            let at = self.prefill_pos - self.prefill_from;
            let n = (total - at).min(*budget);
            *budget -= n;
            return Ok(Some(p.narrow(0, at, n)?));
        }
        match self.next {
            Some(t) => Ok(Some(ctx.thinker.llm.embed(&[t])?)),
            None => Ok(None),
        }
    }

    fn cache(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    fn after_forward(&mut self, ctx: &mut Ctx, hidden: &Tensor) -> Result<Option<Tensor>> {
        let rows = hidden.dim(0)?;
        if let Some(p) = &self.prefill {
            self.prefill_pos += rows;
            if self.prefill_pos < self.prefill_from + p.dim(0)? {
                return Ok(None);
            }
            self.prefill = None;
            if let Some(len) = self.store_system.take() {
                if !ctx.prefixes.covers(self.voice, &self.key[..len]) {
                    store_prefix(ctx, self.voice, self.key[..len].to_vec(), &self.cache);
                }
            }
        } else {
            // the fed token was generated: keep its row for the Talker
            self.rows.push(hidden.narrow(0, rows - 1, 1)?.to_dtype(DType::F32)?);
        }
        Ok(Some(hidden.narrow(0, rows - 1, 1)?))
    }

    fn on_logits(&mut self, ctx: &mut Ctx, logits: &LogitsRow) -> Result<()> {
        if !ctx.registry.is_live(&self.id) {
            self.done = true;
            return Ok(());
        }
        if self.next.is_none() {
            ctx.registry.mark(&self.id, |t| {
                t.first_token.get_or_insert_with(std::time::Instant::now);
            });
        }
        let tok = match self.forced.pop_front() {
            Some(t) if !self.length.full() => {
                self.length.force(&mut self.sampler, t);
                t
            }
            _ => {
                let forbid = if self.calling.is_some() {
                    &ctx.forbidden.reply_calling
                } else {
                    &ctx.forbidden.reply
                };
                self.length.next_row(&mut self.sampler, logits, forbid)?
            }
        };
        let s = *ctx.tok.special();
        if tok == s.tts_eos || tok == s.im_end {
            self.report_call(ctx, false)?;
            return self.hand_off(ctx);
        }
        let tags = ctx.tok.tool_tokens().copied().filter(|_| self.calling.is_some());
        if let Some(tags) = tags {
            if self.call_at.is_none() && tok == tags.call {
                // the speech ends here; the call is written, not said
                self.call_at = Some(self.ids.len());
            } else if self.call_at.is_some() && tok == tags.call_end {
                // one call a reply: its result comes back as the next turn
                self.report_call(ctx, true)?;
                self.ids.push(tok);
                return self.hand_off(ctx);
            }
        }
        self.ids.push(tok);
        self.next = Some(tok);
        if self.call_at.is_some() {
            return Ok(());
        }
        if self.text_chunk > 0 {
            self.send_full_chunks(ctx)?;
        }
        let delta = self.text.push(&ctx.tok, tok)?;
        if !delta.is_empty() {
            ctx.registry.emit(&self.id, crate::EngineEvent::TextDelta(delta));
        }
        Ok(())
    }

    /// Streaming prefill: the Talker gets every row written so far.
    fn after_step(&mut self, ctx: &mut Ctx) -> Result<()> {
        if ctx.cfg.talker.streaming_prefill && self.text_chunk == 0 && !self.text_only {
            self.send_rows(ctx, self.speech_rows())?;
        }
        Ok(())
    }

    fn after_hand_offs(&mut self, ctx: &mut Ctx) {
        if !std::mem::take(&mut self.prefix_due) || !self.kept {
            return;
        }
        let len = self.cache.len().min(self.ids.len());
        if ctx.cfg.thinker.prefix_cache > 0 && len >= MIN_SHARED {
            // the prompt as the store knows it, then the reply as written
            let key =
                self.key.iter().chain(&self.ids[self.prompt_len..]).take(len).copied().collect();
            store_prefix(ctx, self.voice, key, &self.cache);
        }
    }

    fn fail(&mut self, ctx: &mut Ctx, why: &str) {
        self.done = true;
        ctx.fail(&self.id, why.to_string());
    }

    fn ended(&self, ctx: &Ctx) -> bool {
        self.done || !ctx.registry.is_live(&self.id)
    }

    fn before_first_hand_off(&self) -> bool {
        !self.done && !self.text_only && self.streamed == 0
    }
}

/// The wire's word for what is wrong with a call.
fn call_problem(e: &CallError) -> ToolCallProblem {
    match e {
        CallError::NotJson(_) | CallError::NotAnObject => ToolCallProblem::NotJson,
        CallError::NoName => ToolCallProblem::NoName,
        CallError::Undeclared(_) => ToolCallProblem::UndeclaredTool,
        CallError::ArgumentsNotAnObject | CallError::ArgumentsStringNotAnObject => {
            ToolCallProblem::BadArguments
        }
    }
}
