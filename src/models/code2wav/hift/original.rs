//! The original (non-causal) HiFT generator streamed by overlap and cross-fade.

use candle_core::{Result, Tensor};

use super::HiftGenerator;

/// Per-stream state of the original generator streamed by overlap: every chunk is vocoded with the
/// previous chunk's last 8 mel frames in front, its source starts with the previous source tail,
/// and its first 3840 samples are cross-faded (Hamming) with the tail held back from before.
#[derive(Debug, Clone, Default)]
pub struct OriginalStreamState {
    mel: Option<Tensor>,
    source: Option<Tensor>,
    speech: Option<Tensor>,
    seed: u64,
    calls: u64,
}

impl OriginalStreamState {
    pub fn new(seed: u64) -> Self {
        Self { seed, ..Default::default() }
    }
}

impl HiftGenerator {
    /// One chunk of mel `[1, 80, frames]` through the original generator with overlap and
    /// cross-fade; holds back the last 8 frames' worth of audio unless `last`.
    pub fn stream_original(
        &self,
        st: &mut OriginalStreamState,
        mel: &Tensor,
        last: bool,
    ) -> Result<Tensor> {
        const MEL_CACHE: usize = 8;
        let hop = self.cfg.hop();
        let hold = MEL_CACHE * hop;
        let mel = match &st.mel {
            Some(m) => Tensor::cat(&[m, &mel.to_dtype(m.dtype())?], 2)?,
            None => mel.clone(),
        };
        let f0 = self.f0(&mel, true)?.to_vec1::<f32>()?;
        st.calls += 1;
        let mut s = self.source_original(&f0, Some(st.seed.wrapping_add(st.calls)))?;
        if let Some(cs) = &st.source {
            let n = cs.dim(2)?.min(s.dim(2)?);
            let rest = s.dim(2)? - n;
            s = Tensor::cat(&[&cs.narrow(2, 0, n)?, &s.narrow(2, n, rest)?], 2)?;
        }
        let mut speech = self.decode(&mel, &s, true)?.squeeze(0)?;
        let len = speech.dim(0)?;
        if let Some(prev) = &st.speech {
            let n = prev.dim(0)?.min(len).min(hold);
            let w: Vec<f32> = (0..2 * hold)
                .map(|i| {
                    (0.54
                        - 0.46
                            * (2.0 * std::f64::consts::PI * i as f64 / (2 * hold - 1) as f64).cos())
                        as f32
                })
                .collect();
            let up = Tensor::from_vec(w[..n].to_vec(), n, speech.device())?;
            let down = Tensor::from_vec(w[hold..hold + n].to_vec(), n, speech.device())?;
            let head = ((speech.narrow(0, 0, n)? * up)? + (prev.narrow(0, 0, n)? * down)?)?;
            speech = Tensor::cat(&[&head, &speech.narrow(0, n, len - n)?], 0)?;
        }
        let frames = mel.dim(2)?;
        st.mel = Some(mel.narrow(2, frames.saturating_sub(MEL_CACHE), frames.min(MEL_CACHE))?);
        let sl = s.dim(2)?;
        st.source = Some(s.narrow(2, sl.saturating_sub(hold), sl.min(hold))?);
        st.speech = Some(speech.narrow(0, len.saturating_sub(hold), len.min(hold))?);
        if last {
            Ok(speech)
        } else {
            speech.narrow(0, 0, len.saturating_sub(hold))
        }
    }
}
