//! Thinker, the Thinker loop: a scheduler over streams. Two kinds of stream implement
//! [`ThinkerStream`]: a turn-mode request ([`turn::TurnStream`]: prompt, reply, hand-off to the
//! Talker at `<|tts_eos|>`) and a duplex session ([`duplex::DuplexStream`]: one long-lived stream
//! fed a unit of audio at a time). Each step gathers what every stream feeds — chunked prefill
//! within a token budget and one-token decode steps — into one batched forward, takes logits of
//! the rows that need them in one batch, and gives each stream its rows back. A stream that fails
//! ends alone; only a failure of the batched forward itself ends every stream in it.

pub mod duplex;
mod prompt;
mod turn;

use std::collections::VecDeque;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use candle_core::Tensor;

use super::caches::StageCaches;
use super::gate::PrefillGate;
use super::prefix::PrefixStore;
use super::{
    Admission, EngineConfig, EngineMetrics, RefInput, Registry, RequestId, RequestSpec, StageLoop,
    Status, TalkerMsg, ThinkerMsg,
};
use crate::metric_labels::{MetricLabel, RequestOutcome, StageName, StepKind};
use antiphon_models::code2wav::prompt::PROMPT_SECONDS;
use antiphon_models::decoder::{KvCache, StreamStep};
use antiphon_models::thinker::Thinker;
use antiphon_models::tokenizer::{Forbidden, TextTokenizer};
use antiphon_models::top_k::{Logits, LogitsRow, TOP_K};
use duplex::DuplexStream;
use turn::TurnStream;

/// What every stream shares: the model, the tokenizer, the configuration, and where results go.
pub struct Ctx {
    pub thinker: Thinker,
    pub tok: TextTokenizer,
    pub cfg: Arc<EngineConfig>,
    pub registry: Registry,
    pub metrics: EngineMetrics,
    pub to_talker: SyncSender<TalkerMsg>,
    /// The tokens the sampler may not pick (built once from the tokenizer's special tokens).
    pub forbidden: Forbidden,
    /// The audio encoder's embeddings of recent reference voices, by content: the same voice in
    /// every system prompt (turn or duplex) is encoded once.
    ref_embeds: Recent<Tensor>,
    /// KV of recent system turns and finished turns, found by the longest shared run of ids.
    pub prefixes: PrefixStore<KvCache>,
    /// Open unless a Talker prefill for a reply's first code is on the GPU (`gate.rs`).
    pub gate: PrefillGate,
    /// Streams in the step running now: at most `engine.gated_streams`, a reply's first
    /// text chunk goes to the Talker with the gate held.
    pub step_streams: usize,
}

impl Ctx {
    /// Ends a request as failed (its `Done` carries `why`).
    pub fn fail(&self, id: &RequestId, why: String) {
        tracing::warn!(request = %id, "thinker failed: {why}");
        if self.registry.finish(id, Status::Failed(why)).is_some() {
            self.metrics.requests.at(RequestOutcome::Failed).inc();
        }
    }

    /// Ends a request the engine cannot hold as asked (its `Done` carries `why`, naming the field).
    pub fn refuse(&self, id: &RequestId, why: String) {
        tracing::info!(request = %id, "thinker refused: {why}");
        if self.registry.finish(id, Status::Refused(why)).is_some() {
            self.metrics.requests.at(RequestOutcome::Failed).inc();
        }
    }

    /// The reference voice's audio embeddings (its first [`PROMPT_SECONDS`] at 16 kHz), cached by
    /// content.
    pub fn reference_embeddings(&mut self, voice: &RefInput) -> Result<Tensor> {
        let key = voice.content_key();
        if let Some(hit) = self.ref_embeds.get(key) {
            return Ok(hit.clone());
        }
        let emb = self.thinker.encode_clip(&heard_clip(voice)?)?;
        self.ref_embeds.insert(key, emb.clone());
        Ok(emb)
    }

    /// The reference voices of a burst of new prompts, encoded together (each prompt hears its
    /// voice at the head of its system turn): those not kept yet, at most half of what is kept, are
    /// resampled side by side and encoded in one batch ([`Thinker::encode_clips`]), and kept for
    /// [`Ctx::reference_embeddings`]. Only an optimisation: a failure is logged, and each prompt
    /// then encodes its own voice (and fails alone if it cannot).
    pub fn hear_references(&mut self, voices: &[&RefInput]) {
        let mut todo: Vec<(u64, &RefInput)> = Vec::new();
        for v in voices {
            let key = v.content_key();
            if !todo.iter().any(|(k, _)| *k == key)
                && !self.ref_embeds.contains(key)
                && todo.len() < REF_EMBED_CACHE / 2
            {
                todo.push((key, v));
            }
        }
        if todo.len() < 2 {
            return;
        }
        let t0 = Instant::now();
        let clips: Vec<(u64, Vec<f32>)> = std::thread::scope(|scope| {
            let jobs: Vec<_> = todo
                .iter()
                .map(|&(k, v)| scope.spawn(move || heard_clip(v).map(|c| (k, c))))
                .collect();
            jobs.into_iter().filter_map(|j| j.join().ok().and_then(|r| r.ok())).collect()
        });
        let refs: Vec<&[f32]> = clips.iter().map(|(_, c)| c.as_slice()).collect();
        match self.thinker.encode_clips(&refs) {
            Ok(embs) => {
                for ((k, _), e) in clips.iter().zip(embs) {
                    self.ref_embeds.insert(*k, e);
                }
            }
            Err(e) => tracing::warn!(
                "thinker: a burst of reference voices could not be encoded together: {e:#}"
            ),
        }
        self.metrics.step_seconds.at(StepKind::ThinkerHear).observe(t0.elapsed().as_secs_f64());
    }

    /// The Thinker's context a conversation may take, in positions (`thinker.context`).
    pub fn context(&self) -> usize {
        crate::fit::conversation_context(
            self.thinker.llm.decoder().config().max_positions,
            self.cfg.thinker.context,
        )
    }
}

/// One stream of the Thinker's batched step.
pub trait ThinkerStream {
    /// The rows this stream feeds this step — prompt rows within `budget` (which it lowers), or
    /// its next token — or `None` when it has nothing to run now.
    fn input(&self, ctx: &Ctx, budget: &mut usize) -> Result<Option<Tensor>>;
    /// The KV cache its positions go into.
    fn cache(&mut self) -> &mut KvCache;
    /// After the forward, with the hidden rows of what it fed: the row to take logits of, if any.
    fn after_forward(&mut self, ctx: &mut Ctx, hidden: &Tensor) -> Result<Option<Tensor>>;
    /// Its logits (its best candidates on the host, the whole row on demand): sample the next
    /// token and hand on what is due.
    fn on_logits(&mut self, ctx: &mut Ctx, logits: &LogitsRow) -> Result<()>;
    /// At the end of every step it took part in.
    fn after_step(&mut self, _ctx: &mut Ctx) -> Result<()> {
        Ok(())
    }
    /// After every stream of the step handed on what was due (ended streams too): work that
    /// must not delay another stream's hand-off in the same step.
    fn after_hand_offs(&mut self, _ctx: &mut Ctx) {}
    /// Ends the stream with a failure, telling its client.
    fn fail(&mut self, ctx: &mut Ctx, why: &str);
    /// Over: handed off, failed, cancelled or closed; the scheduler drops it after the step.
    fn ended(&self, ctx: &Ctx) -> bool;

    /// A reply whose text has not yet begun to go to the Talker (its prompt, or its first text):
    /// a caller waits for its first audio.
    fn before_first_hand_off(&self) -> bool {
        false
    }
}

pub struct ThinkerStage {
    ctx: Ctx,
    /// Requests waiting for the Thinker: for a free batch place and a free stream place
    /// (admission), in arrival order.
    queue: VecDeque<RequestSpec>,
    admission: Admission,
    turns: Vec<TurnStream>,
    duplex: Vec<DuplexStream>,
    /// KV slots (batched decode), and caches of finished turn-mode streams for the next ones
    /// (their decode graphs with them).
    caches: StageCaches,
}

/// Reference voices whose embeddings the Thinker keeps (each ~0.5 MB at full size: 60 rows of
/// 4096).
const REF_EMBED_CACHE: usize = 32;

/// With `thinker.prefill_graph_rows`, prompt rows a step takes at least, even where the streams
/// decoding leave fewer of the captured step's rows (the step then runs op by op, as without it).
const MIN_GRAPH_ROWS: usize = 16;

/// Thinker caches are made with room for a multiple of this many positions: a conversation
/// grows by its turns, and a stream that outgrows the pooled caches needs a new one, whose decode
/// step is captured anew (~10 ms). The static step's attention reads only the held positions, so
/// room costs memory (~150 KB a position at full size), not time.
const THINKER_CACHE_QUANTUM: usize = 1024;

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

    fn contains(&self, key: u64) -> bool {
        self.entries.iter().any(|(k, _)| *k == key)
    }

    fn insert(&mut self, key: u64, value: V) {
        self.entries.retain(|(k, _)| *k != key);
        self.entries.push_front((key, value));
        self.entries.truncate(self.cap);
    }
}

/// What the Thinker hears of a reference voice: its first [`PROMPT_SECONDS`] at 16 kHz.
fn heard_clip(voice: &RefInput) -> Result<Vec<f32>> {
    let mut r16 = antiphon_audio::resample(&voice.samples, voice.sample_rate, 16_000)?;
    r16.truncate((16_000.0 * PROMPT_SECONDS) as usize);
    Ok(r16)
}

/// Rows for the Talker, in host memory: the Talker may run on another stream, and a tensor is used
/// only on the stream that made it (gpu.rs). The Thinker has just synchronised for its logits, so
/// this copy waits for nothing.
pub(crate) fn to_host(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_device(&candle_core::Device::Cpu)?)
}

impl ThinkerStage {
    pub fn new(
        thinker: Thinker,
        tok: TextTokenizer,
        cfg: Arc<EngineConfig>,
        registry: Registry,
        metrics: EngineMetrics,
        to_talker: SyncSender<TalkerMsg>,
        admission: Admission,
    ) -> anyhow::Result<Self> {
        let forbidden = tok.forbidden();
        let prefixes = PrefixStore::new(cfg.thinker.prefix_cache, cfg.thinker.prefix_mib << 20);
        let caches = StageCaches::new(
            thinker.llm.decoder(),
            cfg.thinker.max_batch,
            THINKER_CACHE_QUANTUM,
            cfg.idle_cache_mib << 20,
            cfg.thinker.slots,
            cfg.thinker.slot_context,
        )?;
        let ctx = Ctx {
            thinker,
            tok,
            cfg,
            registry,
            metrics,
            to_talker,
            forbidden,
            ref_embeds: Recent::new(REF_EMBED_CACHE),
            prefixes,
            gate: PrefillGate::new(false),
            step_streams: 0,
        };
        Ok(Self {
            ctx,
            queue: VecDeque::new(),
            admission,
            turns: Vec::new(),
            duplex: Vec::new(),
            caches,
        })
    }

    /// The Thinker waits for the steps that hold `gate` (gate.rs).
    pub fn with_gate(mut self, gate: PrefillGate) -> Self {
        self.ctx.gate = gate;
        self
    }

    /// One batched step over every stream with work (duplex units first: they are due in real
    /// time). Streams that fail are failed and dropped; `Err` only when the forward itself failed.
    fn run(&mut self) -> Result<()> {
        let ThinkerStage { ctx, turns, duplex, .. } = self;
        let max_batch = ctx.cfg.thinker.max_batch;
        // (with prompt rows in a captured step, what the decoding streams leave of its rows, at
        // least a few: a step that outgrows it runs op by op)
        let full = match ctx.thinker.llm.decoder().prefill_graph_rows() {
            0 => ctx.cfg.thinker.prefill_tokens,
            rows => {
                // (the largest bucket: those rows, or the slots' decode bucket if larger)
                let rows = rows.max(ctx.cfg.thinker.slots);
                let decoding = turns.len() + duplex.len();
                ctx.cfg
                    .thinker
                    .prefill_tokens
                    .min(rows.saturating_sub(decoding).max(MIN_GRAPH_ROWS))
            }
        };
        let mut budget = full;
        let mut picked: Vec<(&mut dyn ThinkerStream, Tensor)> = Vec::new();
        let streams = duplex
            .iter_mut()
            .map(|d| d as &mut dyn ThinkerStream)
            .chain(turns.iter_mut().map(|t| t as &mut dyn ThinkerStream));
        for s in streams {
            if picked.len() >= max_batch {
                break;
            }
            if s.ended(ctx) {
                continue;
            }
            match s.input(ctx, &mut budget) {
                Ok(Some(embeds)) => picked.push((s, embeds)),
                Ok(None) => {}
                Err(e) => s.fail(ctx, &format!("thinker input: {e:#}")),
            }
        }
        if picked.is_empty() {
            return Ok(());
        }
        let n = picked.len();
        ctx.step_streams = n;
        // (a Talker prefill for a first code would wait behind this step's kernels: it goes first,
        // unless this step's own replies are before their hand-off and
        // `thinker.gate_spares_new_replies`)
        let spared = ctx.cfg.thinker.gate_spares_new_replies
            && picked.iter().any(|(s, _)| s.before_first_hand_off());
        let waited = if spared {
            std::time::Duration::ZERO
        } else {
            ctx.gate.wait_open(crate::gate::MAX_WAIT)
        };
        if waited > std::time::Duration::from_micros(200) {
            tracing::debug!(
                ms = waited.as_secs_f64() * 1e3,
                "thinker step waited for a talker prefill"
            );
        }
        let t0 = Instant::now();
        let rows: usize = picked.iter().map(|(_, e)| e.dim(0).unwrap_or(0)).sum();
        // (a batch that fails runs again stream by stream: one stream's error fails it alone)
        let outcomes = {
            let mut steps: Vec<StreamStep> = picked
                .iter_mut()
                .map(|(s, embeds)| StreamStep { cache: s.cache(), embeds: embeds.clone() })
                .collect();
            crate::contain::forward_contained(&mut steps, |s| ctx.thinker.llm.forward(s))
        };
        let mut hidden: Vec<Option<Tensor>> = Vec::with_capacity(n);
        for ((s, _), o) in picked.iter_mut().zip(outcomes) {
            match o {
                Ok(h) => hidden.push(Some(h)),
                Err(e) => {
                    s.fail(ctx, &format!("thinker step: {e}"));
                    hidden.push(None);
                }
            }
        }
        if hidden.iter().all(Option::is_none) {
            anyhow::bail!("the forward failed for every stream of the step");
        }
        let issued = t0.elapsed();
        let mut synced = issued;
        // the rows that need logits: streams that finished a prefill, or decode
        let mut want: Vec<(usize, Tensor)> = Vec::new();
        for (k, (s, _)) in picked.iter_mut().enumerate() {
            let Some(h) = &hidden[k] else { continue };
            match s.after_forward(ctx, h) {
                Ok(Some(row)) => want.push((k, row)),
                Ok(None) => {}
                Err(e) => s.fail(ctx, &format!("thinker step: {e:#}")),
            }
        }
        if !want.is_empty() {
            let last = Tensor::cat(&want.iter().map(|(_, h)| h.clone()).collect::<Vec<_>>(), 0);
            // only each row's best candidates come to the host (top_k.rs)
            let logits = last.and_then(|l| Logits::new(ctx.thinker.llm.logits(&l)?, TOP_K));
            synced = t0.elapsed();
            match logits {
                Ok(logits) => {
                    for (j, (k, _)) in want.into_iter().enumerate() {
                        let s = &mut picked[k].0;
                        if let Err(e) = s.on_logits(ctx, &logits.row(j)) {
                            s.fail(ctx, &format!("thinker sampling: {e:#}"));
                        }
                    }
                }
                Err(e) => {
                    for (k, _) in want {
                        picked[k].0.fail(ctx, &format!("thinker logits: {e:#}"));
                    }
                }
            }
        }
        for (s, _) in picked.iter_mut() {
            if !s.ended(ctx) {
                if let Err(e) = s.after_step(ctx) {
                    s.fail(ctx, &format!("thinker hand-off: {e:#}"));
                }
            }
        }
        // (a wave of replies that end in the same step: every End goes out before any prefix copy)
        for (s, _) in picked.iter_mut() {
            s.after_hand_offs(ctx);
        }
        // steps that prefill (prompt rows, duplex units) apart from pure decode steps
        let label = if budget < full { StepKind::ThinkerPrefill } else { StepKind::Thinker };
        tracing::debug!(
            streams = n,
            rows,
            issued_ms = issued.as_secs_f64() * 1e3,
            logits_ms = synced.as_secs_f64() * 1e3,
            total_ms = t0.elapsed().as_secs_f64() * 1e3,
            "{} step (ms since the step began: forward's kernels queued; logits on the host; \
            sampled and sent)",
            label.label()
        );
        ctx.metrics.step_seconds.at(label).observe(t0.elapsed().as_secs_f64());
        ctx.metrics.batch_size.at(StageName::Thinker).observe(n as f64);
        Ok(())
    }

    /// Drops the streams that ended (a turn's pooled cache goes back to the pool as it drops).
    fn sweep(&mut self) {
        let ThinkerStage { ctx, turns, duplex, .. } = self;
        duplex.retain(|d| !d.ended(ctx));
        turns.retain(|t| !t.ended(ctx));
    }
}

impl StageLoop for ThinkerStage {
    type Msg = ThinkerMsg;

    fn fail_all(&mut self, why: &str) {
        let ctx = &mut self.ctx;
        for mut d in std::mem::take(&mut self.duplex) {
            d.end(ctx, crate::DuplexEnd::Failed(why.to_string()));
        }
        for mut t in std::mem::take(&mut self.turns) {
            t.fail(ctx, why);
        }
        for q in std::mem::take(&mut self.queue) {
            ctx.fail(&q.id, why.to_string());
        }
    }

    fn on_message(&mut self, m: ThinkerMsg) {
        match m {
            ThinkerMsg::Admit(spec) => self.queue.push_back(spec),
            ThinkerMsg::Cancel(id) => {
                self.queue.retain(|s| s.id != id);
                self.turns.retain(|t| t.id() != &id);
            }
            ThinkerMsg::DuplexOpen(spec, sink) => {
                if let Some(d) = DuplexStream::open(&mut self.ctx, &self.caches, spec, sink) {
                    self.duplex.retain(|o| o.session() != d.session());
                    self.duplex.push(d);
                }
            }
            ThinkerMsg::DuplexUnit { session, samples, arrived } => {
                if let Some(d) = self.duplex.iter_mut().find(|d| d.session() == session) {
                    d.push_unit(&mut self.ctx, samples, arrived);
                }
            }
            ThinkerMsg::DuplexClose(session) => {
                if let Some(j) = self.duplex.iter().position(|d| d.session() == session) {
                    let mut d = self.duplex.remove(j);
                    d.end(&mut self.ctx, crate::DuplexEnd::Closed);
                }
            }
            ThinkerMsg::Wake => {}
        }
    }

    /// While requests wait for a stream place, look again now and then: the online limit also
    /// rises with time, not only when a stream ends (which wakes this loop at once).
    fn idle_wait(&self) -> Option<std::time::Duration> {
        (!self.queue.is_empty()).then_some(std::time::Duration::from_millis(20))
    }

    fn step(&mut self) -> bool {
        // admission: prompts are built and queued for prefill (a burst's new voices heard together)
        let room = self.ctx.cfg.thinker.max_batch.saturating_sub(self.turns.len());
        if self.ctx.cfg.thinker.hears_reference && room > 1 && self.queue.len() > 1 {
            let registry = &self.ctx.registry;
            let voices: Vec<&RefInput> = self
                .queue
                .iter()
                .take(room)
                .filter(|s| registry.is_live(&s.id))
                .map(|s| &s.voice)
                .collect();
            self.ctx.hear_references(&voices);
        }
        // (a request starts only with a stream place: beyond them it would slow every stream)
        while self.turns.len() < self.ctx.cfg.thinker.max_batch {
            let Some(front) = self.queue.front() else { break };
            if !self.ctx.registry.is_live(&front.id) {
                self.queue.pop_front();
                continue;
            }
            if !self.admission.try_start(&front.id) {
                break;
            }
            let spec = self.queue.pop_front().expect("front");
            if let Some(t) = TurnStream::admit(&mut self.ctx, &self.caches, spec) {
                self.turns.push(t);
            }
        }
        // drop streams that ended elsewhere (cancelled, failed; a duplex session that holds no
        // place has closed, though its close may have found the inbox full)
        let ThinkerStage { ctx, duplex: sessions, admission, .. } = self;
        for d in sessions.iter_mut().filter(|d| !admission.holds_duplex(d.session())) {
            d.end(ctx, crate::DuplexEnd::Closed);
        }
        self.sweep();
        duplex::intake(&mut self.ctx, &mut self.duplex);
        self.sweep();
        self.ctx
            .metrics
            .queue_depth
            .at(StageName::Thinker)
            .set((self.turns.len() + self.queue.len()) as i64);
        if self.turns.is_empty() && !self.duplex.iter().any(|d| d.has_work()) {
            return false;
        }
        if let Err(e) = self.run() {
            tracing::warn!("thinker step failed: {e:#}");
        }
        self.sweep();
        true
    }
}
