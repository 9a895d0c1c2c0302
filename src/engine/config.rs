//! The engine's configuration: one definition, read from the `[engine]` table as it is.

use std::time::Duration;

use serde::{Deserialize, Deserializer};

use antiphon_models::code2wav::dit_attention::PoolAttention;
use antiphon_models::sampling::SamplingParams;

/// Engine knobs: the `[engine]` table of the configuration file is this struct, read by serde
/// (absent keys keep these defaults, unknown keys are refused). Fields marked `skip` are not
/// settable from a file.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Streams a Thinker step advances at most.
    pub thinker_max_batch: usize,
    /// Prompt positions a Thinker step prefills at most (chunked prefill).
    pub thinker_prefill_tokens: usize,
    pub talker_max_batch: usize,
    pub code2wav_max_batch: usize,
    /// A Code2Wav step takes every chunk due within its horizon (two recent steps, at least
    /// 300 ms); while it has fewer than this many, chunks not yet due join it, earliest first
    /// (audio sent ahead covers a client's network jitter). A step of many streams with seconds
    /// buffered would keep a new stream's first chunk waiting.
    pub code2wav_early_batch: usize,
    /// A Code2Wav step runs its chunks as one batch whatever their lengths and `last` flags (one
    /// flow solve over the pool, every chunk padded to the step's longest and masked to its own,
    /// with graphs up to a length the warm-up captured); off, one batch per (chunk length, last).
    /// Fewer solves pay where a solve has a fixed cost (a GPU); on the CPU the padding costs
    /// compute, so it is off by default.
    pub code2wav_mixed_steps: bool,
    /// A Code2Wav step that holds first chunks (chunk 0s) takes with them only the chunks due
    /// within its horizon; the chunks of streams with more audio buffered run in the step right
    /// after, so a new stream's first chunk does not ride a whole step of theirs.
    pub code2wav_first_chunks_apart: bool,
    /// A Code2Wav step runs one batch, the one that holds its earliest-due chunk (without mixed
    /// steps a step's chunks are one batch per chunk length and `last` flag); the other batches go
    /// back to the queue and are planned again with what came meanwhile, so a new stream's first
    /// chunk waits for at most one batch of the step running when it came, not all of them.
    pub code2wav_one_batch_per_step: bool,
    /// How the flow's attention over its slot pool runs on CUDA: `gathered` (the rows' planes
    /// gathered, two products, the masked softmax, the heads' transpose), `in_place` (two
    /// pointer-array products that read the pool where it is and write the heads side by side) or
    /// `kernel` (one flash-style kernel of ours, 16-bit; its three forms measured slower, runs
    /// 50-51). Elsewhere always `gathered`.
    pub code2wav_pool_attention: PoolAttention,
    /// The f32 vocoder's main-path convolutions write their columns in f16 and multiply them by
    /// an f16 weight into f32 sums (half the bytes of the columns, which were half of the
    /// vocoder's GPU time in run 49; the inputs keep TF32's 10-bit mantissa, but f16's range). The
    /// source's path and the last conv stay f32. Off until measured.
    pub vocoder_half_columns: bool,
    /// New codes in the first Code2Wav chunk (a smaller first chunk lowers first-audio time)...
    pub first_chunk_codes: usize,
    /// ...for a stream that finds at most this many requests in the engine (itself included, in
    /// any stage) when the Thinker takes it and again when its text is complete; busier, its first
    /// chunk is a full one, whose second of audio covers the next chunk's wait.
    /// Absent: every stream (unlimited); 0: never.
    pub small_first_chunk_streams: usize,
    /// Busier than that, a small first chunk all the same where the streams already speaking can
    /// wait for its extra Code2Wav step and its own audio covers its next chunk's wait
    /// (`pace.rs`: `first_chunk_codes`, halfway, or a full chunk); off: a full one.
    pub small_first_chunk_slack: bool,
    pub chunk_codes: usize,
    /// Codes of left context in every chunk after the first.
    #[serde(skip)]
    pub context_codes: usize,
    /// Feed the Talker's prefill row by row while the Thinker is still writing (same input).
    pub talker_streaming_prefill: bool,
    /// Turn mode: hand the Talker the reply in text chunks of this many Thinker tokens, as the
    /// model's own streaming mode does (10 there): the Talker starts on the first chunk and makes
    /// each chunk's codes over a window of the previous chunk (docs/design/turn-streaming.md).
    /// 0: the whole reply at once (the vLLM-Omni reference's hand-off).
    pub talker_text_chunk: usize,
    /// A stream's later segments (a text chunk's window, a duplex unit's condition), once its first
    /// chunk is out, go through the batched decode step a row a step rather than as a prefill
    /// beside it. On a GPU with stage priorities the decode step is a graph at the Talker's raised
    /// priority, while a prefill runs op by op at the lowest one: under load it waited behind the
    /// Thinker's graphs, and the whole Talker step with it (every stream stalled). A segment of
    /// ~50 rows (a window) or ~15 (a unit) costs as many steps, which the audio before covers.
    pub talker_segment_rows: bool,
    /// Turn mode: a stream's Talker runs at most this many chunks of codes ahead of the audio
    /// Code2Wav has delivered (`None`: as fast as it can). On one GPU the stages' steps slow each
    /// other down; codes made long before Code2Wav can use them only slow down its chunk 0.
    /// In the file: a count, or -1 for no limit.
    #[serde(deserialize_with = "minus_one_is_none")]
    pub talker_lead_chunks: Option<usize>,
    /// Turn mode, with pacing on: no codes beyond a stream's small first chunk until that chunk's
    /// audio is delivered (the stream's Talker steps would only slow its chunk 0 down).
    pub talker_hold_first_chunk: bool,
    /// Prompt prefixes whose KV the Thinker keeps (0 = off): system turns with their voice, and
    /// finished turns (prompt + reply) for their conversation's next prompt. A new prompt starts
    /// from the entry it shares the most leading ids with.
    pub thinker_prefix_cache: usize,
    /// ...holding at most this many MiB of KV together (the least recently used go first).
    pub thinker_prefix_mib: usize,
    /// Idle KV caches each stage keeps for its next streams (beyond its slots) hold at most this
    /// many MiB together; a cache that would pass it is freed instead.
    pub idle_cache_mib: usize,
    /// KV slots allocated at start-up for Thinker streams (0: none), each with room for
    /// `thinker_slot_context` positions: streams in slots decode in one batched step (on CUDA a
    /// graph per batch size); a stream that finds no free slot, or needs more, gets a cache of
    /// its own.
    pub thinker_slots: usize,
    pub thinker_slot_context: usize,
    /// The same for the Talker.
    pub talker_slots: usize,
    pub talker_slot_context: usize,
    /// One-stream decode steps of the Thinker and the Talker over fixed-address buffers, captured
    /// as CUDA graphs on a GPU (`DecodeMode::Graph`); off: every step runs op by op.
    pub decode_graphs: bool,
    /// Code2Wav's chunks over fixed buffers, captured as CUDA graphs per shape on a GPU (a shape is
    /// captured the second time it comes): the flow's 10-step CFM solve and the vocoder's F0 and
    /// decode steps; off: op by op.
    pub code2wav_graphs: bool,
    /// Code2Wav's flow solve is captured for chunks of up to this many streams (larger ones run op
    /// by op), and at most `code2wav_graph_count` shapes are kept (each holds its own copies of
    /// the streams' caches: a graph of B streams holds B times a stream's flow caches).
    pub code2wav_graph_batch: usize,
    pub code2wav_graph_count: usize,
    /// Slots of the flow's attention caches allocated at start-up (0: none), each of
    /// `code2wav_slot_frames` mel positions (history + the voice's prompt + a chunk must fit): the
    /// streams in slots share one flow solve with no cache copied (on a GPU one graph per batch
    /// size up to `code2wav_max_batch`, at most `code2wav_pool_graphs` kept); a stream that finds
    /// no free slot, or whose voice does not fit, keeps caches of its own.
    pub code2wav_slots: usize,
    pub code2wav_slot_frames: usize,
    pub code2wav_pool_graphs: usize,
    /// On a GPU with a stream per stage, the Thinker's and the Talker's captured steps run at the
    /// highest stream priority: when their kernels wait beside Code2Wav's, the block scheduler
    /// starts theirs first (a decode step is a few ms; Code2Wav's chunks are hundreds). Off by
    /// default; on in the GPU configuration (docs/performance.md).
    pub stage_priorities: bool,
    /// With stage priorities: a Thinker step that holds a reply still before its first hand-off
    /// (its prompt, or its first text) does not wait for the gate (gate.rs). That reply's first
    /// audio is a caller's too; under arrivals the waits took 15 % of the Thinker's time.
    pub gate_spares_new_replies: bool,
    /// On a GPU, f32 matrix products (the vocoder's convolutions, reference preparation) run on
    /// tensor cores in TF32 (10-bit mantissa products, f32 sums); off: full f32. Process-wide.
    pub gpu_tf32: bool,
    pub ref_cache_capacity: usize,
    pub setup_cache_capacity: usize,
    /// Reference prefetch, phase A (materialize + prepare).
    pub prefetch: bool,
    /// Reference prefetch, phase B (setup), off by default.
    pub prefetch_setup: bool,
    /// How long an idle Code2Wav with waiting references sleeps between idle steps.
    #[serde(skip)]
    pub idle_tick: Duration,
    #[serde(skip)]
    pub thinker_sampling: SamplingParams,
    #[serde(skip)]
    pub talker_sampling: SamplingParams,
    pub default_max_text_tokens: usize,
    pub default_min_audio_tokens: usize,
    pub default_max_audio_tokens: usize,
    /// Put the reference voice into the Thinker's system prompt (MiniCPM-o's voice-cloning prompt).
    pub thinker_hears_reference: bool,
    /// Messages each stage's inbox holds.
    #[serde(skip)]
    pub channel_capacity: usize,
    /// Duplex unit length in ms (a multiple of 100 ms; 1000 as the model was trained).
    pub duplex_unit_ms: u32,
    /// Codes the Talker may drain at the end of a duplex turn.
    pub duplex_drain_codes: usize,
    /// Thinker positions a duplex session may use (default: the model's context); the session
    /// closes with `context_full` when the next unit would not fit.
    /// In the file: 0 for the model's context.
    #[serde(deserialize_with = "zero_is_none")]
    pub duplex_max_context: Option<usize>,
    /// Streams (turn responses from the Thinker to their last audio, and open duplex sessions) the
    /// engine runs at once at most (admission.rs). Default: the fewest KV slots of a stage that
    /// holds every stream (the Talker's and Code2Wav's, and the Thinker's for duplex sessions), so
    /// no stream runs beside the batched step. In the file: 0 for that default.
    #[serde(deserialize_with = "zero_is_none")]
    pub max_streams: Option<usize>,
    /// Responses that wait for a place at most; beyond, a response is refused (`capacity`).
    pub max_queued: usize,
    /// A chunk that reaches its listener late lowers the stream limit below the streams running
    /// then; a while without one raises it again, up to `max_streams` (off: the limit stays there).
    pub adaptive_stream_limit: bool,
    /// With the adaptive limit: a chunk that reached Code2Wav with more than this many ms of its
    /// listener's audio to spare and has less left while it waits there holds new streams back
    /// (the limit goes to the streams running) before any chunk is late; 0: off (only late chunks
    /// lower the limit). Below the step horizon (300 ms at least) when `code2wav_early_batch`
    /// holds chunks back until they are due.
    pub admission_slack_ms: u64,
    /// Places kept free for the next turns of calls already admitted: a new call (session) is
    /// refused while fewer are free or any response waits.
    pub call_headroom: usize,
    /// On a GPU, the streams (every stage's slots, at most as configured) are as many as the
    /// device's free memory holds at start-up beside `memory_headroom_mib` and the caches' own
    /// budgets (capacity.rs); off: the slots as configured.
    pub streams_from_memory: bool,
    /// With `streams_from_memory`: MiB kept free beside the slots, the prefix store and the idle
    /// caches, for activations, CUDA graphs and the voices' setups.
    pub memory_headroom_mib: usize,
}

/// The longest text chunk `talker_text_chunk` may ask for (a chunk's condition and the previous
/// one's sit in the Talker's window together).
pub const MAX_TEXT_CHUNK: usize = 256;

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            thinker_max_batch: 16,
            thinker_prefill_tokens: 1024,
            talker_max_batch: 32,
            code2wav_max_batch: 8,
            code2wav_early_batch: 8,
            code2wav_mixed_steps: false,
            code2wav_first_chunks_apart: false,
            code2wav_one_batch_per_step: false,
            code2wav_pool_attention: PoolAttention::Gathered,
            vocoder_half_columns: false,
            first_chunk_codes: 25,
            small_first_chunk_streams: usize::MAX,
            small_first_chunk_slack: false,
            chunk_codes: 25,
            context_codes: 3,
            talker_streaming_prefill: false,
            talker_text_chunk: 0,
            talker_segment_rows: false,
            talker_lead_chunks: Some(1),
            talker_hold_first_chunk: false,
            thinker_prefix_cache: 16,
            thinker_prefix_mib: 1024,
            idle_cache_mib: 1024,
            thinker_slots: 16,
            thinker_slot_context: 4096,
            talker_slots: 32,
            talker_slot_context: 4096,
            decode_graphs: true,
            code2wav_graphs: true,
            code2wav_graph_batch: 2,
            code2wav_graph_count: 12,
            code2wav_slots: 8,
            code2wav_slot_frames: 576,
            code2wav_pool_graphs: 16,
            stage_priorities: false,
            gate_spares_new_replies: false,
            gpu_tf32: true,
            ref_cache_capacity: 4,
            setup_cache_capacity: 1,
            prefetch: true,
            prefetch_setup: false,
            idle_tick: Duration::from_millis(2),
            thinker_sampling: SamplingParams::thinker_greedy(),
            talker_sampling: SamplingParams::talker(),
            default_max_text_tokens: 512,
            default_min_audio_tokens: 50,
            default_max_audio_tokens: 2048,
            thinker_hears_reference: true,
            channel_capacity: 1024,
            duplex_unit_ms: 1000,
            duplex_drain_codes: 104,
            duplex_max_context: None,
            max_streams: None,
            max_queued: 32,
            adaptive_stream_limit: true,
            admission_slack_ms: 0,
            call_headroom: 0,
            streams_from_memory: false,
            memory_headroom_mib: 16384,
        }
    }
}

impl EngineConfig {
    /// `admission_slack_ms` as a margin, `None` when off.
    pub fn admission_slack(&self) -> Option<std::time::Duration> {
        (self.admission_slack_ms > 0)
            .then(|| std::time::Duration::from_millis(self.admission_slack_ms))
    }

    /// The most new codes one Code2Wav chunk carries (what a flow slot must leave room for).
    pub fn max_chunk_codes(&self) -> usize {
        self.chunk_codes.max(self.first_chunk_codes).max(self.duplex_codes_per_unit())
    }

    /// Talker codes per spoken duplex unit (25 codes per second of speech).
    pub fn duplex_codes_per_unit(&self) -> usize {
        (self.duplex_unit_ms as usize / 40).max(1)
    }

    /// Streams the engine runs at once (see `max_streams`).
    pub fn stream_places(&self) -> usize {
        let slots = [self.thinker_slots, self.talker_slots, self.code2wav_slots]
            .into_iter()
            .filter(|&n| n > 0)
            .min();
        self.max_streams.or(slots).unwrap_or(self.talker_max_batch).max(1)
    }

    /// What the stages cannot run with, named by key.
    pub fn validate(&self) -> Result<(), String> {
        if self.chunk_codes == 0
            || self.thinker_max_batch == 0
            || self.talker_max_batch == 0
            || self.code2wav_max_batch == 0
        {
            return Err("engine batch limits and chunk_codes must be at least 1".into());
        }
        if self.talker_text_chunk > MAX_TEXT_CHUNK {
            return Err(format!(
                "engine.talker_text_chunk {}: 0 (the whole reply) or up to {MAX_TEXT_CHUNK} tokens",
                self.talker_text_chunk
            ));
        }
        if self.duplex_unit_ms == 0
            || !self.duplex_unit_ms.is_multiple_of(100)
            || self.duplex_unit_ms > 10_000
        {
            return Err(format!(
                "engine.duplex_unit_ms {}: a multiple of 100 ms up to 10000",
                self.duplex_unit_ms
            ));
        }
        Ok(())
    }
}

fn minus_one_is_none<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    let v = i64::deserialize(d)?;
    match v {
        -1 => Ok(None),
        v => usize::try_from(v)
            .map(Some)
            .map_err(|_| serde::de::Error::custom(format!("{v}: a count, or -1 for no limit"))),
    }
}

fn zero_is_none<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    let v = usize::deserialize(d)?;
    Ok((v > 0).then_some(v))
}
