//! G.711 (ITU-T Rec. G.711) μ-law and A-law, the telephony codecs of the OpenAI Realtime dialect's
//! `audio/pcmu` and `audio/pcma`: 8 kHz, one byte per sample. The rate conversion to and from the
//! server's 24 kHz is a factor of 3 each way.

const BIAS: i32 = 0x84;
const CLIP: i32 = 32635;

/// The segment (exponent) of a magnitude: the position of its highest set bit above bit 7.
fn segment(mag: i32) -> i32 {
    let mut seg = 0;
    let mut v = mag >> 8;
    while v > 0 && seg < 7 {
        seg += 1;
        v >>= 1;
    }
    seg
}

pub fn ulaw_encode(s: i16) -> u8 {
    let sign = if s < 0 { 0x80 } else { 0 };
    let mag = (s as i32).abs().min(CLIP) + BIAS;
    let seg = segment(mag);
    let mantissa = (mag >> (seg + 3)) & 0x0F;
    !(sign | (seg << 4) as u8 | mantissa as u8)
}

pub fn ulaw_decode(b: u8) -> i16 {
    let b = !b;
    let seg = ((b >> 4) & 0x07) as i32;
    let mag = ((((b & 0x0F) as i32) << 3) + BIAS) << seg;
    let v = mag - BIAS;
    (if b & 0x80 != 0 { -v } else { v }) as i16
}

pub fn alaw_encode(s: i16) -> u8 {
    let (sign, mag) =
        if s >= 0 { (0x80u8, (s as i32) >> 3) } else { (0u8, (-(s as i32) - 1).max(0) >> 3) };
    let b = if mag < 32 {
        (mag >> 1) as u8
    } else {
        let mut seg = 1;
        while seg < 7 && mag >= (32 << seg) {
            seg += 1;
        }
        ((seg << 4) | ((mag >> seg) & 0x0F)) as u8
    };
    (b | sign) ^ 0x55
}

pub fn alaw_decode(b: u8) -> i16 {
    let b = b ^ 0x55;
    let seg = ((b >> 4) & 0x07) as i32;
    let mantissa = (b & 0x0F) as i32;
    let mag = if seg == 0 { (mantissa << 4) + 8 } else { ((mantissa << 4) + 0x108) << (seg - 1) };
    (if b & 0x80 != 0 { mag } else { -mag }) as i16
}

/// 8 kHz to 24 kHz by linear interpolation (G.711's band ends at 4 kHz, well below the new
/// Nyquist frequency, so no image above it needs removing for the models).
pub fn upsample_8k_to_24k(x: &[i16]) -> Vec<i16> {
    let mut out = Vec::with_capacity(x.len() * 3);
    for (i, &a) in x.iter().enumerate() {
        let b = *x.get(i + 1).unwrap_or(&a) as i32;
        let a = a as i32;
        out.extend([a, (2 * a + b) / 3, (a + 2 * b) / 3].map(|v| v as i16));
    }
    out
}

/// 24 kHz to 8 kHz, streaming: a 3-tap average then every third sample (the output's band is
/// the phone's, 4 kHz; the average's first null lies at 8 kHz).
#[derive(Default)]
pub struct Downsample24kTo8k {
    pending: Vec<f32>,
}

impl Downsample24kTo8k {
    pub fn push(&mut self, x: &[f32]) -> Vec<i16> {
        self.pending.extend_from_slice(x);
        let n = self.pending.len() / 3;
        let out = (0..n)
            .map(|i| {
                let w = &self.pending[3 * i..3 * i + 3];
                crate::f32_to_i16((w[0] + w[1] + w[2]) / 3.0)
            })
            .collect();
        self.pending.drain(..3 * n);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_laws_round_trip_within_their_quantisation_step() {
        for s in (-32768i32..=32767).step_by(7).map(|s| s as i16) {
            for (name, enc, dec) in [
                ("mu", ulaw_encode as fn(i16) -> u8, ulaw_decode as fn(u8) -> i16),
                ("a", alaw_encode, alaw_decode),
            ] {
                let back = dec(enc(s)) as i32;
                // a segment's step is 1/16 of its range: the error is at most about 1/32 of |s| (+
                // the smallest step)
                let bound = (s as i32).abs() / 16 + 40;
                assert!((back - s as i32).abs() <= bound, "{name}-law: {s} came back {back}");
                assert!(back.signum() * (s as i32).signum() >= 0, "{name}-law sign of {s}");
            }
        }
    }

    #[test]
    fn known_code_words() {
        // G.711's tables: silence is 0xFF in mu-law and 0xD5 in A-law; the loudest words
        assert_eq!(ulaw_encode(0), 0xFF);
        assert_eq!(alaw_encode(0), 0xD5);
        assert_eq!(ulaw_decode(0x00), -32124);
        assert_eq!(ulaw_decode(0x80), 32124);
        assert_eq!(alaw_decode(0xAA), 32256);
        assert_eq!(alaw_decode(0x2A), -32256);
        // every byte decodes to a value that encodes back to the same byte (except mu-law's two
        // zeros)
        for b in 0..=255u8 {
            assert_eq!(alaw_encode(alaw_decode(b)), b, "A-law {b:#x}");
            if b != 0x7F {
                assert_eq!(ulaw_encode(ulaw_decode(b)), b, "mu-law {b:#x}");
            }
        }
    }

    #[test]
    fn rates_convert_by_three_and_keep_a_tone() {
        let tone: Vec<f32> = (0..2400)
            .map(|i| 0.5 * (2.0 * std::f32::consts::PI * 440.0 * i as f32 / 24_000.0).sin())
            .collect();
        let mut d = Downsample24kTo8k::default();
        let mut narrow = d.push(&tone[..1001]);
        narrow.extend(d.push(&tone[1001..]));
        assert_eq!(narrow.len(), 800);
        let up = upsample_8k_to_24k(&narrow);
        assert_eq!(up.len(), 2400);
        // the tone survives the round trip (a 440 Hz tone is far below both bands' edges)
        // (the 3-tap average centres output sample i on input sample 3i + 1: one sample of lag)
        let err = up[30..2370]
            .iter()
            .zip(&tone[31..2371])
            .map(|(&a, &b)| (crate::i16_to_f32(a) - b).abs())
            .fold(0.0f32, |m, e| if e.is_nan() || m.is_nan() { f32::NAN } else { m.max(e) });
        assert!(err < 0.05, "round trip error {err}");
    }
}
