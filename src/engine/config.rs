//! The engine's configuration: one definition, read from the `[engine]` table as it is. The keys
//! every stage shares (admission, memory, the GPU) sit in `[engine]`; each stage's own in its
//! section (`[engine.thinker]`, `[engine.talker]`, `[engine.code2wav]`, `[engine.prefetch]`,
//! `[engine.duplex]`, `config/stages.rs`). A count that may be absent is an `Option`, written
//! `"none"` in a file.

use serde::{Deserialize, Deserializer};

mod stages;

pub use stages::{Code2WavConfig, DuplexConfig, PrefetchConfig, TalkerConfig, ThinkerConfig};

/// Engine knobs: the `[engine]` table of the configuration file is this struct, read by serde
/// (absent keys keep these defaults, unknown keys are refused). Fields marked `skip` are not
/// settable from a file.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    pub thinker: ThinkerConfig,
    pub talker: TalkerConfig,
    pub code2wav: Code2WavConfig,
    pub prefetch: PrefetchConfig,
    pub duplex: DuplexConfig,
    /// Idle KV caches each stage keeps for its next streams (beyond its slots) hold at most this
    /// many MiB together; a cache that would pass it is freed instead.
    pub idle_cache_mib: usize,
    /// One-stream decode steps of the Thinker and the Talker over fixed-address buffers, captured
    /// as CUDA graphs on a GPU (`DecodeMode::Graph`); off: every step runs op by op.
    pub decode_graphs: bool,
    /// On a GPU with a stream per stage, the Thinker's and the Talker's captured steps run at the
    /// highest stream priority: when their kernels wait beside Code2Wav's, the block scheduler
    /// starts theirs first (a decode step is a few ms; Code2Wav's chunks are hundreds). Off by
    /// default; on in the GPU configuration (docs/performance.md).
    pub stage_priorities: bool,
    /// With stage priorities, the Talker's graphs one level above the Thinker's (both above
    /// Code2Wav's kernels): a Talker step (~1-2 ms) that waits beside a Thinker step starts first.
    pub talker_first: bool,
    /// With stage priorities, a step of at most this many streams is a lightly loaded stage's:
    /// a Talker step this small holds the gate while one of its streams makes its first chunk's
    /// codes (or a text chunk's window), and a Thinker step this small sends a reply's first text
    /// chunk with it held (`gate.rs`). Larger steps leave the Thinker its priority.
    pub gated_streams: usize,
    /// On a GPU, f32 matrix products (the vocoder's convolutions, reference preparation) run on
    /// tensor cores in TF32 (10-bit mantissa products, f32 sums); off: full f32. Process-wide.
    pub gpu_tf32: bool,
    /// On CUDA, attention under a causal mask (a prompt chunk, op by op or in a ragged step) takes
    /// its softmax in one kernel that never makes the mask, instead of the mask's add and the
    /// softmax. Process-wide.
    pub causal_softmax_kernel: bool,
    /// On CUDA, the decode step's attention reads each K and V row with a team of lanes, 16
    /// bytes a lane (`batch_attn_teams`), instead of a warp a row. Process-wide.
    pub decode_attention_teams: bool,
    pub default_max_text_tokens: usize,
    pub default_min_audio_tokens: usize,
    pub default_max_audio_tokens: usize,
    /// Messages each stage's inbox holds.
    #[serde(skip)]
    pub channel_capacity: usize,
    /// Streams (turn responses from the Thinker to their last audio, and open duplex sessions) the
    /// engine runs at once at most (admission.rs). Absent or `"none"`: the fewest KV slots of a
    /// stage that holds every stream (the Talker's and Code2Wav's, and the Thinker's for duplex
    /// sessions), so no stream runs beside the batched step.
    #[serde(deserialize_with = "count_or_none")]
    pub max_streams: Option<usize>,
    /// Responses that wait for a place at most; beyond, a response is refused (`capacity`).
    pub max_queued: usize,
    /// A chunk that reaches its listener late lowers the stream limit below the streams running
    /// then; a while without one raises it again, up to `max_streams` (off: the limit stays there).
    pub adaptive_stream_limit: bool,
    /// With the adaptive limit: a chunk that reached Code2Wav with more than this many ms of its
    /// listener's audio to spare and has less left while it waits there holds new streams back
    /// (the limit goes to the streams running) before any chunk is late; 0: off (only late chunks
    /// lower the limit). Below the step horizon (300 ms at least) when `code2wav.early_batch`
    /// holds chunks back until they are due.
    pub admission_slack_ms: u64,
    /// With the adaptive limit: while the recent replies' first audio (a moving mean, each reply
    /// 1/8) comes more than this many ms after they took their places, each one lowers the stream
    /// limit as a late chunk does (new streams wait or are refused while the admitted ones
    /// answer slowly); 0: off. From the place, not the arrival: a wait in the queue is the
    /// limit's doing, and counting it would lower the limit further.
    pub first_audio_target_ms: u64,
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

/// The longest text chunk `talker.text_chunk` may ask for (a chunk's condition and the previous
/// one's sit in the Talker's window together).
pub const MAX_TEXT_CHUNK: usize = 256;

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            thinker: ThinkerConfig::default(),
            talker: TalkerConfig::default(),
            code2wav: Code2WavConfig::default(),
            prefetch: PrefetchConfig::default(),
            duplex: DuplexConfig::default(),
            idle_cache_mib: 1024,
            decode_graphs: true,
            stage_priorities: false,
            talker_first: false,
            gated_streams: 4,
            gpu_tf32: true,
            causal_softmax_kernel: true,
            decode_attention_teams: false,
            default_max_text_tokens: 512,
            default_min_audio_tokens: 50,
            default_max_audio_tokens: 2048,
            channel_capacity: 1024,
            max_streams: None,
            max_queued: 32,
            adaptive_stream_limit: true,
            admission_slack_ms: 0,
            first_audio_target_ms: 0,
            call_headroom: 0,
            streams_from_memory: false,
            memory_headroom_mib: 16384,
        }
    }
}

/// Where each key of the flat `[engine]` table before the stages' sections went: a file that
/// still writes one is refused with the key's new place (`legacy_key`).
const MOVED: &[(&str, &str)] = &[
    ("thinker_max_batch", "thinker.max_batch"),
    ("thinker_prefill_tokens", "thinker.prefill_tokens"),
    ("thinker_slots", "thinker.slots"),
    ("thinker_slot_context", "thinker.slot_context"),
    ("thinker_prefix_cache", "thinker.prefix_cache"),
    ("thinker_prefix_mib", "thinker.prefix_mib"),
    ("gate_spares_new_replies", "thinker.gate_spares_new_replies"),
    ("thinker_hears_reference", "thinker.hears_reference"),
    ("talker_max_batch", "talker.max_batch"),
    ("talker_slots", "talker.slots"),
    ("talker_slot_context", "talker.slot_context"),
    ("talker_streaming_prefill", "talker.streaming_prefill"),
    ("talker_text_chunk", "talker.text_chunk"),
    ("talker_segment_rows", "talker.segment_rows"),
    ("talker_lead_chunks", "talker.lead_chunks"),
    ("talker_hold_first_chunk", "talker.hold_first_chunk"),
    ("code2wav_max_batch", "code2wav.max_batch"),
    ("code2wav_early_batch", "code2wav.early_batch"),
    ("code2wav_mixed_steps", "code2wav.mixed_steps"),
    ("code2wav_first_chunks_apart", "code2wav.first_chunks_apart"),
    ("code2wav_one_batch_per_step", "code2wav.one_batch_per_step"),
    ("code2wav_pool_attention", "code2wav.pool_attention"),
    ("vocoder_half_columns", "code2wav.vocoder_half_columns"),
    ("chunk_codes", "code2wav.chunk_codes"),
    ("first_chunk_codes", "code2wav.first_chunk_codes"),
    ("small_first_chunk_streams", "code2wav.small_first_chunk_streams"),
    ("small_first_chunk_slack", "code2wav.small_first_chunk_slack"),
    ("code2wav_graphs", "code2wav.graphs"),
    ("code2wav_graph_batch", "code2wav.graph_batch"),
    ("code2wav_graph_count", "code2wav.graph_count"),
    ("code2wav_slots", "code2wav.slots"),
    ("code2wav_slot_frames", "code2wav.slot_frames"),
    ("code2wav_pool_graphs", "code2wav.pool_graphs"),
    ("prefetch_setup", "prefetch.setup"),
    ("ref_cache_capacity", "prefetch.ref_cache_capacity"),
    ("setup_cache_capacity", "prefetch.setup_cache_capacity"),
    ("duplex_unit_ms", "duplex.unit_ms"),
    ("duplex_drain_codes", "duplex.drain_codes"),
    ("duplex_max_context", "duplex.max_context"),
];

/// The section and key where a key of the flat `[engine]` table now lives (`prefetch`, once a
/// switch, is now its own section: `prefetch.enabled`), if `key` is one of them.
pub fn legacy_key(key: &str, value_is_table: bool) -> Option<&'static str> {
    if key == "prefetch" && !value_is_table {
        return Some("prefetch.enabled");
    }
    MOVED.iter().find(|(old, _)| *old == key).map(|(_, new)| *new)
}

impl EngineConfig {
    /// This configuration with `f` applied (a few keys changed from a base).
    pub fn with(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self
    }

    /// `admission_slack_ms` as a margin, `None` when off.
    pub fn admission_slack(&self) -> Option<std::time::Duration> {
        (self.admission_slack_ms > 0)
            .then(|| std::time::Duration::from_millis(self.admission_slack_ms))
    }

    /// The most new codes one Code2Wav chunk carries (what a flow slot must leave room for).
    pub fn max_chunk_codes(&self) -> usize {
        self.code2wav
            .chunk_codes
            .max(self.code2wav.first_chunk_codes)
            .max(self.duplex.codes_per_unit())
    }

    /// Streams the engine runs at once (see `max_streams`).
    pub fn stream_places(&self) -> usize {
        let slots = [self.thinker.slots, self.talker.slots, self.code2wav.slots]
            .into_iter()
            .filter(|&n| n > 0)
            .min();
        self.max_streams.or(slots).unwrap_or(self.talker.max_batch).max(1)
    }

    /// What the stages cannot run with, named by key.
    pub fn validate(&self) -> Result<(), String> {
        if self.code2wav.chunk_codes == 0
            || self.thinker.max_batch == 0
            || self.talker.max_batch == 0
            || self.code2wav.max_batch == 0
        {
            return Err("engine: each stage's max_batch and code2wav.chunk_codes must be at \
                least 1"
                .into());
        }
        if self.talker.text_chunk > MAX_TEXT_CHUNK {
            return Err(format!(
                "engine.talker.text_chunk {}: 0 (the whole reply) or up to {MAX_TEXT_CHUNK} tokens",
                self.talker.text_chunk
            ));
        }
        // (0 once meant "none" for these two: a file from then would ask for no stream, or for a
        // duplex session that ends at its first unit)
        if self.max_streams == Some(0) {
            return Err("engine.max_streams 0: at least 1, or \"none\" for the fewest slots".into());
        }
        if self.duplex.max_context == Some(0) {
            return Err("engine.duplex.max_context 0: at least 1, or \"none\" for the model's \
                context"
                .into());
        }
        let unit = self.duplex.unit_ms;
        if unit == 0 || !unit.is_multiple_of(100) || unit > 10_000 {
            return Err(format!("engine.duplex.unit_ms {unit}: a multiple of 100 ms up to 10000"));
        }
        Ok(())
    }
}

/// A count, or `"none"` (the key's "no count": no limit, or a default the engine derives).
pub(crate) fn count_or_none<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    struct CountOrNone;
    impl serde::de::Visitor<'_> for CountOrNone {
        type Value = Option<usize>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a count (0 or more), or \"none\"")
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
            usize::try_from(v).map(Some).map_err(|_| {
                E::custom(format!("{v}: a count (0 or more), or \"none\" for no count"))
            })
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
            self.visit_i64(i64::try_from(v).unwrap_or(i64::MAX))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            match v {
                "none" => Ok(None),
                _ => Err(E::custom(format!("{v:?}: a count (0 or more), or \"none\""))),
            }
        }
    }
    d.deserialize_any(CountOrNone)
}
