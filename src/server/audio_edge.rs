//! The audio edge of a session: client audio (Opus or PCM16 at 16/24/48 kHz) in, decoded and
//! gathered for the engine at 16 kHz; the engine's 24 kHz audio out, cut into Opus packets (10 / 20
//! / 40 / 60 ms) or PCM16 frames. libopus is built from the `opus` crate's bundled source.

use anyhow::{bail, Result};

use antiphon_protocol::Codec;

pub const OUTPUT_RATE: u32 = 24_000;
pub const ENGINE_INPUT_RATE: u32 = 16_000;

/// Decodes client audio packets and gathers the samples of the current turn.
pub struct InputAudio {
    codec: Codec,
    rate: u32,
    opus: Option<opus::Decoder>,
    buf: Vec<f32>,
    scratch: Vec<f32>,
    /// The duplex path's units: one resampler across all of them (no filter edges at unit
    /// boundaries), made at the first unit.
    units: Option<antiphon_audio::StreamResampler>,
    /// The most samples held at once (a turn not yet committed, units not yet taken).
    max_samples: usize,
}

impl InputAudio {
    pub fn new(codec: Codec, rate: u32) -> Result<Self> {
        if !matches!(rate, 16_000 | 24_000 | 48_000) {
            bail!("input sample_rate {rate}: expected 16000, 24000 or 48000");
        }
        let opus = match codec {
            Codec::Opus => Some(opus::Decoder::new(rate, opus::Channels::Mono)?),
            Codec::Pcm16 => None,
        };
        Ok(Self {
            codec,
            rate,
            opus,
            buf: Vec::new(),
            scratch: vec![0.0; rate as usize * 120 / 1000],
            units: None,
            max_samples: usize::MAX,
        })
    }

    /// Holds at most `seconds` of audio: a packet beyond is refused (and changes nothing).
    pub fn with_limit_s(mut self, seconds: u64) -> Self {
        self.max_samples = (seconds as usize).saturating_mul(self.rate as usize);
        self
    }

    pub fn rate(&self) -> u32 {
        self.rate
    }

    fn room(&self, n: usize) -> Result<()> {
        if self.buf.len().saturating_add(n) > self.max_samples {
            bail!(
                "over the {} s of audio a turn may hold: commit or clear it first",
                self.max_samples / self.rate as usize
            );
        }
        Ok(())
    }

    /// Decodes one packet and keeps its samples; an undecodable packet is an error and changes
    /// nothing.
    pub fn push(&mut self, payload: &[u8]) -> Result<usize> {
        match self.codec {
            Codec::Pcm16 => {
                if !payload.len().is_multiple_of(2) {
                    bail!("PCM16 payload of odd length {}", payload.len());
                }
                let n = payload.len() / 2;
                self.room(n)?;
                self.buf.extend(
                    payload
                        .chunks_exact(2)
                        .map(|b| antiphon_audio::i16_to_f32(i16::from_le_bytes([b[0], b[1]]))),
                );
                Ok(n)
            }
            Codec::Opus => {
                if payload.is_empty() {
                    bail!("empty Opus packet");
                }
                let dec = self.opus.as_mut().expect("opus decoder");
                let n = dec
                    .decode_float(payload, &mut self.scratch, false)
                    .map_err(|e| anyhow::anyhow!("Opus: {e}"))?;
                self.room(n)?;
                self.buf.extend_from_slice(&self.scratch[..n]);
                Ok(n)
            }
        }
    }

    /// Milliseconds of audio gathered.
    pub fn buffered_ms(&self) -> u64 {
        self.buf.len() as u64 * 1000 / self.rate as u64
    }

    pub fn clear(&mut self) {
        self.buf.clear();
        self.units = None;
    }

    /// The next `n` input samples' worth of 16 kHz audio (exactly `n × 16000 / rate` samples),
    /// once that many are gathered: the duplex path cuts its units with it. The units are one
    /// continuous resample of the input, running [`antiphon_audio::StreamResampler::lag`] samples
    /// behind it (tens of milliseconds), with no filter edges at their boundaries.
    pub fn take_block_16k(&mut self, n: usize) -> Option<Result<Vec<f32>>> {
        if n == 0 || self.buf.len() < n {
            return None;
        }
        let block: Vec<f32> = self.buf.drain(..n).collect();
        let want = n * ENGINE_INPUT_RATE as usize / self.rate as usize;
        let units = match self.units.take() {
            Some(u) => u,
            None => match antiphon_audio::StreamResampler::new(self.rate, ENGINE_INPUT_RATE) {
                Ok(u) => u,
                Err(e) => return Some(Err(e)),
            },
        };
        let units = self.units.insert(units);
        if let Err(e) = units.push(&block) {
            return Some(Err(e));
        }
        Some(units.take(want).ok_or_else(|| anyhow::anyhow!("the unit resampler fell behind")))
    }

    /// Pads what is gathered with silence up to a multiple of `n` samples.
    pub fn pad_to_multiple(&mut self, n: usize) {
        let r = self.buf.len() % n.max(1);
        if r != 0 {
            self.buf.resize(self.buf.len() + n - r, 0.0);
        }
    }

    /// The gathered turn at 16 kHz (the buffer is emptied).
    pub fn take_16k(&mut self) -> Result<Vec<f32>> {
        let x = std::mem::take(&mut self.buf);
        antiphon_audio::resample(&x, self.rate, ENGINE_INPUT_RATE)
    }
}

/// Cuts the engine's 24 kHz audio into packets.
pub struct OutputAudio {
    codec: Codec,
    frame: usize,
    opus: Option<opus::Encoder>,
    pending: Vec<f32>,
}

impl OutputAudio {
    pub fn new(codec: Codec, frame_ms: u32) -> Result<Self> {
        if !matches!(frame_ms, 10 | 20 | 40 | 60) {
            bail!("output frame_ms {frame_ms}: expected 10, 20, 40 or 60");
        }
        let opus = match codec {
            Codec::Opus => {
                let mut e =
                    opus::Encoder::new(OUTPUT_RATE, opus::Channels::Mono, opus::Application::Voip)?;
                e.set_bitrate(opus::Bitrate::Bits(32_000))?;
                Some(e)
            }
            Codec::Pcm16 => None,
        };
        Ok(Self {
            codec,
            frame: OUTPUT_RATE as usize * frame_ms as usize / 1000,
            opus,
            pending: Vec::new(),
        })
    }

    pub fn frame_samples(&self) -> usize {
        self.frame
    }

    fn packet(&mut self, samples: &[f32]) -> Result<Vec<u8>> {
        match self.codec {
            Codec::Pcm16 => Ok(samples
                .iter()
                .flat_map(|&s| antiphon_audio::f32_to_i16(s).to_le_bytes())
                .collect()),
            Codec::Opus => {
                let e = self.opus.as_mut().expect("opus encoder");
                Ok(e.encode_vec_float(samples, 4000).map_err(|e| anyhow::anyhow!("Opus: {e}"))?)
            }
        }
    }

    /// Packets for the whole frames now available.
    pub fn push(&mut self, samples: &[f32]) -> Result<Vec<Vec<u8>>> {
        self.pending.extend_from_slice(samples);
        let mut out = Vec::new();
        while self.pending.len() >= self.frame {
            let f: Vec<f32> = self.pending.drain(..self.frame).collect();
            out.push(self.packet(&f)?);
        }
        Ok(out)
    }

    /// The rest, as one last packet (Opus pads the frame with silence; PCM16 sends what is left).
    pub fn finish(&mut self) -> Result<Option<Vec<u8>>> {
        if self.pending.is_empty() {
            return Ok(None);
        }
        let mut f = std::mem::take(&mut self.pending);
        if self.codec == Codec::Opus {
            f.resize(self.frame, 0.0);
        }
        Ok(Some(self.packet(&f)?))
    }

    /// Drops what is pending (a cancelled response).
    pub fn reset(&mut self) {
        self.pending.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opus_round_trip_keeps_a_tone() {
        let mut out = OutputAudio::new(Codec::Opus, 20).unwrap();
        let tone: Vec<f32> = (0..24_000)
            .map(|i| 0.4 * (i as f32 * 440.0 / 24_000.0 * std::f32::consts::TAU).sin())
            .collect();
        let mut packets = out.push(&tone).unwrap();
        packets.extend(out.finish().unwrap());
        assert_eq!(packets.len(), 50, "1 s in 20 ms packets");
        let mut inp = InputAudio::new(Codec::Opus, 24_000).unwrap();
        for p in &packets {
            assert_eq!(inp.push(p).unwrap(), 480);
        }
        let x = inp.take_16k().unwrap();
        assert_eq!(x.len(), 16_000);
        let rms = (x[4000..12000].iter().map(|v| v * v).sum::<f32>() / 8000.0).sqrt();
        assert!((rms - 0.4 / 2f32.sqrt()).abs() < 0.05, "rms {rms}");
        assert!(
            inp.push(&[0xff, 0xff, 0xff]).is_err() || inp.buffered_ms() == 0,
            "garbage is refused or decodes to nothing"
        );
    }

    #[test]
    fn pcm16_frames_and_rates() {
        let mut out = OutputAudio::new(Codec::Pcm16, 10).unwrap();
        let p = out.push(&[0.5; 500]).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].len(), 480);
        assert_eq!(out.finish().unwrap().unwrap().len(), 40);
        assert!(OutputAudio::new(Codec::Opus, 15).is_err());
        assert!(InputAudio::new(Codec::Pcm16, 44_100).is_err());
        let mut i = InputAudio::new(Codec::Pcm16, 48_000).unwrap();
        assert!(i.push(&[1, 2, 3]).is_err());
        i.push(&vec![0u8; 960]).unwrap();
        assert_eq!(i.buffered_ms(), 10);
        // a turn holds at most its limit: the packet beyond is refused and nothing changes
        let mut i = InputAudio::new(Codec::Pcm16, 16_000).unwrap().with_limit_s(1);
        for _ in 0..50 {
            i.push(&vec![0u8; 640]).unwrap();
        }
        assert_eq!(i.buffered_ms(), 1000);
        let e = i.push(&vec![0u8; 640]).unwrap_err();
        assert!(e.to_string().contains("1 s"), "{e}");
        assert_eq!(i.buffered_ms(), 1000);
        i.clear();
        i.push(&vec![0u8; 640]).unwrap();
    }
}
