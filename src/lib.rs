//! antiphon: a realtime voice server for the MiniCPM-o 4.5 speech path.
//!
//! See `ARCHITECTURE.md` for the bird's-eye view and the code map.

pub mod audio;
pub mod bench;
pub mod checkpoint;
pub mod engine;
pub mod gpu;
pub mod models;
pub mod onnx;
pub mod server;
pub mod synth;
pub mod tokenizer;
pub mod torchsave;
