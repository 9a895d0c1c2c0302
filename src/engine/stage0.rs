//! Stage 0, the Thinker loop: admit requests (build the prompt, encode audio, splice), then advance
//! all of them together — chunked prefill and one-token decode steps in the same batched forward —
//! emitting text deltas, and hand each one to the Talker at `<|tts_eos|>` (or, with streaming
//! prefill, row by row as the text is written).

use std::collections::VecDeque;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};

use super::duplex::DuplexStream;
use super::prefix::PrefixStore;
use super::{EngineConfig, EngineMetrics, Mode, Registry, RequestId, RequestSpec, Stage0Msg, Stage1Msg, StageLoop, Status, UserInput};
use antiphon_models::decoder::{CachePool, KvCache, PooledCache, StreamStep};
use antiphon_models::sampling::{LengthPolicy, Sampler};
use antiphon_models::thinker::Thinker;
use antiphon_models::tokenizer::{handoff_range, Message, Part, Role, TextStream, TextTokenizer};

struct Active {
    id: RequestId,
    epoch: u64,
    cache: PooledCache,
    /// Prompt embeddings still to prefill.
    prefill: Option<Tensor>,
    prefill_pos: usize,
    /// Prompt + generated ids.
    ids: Vec<u32>,
    prompt_len: usize,
    next: Option<u32>,
    sampler: Sampler,
    length: LengthPolicy,
    text: TextStream,
    /// Hidden rows of generated tokens, in order.
    rows: Vec<Tensor>,
    /// Rows already streamed to the Talker.
    streamed: usize,
    /// The voice heard in the system turn (0: none), for the prefix store.
    voice: u64,
    /// The system turn's length, when its KV is to be stored once prefilled.
    store_system: Option<usize>,
    /// Positions whose KV is fixed by their ids (up to the first user audio clip): what a
    /// finished turn may leave in the prefix store.
    shareable: usize,
}

pub struct Stage0 {
    pub(super) thinker: Thinker,
    pub(super) tok: TextTokenizer,
    pub(super) cfg: Arc<EngineConfig>,
    pub(super) registry: Registry,
    pub(super) metrics: EngineMetrics,
    pub(super) to_talker: SyncSender<Stage1Msg>,
    queue: VecDeque<RequestSpec>,
    active: Vec<Active>,
    /// Duplex sessions' long-lived streams (see [`super::duplex`]).
    pub(super) duplex: Vec<DuplexStream>,
    forbid: Vec<u32>,
    /// The audio encoder's embeddings of recent reference voices, by content: the same voice in
    /// every system prompt is encoded once.
    ref_embeds: Recent<Tensor>,
    /// KV of recent system turns and finished turns, found by the longest shared run of ids.
    prefixes: PrefixStore<KvCache>,
    /// Caches of finished turn-mode streams, for the next ones (their decode graphs with them).
    caches: CachePool,
}

/// Reference voices whose embeddings Stage 0 keeps.
const REF_EMBED_CACHE: usize = 8;

/// A few values by content key, most recently used first; the least recent goes beyond `cap`.
struct Recent<V> {
    entries: VecDeque<(u64, V)>,
    cap: usize,
}

impl<V> Recent<V> {
    fn new(cap: usize) -> Self {
        Self { entries: VecDeque::new(), cap }
    }

    /// The value, now the most recent.
    fn get(&mut self, key: u64) -> Option<&V> {
        let i = self.entries.iter().position(|(k, _)| *k == key)?;
        let hit = self.entries.remove(i).expect("found");
        self.entries.push_front(hit);
        self.entries.front().map(|(_, v)| v)
    }

    fn insert(&mut self, key: u64, value: V) {
        self.entries.retain(|(k, _)| *k != key);
        self.entries.push_front((key, value));
        self.entries.truncate(self.cap);
    }
}

/// Thinker caches are made with room for a multiple of this many positions: a conversation
/// grows by its turns, and a stream that outgrows the pooled caches needs a new one, whose decode
/// step is captured anew (~10 ms). The static step's attention reads only the held positions, so
/// room costs memory (~150 KB a position at full size), not time.
const THINKER_CACHE_QUANTUM: usize = 1024;

/// The fewest shared positions worth a copy from the prefix store.
const MIN_SHARED: usize = 8;

/// Where the first audio clip after `from` (the system turn) starts: the ids before it fix their
/// embeddings; a clip's placeholders do not (`ids.len()` when there is none).
fn first_user_audio(ids: &[u32], from: usize, m: &antiphon_models::thinker::AudioMarkers) -> usize {
    ids.iter().enumerate().skip(from).find(|(_, &t)| t == m.start || t == m.placeholder).map(|(i, _)| i).unwrap_or(ids.len())
}

fn content_key(samples: &[f32], rate: u32) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    rate.hash(&mut h);
    samples.len().hash(&mut h);
    for s in samples {
        s.to_bits().hash(&mut h);
    }
    h.finish()
}

/// A stream in a batched Thinker step.
#[derive(Clone, Copy, PartialEq)]
enum Slot {
    Turn(usize),
    Duplex(usize),
}

impl Stage0 {
    pub fn new(
        thinker: Thinker,
        tok: TextTokenizer,
        cfg: Arc<EngineConfig>,
        registry: Registry,
        metrics: EngineMetrics,
        to_talker: SyncSender<Stage1Msg>,
    ) -> Self {
        let s = *tok.special();
        let prefix_cap = cfg.thinker_prefix_cache;
        let pool_cap = cfg.thinker_max_batch;
        // Tokens a spoken reply never contains (synthetic weights would otherwise emit them).
        let forbid = vec![
            s.tts_pad,
            s.tts_bos,
            s.listen,
            s.speak,
            s.unit,
            s.unit_end,
            s.chunk_eos,
            s.chunk_tts_eos,
            s.turn_eos,
            s.audio_start,
            s.audio_end,
            s.im_start,
            s.think,
            s.think_end,
            s.unk,
        ];
        Self {
            thinker,
            tok,
            cfg,
            registry,
            metrics,
            to_talker,
            queue: VecDeque::new(),
            active: Vec::new(),
            duplex: Vec::new(),
            forbid,
            ref_embeds: Recent::new(REF_EMBED_CACHE),
            prefixes: PrefixStore::new(prefix_cap),
            caches: CachePool::with_quantum(pool_cap, THINKER_CACHE_QUANTUM),
        }
    }

    fn fail(&self, id: &RequestId, epoch: u64, why: String) {
        tracing::warn!(request = %id, "thinker failed: {why}");
        if self.registry.finish(id, epoch, Status::Failed(why)).is_some() {
            self.metrics.requests.with_label_values(&["failed"]).inc();
        }
    }

    /// Prompt ids and embeddings for a request.
    /// The reference voice's audio embeddings (cached by content).
    fn reference_embeddings(&mut self, samples: &[f32], rate: u32) -> Result<Tensor> {
        let key = content_key(samples, rate);
        if let Some(hit) = self.ref_embeds.get(key) {
            return Ok(hit.clone());
        }
        let r16 = antiphon_audio::resample(samples, rate, 16_000)?;
        let emb = self.thinker.encode_clip(&r16[..r16.len().min(16_000 * 6)])?;
        self.ref_embeds.insert(key, emb.clone());
        Ok(emb)
    }

    fn build_prompt(&mut self, spec: &RequestSpec) -> Result<(Vec<u32>, Tensor)> {
        let mut audio = Vec::new();
        let mut messages = Vec::new();
        let instructions = spec.instructions.clone().unwrap_or_else(|| "You are a helpful assistant with the above voice style.".into());
        if self.cfg.thinker_hears_reference {
            let emb = self.reference_embeddings(&spec.voice.samples, spec.voice.sample_rate)?;
            messages.push(Message {
                role: Role::System,
                parts: vec![
                    Part::Text("Use the voice in the audio prompt to synthesize new content.\n".into()),
                    Part::Audio(emb.dim(0)?),
                    Part::Text(format!("\n{instructions}")),
                ],
            });
            audio.push(emb);
        } else {
            messages.push(Message::text(Role::System, instructions));
        }
        // the oldest turns give way when the conversation outgrows the context
        let ctx = self.thinker.llm.decoder().config().max_positions;
        let budget = ctx.saturating_sub(spec.generation.max_text_tokens.unwrap_or(self.cfg.default_max_text_tokens) + 64);
        let mut first = 0;
        while first < spec.history.len() {
            let tokens: usize = spec.history[first..]
                .iter()
                .map(|t| self.tok.encode(&t.user).map(|v| v.len()).unwrap_or(0) + self.tok.encode(&t.assistant).map(|v| v.len()).unwrap_or(0) + 10)
                .sum();
            if tokens <= budget / 2 {
                break;
            }
            first += 1;
        }
        for t in &spec.history[first..] {
            messages.push(Message::text(Role::User, t.user.clone()));
            messages.push(Message::text(Role::Assistant, t.assistant.clone()));
        }
        match &spec.input {
            UserInput::Text(t) => messages.push(Message::text(Role::User, t.clone())),
            UserInput::Audio(samples) => {
                let emb = self.thinker.encode_clip(samples)?;
                messages.push(Message { role: Role::User, parts: vec![Part::Audio(emb.dim(0)?)] });
                audio.push(emb);
            }
        }
        let ids = self.tok.spoken_reply_prompt(&messages)?;
        let embeds = self.thinker.embed_with_audio(&ids, &self.tok.special().audio_markers(), &audio)?;
        Ok((ids, embeds))
    }

    fn admit(&mut self, spec: RequestSpec) {
        if !self.registry.is_live(&spec.id, spec.epoch) {
            return;
        }
        let t0 = Instant::now();
        let built = self.build_prompt(&spec).context("building the prompt");
        self.metrics.step_seconds.with_label_values(&["thinker_prompt"]).observe(t0.elapsed().as_secs_f64());
        let (ids, embeds) = match built {
            Ok(v) => v,
            Err(e) => return self.fail(&spec.id, spec.epoch, format!("{e:#}")),
        };
        let ctx = self.thinker.llm.decoder().config().max_positions;
        if ids.len() >= ctx {
            return self.fail(&spec.id, spec.epoch, format!("the prompt has {} tokens; the context holds {ctx}", ids.len()));
        }
        let g = &spec.generation;
        let s = self.tok.special();
        let max = g.max_text_tokens.unwrap_or(self.cfg.default_max_text_tokens);
        let min = g.min_text_tokens.unwrap_or(0);
        let mut params = self.cfg.thinker_sampling.clone();
        if let Some(t) = g.temperature {
            params.temperature = t;
        }
        let seed = g.seed.unwrap_or(0);
        let mut sampler = Sampler::new(params, seed);
        sampler.observe(&ids);
        let codes_seed = seed.wrapping_add(1);
        let _ = self.to_talker.send(Stage1Msg::Begin {
            id: spec.id.clone(),
            epoch: spec.epoch,
            mode: spec.mode,
            voice: spec.voice.clone(),
            min_codes: g.min_audio_tokens.unwrap_or(match spec.mode {
                Mode::Turn => self.cfg.default_min_audio_tokens,
                Mode::Duplex => 0,
            }),
            max_codes: g.max_audio_tokens.unwrap_or(self.cfg.default_max_audio_tokens),
            seed: codes_seed,
        });
        let prompt_len = ids.len();
        // the KV of the longest prompt prefix seen before (the system turn with the voice, or
        // this conversation up to its last turn), up to the first user audio clip
        let voice = if self.cfg.thinker_hears_reference { content_key(&spec.voice.samples, spec.voice.sample_rate) } else { 0 };
        let system = ids.iter().position(|&t| t == s.im_end).map(|end| end + 1).filter(|&len| len < prompt_len);
        let shareable = first_user_audio(&ids, system.unwrap_or(0), &s.audio_markers());
        // a finished stream's cache (its buffers and captured decode step) when one fits
        let mut cache = match self.caches.take(self.thinker.llm.decoder(), prompt_len + max + 8) {
            Ok(c) => c,
            Err(e) => return self.fail(&spec.id, spec.epoch, format!("thinker cache: {e:#}")),
        };
        let mut prefill_pos = 0;
        if self.cfg.thinker_prefix_cache > 0 {
            // (at least one prompt position is prefilled: its logits start the reply)
            match self.prefixes.lookup(voice, &ids, shareable.min(prompt_len - 1), MIN_SHARED) {
                Some((hit, len)) => match cache.load_prefix(hit, len) {
                    Ok(()) => {
                        prefill_pos = len;
                        self.metrics.prefix_cache.with_label_values(&["hit"]).inc();
                    }
                    Err(e) => {
                        tracing::warn!("prefix cache copy failed: {e:#}");
                        cache.truncate(0);
                    }
                },
                None => self.metrics.prefix_cache.with_label_values(&["miss"]).inc(),
            }
        }
        self.metrics.prompt_positions.with_label_values(&["reused"]).inc_by(prefill_pos as u64);
        self.metrics.prompt_positions.with_label_values(&["prefilled"]).inc_by((prompt_len - prefill_pos) as u64);
        let store_system = system
            .filter(|&len| self.cfg.thinker_prefix_cache > 0 && len > prefill_pos && len <= shareable && !self.prefixes.covers(voice, &ids[..len]));
        self.active.push(Active {
            id: spec.id,
            epoch: spec.epoch,
            cache,
            prefill: Some(embeds),
            prefill_pos,
            ids,
            prompt_len,
            next: None,
            sampler,
            length: LengthPolicy::new(vec![s.tts_eos, s.im_end], min, max),
            text: TextStream::new(),
            rows: Vec::new(),
            streamed: 0,
            voice,
            store_system,
            shareable,
        });
    }

    fn run(&mut self) -> Result<Vec<usize>> {
        let mut budget = self.cfg.thinker_prefill_tokens;
        let mut order = Vec::new();
        let mut steps = Vec::new();
        // duplex units first: they are due in real time
        for (j, d) in self.duplex.iter_mut().enumerate() {
            if steps.len() >= self.cfg.thinker_max_batch || d.gone {
                continue;
            }
            if let Some(embeds) = d.next_embeds(&self.thinker, &mut budget)? {
                order.push(Slot::Duplex(j));
                steps.push(StreamStep { cache: &mut d.cache, embeds });
            }
        }
        for (i, a) in self.active.iter_mut().enumerate() {
            if steps.len() >= self.cfg.thinker_max_batch {
                break;
            }
            let embeds = if let Some(p) = &a.prefill {
                let total = p.dim(0)?;
                if budget == 0 {
                    continue;
                }
                let n = (total - a.prefill_pos).min(budget);
                budget -= n;
                p.narrow(0, a.prefill_pos, n)?
            } else if let Some(t) = a.next {
                self.thinker.llm.embed(&[t])?
            } else {
                continue;
            };
            order.push(Slot::Turn(i));
            steps.push(StreamStep { cache: &mut a.cache, embeds });
        }
        if steps.is_empty() {
            return Ok(vec![]);
        }
        let n = steps.len();
        let t0 = Instant::now();
        let rows: usize = steps.iter().map(|s| s.embeds.dim(0).unwrap_or(0)).sum();
        let hidden = self.thinker.llm.forward(&mut steps)?;
        let issued = t0.elapsed();
        let mut synced = issued;
        drop(steps);
        // logits of the streams that finished prefilling or decode
        let mut finished = Vec::new();
        let mut want = Vec::new();
        for (k, &slot) in order.iter().enumerate() {
            let i = match slot {
                Slot::Duplex(j) => {
                    if let Some(row) = self.duplex_after_forward(j, &hidden[k])? {
                        want.push((slot, row));
                    }
                    continue;
                }
                Slot::Turn(i) => i,
            };
            let a = &mut self.active[i];
            let rows = hidden[k].dim(0)?;
            if let Some(p) = &a.prefill {
                a.prefill_pos += rows;
                if a.prefill_pos < p.dim(0)? {
                    continue;
                }
                a.prefill = None;
                if let Some(len) = a.store_system.take() {
                    if !self.prefixes.covers(a.voice, &a.ids[..len]) {
                        self.prefixes.insert(a.voice, a.ids[..len].to_vec(), a.cache.copy_prefix(len, 0)?);
                    }
                }
            } else {
                // the fed token was generated: keep its row for the Talker
                a.rows.push(hidden[k].narrow(0, rows - 1, 1)?.to_dtype(DType::F32)?);
            }
            want.push((slot, hidden[k].narrow(0, rows - 1, 1)?));
        }
        if !want.is_empty() {
            let last = Tensor::cat(&want.iter().map(|(_, h)| h.clone()).collect::<Vec<_>>(), 0)?;
            let logits = self.thinker.llm.logits(&last)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            synced = t0.elapsed();
            for ((slot, _), l) in want.into_iter().zip(logits) {
                let i = match slot {
                    Slot::Duplex(j) => {
                        if let Err(e) = self.duplex_sample(j, &l) {
                            self.duplex_end(j, &format!("failed: {e:#}"));
                        }
                        continue;
                    }
                    Slot::Turn(i) => i,
                };
                let a = &mut self.active[i];
                if !self.registry.is_live(&a.id, a.epoch) {
                    finished.push(i);
                    continue;
                }
                let tok = a.length.next(&mut a.sampler, &l, &self.forbid);
                let s = self.tok.special();
                if tok == s.tts_eos || tok == s.im_end {
                    finished.push(i);
                    let range = handoff_range(&a.ids, a.prompt_len, s);
                    let upto = range.end - a.prompt_len;
                    // (rows exist for every generated token fed back, i.e. all before the end)
                    let upto = upto.min(a.rows.len());
                    send_rows(&self.to_talker, a, upto)?;
                    self.registry.mark(&a.id, |t| t.handoff = Some(Instant::now()));
                    let _ = self.to_talker.send(Stage1Msg::End { id: a.id.clone(), epoch: a.epoch });
                    // the turn's KV for the conversation's next prompt, which starts with it
                    let len = a.cache.len().min(a.shareable).min(a.ids.len());
                    if self.cfg.thinker_prefix_cache > 0 && len >= MIN_SHARED {
                        self.prefixes.insert(a.voice, a.ids[..len].to_vec(), a.cache.copy_prefix(len, 0)?);
                    }
                    continue;
                }
                a.ids.push(tok);
                a.next = Some(tok);
                let delta = a.text.push(&self.tok, tok)?;
                if !delta.is_empty() {
                    self.registry.emit(&a.id, a.epoch, super::EngineEvent::TextDelta(delta));
                }
            }
        }
        // streaming prefill: hand the Talker every row written so far
        if self.cfg.talker_streaming_prefill {
            for i in 0..self.active.len() {
                if finished.contains(&i) {
                    continue;
                }
                let a = &mut self.active[i];
                let upto = a.rows.len();
                send_rows(&self.to_talker, a, upto)?;
            }
        }
        // steps that prefill (prompt rows, duplex units) apart from pure decode steps
        let label = if budget < self.cfg.thinker_prefill_tokens { "thinker_prefill" } else { "thinker" };
        tracing::debug!(
            streams = n,
            rows,
            issued_ms = issued.as_secs_f64() * 1e3,
            logits_ms = synced.as_secs_f64() * 1e3,
            total_ms = t0.elapsed().as_secs_f64() * 1e3,
            "{label} step (ms since the step began: forward's kernels queued; logits on the host; sampled and sent)"
        );
        self.metrics.step_seconds.with_label_values(&[label]).observe(t0.elapsed().as_secs_f64());
        self.metrics.batch_size.with_label_values(&["thinker"]).observe(n as f64);
        Ok(finished)
    }
}

/// Rows for the Talker, in host memory: the Talker may run on another stream, and a tensor is used
/// only on the stream that made it (gpu.rs). The Thinker has just synchronised for its logits, so
/// this copy waits for nothing.
pub(super) fn to_host(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_device(&candle_core::Device::Cpu)?)
}

/// Sends the text's hidden rows written since the last call (up to `upto`) to the Talker.
fn send_rows(to_talker: &SyncSender<Stage1Msg>, a: &mut Active, upto: usize) -> Result<()> {
    if upto <= a.streamed {
        return Ok(());
    }
    let ids = a.ids[a.prompt_len + a.streamed..a.prompt_len + upto].to_vec();
    let hidden = to_host(&Tensor::cat(&a.rows[a.streamed..upto], 0)?)?;
    let _ = to_talker.send(Stage1Msg::Rows { id: a.id.clone(), epoch: a.epoch, ids, hidden });
    a.streamed = upto;
    Ok(())
}

impl StageLoop for Stage0 {
    type Msg = Stage0Msg;

    fn fail_all(&mut self, why: &str) {
        for j in 0..self.duplex.len() {
            self.duplex_end(j, &format!("failed: {why}"));
        }
        self.duplex.clear();
        for a in std::mem::take(&mut self.active) {
            self.fail(&a.id, a.epoch, why.to_string());
        }
        for q in std::mem::take(&mut self.queue) {
            self.fail(&q.id, q.epoch, why.to_string());
        }
    }

    fn on_message(&mut self, m: Stage0Msg) {
        match m {
            Stage0Msg::Admit(spec) => self.queue.push_back(spec),
            Stage0Msg::Cancel(id) => {
                self.queue.retain(|s| s.id != id);
                self.active.retain(|a| a.id != id);
            }
            Stage0Msg::DuplexOpen(spec, sink) => self.duplex_open(spec, sink),
            Stage0Msg::DuplexUnit { session, samples, arrived } => self.duplex_unit(&session, samples, arrived),
            Stage0Msg::DuplexClose(session) => self.duplex_close(&session),
        }
    }

    fn step(&mut self) -> bool {
        // admission: prompts are built and queued for prefill
        while self.active.len() < self.cfg.thinker_max_batch {
            match self.queue.pop_front() {
                Some(spec) => self.admit(spec),
                None => break,
            }
        }
        // drop requests that ended elsewhere (cancelled, failed)
        let registry = self.registry.clone();
        self.active.retain(|a| registry.is_live(&a.id, a.epoch));
        self.duplex_intake();
        self.duplex.retain(|d| !d.gone);
        self.metrics.queue_depth.with_label_values(&["thinker"]).set((self.active.len() + self.queue.len()) as i64);
        if self.active.is_empty() && !self.duplex.iter().any(|d| d.has_work()) {
            return false;
        }
        match self.run() {
            Ok(mut finished) => {
                finished.sort_unstable();
                for i in finished.into_iter().rev() {
                    self.active.remove(i);
                }
            }
            Err(e) => {
                let msg = format!("thinker step: {e:#}");
                for a in std::mem::take(&mut self.active) {
                    self.fail(&a.id, a.epoch, msg.clone());
                }
                for j in 0..self.duplex.len() {
                    self.duplex_end(j, &format!("failed: {msg}"));
                }
            }
        }
        self.duplex.retain(|d| !d.gone);
        true
    }
}
