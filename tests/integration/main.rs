//! Every integration test of the root crate, one module per concern, in one binary (one link in
//! CI; `cargo test --release <module>::` runs one module, as `scripts/gpu-measure.sh` runs the
//! parity modules on a GPU). The engine's real-time test is the engine crate's own binary
//! (`src/engine/tests/realtime.rs`), which no other test shares its cores with.

mod common;
mod wire;

mod architecture;
mod bench;
mod chaos;
mod checkpoint;
mod code2wav;
mod config;
mod duplex;
mod edges;
mod engine;
mod flow_slots;
mod fuzz;
mod openai;
mod parity_c2w;
mod parity_lm;
mod parity_prompt;
mod parity_stream;
mod parity_turn;
mod prefetch;
mod profile;
mod prompt_reuse;
mod replica;
mod semantic_turns;
mod server;
mod tokenizer;
mod tool_calls;
mod tool_loop;
mod voices;
