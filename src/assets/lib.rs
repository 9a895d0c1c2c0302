//! Files on disk and the synthetic stand-ins for them: checkpoint directories (safetensors index,
//! `config.json`, `tokenizer.json`), torch state dicts, hyperpyyaml configs, the token2wav ONNX
//! files; synthetic checkpoints in the real layout and synthetic models made in memory.
//! Everything that reads or writes a model file lives here, so `antiphon-models` stays pure.

pub mod check;
pub mod checkpoint;
pub mod onnx;
pub mod synth;
pub mod token2wav;
pub mod torchsave;
pub mod yaml;
