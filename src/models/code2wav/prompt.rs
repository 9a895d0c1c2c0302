//! Reference-voice preparation, in the three steps whose costs differ:
//! 1. [`Reference::materialize`]: mono audio at any rate -> 24 kHz, cut or zero-padded to exactly
//!    6 s, content hash (the cache key);
//! 2. [`prepare`]: S3 speech codes (16 kHz, 150 for 6 s), CAM++ speaker embedding (kaldi fbank at
//!    16 kHz, mean-normalized), the prompt mel (24 kHz, padded to 2 × the code count);
//! 3. setup (the flow over the prompt) lives in [`super::Code2Wav::setup`].

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use sha2::{Digest, Sha256};

use super::campplus::CamPlusPlus;
use super::s3tokenizer::S3Tokenizer;
use crate::mel::{kaldi_fbank, mean_normalize, FlowMel, WhisperLogMel};

pub const PROMPT_RATE: u32 = 24_000;
pub const PROMPT_SECONDS: f64 = 6.0;
pub const TOKENIZER_RATE: u32 = 16_000;

/// A reference voice normalized onto the 6 s / 24 kHz grid, with its content hash.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    pub samples: Vec<f32>,
    /// Hex SHA-256 of the f32 little-endian samples followed by "24000".
    pub key: String,
}

impl Reference {
    /// Step 1: mono samples at `rate` -> the normalized reference. Empty or non-finite audio is
    /// refused.
    pub fn materialize(samples: &[f32], rate: u32) -> Result<Self> {
        if samples.is_empty() {
            bail!("reference audio is empty");
        }
        if samples.iter().any(|s| !s.is_finite()) {
            bail!("reference audio holds non-finite samples");
        }
        let mut x = antiphon_audio::resample(samples, rate, PROMPT_RATE)?;
        x.resize((PROMPT_SECONDS * PROMPT_RATE as f64) as usize, 0.0);
        // (the samples' bytes in one update: the same digest as sample by sample, a fraction of
        // the time)
        let bytes: Vec<u8> = x.iter().flat_map(|s| s.to_le_bytes()).collect();
        let mut h = Sha256::new();
        h.update(&bytes);
        h.update(PROMPT_RATE.to_string().as_bytes());
        let key = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Ok(Self { samples: x, key })
    }

    /// Step 1 from a WAV file's bytes (any rate, any channel count up to 8).
    pub fn from_wav(bytes: &[u8]) -> Result<Self> {
        let (x, rate) = antiphon_audio::decode_wav(bytes)?;
        Self::materialize(&x, rate)
    }
}

/// What the flow needs of a reference (step 2's output).
#[derive(Debug, Clone)]
pub struct PromptFeatures {
    /// S3 speech codes of the reference.
    pub codes: Vec<u32>,
    /// `[192]` speaker embedding.
    pub speaker: Tensor,
    /// `[2 · codes, 80]` prompt mel.
    pub mel: Tensor,
}

/// Step 2 on the reference's 16 kHz and 24 kHz audio.
pub fn prepare_features(
    audio_16k: &[f32],
    audio_24k: &[f32],
    s3: &S3Tokenizer,
    campplus: &CamPlusPlus,
    flow_mel: &FlowMel,
    up_rate: usize,
    dev: &Device,
) -> Result<PromptFeatures> {
    // the host's three spectral front ends run side by side: the kaldi fbank and the prompt mel
    // on helper threads, the S3 log-mel here, whose codes the device computes meanwhile
    let (codes, speaker, (pm, pf)) = std::thread::scope(|scope| -> Result<_> {
        let fbank = scope.spawn(|| {
            let (mut fb, nf) = kaldi_fbank(audio_16k, TOKENIZER_RATE as usize, 80);
            mean_normalize(&mut fb, 80);
            (fb, nf)
        });
        let prompt_mel = scope.spawn(|| flow_mel.compute(audio_24k));
        // speech codes: 128-bin Whisper log-mel -> S3 tokenizer
        let wm = WhisperLogMel::new(s3.n_mels());
        let (m, frames) = wm.compute(audio_16k);
        let mel128 = Tensor::from_vec(m, (s3.n_mels(), frames), dev)?;
        let codes = s3.quantize(&mel128)?;
        if codes.is_empty() {
            bail!("reference audio is too short for speech codes");
        }
        // speaker: kaldi fbank (host), mean-normalized, CAM++ (on its device)
        let (fb, nf) = fbank.join().map_err(|_| anyhow::anyhow!("the fbank thread panicked"))?;
        let fb = Tensor::from_vec(fb, (nf, 80), &Device::Cpu)?;
        let speaker = campplus.embed(&fb)?.to_device(dev)?;
        Ok((
            codes,
            speaker,
            prompt_mel.join().map_err(|_| anyhow::anyhow!("the prompt mel thread panicked"))?,
        ))
    })?;
    finish(codes, speaker, &pm, pf, up_rate, dev)
}

/// The prompt mel at 24 kHz (`pm`: `[n_mels, pf]` row-major) replicate-padded (or cut) to
/// `up_rate` × the code count, and the features.
fn finish(
    codes: Vec<u32>,
    speaker: Tensor,
    pm: &[f32],
    pf: usize,
    up_rate: usize,
    dev: &Device,
) -> Result<PromptFeatures> {
    let n_mels = pm.len() / pf.max(1);
    let mut rows = vec![0f32; codes.len() * up_rate * n_mels];
    let want = codes.len() * up_rate;
    for t in 0..want {
        let src = t.min(pf.saturating_sub(1));
        for m in 0..n_mels {
            rows[t * n_mels + m] = if pf == 0 { 0.0 } else { pm[m * pf + src] };
        }
    }
    let mel = Tensor::from_vec(rows, (want, n_mels), dev)?;
    Ok(PromptFeatures { codes, speaker, mel })
}

/// One voice's host front ends: the S3 log-mel (`[n_mels, frames]`), the mean-normalized kaldi
/// fbank (`[frames, 80]`), the prompt mel (`[80, frames]`), each with its frame count.
struct HostParts {
    s3_mel: (Vec<f32>, usize),
    fbank: (Vec<f32>, usize),
    prompt_mel: (Vec<f32>, usize),
}

fn host_parts(audio_24k: &[f32], s3_mels: usize, flow_mel: &FlowMel) -> Result<HostParts> {
    let a16 = antiphon_audio::resample(audio_24k, PROMPT_RATE, TOKENIZER_RATE)?;
    let (mut fb, nf) = kaldi_fbank(&a16, TOKENIZER_RATE as usize, 80);
    mean_normalize(&mut fb, 80);
    Ok(HostParts {
        s3_mel: WhisperLogMel::new(s3_mels).compute(&a16),
        fbank: (fb, nf),
        prompt_mel: flow_mel.compute(audio_24k),
    })
}

/// Step 2 for several voices (24 kHz, as materialized) at once: every voice's host front ends side
/// by side (a thread each), then every voice's device work queued (S3 codes, CAM++) with one wait
/// for them all, rather than a wait per voice. One result per voice, in order; a voice that fails
/// fails alone.
pub fn prepare_features_batch(
    voices: &[&[f32]],
    s3: &S3Tokenizer,
    campplus: &CamPlusPlus,
    flow_mel: &FlowMel,
    up_rate: usize,
    dev: &Device,
) -> Vec<Result<PromptFeatures>> {
    let hosts: Vec<Result<HostParts>> = std::thread::scope(|scope| {
        let handles: Vec<_> = voices
            .iter()
            .map(|&a| scope.spawn(move || host_parts(a, s3.n_mels(), flow_mel)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a preparation thread panicked")))
            })
            .collect()
    });
    // the device's work queued for every voice: S3 levels, then the speakers in one batch where
    // CAM++ takes one (else voice by voice)
    // (each voice: its S3 levels, queued, and its prompt mel `[80, frames]`)
    type Queued = (Tensor, (Vec<f32>, usize));
    let mut queued: Vec<Result<Queued>> = Vec::with_capacity(voices.len());
    let mut fbanks: Vec<Tensor> = Vec::new();
    for h in hosts {
        let q = h.and_then(|HostParts { s3_mel, fbank, prompt_mel }| {
            let levels =
                s3.levels_queued(&Tensor::from_vec(s3_mel.0, (s3.n_mels(), s3_mel.1), dev)?)?;
            fbanks.push(Tensor::from_vec(fbank.0, (fbank.1, 80), &Device::Cpu)?);
            Ok((levels, prompt_mel))
        });
        queued.push(q);
    }
    let fb: Vec<&Tensor> = fbanks.iter().collect();
    let mut speakers: std::vec::IntoIter<Result<Tensor>> = match campplus.embed_batch(&fb) {
        Ok(Some(rows)) => rows.into_iter().map(Ok).collect::<Vec<_>>().into_iter(),
        _ => fb.iter().map(|f| campplus.embed(f)).collect::<Vec<_>>().into_iter(),
    };
    // then read back, voice by voice (the first wait finds the others' work done or under way)
    queued
        .into_iter()
        .map(|q| {
            let (levels, (pm, pf)) = q?;
            let speaker = speakers
                .next()
                .ok_or_else(|| anyhow::anyhow!("a voice's speaker embedding went missing"))??;
            let codes = S3Tokenizer::codes_of(&levels)?;
            if codes.is_empty() {
                bail!("reference audio is too short for speech codes");
            }
            finish(codes, speaker.to_device(dev)?, &pm, pf, up_rate, dev)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reference's key is what registered voices are saved under: it stays the SHA-256 of its
    /// samples' little-endian bytes (fed sample by sample, as the key was first made) and the rate.
    #[test]
    fn a_references_key_is_the_digest_of_its_samples_and_rate() {
        let x: Vec<f32> = (0..16_000).map(|i| (i as f32 * 0.013).sin() * 0.4).collect();
        let r = Reference::materialize(&x, 16_000).unwrap();
        let mut h = Sha256::new();
        for s in &r.samples {
            h.update(s.to_le_bytes());
        }
        h.update(PROMPT_RATE.to_string().as_bytes());
        let want: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(r.key, want);
        assert_ne!(Reference::materialize(&x[1..], 16_000).unwrap().key, want);
    }
}
