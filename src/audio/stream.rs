//! Resampling a signal that arrives piece by piece (the duplex path's units): one resampler for
//! the whole stream, so there are no filter edges at piece boundaries, at the price of a fixed lag.

use std::collections::VecDeque;

use anyhow::{bail, Context, Result};
use rubato::{FftFixedIn, Resampler};

/// Input frames per resampler call.
const CHUNK: usize = 1024;

/// A streaming resampler whose output runs a fixed [`StreamResampler::lag`] behind its input:
/// after `n` input samples have been pushed, `n · to / from` output samples can be taken (the
/// first `lag` of them silence), and the concatenated output equals a whole-signal resample delayed
/// by `lag` samples.
pub struct StreamResampler {
    r: Option<FftFixedIn<f32>>,
    pending: Vec<f32>,
    out: VecDeque<f32>,
    /// Resampler outputs still to drop (its own delay).
    skip: usize,
    lag: usize,
    from: u32,
    to: u32,
    pushed: u64,
    taken: u64,
}

impl StreamResampler {
    pub fn new(from: u32, to: u32) -> Result<Self> {
        if from == 0 || to == 0 {
            bail!("sample rate 0");
        }
        let (r, skip, lag) = if from == to {
            (None, 0, 0)
        } else {
            let r = FftFixedIn::<f32>::new(from as usize, to as usize, CHUNK, 2, 1)
                .context("creating the resampler")?;
            // up to a chunk's worth of input waits in `pending`, the FFT resampler holds up to
            // another inside, and its own delay is dropped: the lag covers all three
            let lag = 2 * (CHUNK as u64 * to as u64).div_ceil(from as u64) as usize
                + r.output_delay()
                + 2;
            (Some(r), 0, lag)
        };
        let mut s = Self {
            r,
            pending: Vec::new(),
            out: VecDeque::new(),
            skip,
            lag,
            from,
            to,
            pushed: 0,
            taken: 0,
        };
        if let Some(r) = &s.r {
            s.skip = r.output_delay();
        }
        s.out.extend(std::iter::repeat_n(0.0, s.lag));
        Ok(s)
    }

    /// Output samples of delay against the input.
    pub fn lag(&self) -> usize {
        self.lag
    }

    pub fn push(&mut self, x: &[f32]) -> Result<()> {
        self.pushed += x.len() as u64;
        let Some(r) = self.r.as_mut() else {
            self.out.extend(x.iter().copied());
            return Ok(());
        };
        self.pending.extend_from_slice(x);
        let mut pos = 0;
        while self.pending.len() - pos >= r.input_frames_next() {
            let n = r.input_frames_next();
            let y = r.process(&[&self.pending[pos..pos + n]], None)?;
            pos += n;
            let drop = self.skip.min(y[0].len());
            self.skip -= drop;
            self.out.extend(y[0][drop..].iter().copied());
        }
        self.pending.drain(..pos);
        Ok(())
    }

    /// The next `n` output samples, if the input pushed so far covers them
    /// (`taken + n <= pushed · to / from`).
    pub fn take(&mut self, n: usize) -> Option<Vec<f32>> {
        let allowed = self.pushed * self.to as u64 / self.from as u64;
        if self.taken + n as u64 > allowed {
            return None;
        }
        if self.out.len() < n {
            // (the lag covers what waits in `pending`; short only if the lag were too small)
            self.out.extend(std::iter::repeat_n(0.0, n - self.out.len()));
        }
        self.taken += n as u64;
        Some(self.out.drain(..n).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_give_the_whole_signal_resampled_with_a_fixed_lag() {
        for rate in [48_000u32, 24_000] {
            pieces_at(rate);
        }
    }

    fn pieces_at(rate: u32) {
        let x: Vec<f32> = (0..rate as usize * 3)
            .map(|i| (2.0 * std::f32::consts::PI * 440.0 * i as f32 / rate as f32).sin() * 0.5)
            .collect();
        let whole = crate::resample(&x, rate, 16_000).unwrap();
        let mut s = StreamResampler::new(rate, 16_000).unwrap();
        let mut got = Vec::new();
        for piece in x.chunks(rate as usize) {
            s.push(piece).unwrap();
            got.extend(s.take(16_000).expect("a unit's worth after a unit's input"));
        }
        assert_eq!(got.len(), 48_000);
        let lag = s.lag();
        assert!(got[..lag].iter().all(|&v| v == 0.0), "the lag is silence");
        // the stream equals the whole resample shifted by the lag, across the piece boundaries
        // (the whole resample's own last samples lack look-ahead: compared up to 100 ms before)
        let mut worst = 0f32;
        for i in lag..got.len() - 1600 {
            let d = (got[i] - whole[i - lag]).abs();
            worst = if d.is_nan() { f32::INFINITY } else { worst.max(d) };
        }
        assert!(worst < 1e-3, "{rate}: max diff {worst}");
        // pieces resampled each on their own show their edges at the boundaries
        let fresh: Vec<f32> = x
            .chunks(rate as usize)
            .flat_map(|p| crate::resample(p, rate, 16_000).unwrap())
            .collect();
        let edge = (15_990..16_010).map(|i| (fresh[i] - whole[i]).abs()).fold(0f32, |a, d| {
            if d.is_nan() {
                f32::INFINITY
            } else {
                a.max(d)
            }
        });
        assert!(edge > worst, "a fresh resampler per piece leaves an edge ({edge} vs {worst})");
    }

    #[test]
    fn equal_rates_pass_through() {
        let mut s = StreamResampler::new(16_000, 16_000).unwrap();
        s.push(&[0.1, 0.2, 0.3]).unwrap();
        assert_eq!(s.lag(), 0);
        assert_eq!(s.take(2), Some(vec![0.1, 0.2]));
        assert_eq!(s.take(2), None);
    }
}
