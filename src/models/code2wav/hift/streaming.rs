//! The causal vocoder streamed with bounded history (the reference's `BoundedVocoder`), for one
//! stream or for a batch: streams whose windows have equal shapes share one F0 run and one decode
//! run (stacked on the batch axis; with graphs on, padded to a power of two so a few captured
//! shapes serve every batch size), while each stream keeps its own mel and source history, phase
//! and offsets.

use candle_core::{Result, Tensor};

use super::HiftGenerator;

/// Per-stream state of the streaming (bounded) vocoder.
#[derive(Debug, Clone)]
pub struct HiftState {
    mel: Tensor,
    source: Tensor,
    phase: [f64; 16],
    mel_offset: usize,
    source_offset: usize,
    source_end: usize,
    speech_offset: usize,
    finalized: bool,
    first_chunk: bool,
}

/// The streaming limits (the reference's `BoundedVocoder.limits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    pub f0_left: usize,
    pub f0_right: usize,
    pub history: usize,
    pub decoder_right: usize,
    pub block_frames: usize,
}

impl StreamLimits {
    /// Frames of delay: audio for a mel frame comes out this many frames later.
    pub fn delay(&self) -> usize {
        self.f0_right + self.decoder_right
    }
}

/// Mel frames a round takes in at once (a whole chunk: a steady one is 50). The history covers the
/// decoder's whole receptive field, so the audio does not depend on how the frames are split into
/// rounds; but every round recomputes the history (~23 frames), so the reference's 16-frame rounds
/// did ~2.4× the decoder work of one round per chunk. (The source is still made in the reference's
/// 16-frame blocks.)
pub const ROUND_FRAMES: usize = 64;

/// Graph tags of the streaming steps (+1 when finalizing: another computation).
const GRAPH_F0: usize = 0;
const GRAPH_DECODE: usize = 2;

/// At most this many threads make a batch's excitation.
const SOURCE_THREADS: usize = 8;

/// Indices grouped by equal keys, groups and members in first-seen order.
fn groups<K: PartialEq>(keyed: Vec<(usize, K)>) -> Vec<(K, Vec<usize>)> {
    let mut out: Vec<(K, Vec<usize>)> = Vec::new();
    for (i, k) in keyed {
        match out.iter_mut().find(|g| g.0 == k) {
            Some(g) => g.1.push(i),
            None => out.push((k, vec![i])),
        }
    }
    out
}

impl HiftGenerator {
    /// A fresh streaming state.
    pub fn new_state(&self) -> Result<HiftState> {
        let dev = self.conv_pre.w.device();
        let dt = self.conv_pre.w.dtype();
        Ok(HiftState {
            mel: Tensor::zeros((1, self.cfg.in_channels, 0), dt, dev)?,
            source: Tensor::zeros((1, 1, 0), dt, dev)?,
            phase: [0.0; 16],
            mel_offset: 0,
            source_offset: 0,
            source_end: 0,
            speech_offset: 0,
            finalized: false,
            first_chunk: true,
        })
    }

    /// Rows `[1, …]` stacked on the batch axis; with graphs on, padded to the next power of two
    /// by repeating the last row (its output is not used).
    fn stack_rows(&self, rows: &[Tensor]) -> Result<Tensor> {
        let mut rows = rows.to_vec();
        if self.graphs.is_on() {
            let n = rows.len().next_power_of_two();
            while rows.len() < n {
                rows.push(rows[rows.len() - 1].clone());
            }
        }
        Tensor::cat(&rows, 0)
    }

    /// The causal excitation for a stream's new frames `f0` (from its `source_end` on), in the
    /// reference's blocks: the samples, on the host; advances the phase and `source_end`.
    fn source_blocks(&self, st: &mut HiftState, f0: &[f32]) -> Vec<f32> {
        let block = self.limits.map_or(f0.len(), |l| l.block_frames).max(1);
        let mut out = Vec::with_capacity(f0.len() * self.cfg.hop());
        for part in f0.chunks(block) {
            let offset = st.source_end;
            out.extend(self.source(st, part, offset));
            st.source_end += part.len();
        }
        out
    }

    /// [`Self::source_blocks`] for several streams, on threads of their own when there are
    /// several (a steady chunk is ~24k samples, each a tanh on the host: serially, a batch of 8
    /// held the GPU idle for milliseconds between the F0 and the decode).
    fn sources(&self, jobs: &mut [(&mut HiftState, &[f32])]) -> Result<Vec<Vec<f32>>> {
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(SOURCE_THREADS)
            .min(jobs.len());
        if threads <= 1 {
            return Ok(jobs.iter_mut().map(|(st, f0)| self.source_blocks(st, f0)).collect());
        }
        let (n, per) = (jobs.len(), jobs.len().div_ceil(threads));
        std::thread::scope(|s| {
            let handles: Vec<_> = jobs
                .chunks_mut(per)
                .map(|part| {
                    s.spawn(move || {
                        part.iter_mut()
                            .map(|(st, f0)| self.source_blocks(st, f0))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            let mut out = Vec::with_capacity(n);
            for h in handles {
                out.extend(h.join().map_err(|_| {
                    candle_core::Error::Msg("the vocoder's source thread panicked".into())
                })?);
            }
            Ok(out)
        })
    }

    /// The causal excitation for frames `f0` starting at frame `frame_offset`, advancing the phase.
    fn source(&self, st: &mut HiftState, f0: &[f32], frame_offset: usize) -> Vec<f32> {
        let cfg = &self.cfg;
        let (hop, h1, sr, amp, thr) = self.source_params();
        let n = f0.len();
        // cycles = cumsum(increments) · hop + phase, in f64, as the reference orders it
        let mut sums = [0f64; 16];
        let mut last = [0f64; 16];
        let mut per_frame = vec![0f32; n * h1];
        let mut noise_amp = vec![0f32; n];
        for (t, &f) in f0.iter().enumerate() {
            let voiced = if f > thr { 1.0f32 } else { 0.0 };
            for h in 0..h1 {
                let inc = (f * (h + 1) as f32 / sr).rem_euclid(1.0);
                sums[h] += inc as f64;
                let cycles = sums[h] * hop as f64 + st.phase[h];
                last[h] = cycles;
                let sine = ((cycles.rem_euclid(1.0)) * (2.0 * std::f64::consts::PI)).sin() as f32;
                per_frame[t * h1 + h] = sine * amp * voiced;
            }
            noise_amp[t] = voiced * cfg.nsf_sigma as f32 + (1.0 - voiced) * amp / 3.0;
        }
        if n > 0 {
            for (p, l) in st.phase.iter_mut().zip(&last).take(h1) {
                *p = l.rem_euclid(1.0);
            }
        }
        // per sample: tanh(l_linear(the frame's sines + the table's noise)); the linear merge is
        // split into the frame's part and the noise row's part (merged once at load), so each
        // sample costs one product and a tanh on the host, and only the merged signal goes up
        let mut merged = vec![0f32; n * hop];
        let rows = self.noise_rows;
        for t in 0..n {
            let sines: f32 = per_frame[t * h1..(t + 1) * h1]
                .iter()
                .zip(&self.merge_w)
                .map(|(s, w)| s * w)
                .sum::<f32>()
                + self.merge_b;
            let mut pos = (frame_offset * hop + t * hop) % rows;
            for out in &mut merged[t * hop..(t + 1) * hop] {
                *out = (sines + noise_amp[t] * self.noise_merged[pos]).tanh();
                pos += 1;
                if pos == rows {
                    pos = 0;
                }
            }
        }
        merged
    }

    /// One round over a batch of states that each took in a block (or, finalizing, nothing): the
    /// excitation for every frame whose F0 right context has come, then the audio for every frame
    /// whose decoder right context has; then the histories are trimmed. Returns each stream's new
    /// samples `[1, n]`.
    fn process_batch(&self, sts: &mut [&mut HiftState], finalize: bool) -> Result<Vec<Tensor>> {
        let lim = self.limits.expect("causal generator");
        let hop = self.cfg.hop();
        let f0_start = |st: &HiftState| st.source_end.saturating_sub(lim.f0_left);
        // 1. F0 and excitation
        let mut need = Vec::new();
        for (i, st) in sts.iter().enumerate() {
            let received = st.mel_offset + st.mel.dim(2)?;
            if received.saturating_sub(if finalize { 0 } else { lim.f0_right }) > st.source_end {
                need.push((i, received - f0_start(st)));
            }
        }
        for (len, idx) in groups(need) {
            let feats = idx
                .iter()
                .map(|&i| sts[i].mel.narrow(2, f0_start(&*sts[i]) - sts[i].mel_offset, len))
                .collect::<Result<Vec<_>>>()?;
            let x = self.stack_rows(&feats)?;
            let f0 = self.graphs.run(GRAPH_F0 + usize::from(finalize), &[&x], &|x| {
                Ok(vec![self.f0_predictor.forward(&x[0], finalize)?])
            })?;
            let f0 = f0[0].to_vec2::<f32>()?;
            // (idx ascends: the streams' rows in order)
            let mut rows = idx.iter().zip(&f0).peekable();
            let mut jobs: Vec<(&mut HiftState, &[f32])> = Vec::with_capacity(idx.len());
            for (i, st) in sts.iter_mut().enumerate() {
                if let Some((_, row)) = rows.next_if(|(&j, _)| j == i) {
                    let skip = st.source_end - f0_start(st);
                    jobs.push((&mut **st, &row[skip..]));
                }
            }
            let made = self.sources(&mut jobs)?;
            let (dev, dt) = (self.conv_pre.w.device(), self.conv_pre.w.dtype());
            for ((st, _), samples) in jobs.into_iter().zip(made) {
                let n = samples.len();
                let new = Tensor::from_vec(samples, (1, 1, n), dev)?.to_dtype(dt)?;
                st.source = Tensor::cat(&[&st.source, &new], 2)?;
            }
        }
        // 2. audio
        let available = |st: &HiftState| {
            st.source_end.saturating_sub(if finalize { 0 } else { lim.decoder_right })
        };
        let start = |st: &HiftState| (st.speech_offset / hop).saturating_sub(lim.history);
        let mut need = Vec::new();
        for (i, st) in sts.iter().enumerate() {
            if available(st) > st.speech_offset / hop {
                let src = st.source.dim(2)? - (start(st) - st.source_offset) * hop;
                need.push((i, (st.source_end - start(st), src)));
            }
        }
        let mut speech: Vec<Option<Tensor>> = vec![None; sts.len()];
        for ((frames, src_len), idx) in groups(need) {
            let mut feats = Vec::with_capacity(idx.len());
            let mut srcs = Vec::with_capacity(idx.len());
            for &i in &idx {
                let st = &*sts[i];
                feats.push(st.mel.narrow(2, start(st) - st.mel_offset, frames)?);
                srcs.push(st.source.narrow(2, (start(st) - st.source_offset) * hop, src_len)?);
            }
            let (x, s) = (self.stack_rows(&feats)?, self.stack_rows(&srcs)?);
            let y = self.graphs.run(GRAPH_DECODE + usize::from(finalize), &[&x, &s], &|x| {
                Ok(vec![self.decode(&x[0], &x[1], finalize)?])
            })?;
            let y = &y[0];
            for (row, &i) in idx.iter().enumerate() {
                let st = &mut *sts[i];
                let emitted = st.speech_offset / hop;
                let skip = (emitted - start(st)) * hop;
                let want = (available(st) - emitted) * hop;
                if y.dim(1)? != skip + want {
                    candle_core::bail!(
                        "streaming vocoder: {} samples where {} were expected",
                        y.dim(1)?,
                        skip + want
                    );
                }
                speech[i] = Some(y.narrow(0, row, 1)?.narrow(1, skip, want)?);
                st.speech_offset = available(st) * hop;
            }
        }
        // 3. trim the histories
        let mut out = Vec::with_capacity(sts.len());
        for (st, sp) in sts.iter_mut().zip(speech) {
            let emitted = st.speech_offset / hop;
            let keep_mel =
                emitted.saturating_sub(lim.history).min(st.source_end.saturating_sub(lim.f0_left));
            let keep_source = emitted.saturating_sub(lim.history);
            let ml = st.mel.dim(2)?;
            st.mel = st
                .mel
                .narrow(2, keep_mel - st.mel_offset, ml - (keep_mel - st.mel_offset))?
                .contiguous()?;
            let sl = st.source.dim(2)?;
            let cut = (keep_source - st.source_offset) * hop;
            st.source = st.source.narrow(2, cut, sl - cut)?.contiguous()?;
            st.mel_offset = keep_mel;
            st.source_offset = keep_source;
            out.push(match sp {
                Some(t) => t,
                None => Tensor::zeros((1, 0), st.mel.dtype(), st.mel.device())?,
            });
        }
        Ok(out)
    }

    /// Streams fresh mel `[1, 80, frames]` (possibly empty) through the causal vocoder: returns the
    /// audio `[samples]` that is ready. The first audio is preceded by the delay's worth of
    /// silence (unless the stream ends right away), so audio stays aligned with mel; `last` flushes
    /// everything.
    pub fn stream(&self, st: &mut HiftState, mel: &Tensor, last: bool) -> Result<Tensor> {
        Ok(self.stream_batch(&mut [st], &[mel], last)?.pop().expect("one in, one out"))
    }

    /// [`HiftGenerator::stream`] for several streams at once (`mels[i]: [1, 80, frames_i]`, the
    /// same `last` for all): each stream gives what it would give alone.
    pub fn stream_batch(
        &self,
        sts: &mut [&mut HiftState],
        mels: &[&Tensor],
        last: bool,
    ) -> Result<Vec<Tensor>> {
        let Some(lim) = self.limits else {
            candle_core::bail!("the original HiFT has no streaming mode")
        };
        if sts.iter().any(|s| s.finalized) {
            candle_core::bail!("vocoder stream already finalized");
        }
        if mels.len() != sts.len() {
            candle_core::bail!("stream_batch: {} mels for {} streams", mels.len(), sts.len());
        }
        let frames = mels.iter().map(|m| m.dim(2)).collect::<Result<Vec<_>>>()?;
        let mut chunks: Vec<Vec<Tensor>> = vec![Vec::new(); sts.len()];
        let mut pos = 0;
        while frames.iter().any(|&f| f > pos) {
            let active: Vec<usize> = (0..sts.len()).filter(|&i| frames[i] > pos).collect();
            for &i in &active {
                let n = ROUND_FRAMES.min(frames[i] - pos);
                let st = &mut *sts[i];
                st.mel = Tensor::cat(
                    &[&st.mel, &mels[i].narrow(2, pos, n)?.to_dtype(st.mel.dtype())?],
                    2,
                )?;
            }
            let mut round: Vec<&mut HiftState> = sts
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| frames[*i] > pos)
                .map(|(_, s)| &mut **s)
                .collect();
            for (i, sp) in active.into_iter().zip(self.process_batch(&mut round, false)?) {
                chunks[i].push(sp);
            }
            pos += ROUND_FRAMES;
        }
        if last {
            for (i, sp) in self.process_batch(sts, true)?.into_iter().enumerate() {
                chunks[i].push(sp);
                sts[i].finalized = true;
            }
        }
        let mut out = Vec::with_capacity(sts.len());
        for (st, parts) in sts.iter_mut().zip(chunks) {
            let speech = if parts.is_empty() {
                Tensor::zeros((1, 0), st.mel.dtype(), st.mel.device())?
            } else {
                Tensor::cat(&parts, 1)?
            };
            let mut speech = speech.squeeze(0)?;
            if speech.dim(0)? > 0 && st.first_chunk {
                st.first_chunk = false;
                if !last {
                    let silence = Tensor::zeros(
                        lim.delay() * self.cfg.hop(),
                        speech.dtype(),
                        speech.device(),
                    )?;
                    speech = Tensor::cat(&[&silence, &speech], 0)?;
                }
            }
            out.push(speech);
        }
        Ok(out)
    }
}
