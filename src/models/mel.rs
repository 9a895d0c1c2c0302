//! Spectral front ends on the CPU (candle has no FFT): the Whisper log-mel (80 bins for the audio
//! encoder, 128 bins for the S3 speech tokenizer) and the shared pieces (periodic Hann window,
//! Slaney mel filter bank, power STFT) that the other feature extractors reuse.
//!
//! Computed in f64 and returned as f32, so results match the reference's float32 numbers to
//! rounding.

use std::sync::Arc;

use realfft::{RealFftPlanner, RealToComplex};

/// Periodic Hann window of length `n` (torch.hann_window / transformers' "hann").
pub fn hann_periodic(n: usize) -> Vec<f64> {
    (0..n).map(|i| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / n as f64).cos()).collect()
}

fn hz_to_mel_slaney(f: f64) -> f64 {
    let logstep = 27.0 / 6.4f64.ln();
    if f >= 1000.0 {
        15.0 + (f / 1000.0).ln() * logstep
    } else {
        3.0 * f / 200.0
    }
}

fn mel_to_hz_slaney(m: f64) -> f64 {
    let logstep = 27.0 / 6.4f64.ln();
    if m >= 15.0 {
        1000.0 * ((m - 15.0) / logstep).exp()
    } else {
        200.0 * m / 3.0
    }
}

/// Triangular mel filters on the Slaney scale with Slaney area normalization (librosa's default,
/// transformers' `mel_filter_bank(norm="slaney", mel_scale="slaney")`), `[n_mels][n_fft/2+1]`.
pub fn mel_filters_slaney(
    sample_rate: usize,
    n_fft: usize,
    n_mels: usize,
    fmin: f64,
    fmax: f64,
) -> Vec<Vec<f64>> {
    let n_freq = n_fft / 2 + 1;
    let (mmin, mmax) = (hz_to_mel_slaney(fmin), hz_to_mel_slaney(fmax));
    let pts: Vec<f64> = (0..n_mels + 2)
        .map(|i| mel_to_hz_slaney(mmin + (mmax - mmin) * i as f64 / (n_mels + 1) as f64))
        .collect();
    let fft_freqs: Vec<f64> =
        (0..n_freq).map(|k| (sample_rate as f64 / 2.0) * k as f64 / (n_freq - 1) as f64).collect();
    (0..n_mels)
        .map(|m| {
            let (lo, mid, hi) = (pts[m], pts[m + 1], pts[m + 2]);
            let enorm = 2.0 / (hi - lo);
            fft_freqs
                .iter()
                .map(|&f| {
                    let down = (f - lo) / (mid - lo);
                    let up = (hi - f) / (hi - mid);
                    down.min(up).max(0.0) * enorm
                })
                .collect()
        })
        .collect()
}

/// A bank of mel filters kept as the span of bins each one covers (first to last non-zero
/// weight): applying it sums the same products in the same order as the dense rows, without the
/// zeros (most of each row), so the result is the same to the bit.
#[derive(Debug, Clone)]
pub struct MelBank {
    bands: Vec<(usize, Vec<f64>)>,
}

impl MelBank {
    pub fn from_dense(rows: &[Vec<f64>]) -> Self {
        let bands = rows
            .iter()
            .map(|r| match (r.iter().position(|&w| w != 0.0), r.iter().rposition(|&w| w != 0.0)) {
                (Some(a), Some(b)) => (a, r[a..=b].to_vec()),
                _ => (0, vec![]),
            })
            .collect();
        Self { bands }
    }

    pub fn len(&self) -> usize {
        self.bands.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bands.is_empty()
    }

    /// Each band's energy in `spectrum` (one frame's bins), in band order.
    pub fn apply<'a>(&'a self, spectrum: &'a [f64]) -> impl Iterator<Item = f64> + 'a {
        self.bands
            .iter()
            .map(move |(start, w)| w.iter().zip(&spectrum[*start..]).map(|(a, b)| a * b).sum())
    }
}

/// Short-time Fourier transform of framed, windowed real signals.
pub struct Stft {
    n_fft: usize,
    hop: usize,
    window: Vec<f64>,
    plan: Arc<dyn RealToComplex<f64>>,
}

impl Stft {
    /// `window` shorter than `n_fft` is centered in the frame (torch.stft's convention).
    pub fn new(n_fft: usize, hop: usize, window: Vec<f64>) -> Self {
        let mut w = vec![0.0; n_fft];
        let off = (n_fft - window.len()) / 2;
        w[off..off + window.len()].copy_from_slice(&window);
        let plan = RealFftPlanner::<f64>::new().plan_fft_forward(n_fft);
        Self { n_fft, hop, window: w, plan }
    }

    pub fn n_fft(&self) -> usize {
        self.n_fft
    }

    /// |X|^2 of every full frame of `signal` (already padded as the caller wants):
    /// `frames x (n_fft/2 + 1)`.
    pub fn power(&self, signal: &[f64]) -> Vec<Vec<f64>> {
        if signal.len() < self.n_fft {
            return vec![];
        }
        let frames = 1 + (signal.len() - self.n_fft) / self.hop;
        let mut input = self.plan.make_input_vec();
        let mut spec = self.plan.make_output_vec();
        let mut out = Vec::with_capacity(frames);
        for t in 0..frames {
            let s = &signal[t * self.hop..t * self.hop + self.n_fft];
            for ((i, x), w) in input.iter_mut().zip(s).zip(&self.window) {
                *i = x * w;
            }
            self.plan.process(&mut input, &mut spec).expect("fft sizes match the plan");
            out.push(spec.iter().map(|c| c.norm_sqr()).collect());
        }
        out
    }
}

/// Reflect-pads `x` by `pad` on both sides (numpy/torch "reflect"); a signal too short to reflect
/// is zero-extended first.
pub fn reflect_pad(x: &[f32], pad: usize) -> Vec<f64> {
    let mut src: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    if src.len() <= pad {
        src.resize(pad + 1, 0.0);
    }
    let n = src.len();
    let mut out = Vec::with_capacity(n + 2 * pad);
    out.extend((1..=pad).rev().map(|i| src[i]));
    out.extend_from_slice(&src);
    out.extend((0..pad).map(|i| src[n - 2 - i]));
    out
}

/// Whisper's log-mel spectrogram: 16 kHz, n_fft 400, hop 160, centered with reflect padding,
/// power spectrum, Slaney mel filters up to 8 kHz, log10 clamped at 1e-10, the last frame dropped,
/// floored at (max - 8), then (x + 4) / 4.
pub struct WhisperLogMel {
    stft: Stft,
    filters: MelBank,
    hop: usize,
}

impl std::fmt::Debug for WhisperLogMel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WhisperLogMel({} bins)", self.filters.len())
    }
}

impl WhisperLogMel {
    pub const SAMPLE_RATE: usize = 16_000;
    pub const N_FFT: usize = 400;
    pub const HOP: usize = 160;

    pub fn new(n_mels: usize) -> Self {
        Self {
            stft: Stft::new(Self::N_FFT, Self::HOP, hann_periodic(Self::N_FFT)),
            filters: MelBank::from_dense(&mel_filters_slaney(
                Self::SAMPLE_RATE,
                Self::N_FFT,
                n_mels,
                0.0,
                8000.0,
            )),
            hop: Self::HOP,
        }
    }

    pub fn n_mels(&self) -> usize {
        self.filters.len()
    }

    /// Frames produced for `samples` samples (one per hop).
    pub fn frames_for(&self, samples: usize) -> usize {
        samples / self.hop
    }

    /// `[n_mels, frames]` row-major, and `frames`.
    pub fn compute(&self, samples: &[f32]) -> (Vec<f32>, usize) {
        let padded = reflect_pad(samples, self.stft.n_fft() / 2);
        let mut power = self.stft.power(&padded);
        power.truncate(self.frames_for(samples.len()));
        let frames = power.len();
        let n_mels = self.n_mels();
        let mut logmel = vec![0f64; n_mels * frames];
        let mut max = f64::NEG_INFINITY;
        for (t, p) in power.iter().enumerate() {
            for (m, e) in self.filters.apply(p).enumerate() {
                let v = e.max(1e-10).log10();
                max = max.max(v);
                logmel[m * frames + t] = v;
            }
        }
        let out = logmel.iter().map(|&v| ((v.max(max - 8.0) + 4.0) / 4.0) as f32).collect();
        (out, frames)
    }
}

/// Kaldi-compatible log mel filter bank (torchaudio.compliance.kaldi.fbank defaults: 25 ms frames
/// every 10 ms without edge padding, DC removal, pre-emphasis 0.97, Povey window, 512-point power
/// spectrum, Kaldi mel banks from 20 Hz to Nyquist, log floored at f32 epsilon; no dither).
/// Returns `[frames][n_mels]` row-major and `frames`.
pub fn kaldi_fbank(samples: &[f32], sample_rate: usize, n_mels: usize) -> (Vec<f32>, usize) {
    let win = sample_rate * 25 / 1000;
    let shift = sample_rate * 10 / 1000;
    let nfft = win.next_power_of_two();
    if samples.len() < win {
        return (vec![], 0);
    }
    let frames = 1 + (samples.len() - win) / shift;
    let povey: Vec<f64> = (0..win)
        .map(|i| {
            (0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / (win - 1) as f64).cos())
                .powf(0.85)
        })
        .collect();
    // mel banks over the first nfft/2 bins (the Nyquist bin gets no weight)
    let mel = |f: f64| 1127.0 * (1.0 + f / 700.0).ln();
    let nyq = sample_rate as f64 / 2.0;
    let (lo, hi) = (mel(20.0), mel(nyq));
    let delta = (hi - lo) / (n_mels + 1) as f64;
    let width = sample_rate as f64 / nfft as f64;
    let banks: Vec<Vec<f64>> = (0..n_mels)
        .map(|m| {
            let (l, c, r) =
                (lo + m as f64 * delta, lo + (m + 1) as f64 * delta, lo + (m + 2) as f64 * delta);
            (0..nfft / 2 + 1)
                .map(|k| {
                    if k == nfft / 2 {
                        return 0.0;
                    }
                    let x = mel(width * k as f64);
                    ((x - l) / (c - l)).min((r - x) / (r - c)).max(0.0)
                })
                .collect()
        })
        .collect();
    let banks = MelBank::from_dense(&banks);
    let plan = RealFftPlanner::<f64>::new().plan_fft_forward(nfft);
    let mut input = plan.make_input_vec();
    let mut spec = plan.make_output_vec();
    let eps = f32::EPSILON as f64;
    let mut out = vec![0f32; frames * n_mels];
    for t in 0..frames {
        let fr: Vec<f64> = samples[t * shift..t * shift + win].iter().map(|&v| v as f64).collect();
        let mean = fr.iter().sum::<f64>() / win as f64;
        let fr: Vec<f64> = fr.iter().map(|v| v - mean).collect();
        input.iter_mut().for_each(|v| *v = 0.0);
        for i in 0..win {
            let prev = if i == 0 { fr[0] } else { fr[i - 1] };
            input[i] = (fr[i] - 0.97 * prev) * povey[i];
        }
        plan.process(&mut input, &mut spec).expect("fft sizes match the plan");
        let power: Vec<f64> = spec.iter().map(|c| c.norm_sqr()).collect();
        for (m, e) in banks.apply(&power).enumerate() {
            out[t * n_mels + m] = e.max(eps).ln() as f32;
        }
    }
    (out, frames)
}

/// Subtracts each column's mean over time (cepstral mean normalization) of `[frames][dim]`.
pub fn mean_normalize(x: &mut [f32], dim: usize) {
    let frames = x.len() / dim.max(1);
    if frames == 0 {
        return;
    }
    for d in 0..dim {
        let mean = (0..frames).map(|t| x[t * dim + d] as f64).sum::<f64>() / frames as f64;
        for t in 0..frames {
            x[t * dim + d] = (x[t * dim + d] as f64 - mean) as f32;
        }
    }
}

/// The flow's mel (matcha `mel_spectrogram`: 24 kHz, n_fft 1920, hop 480, Hann, no centering but
/// (n_fft − hop)/2 reflect padding, magnitude, Slaney mel filters 0–8 kHz, natural log floored
/// at 1e-5). Returns `[n_mels][frames]` row-major and `frames` (50 per second).
pub struct FlowMel {
    stft: Stft,
    filters: MelBank,
    n_fft: usize,
    hop: usize,
}

impl FlowMel {
    pub fn new(sample_rate: usize, n_fft: usize, hop: usize, n_mels: usize, fmax: f64) -> Self {
        Self {
            stft: Stft::new(n_fft, hop, hann_periodic(n_fft)),
            filters: MelBank::from_dense(&mel_filters_slaney(
                sample_rate,
                n_fft,
                n_mels,
                0.0,
                fmax,
            )),
            n_fft,
            hop,
        }
    }

    /// The configuration the token2wav assets check for.
    pub fn standard() -> Self {
        Self::new(24_000, 1920, 480, 80, 8000.0)
    }

    pub fn compute(&self, samples: &[f32]) -> (Vec<f32>, usize) {
        let padded = reflect_pad(samples, (self.n_fft - self.hop) / 2);
        let power = self.stft.power(&padded);
        let frames = power.len();
        let n_mels = self.filters.len();
        let mut out = vec![0f32; n_mels * frames];
        for (t, p) in power.iter().enumerate() {
            let mag: Vec<f64> = p.iter().map(|v| (v + 1e-9).sqrt()).collect();
            for (m, e) in self.filters.apply(&mag).enumerate() {
                out[m * frames + t] = e.max(1e-5).ln() as f32;
            }
        }
        (out, frames)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_are_triangles_with_slaney_area() {
        let f = mel_filters_slaney(16_000, 400, 80, 0.0, 8000.0);
        assert_eq!(f.len(), 80);
        assert_eq!(f[0].len(), 201);
        for row in &f {
            assert!(row.iter().all(|&v| v >= 0.0));
            assert!(row.iter().any(|&v| v > 0.0), "every filter covers some bin");
        }
    }

    #[test]
    fn the_sparse_bank_sums_to_the_bit_what_the_dense_rows_sum() {
        for (rate, n_fft, n_mels) in [(16_000, 400, 128), (24_000, 1920, 80), (16_000, 400, 80)] {
            let dense = mel_filters_slaney(rate, n_fft, n_mels, 0.0, 8000.0);
            let bank = MelBank::from_dense(&dense);
            assert_eq!(bank.len(), n_mels);
            let kept: usize = bank.bands.iter().map(|b| b.1.len()).sum();
            assert!(kept * 4 < n_mels * (n_fft / 2 + 1), "the bank keeps {kept} weights");
            let spectrum: Vec<f64> =
                (0..n_fft / 2 + 1).map(|k| ((k * 7919) % 1000) as f64 * 1e-3 + 1e-7).collect();
            for (row, e) in dense.iter().zip(bank.apply(&spectrum)) {
                let want: f64 = row.iter().zip(&spectrum).map(|(a, b)| a * b).sum();
                assert!(want.is_finite() && want > 0.0, "{want}");
                assert_eq!(want.to_bits(), e.to_bits(), "{want} against {e}");
            }
        }
    }

    #[test]
    fn a_sine_lights_the_right_band() {
        let mel = WhisperLogMel::new(80);
        let s: Vec<f32> = (0..16_000)
            .map(|i| (2.0 * std::f32::consts::PI * 440.0 * i as f32 / 16_000.0).sin())
            .collect();
        let (m, frames) = mel.compute(&s);
        assert_eq!(frames, 100);
        let t = 50;
        let col: Vec<f32> = (0..80).map(|b| m[b * frames + t]).collect();
        let peak = col.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
        // 440 Hz lies at mel 6.6 on the Slaney scale; with 80 bands up to 8 kHz (~ mel 47.2 / 81
        // per band) that is band 10 or 11.
        assert!((9..=12).contains(&peak), "peak band {peak}");
    }
}
