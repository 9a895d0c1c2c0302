//! Each stage's own keys: the `[engine.thinker]`, `[engine.talker]`, `[engine.code2wav]`,
//! `[engine.prefetch]` and `[engine.duplex]` sections of a configuration file.

use std::time::Duration;

use serde::Deserialize;

use antiphon_models::code2wav::dit_attention::PoolAttention;
use antiphon_models::sampling::SamplingParams;

use super::count_or_none;

/// `[engine.thinker]`: the Thinker (Qwen3-8B and its hearing).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ThinkerConfig {
    /// Streams a Thinker step advances at most.
    pub max_batch: usize,
    /// Prompt positions a Thinker step prefills at most (chunked prefill).
    pub prefill_tokens: usize,
    /// With decode graphs: a step with prompt rows, all its streams in slots, runs as the rows of
    /// a captured step of up to this many rows (a power of two), the prompt chunked to what the
    /// decoding streams leave of it, instead of op by op for every stream in it (0: never;
    /// `Decoder::set_prefill_graph_rows`).
    pub prefill_graph_rows: usize,
    /// Those captured steps (beyond the decode buckets) at the Thinker's raised priority; false:
    /// at the default one, beside Code2Wav's kernels as the op-by-op step (run 74: raised, they
    /// slowed Code2Wav's steps at C16 and under arrivals).
    pub prefill_graph_raised: bool,
    /// KV slots allocated at start-up for Thinker streams (0: none), each with room for
    /// `slot_context` positions: streams in slots decode in one batched step (on CUDA a graph per
    /// batch size); a stream that finds no free slot, or needs more, gets a cache of its own.
    pub slots: usize,
    pub slot_context: usize,
    /// Positions a conversation may take of the Thinker's context (its prompt, the turns it keeps
    /// and a reply; 0: the model's whole context): the oldest turns give way within it
    /// (`fit::conversation_context`). Set to `slot_context`, no conversation outgrows its slot.
    pub context: usize,
    /// Prompt prefixes whose KV the Thinker keeps (0 = off): system turns with their voice, and
    /// finished turns (prompt + reply) for their conversation's next prompt. A new prompt starts
    /// from the entry it shares the most leading ids with.
    pub prefix_cache: usize,
    /// ...holding at most this many MiB of KV together (the least recently used go first).
    pub prefix_mib: usize,
    /// With stage priorities: a Thinker step that holds a reply still before its first hand-off
    /// (its prompt, or its first text) does not wait for the gate (gate.rs). That reply's first
    /// audio is a caller's too; under arrivals the waits took 15 % of the Thinker's time.
    pub gate_spares_new_replies: bool,
    /// Put the reference voice into the Thinker's system prompt (MiniCPM-o's voice-cloning prompt).
    pub hears_reference: bool,
    #[serde(skip)]
    pub sampling: SamplingParams,
}

impl Default for ThinkerConfig {
    fn default() -> Self {
        Self {
            max_batch: 16,
            prefill_tokens: 1024,
            prefill_graph_rows: 0,
            prefill_graph_raised: true,
            slots: 16,
            slot_context: 4096,
            context: 0,
            prefix_cache: 16,
            prefix_mib: 1024,
            gate_spares_new_replies: false,
            hears_reference: true,
            sampling: SamplingParams::thinker_greedy(),
        }
    }
}

/// `[engine.talker]`: the Talker (speech-token LM) and how it follows the Thinker's text.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TalkerConfig {
    pub max_batch: usize,
    /// KV slots for Talker streams (0: none), each of `slot_context` positions (as the Thinker's).
    pub slots: usize,
    pub slot_context: usize,
    /// Feed the Talker's prefill row by row while the Thinker is still writing (same input).
    pub streaming_prefill: bool,
    /// Turn mode: hand the Talker the reply in text chunks of this many Thinker tokens, as the
    /// model's own streaming mode does (10 there): the Talker starts on the first chunk and makes
    /// each chunk's codes over a window of the previous chunk (docs/design/turn-streaming.md).
    /// 0: the whole reply at once (the vLLM-Omni reference's hand-off).
    pub text_chunk: usize,
    /// Text chunks only for a reply that finds at most this many requests in the engine (itself
    /// included) when the Thinker takes it; busier, the whole reply: text chunks bring first audio
    /// sooner, but their windows cost the batched steps throughput under load. `"none"` (the
    /// default): every reply.
    #[serde(deserialize_with = "count_or_none")]
    pub text_chunk_streams: Option<usize>,
    /// A stream's later segments (a text chunk's window, a duplex unit's condition), once its first
    /// chunk is out, go through the batched decode step a row a step rather than as a prefill
    /// beside it. On a GPU with stage priorities the decode step is a graph at the Talker's raised
    /// priority, while a prefill runs op by op at the lowest one: under load it waited behind the
    /// Thinker's graphs, and the whole Talker step with it (every stream stalled). A segment of
    /// ~50 rows (a window) or ~15 (a unit) costs as many steps, which the audio before covers.
    pub segment_rows: bool,
    /// With decode graphs: the Talker's prefills (a reply's condition, a text chunk's window, a
    /// duplex unit's condition) whose streams are all in slots run as the rows of a captured step
    /// of up to this many rows, at the Talker's raised priority, instead of op by op at the
    /// default one behind the Thinker's graphs (0: never; `Decoder::set_prefill_graph_rows`).
    pub prefill_graph_rows: usize,
    /// Those captured steps (beyond the decode buckets) at the Talker's raised priority; false: at
    /// the default one, as the op-by-op prefill.
    pub prefill_graph_raised: bool,
    /// Turn mode: a stream's Talker runs at most this many chunks of codes ahead of the audio
    /// Code2Wav has delivered (`"none"`: as fast as it can). On one GPU the stages' steps slow
    /// each other down; codes made long before Code2Wav can use them only slow down its chunk 0.
    #[serde(deserialize_with = "count_or_none")]
    pub lead_chunks: Option<usize>,
    /// Turn mode, with pacing on: no codes beyond a stream's small first chunk until that chunk's
    /// audio is delivered (the stream's Talker steps would only slow its chunk 0 down).
    pub hold_first_chunk: bool,
    #[serde(skip)]
    pub sampling: SamplingParams,
}

impl TalkerConfig {
    /// Text tokens a chunk of a turn reply that finds `engaged` requests in the engine
    /// (`text_chunk_streams`); 0: the whole reply.
    pub fn text_chunk_for(&self, engaged: usize) -> usize {
        if self.text_chunk_streams.is_none_or(|n| engaged <= n) {
            self.text_chunk
        } else {
            0
        }
    }
}

impl Default for TalkerConfig {
    fn default() -> Self {
        Self {
            max_batch: 32,
            slots: 32,
            slot_context: 4096,
            streaming_prefill: false,
            text_chunk: 0,
            text_chunk_streams: None,
            segment_rows: false,
            prefill_graph_rows: 0,
            prefill_graph_raised: true,
            lead_chunks: Some(1),
            hold_first_chunk: false,
            sampling: SamplingParams::talker(),
        }
    }
}

/// `[engine.code2wav]`: Code2Wav (flow matching and the HiFT vocoder), the chunks it makes audio
/// of, and how its steps are formed.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Code2WavConfig {
    pub max_batch: usize,
    /// A Code2Wav step takes every chunk due within its horizon (two recent steps, at least
    /// 300 ms); while it has fewer than this many, chunks not yet due join it, earliest first
    /// (audio sent ahead covers a client's network jitter). A step of many streams with seconds
    /// buffered would keep a new stream's first chunk waiting.
    pub early_batch: usize,
    /// A Code2Wav step runs its chunks as one batch whatever their lengths and `last` flags (one
    /// flow solve over the pool, every chunk padded to the step's longest and masked to its own,
    /// with graphs up to a length the warm-up captured); off, one batch per (chunk length, last).
    /// Fewer solves pay where a solve has a fixed cost (a GPU); on the CPU the padding costs
    /// compute, so it is off by default.
    pub mixed_steps: bool,
    /// A Code2Wav step that holds first chunks (chunk 0s) takes with them only the chunks due
    /// within its horizon; the chunks of streams with more audio buffered run in the step right
    /// after, so a new stream's first chunk does not ride a whole step of theirs.
    pub first_chunks_apart: bool,
    /// A Code2Wav step runs one batch, the one that holds its earliest-due chunk (without mixed
    /// steps a step's chunks are one batch per chunk length and `last` flag); the other batches go
    /// back to the queue and are planned again with what came meanwhile, so a new stream's first
    /// chunk waits for at most one batch of the step running when it came, not all of them.
    pub one_batch_per_step: bool,
    /// How the flow's attention over its slot pool runs on CUDA: `gathered` (the rows' planes
    /// gathered, two products, the masked softmax, the heads' transpose), `in_place` (two
    /// pointer-array products that read the pool where it is and write the heads side by side) or
    /// `kernel` (one flash-style kernel of ours, 16-bit; its three forms measured slower, runs
    /// 50-51). Elsewhere always `gathered`.
    pub pool_attention: PoolAttention,
    /// The f32 vocoder's main-path convolutions write their columns in f16 and multiply them by
    /// an f16 weight into f32 sums (half the bytes of the columns, which were half of the
    /// vocoder's GPU time in run 49; the inputs keep TF32's 10-bit mantissa, but f16's range). The
    /// source's path and the last conv stay f32. Off until measured.
    pub vocoder_half_columns: bool,
    /// New codes in every chunk after the first.
    pub chunk_codes: usize,
    /// Codes of left context in every chunk after the first.
    #[serde(skip)]
    pub context_codes: usize,
    /// New codes in the first Code2Wav chunk (a smaller first chunk lowers first-audio time)...
    pub first_chunk_codes: usize,
    /// ...for a stream that finds at most this many requests in the engine (itself included, in
    /// any stage) when the Thinker takes it and again when its text is complete; busier, its first
    /// chunk is a full one, whose second of audio covers the next chunk's wait.
    /// `"none"` (the default): every stream; 0: none.
    #[serde(deserialize_with = "count_or_none")]
    pub small_first_chunk_streams: Option<usize>,
    /// Busier than that, a small first chunk all the same where the streams already speaking can
    /// wait for its extra Code2Wav step and its own audio covers its next chunk's wait
    /// (`pace.rs`: `first_chunk_codes`, halfway, or a full chunk); off: a full one.
    pub small_first_chunk_slack: bool,
    /// Code2Wav's chunks over fixed buffers, captured as CUDA graphs per shape on a GPU (a shape is
    /// captured the second time it comes): the flow's 10-step CFM solve and the vocoder's F0 and
    /// decode steps; off: op by op.
    pub graphs: bool,
    /// The flow solve is captured for chunks of up to this many streams (larger ones run op by
    /// op), and at most `graph_count` shapes are kept (each holds its own copies of the streams'
    /// caches: a graph of B streams holds B times a stream's flow caches).
    pub graph_batch: usize,
    pub graph_count: usize,
    /// Slots of the flow's attention caches allocated at start-up (0: none), each of
    /// `slot_frames` mel positions (history + the voice's prompt + a chunk must fit): the streams
    /// in slots share one flow solve with no cache copied (on a GPU one graph per batch size up to
    /// `max_batch`, at most `pool_graphs` kept); a stream that finds no free slot, or whose voice
    /// does not fit, keeps caches of its own.
    pub slots: usize,
    pub slot_frames: usize,
    pub pool_graphs: usize,
    /// How long an idle Code2Wav with waiting references sleeps between idle steps.
    #[serde(skip)]
    pub idle_tick: Duration,
}

impl Code2WavConfig {
    /// Whether a stream that finds `engaged` requests in the engine gets a small first chunk
    /// (`small_first_chunk_streams`).
    pub fn small_first_chunk_for(&self, engaged: usize) -> bool {
        self.small_first_chunk_streams.is_none_or(|n| engaged <= n)
    }
}

impl Default for Code2WavConfig {
    fn default() -> Self {
        Self {
            max_batch: 8,
            early_batch: 8,
            mixed_steps: false,
            first_chunks_apart: false,
            one_batch_per_step: false,
            pool_attention: PoolAttention::Gathered,
            vocoder_half_columns: false,
            chunk_codes: 25,
            context_codes: 3,
            first_chunk_codes: 25,
            small_first_chunk_streams: None,
            small_first_chunk_slack: false,
            graphs: true,
            graph_batch: 2,
            graph_count: 12,
            slots: 8,
            slot_frames: 576,
            pool_graphs: 16,
            idle_tick: Duration::from_millis(2),
        }
    }
}

/// `[engine.prefetch]`: a caller's reference voice prepared in Code2Wav's idle steps while its
/// reply's text is still being thought (never while a live duplex stream needs Code2Wav).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefetchConfig {
    /// Phase A: the reference materialized and prepared (its features).
    pub enabled: bool,
    /// Phase B: the voice's setup (the DiT's attention over its prompt), off by default.
    pub setup: bool,
    /// References kept prepared, and setups kept, at most.
    pub ref_cache_capacity: usize,
    pub setup_cache_capacity: usize,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        Self { enabled: true, setup: false, ref_cache_capacity: 4, setup_cache_capacity: 1 }
    }
}

/// `[engine.duplex]`: full-duplex sessions (the Thinker hears a unit of audio at a time).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DuplexConfig {
    /// Duplex unit length in ms (a multiple of 100 ms; 1000 as the model was trained).
    pub unit_ms: u32,
    /// Codes the Talker may drain at the end of a duplex turn.
    pub drain_codes: usize,
    /// Thinker positions a duplex session may use (`"none"`, the default: the model's context);
    /// the session closes with `context_full` when the next unit would not fit.
    #[serde(deserialize_with = "count_or_none")]
    pub max_context: Option<usize>,
}

impl DuplexConfig {
    /// Talker codes per spoken duplex unit (25 codes per second of speech).
    pub fn codes_per_unit(&self) -> usize {
        (self.unit_ms as usize / 40).max(1)
    }
}

impl Default for DuplexConfig {
    fn default() -> Self {
        Self { unit_ms: 1000, drain_codes: 104, max_context: None }
    }
}
