//! Code2Wav streams for the tests: a reference voice, codes, chunk payloads.

use antiphon_models::code2wav::prompt::Reference;
use antiphon_models::code2wav::SILENCE_CODE;
use candle_core::Tensor;

/// A 3 s synthetic voice at 16 kHz (a gliding tone with a tremolo).
pub fn reference() -> Reference {
    let sr = 16_000;
    let x: Vec<f32> = (0..sr * 3)
        .map(|i| {
            let t = i as f32 / sr as f32;
            0.3 * (2.0 * std::f32::consts::PI * (150.0 + 30.0 * t) * t).sin()
                * (0.5 + 0.5 * (6.0 * t).sin().abs())
        })
        .collect();
    Reference::materialize(&x, sr as u32).unwrap()
}

pub fn codes(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2654435761u32.wrapping_add(salt)) % 6561).collect()
}

/// Chunks of [3 context + n new] codes, the first context being silence; the last has no
/// look-ahead.
pub fn payloads(all: &[u32], sizes: &[usize]) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    let mut prev = vec![SILENCE_CODE; 3];
    let mut pos = 0;
    for &n in sizes {
        let mut p = prev.clone();
        p.extend_from_slice(&all[pos..pos + n]);
        prev = p[p.len() - 3..].to_vec();
        out.push(p);
        pos += n;
    }
    out
}

pub fn samples(t: &Tensor) -> Vec<f32> {
    t.to_vec1::<f32>().unwrap()
}

/// The streams (and their chunk index) due in `round`'s batch of `last` or not-last chunks, stream
/// `s` starting `lag[s]` rounds late, every stream with `chunks` chunks.
pub fn due(round: usize, last: bool, lag: &[usize], chunks: usize) -> Vec<(usize, usize)> {
    (0..lag.len())
        .filter_map(|s| {
            round
                .checked_sub(lag[s])
                .filter(|&i| i < chunks && (i == chunks - 1) == last)
                .map(|i| (s, i))
        })
        .collect()
}
