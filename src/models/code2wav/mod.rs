//! Stage 2, Code2Wav: speech codes -> 24 kHz audio. The flow (Conformer encoder + DiT flow
//! matching) makes mel, the HiFT vocoder makes audio; reference-voice preparation (S3 speech
//! tokens, CAM++ speaker embedding, prompt mel) feeds the flow's prompt.

pub mod conformer;
pub mod dit;
pub mod flow;
pub mod hift;
pub mod yaml;
