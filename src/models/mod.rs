//! Pure model code (candle only): no async, no sockets, no knowledge of sessions. Every module
//! mirrors the checkpoint's module tree so weights load by their checkpoint names; streaming state
//! (KV caches, encoder caches) lives in explicit per-stream structs passed in, so one model
//! instance serves a batch of streams.

pub mod cache_pool;
pub mod code2wav;
pub mod config;
pub mod cuda_graph;
pub mod decode_attention;
pub mod decoder;
pub mod fused;
pub mod mel;
pub mod qwen3;
pub mod sampling;
pub mod talker;
pub mod thinker;
pub mod whisper;
