//! Audio utilities shared by the edge and the models: WAV decoding, mono mixdown, resampling
//! (rubato, FFT-based), PCM16 conversion.

use std::io::Cursor;

use anyhow::{bail, Context, Result};
use rubato::{FftFixedIn, Resampler};

pub mod g711;
mod stream;
pub mod vad;
pub use stream::StreamResampler;

/// Channels a WAV file may have (every one is mixed down; the file's size bounds the work).
const MAX_WAV_CHANNELS: usize = 64;

/// Decodes a WAV file (PCM 8/16/24/32-bit or float) to mono f32 in [-1, 1] and its sample rate.
pub fn decode_wav(bytes: &[u8]) -> Result<(Vec<f32>, u32)> {
    let mut r = hound::WavReader::new(Cursor::new(bytes)).context("not a WAV file")?;
    let spec = r.spec();
    let ch = spec.channels as usize;
    if ch == 0 || ch > MAX_WAV_CHANNELS {
        bail!("WAV with {ch} channels (1 to {MAX_WAV_CHANNELS} are mixed down to one)");
    }
    let interleaved: Vec<f32> = match spec.sample_format {
        hound::SampleFormat::Float => {
            r.samples::<f32>().collect::<Result<_, _>>().context("reading float samples")?
        }
        hound::SampleFormat::Int => {
            let scale = 1.0 / (1i64 << (spec.bits_per_sample - 1)) as f32;
            r.samples::<i32>()
                .map(|s| s.map(|v| v as f32 * scale))
                .collect::<Result<_, _>>()
                .context("reading samples")?
        }
    };
    Ok((mix_to_mono(&interleaved, ch), spec.sample_rate))
}

/// Averages interleaved channels.
pub fn mix_to_mono(interleaved: &[f32], channels: usize) -> Vec<f32> {
    if channels <= 1 {
        return interleaved.to_vec();
    }
    interleaved.chunks_exact(channels).map(|f| f.iter().sum::<f32>() / channels as f32).collect()
}

/// Writes mono f32 samples as a 16-bit PCM WAV.
pub fn encode_wav_pcm16(samples: &[f32], sample_rate: u32) -> Result<Vec<u8>> {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut buf = Cursor::new(Vec::new());
    {
        let mut w = hound::WavWriter::new(&mut buf, spec)?;
        for &s in samples {
            w.write_sample(f32_to_i16(s))?;
        }
        w.finalize()?;
    }
    Ok(buf.into_inner())
}

pub fn f32_to_i16(s: f32) -> i16 {
    (s.clamp(-1.0, 1.0) * 32767.0).round() as i16
}

/// The least audio a reference voice is made of, in seconds.
pub const MIN_VOICE_S: f64 = 0.5;
/// The quietest a reference voice may be (its RMS, in dBFS): below it there is no voice to clone.
pub const MIN_VOICE_DBFS: f64 = -60.0;

/// Why `samples` at `rate` Hz cannot be a reference voice (not finite, too short, or silent), or
/// `None`: the one check of a voice, wherever its audio comes in.
pub fn voice_fault(samples: &[f32], rate: u32) -> Option<String> {
    if samples.iter().any(|s| !s.is_finite()) {
        return Some("the audio holds samples that are not finite numbers".into());
    }
    let seconds = samples.len() as f64 / f64::from(rate.max(1));
    if seconds < MIN_VOICE_S {
        return Some(format!(
            "{seconds:.2} s of audio: a voice needs at least {MIN_VOICE_S} s of speech"
        ));
    }
    let power =
        samples.iter().map(|&s| f64::from(s) * f64::from(s)).sum::<f64>() / samples.len() as f64;
    let dbfs = 10.0 * power.log10();
    // (NaN, from a non-finite sample, is no voice either)
    if dbfs.is_nan() || dbfs < MIN_VOICE_DBFS {
        return Some(format!(
            "the audio is silent or nearly ({dbfs:.0} dBFS): a voice needs speech \
            louder than {MIN_VOICE_DBFS} dBFS"
        ));
    }
    None
}

pub fn i16_to_f32(s: i16) -> f32 {
    s as f32 / 32768.0
}

/// Resamples a whole mono signal; the output has `round(len · to / from)` samples, aligned with
/// the input (the resampler's delay removed).
pub fn resample(x: &[f32], from: u32, to: u32) -> Result<Vec<f32>> {
    if from == to || x.is_empty() {
        return Ok(x.to_vec());
    }
    if from == 0 || to == 0 {
        bail!("sample rate 0");
    }
    let want = ((x.len() as u64 * to as u64 + from as u64 / 2) / from as u64) as usize;
    let chunk = 1024;
    let mut r = FftFixedIn::<f32>::new(from as usize, to as usize, chunk, 2, 1)
        .context("creating the resampler")?;
    let delay = r.output_delay();
    let mut out: Vec<f32> = Vec::with_capacity(want + delay + chunk);
    let mut pos = 0;
    while pos + r.input_frames_next() <= x.len() {
        let n = r.input_frames_next();
        let y = r.process(&[&x[pos..pos + n]], None)?;
        out.extend_from_slice(&y[0]);
        pos += n;
    }
    if pos < x.len() {
        let y = r.process_partial(Some(&[&x[pos..]]), None)?;
        out.extend_from_slice(&y[0]);
    }
    while out.len() < want + delay {
        let y = r.process_partial::<&[f32]>(None, None)?;
        if y[0].is_empty() {
            break;
        }
        out.extend_from_slice(&y[0]);
    }
    let mut out = out.split_off(delay.min(out.len()));
    out.resize(want, 0.0);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sine(f: f32, sr: u32, secs: f32) -> Vec<f32> {
        (0..(sr as f32 * secs) as usize)
            .map(|i| (2.0 * std::f32::consts::PI * f * i as f32 / sr as f32).sin() * 0.5)
            .collect()
    }

    #[test]
    fn a_voice_is_half_a_second_of_sound_at_least() {
        assert!(voice_fault(&sine(200.0, 16_000, 1.0), 16_000).is_none());
        let short = voice_fault(&sine(200.0, 16_000, 0.05), 16_000).unwrap();
        assert!(short.contains("0.05 s"), "{short}");
        let silent = voice_fault(&vec![0.0; 32_000], 16_000).unwrap();
        assert!(silent.contains("silent"), "{silent}");
        let hiss: Vec<f32> = (0..32_000).map(|i| if i % 2 == 0 { 1e-4 } else { -1e-4 }).collect();
        assert!(voice_fault(&hiss, 16_000).is_some(), "-80 dBFS is no voice");
        assert!(voice_fault(&[f32::NAN; 16_000], 16_000).is_some());
        let mut loud = sine(200.0, 16_000, 1.0);
        loud[7] = f32::INFINITY;
        assert!(voice_fault(&loud, 16_000).is_some(), "an infinite sample is no voice");
    }

    #[test]
    fn resampling_keeps_length_amplitude_and_alignment() {
        let x = sine(440.0, 24_000, 1.0);
        let y = resample(&x, 24_000, 16_000).unwrap();
        assert_eq!(y.len(), 16_000);
        // away from the edges the resampled sine matches one generated at 16 kHz, up to a delay
        // of less than one output sample (the FFT resampler's fractional part)
        let best = (-6..=6)
            .map(|k| {
                let shift = k as f32 / 12.0;
                (1000..15000)
                    .map(|i| {
                        (y[i]
                            - (2.0 * std::f32::consts::PI * 440.0 * (i as f32 + shift) / 16_000.0)
                                .sin()
                                * 0.5)
                            .abs()
                    })
                    .fold(0f32, |m, e| if e.is_nan() || m.is_nan() { f32::NAN } else { m.max(e) })
            })
            .fold(f32::INFINITY, |m, e| if e.is_nan() || m.is_nan() { f32::NAN } else { m.min(e) });
        assert!(best < 5e-3, "max error {best} at the best sub-sample alignment");
        let amp = y[1000..15000].iter().fold(0f32, |m, v| {
            if v.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(v.abs())
            }
        });
        assert!((amp - 0.5).abs() < 5e-3, "amplitude {amp}");
    }

    #[test]
    fn wav_round_trip_and_mixdown() {
        let x = sine(300.0, 16_000, 0.1);
        let bytes = encode_wav_pcm16(&x, 16_000).unwrap();
        let (y, sr) = decode_wav(&bytes).unwrap();
        assert_eq!(sr, 16_000);
        assert_eq!(y.len(), x.len());
        assert!(y.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-4));
        assert_eq!(mix_to_mono(&[1.0, 0.0, 0.5, 0.5], 2), vec![0.5, 0.5]);
        assert!(decode_wav(b"not a wav").is_err());
    }

    /// A WAV of 9 channels (or any count up to 64) is mixed down as a stereo one is (issue 38: a
    /// valid 9-channel file was refused).
    #[test]
    fn many_channels_are_mixed_down() {
        let write = |channels: u16| {
            let spec = hound::WavSpec {
                channels,
                sample_rate: 16_000,
                bits_per_sample: 16,
                sample_format: hound::SampleFormat::Int,
            };
            let mut out = Cursor::new(Vec::new());
            let mut w = hound::WavWriter::new(&mut out, spec).unwrap();
            for frame in 0..100 {
                for c in 0..channels {
                    // channel c of frame i: (c + 1) × i, so the mix is the mean of 1..=channels
                    // times i
                    w.write_sample(((c as i32 + 1) * frame) as i16).unwrap();
                }
            }
            w.finalize().unwrap();
            out.into_inner()
        };
        let (y, sr) = decode_wav(&write(9)).unwrap();
        assert_eq!((y.len(), sr), (100, 16_000));
        let scale = 1.0 / 32768.0;
        for (i, v) in y.iter().enumerate() {
            assert!((v - 5.0 * i as f32 * scale).abs() < 1e-6, "frame {i}: {v}");
        }
        let e = decode_wav(&write(65)).unwrap_err().to_string();
        assert!(e.contains("65 channels"), "{e}");
    }
}
