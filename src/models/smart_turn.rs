//! Smart Turn v3 (pipecat-ai's end-of-turn classifier, an exported ONNX graph: a Whisper-tiny
//! encoder and a pooled classifier, int8 QDQ): the last 8 s of a speaker's audio at 16 kHz ->
//! the probability that their turn is complete.
//!
//! Its input is what `transformers.WhisperFeatureExtractor(chunk_length=8)` makes of the window:
//! the audio zero-padded at the front to 8 s, normalized to zero mean and unit variance, then
//! Whisper's log-mel (80 bins, 800 frames). Its graph ends in a sigmoid, so its output is the
//! probability itself. Its activations are evaluated in float (only its weights are
//! dequantized: [`OnnxGraph::with_float_activations`] says why).

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};

use crate::mel::WhisperLogMel;
use crate::onnx::graph::OnnxGraph;
use crate::onnx::ModelProto;

/// What the waveform's variance is floored at before normalizing (the feature extractor's).
const NORM_EPS: f64 = 1e-7;

pub struct SmartTurn {
    graph: OnnxGraph,
    features: TurnFeatures,
}

/// The model's input: the window's log-mel.
pub struct TurnFeatures {
    mel: WhisperLogMel,
}

impl TurnFeatures {
    /// The model's input for a speaker's audio at 16 kHz (any length: the last 8 s are used):
    /// `[80, 800]` row-major.
    pub fn features(&self, audio: &[f32]) -> Vec<f32> {
        let tail = &audio[audio.len().saturating_sub(SmartTurn::WINDOW_SAMPLES)..];
        let mut x = vec![0f32; SmartTurn::WINDOW_SAMPLES - tail.len()];
        x.extend_from_slice(tail);
        let n = x.len() as f64;
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + NORM_EPS).sqrt();
        let x: Vec<f32> = x.iter().map(|&v| ((v as f64 - mean) * inv) as f32).collect();
        self.mel.compute(&x).0
    }
}

impl std::fmt::Debug for SmartTurn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SmartTurn")
    }
}

impl SmartTurn {
    pub const SAMPLE_RATE: usize = 16_000;
    /// The window the model sees: the last 8 s.
    pub const WINDOW_SAMPLES: usize = 8 * Self::SAMPLE_RATE;
    const MELS: usize = 80;
    const FRAMES: usize = 800;

    /// The model from its ONNX file's contents (its arithmetic on the CPU).
    pub fn from_model(m: &ModelProto) -> Result<Self> {
        let graph = OnnxGraph::from_model(m, "smart turn model")?.with_float_activations();
        let g = m.graph.as_ref().context("smart turn model: no graph")?;
        let input =
            g.input.iter().find(|v| v.name == "input_features").context(
                "smart turn model: no input `input_features` (not a Smart Turn v3 file?)",
            )?;
        let dims: Vec<i64> = input
            .r#type
            .as_ref()
            .and_then(|t| t.tensor_type.as_ref())
            .and_then(|t| t.shape.as_ref())
            .map(|s| s.dim.iter().map(|d| d.dim_value).collect())
            .unwrap_or_default();
        if dims.len() != 3 || dims[1] != Self::MELS as i64 || dims[2] != Self::FRAMES as i64 {
            bail!(
                "smart turn model: input_features is {dims:?}, expected [batch, 80, 800] (Smart \
                Turn v3)"
            );
        }
        Ok(Self { graph, features: Self::feature_extractor() })
    }

    /// What turns audio into the model's input.
    pub fn feature_extractor() -> TurnFeatures {
        TurnFeatures { mel: WhisperLogMel::new(Self::MELS) }
    }

    /// The probability (0–1) that the turn in `audio` (16 kHz, its last 8 s) is complete.
    pub fn end_of_turn(&self, audio: &[f32]) -> Result<f32> {
        let f = Tensor::from_vec(
            self.features.features(audio),
            (1, Self::MELS, Self::FRAMES),
            &Device::Cpu,
        )?;
        let p = self.graph.run(&f)?.flatten_all()?.to_vec1::<f32>()?;
        match p.as_slice() {
            [v] if v.is_finite() => Ok(*v),
            other => bail!("smart turn model: output {other:?}, expected one probability"),
        }
    }
}
