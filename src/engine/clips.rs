//! The audio a request carries: the reference voice and the clips the caller spoke, each checked
//! and keyed by its content once, where it comes in.

use std::sync::Arc;

/// A reference voice as given (any rate, mono); identity is the shared buffer and its rate. Its
/// content key is made once, here, where the voice comes in (not on a stage's thread, which would
/// hash it again for every prompt that hears it).
#[derive(Debug, Clone)]
pub struct RefInput {
    pub samples: Arc<Vec<f32>>,
    pub sample_rate: u32,
    key: u64,
}

impl RefInput {
    pub fn new(samples: Vec<f32>, sample_rate: u32) -> Self {
        let key = content_key(&samples, sample_rate);
        Self { samples: Arc::new(samples), sample_rate, key }
    }

    /// Why these samples cannot reach a stage (none, no rate, a non-finite sample), or `None`.
    /// Whether they make a voice (long and loud enough) the server decides where the audio comes
    /// in (`antiphon_audio::voice_fault`); this is what the engine itself needs.
    pub fn fault(&self) -> Option<&'static str> {
        let usable = !self.samples.is_empty()
            && self.sample_rate > 0
            && self.samples.iter().all(|s| s.is_finite());
        (!usable)
            .then_some("the reference voice must be non-empty, finite audio with a sample rate")
    }

    /// A key for the audio by its content (the same samples at the same rate, the same key).
    pub fn content_key(&self) -> u64 {
        self.key
    }

    /// Same audio (cheap when it is the same buffer).
    pub fn same_as(&self, o: &RefInput) -> bool {
        self.sample_rate == o.sample_rate
            && (Arc::ptr_eq(&self.samples, &o.samples) || self.samples == o.samples)
    }
}

/// A clip the caller spoke: 16 kHz mono samples, shared (a conversation's history holds it for
/// every later turn without a copy), with a key for its content made once, where it comes in. The
/// Thinker's prefix store keys the clip's prompt positions by it, so a later turn's prompt that
/// holds the same clip reuses the KV built from it.
#[derive(Debug, Clone)]
pub struct SpokenClip {
    samples: Arc<[f32]>,
    key: u64,
}

/// Audio with a NaN or an infinite sample: no clip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NonFiniteAudio;

impl std::fmt::Display for NonFiniteAudio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("input audio holds non-finite samples")
    }
}

impl std::error::Error for NonFiniteAudio {}

impl SpokenClip {
    /// Every sample finite, or no clip: what holds one need not look again.
    pub fn new(samples: Vec<f32>) -> Result<Self, NonFiniteAudio> {
        if samples.iter().any(|s| !s.is_finite()) {
            return Err(NonFiniteAudio);
        }
        let key = content_key(&samples, 16_000);
        Ok(Self { samples: samples.into(), key })
    }

    pub fn samples(&self) -> &[f32] {
        &self.samples
    }

    /// The same samples, the same key.
    pub fn content_key(&self) -> u64 {
        self.key
    }
}

/// A key for audio by its content: its rate, length and samples' bits, the samples hashed a block
/// of bytes at a time.
fn content_key(samples: &[f32], rate: u32) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    rate.hash(&mut h);
    samples.len().hash(&mut h);
    let mut block = [0u8; 4096];
    for part in samples.chunks(1024) {
        for (b, s) in block.chunks_exact_mut(4).zip(part) {
            b.copy_from_slice(&s.to_le_bytes());
        }
        h.write(&block[..4 * part.len()]);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::RefInput;

    /// The key made once per voice tells contents apart: the same samples at the same rate give
    /// the same key, one sample or the rate changed gives another.
    #[test]
    fn a_voices_key_follows_its_content() {
        let x: Vec<f32> = (0..40_000).map(|i| (i as f32 * 0.01).sin()).collect();
        let a = RefInput::new(x.clone(), 16_000);
        assert_eq!(a.content_key(), RefInput::new(x.clone(), 16_000).content_key());
        let mut y = x.clone();
        y[39_999] += 1e-6;
        assert_ne!(a.content_key(), RefInput::new(y, 16_000).content_key());
        assert_ne!(a.content_key(), RefInput::new(x.clone(), 24_000).content_key());
        assert_ne!(a.content_key(), RefInput::new(x[..39_999].to_vec(), 16_000).content_key());
    }
}
