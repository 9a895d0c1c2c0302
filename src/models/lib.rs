//! Pure model code (candle only): no async, no sockets, no files, no knowledge of sessions. Every
//! module mirrors the checkpoint's module tree so weights load by their checkpoint names; streaming
//! state (KV caches, encoder caches) lives in explicit per-stream structs passed in, so one model
//! instance serves a batch of streams.

pub mod attention;
pub mod backend;
pub mod batch_decode;
pub mod cache_pool;
pub mod code2wav;
pub mod config;
pub mod cuda_graph;
pub mod decode_attention;
pub mod decoder;
pub mod fused;
pub mod gpu;
pub mod mel;
pub mod onnx;
pub mod qwen3;
pub mod sampling;
pub mod smart_turn;
pub mod talker;
pub mod thinker;
pub mod tokenizer;
pub mod tools;
pub mod top_k;
pub mod whisper;

/// The models the engine runs (each moves into its stage's thread).
pub struct Models {
    pub thinker: thinker::Thinker,
    pub talker: talker::Talker,
    pub code2wav: code2wav::Code2Wav,
    pub tokenizer: tokenizer::TextTokenizer,
}
