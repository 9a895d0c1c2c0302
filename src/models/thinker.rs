//! Thinker, the Thinker: the Qwen3 LLM (`llm.`), the Whisper encoder (`apm.`), the audio projector
//! (`audio_projection_layer.`) with average pooling, and the splicing of audio embeddings into the
//! LLM input at `<unk>` placeholder runs between `<|audio_start|>` and `<|audio_end|>`.

use candle_core::{Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};

use super::config::MiniCpmoConfig;
use super::decoder::KvCache;
use super::mel::WhisperLogMel;
use super::qwen3::Qwen3;
use super::whisper::{avg_pool_time, ClipMask, EncoderStep, WhisperEncoder};

/// Clips encoded together at most ([`Thinker::encode_clips`]; a batch is padded to a power of two,
/// so graphs of 1, 2, 4 and 8 clips serve every count).
pub const CLIP_BATCH: usize = 8;

/// `audio_projection_layer`: linear1 (encoder width -> LLM width), ReLU, linear2.
#[derive(Debug, Clone)]
pub struct AudioProjector {
    linear1: Linear,
    linear2: Linear,
}

impl AudioProjector {
    pub fn load(vb: VarBuilder, in_dim: usize, out_dim: usize) -> Result<Self> {
        let l = |name: &str, i: usize, o: usize| -> Result<Linear> {
            Ok(Linear::new(vb.pp(name).get((o, i), "weight")?, Some(vb.pp(name).get(o, "bias")?)))
        };
        Ok(Self {
            linear1: l("linear1", in_dim, out_dim)?,
            linear2: l("linear2", out_dim, out_dim)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear2.forward(&self.linear1.forward(x)?.relu()?)
    }
}

/// Token ids that mark audio in a prompt (looked up from the tokenizer by the caller).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AudioMarkers {
    pub start: u32,
    pub end: u32,
    pub placeholder: u32,
}

/// `(first placeholder index, count)` of every `<|audio_start|> <unk>* <|audio_end|>` run.
pub fn audio_spans(ids: &[u32], m: &AudioMarkers) -> Result<Vec<(usize, usize)>> {
    let mut spans = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        if ids[i] == m.start {
            let s = i + 1;
            let mut e = s;
            while e < ids.len() && ids[e] == m.placeholder {
                e += 1;
            }
            if e >= ids.len() || ids[e] != m.end {
                candle_core::bail!(
                    "audio span opened at {i} is not closed by <|audio_end|> right \
                    after its placeholders"
                );
            }
            spans.push((s, e - s));
            i = e + 1;
        } else {
            i += 1;
        }
    }
    Ok(spans)
}

/// The Thinker's modules.
#[derive(Debug, Clone)]
pub struct Thinker {
    pub llm: Qwen3,
    pub apm: WhisperEncoder,
    pub audio_projection_layer: AudioProjector,
    mel: std::sync::Arc<WhisperLogMel>,
    pool_step: usize,
    /// Clips of at most this many samples (reference voices, cut to a fixed length; short
    /// utterances) are encoded padded to it, as a replayed CUDA graph
    /// ([`Thinker::set_clip_graphs`]).
    graph_clip: Option<usize>,
    clip_graphs: crate::cuda_graph::GraphSlot,
}

impl Thinker {
    /// `vb` points at the checkpoint root (`llm.`, `apm.`, `audio_projection_layer.` below it).
    pub fn load(vb: VarBuilder, cfg: &MiniCpmoConfig) -> Result<Self> {
        let llm = Qwen3::load(vb.pp("llm"), cfg)?;
        let apm = WhisperEncoder::load(vb.pp("apm"), &cfg.audio_config)?;
        let audio_projection_layer = AudioProjector::load(
            vb.pp("audio_projection_layer"),
            cfg.audio_config.encoder_ffn_dim / 4,
            cfg.hidden_size,
        )?;
        Ok(Self {
            llm,
            apm,
            audio_projection_layer,
            mel: std::sync::Arc::new(WhisperLogMel::new(cfg.audio_config.num_mel_bins)),
            pool_step: cfg.audio_pool_step,
            graph_clip: None,
            clip_graphs: crate::cuda_graph::GraphSlot::off(),
        })
    }

    /// Audio embeddings the encoder makes of `samples` samples at 16 kHz (10 per second).
    pub fn audio_embeddings_for(&self, samples: usize) -> usize {
        WhisperEncoder::positions_for(self.mel.frames_for(samples)) / self.pool_step
    }

    /// Rows [`Thinker::encode_clip`] gives for a clip of `samples` samples (a clip longer than
    /// the encoder's window is encoded a window at a time): known before it is encoded, so a
    /// prompt's positions are laid out before any clip is.
    pub fn clip_embeddings_for(&self, samples: usize) -> usize {
        let window = self.apm.config().max_source_positions * 2 * WhisperLogMel::HOP;
        (0..samples)
            .step_by(window.max(1))
            .map(|at| self.audio_embeddings_for((samples - at).min(window)))
            .sum()
    }

    /// Whisper log-mel of 16 kHz samples as a `[n_mels, frames]` tensor on the model's device.
    pub fn log_mel(&self, samples: &[f32]) -> Result<Tensor> {
        let (m, frames) = self.mel.compute(samples);
        Tensor::from_vec(m, (self.mel.n_mels(), frames), self.llm_device())?
            .to_dtype(self.llm_dtype())
    }

    fn llm_device(&self) -> &candle_core::Device {
        self.audio_projection_layer.linear1.weight().device()
    }

    fn llm_dtype(&self) -> candle_core::DType {
        self.audio_projection_layer.linear1.weight().dtype()
    }

    /// Projector + pooling: encoder output `[positions, d_model]` -> `[positions / 5, hidden]`.
    pub fn project(&self, enc: &Tensor) -> Result<Tensor> {
        avg_pool_time(&self.audio_projection_layer.forward(enc)?, self.pool_step)
    }

    /// Clips of at most `samples` 16 kHz samples (the reference voices the Thinker hears, cut to
    /// that length, and anything shorter) encoded padded to it, as a CUDA graph from the second
    /// run on; `None`: every clip op by op in its own shapes.
    pub fn set_clip_graphs(&mut self, samples: Option<usize>) {
        self.graph_clip = samples;
        let shapes = CLIP_BATCH.trailing_zeros() as usize + 1;
        self.clip_graphs = if samples.is_some() {
            crate::cuda_graph::GraphSlot::on(shapes)
        } else {
            crate::cuda_graph::GraphSlot::off()
        };
    }

    /// A whole clip of 16 kHz audio -> LLM-width audio embeddings. Clips longer than the encoder's
    /// window (30 s) are encoded window by window.
    pub fn encode_clip(&self, samples: &[f32]) -> Result<Tensor> {
        if self.mel.frames_for(samples.len()) == 0 {
            // shorter than one mel hop: no embeddings
            let h = self.audio_projection_layer.linear2.weight().dim(0)?;
            return Tensor::zeros((0, h), self.llm_dtype(), self.llm_device());
        }
        let window = self.apm.config().max_source_positions * 2 * WhisperLogMel::HOP;
        let mut parts = Vec::new();
        for chunk in samples.chunks(window).filter(|c| self.mel.frames_for(c.len()) > 0) {
            match self.graph_clip {
                Some(n) if chunk.len() <= n => {
                    parts.push(self.encode_padded(&[chunk], n)?.remove(0))
                }
                _ => parts.push(self.project(&self.apm.forward_clip(&self.log_mel(chunk)?)?)?),
            }
        }
        Tensor::cat(&parts, 0)
    }

    /// Several whole clips of 16 kHz audio (a burst of reference voices) -> each one's LLM-width
    /// embeddings, as [`Thinker::encode_clip`] gives them. With clip graphs on and every clip
    /// within the graphed length, they are encoded together, up to [`CLIP_BATCH`] at a time: their
    /// log-mels computed side by side on threads, one upload, one replayed graph per batch; else
    /// clip by clip.
    pub fn encode_clips(&self, clips: &[&[f32]]) -> Result<Vec<Tensor>> {
        match self.graph_clip {
            Some(n)
                if clips.len() > 1
                    && clips.iter().all(|c| c.len() <= n && self.mel.frames_for(c.len()) > 0) =>
            {
                let mut out = Vec::with_capacity(clips.len());
                for part in clips.chunks(CLIP_BATCH) {
                    out.extend(self.encode_padded(part, n)?);
                }
                Ok(out)
            }
            _ => clips.iter().map(|c| self.encode_clip(c)).collect(),
        }
    }

    /// Clips of at most `n` samples (at least one mel frame each) encoded as clips of `n` samples,
    /// padded to a power-of-two batch, the padding masked out
    /// ([`WhisperEncoder::forward_clips_padded`]), replayed as a CUDA graph per batch size: each
    /// the same embeddings as the clip's own shapes give, for every length up to `n`.
    fn encode_padded(&self, clips: &[&[f32]], n: usize) -> Result<Vec<Tensor>> {
        let mels: Vec<(Vec<f32>, usize)> = if clips.len() == 1 {
            vec![self.mel.compute(clips[0])]
        } else {
            std::thread::scope(|scope| {
                let jobs: Vec<_> =
                    clips.iter().map(|&c| scope.spawn(move || self.mel.compute(c))).collect();
                jobs.into_iter()
                    .map(|j| {
                        j.join().map_err(|_| {
                            candle_core::Error::Msg("a log-mel thread panicked".into())
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })?
        };
        let (fmax, nm) = (self.mel.frames_for(n), self.mel.n_mels());
        let pmax = WhisperEncoder::positions_for(fmax);
        let b = clips.len().next_power_of_two();
        // one upload: per clip its padded mel, conv1's output mask, the attention key mask (a
        // padding clip has no frames and hides no key, so its rows stay finite)
        let row = nm * fmax + fmax + pmax;
        let mut host = vec![0f32; b * row];
        let mut lengths = Vec::with_capacity(mels.len());
        for ((m, frames), r) in mels.iter().zip(host.chunks_exact_mut(row)) {
            let frames = *frames;
            for (k, mel_row) in m.chunks_exact(frames).enumerate() {
                r[k * fmax..k * fmax + frames].copy_from_slice(mel_row);
            }
            r[nm * fmax..nm * fmax + frames].fill(1.0);
            let p = WhisperEncoder::positions_for(frames);
            r[nm * fmax + fmax + p..].fill(f32::NEG_INFINITY);
            lengths.push(p);
        }
        let all =
            Tensor::from_vec(host, (b, row), self.llm_device())?.to_dtype(self.llm_dtype())?;
        let step = self.pool_step;
        let encode = |x: &[Tensor]| -> candle_core::Result<Vec<Tensor>> {
            let mel = x[0].narrow(1, 0, nm * fmax)?.reshape((b, nm, fmax))?;
            let conv = x[0].narrow(1, nm * fmax, fmax)?.reshape((b, 1, fmax))?;
            let keys = x[0].narrow(1, nm * fmax + fmax, pmax)?.reshape((b, 1, 1, pmax))?;
            let enc = self.apm.forward_clips_padded(&mel, &ClipMask { conv, keys })?;
            // projector over every clip's rows at once, then average pooling over time by `step`
            // per clip (as `project`)
            let d = enc.dim(2)?;
            let h = self.audio_projection_layer.forward(&enc.reshape((b * pmax, d))?)?;
            let width = h.dim(1)?;
            let (h, pooled) = (h.reshape((b, pmax, width))?, pmax / step);
            Ok(vec![h.narrow(1, 0, pooled * step)?.reshape((b, pooled, step, width))?.mean(2)?])
        };
        let pooled = self.clip_graphs.run(0, &[&all], &encode)?.remove(0);
        lengths.iter().enumerate().map(|(i, &p)| pooled.get(i)?.narrow(0, 0, p / step)).collect()
    }

    /// Streaming units (the duplex path): each stream's next unit of 16 kHz audio, encoded against
    /// that stream's encoder cache, batched across streams. Returns LLM-width embeddings per unit.
    pub fn encode_units(&self, units: &mut [(&mut KvCache, &[f32])]) -> Result<Vec<Tensor>> {
        let mut steps = Vec::with_capacity(units.len());
        for (cache, samples) in units.iter_mut() {
            steps.push(EncoderStep { cache: Some(&mut **cache), mel: self.log_mel(samples)? });
        }
        let enc = self.apm.forward(&mut steps)?;
        enc.iter().map(|e| self.project(e)).collect()
    }

    /// LLM input embeddings of `ids` with every placeholder run replaced, in order, by the rows of
    /// `audio` (one tensor per run, exactly as many rows as placeholders).
    pub fn embed_with_audio(
        &self,
        ids: &[u32],
        markers: &AudioMarkers,
        audio: &[Tensor],
    ) -> Result<Tensor> {
        let spans = audio_spans(ids, markers)?.len();
        if spans != audio.len() {
            candle_core::bail!(
                "the prompt has {spans} audio spans but {} audio inputs were given",
                audio.len()
            );
        }
        self.embed_with_audio_from(ids, markers, 0, &mut |k| Ok(audio[k].clone()))
    }

    /// The embeddings of `ids[from..]` as [`Thinker::embed_with_audio`] gives them for the whole of
    /// `ids`: `audio(k)` is asked only for the runs that reach past `from` (a run before it, whose
    /// KV is held already, is never encoded), and a run that straddles `from` gives its rows from
    /// there on.
    pub fn embed_with_audio_from(
        &self,
        ids: &[u32],
        markers: &AudioMarkers,
        from: usize,
        audio: &mut dyn FnMut(usize) -> Result<Tensor>,
    ) -> Result<Tensor> {
        if from >= ids.len() {
            candle_core::bail!("embeddings from position {from} of a prompt of {}", ids.len());
        }
        let text = self.llm.embed(&ids[from..])?;
        let mut parts = Vec::new();
        let mut pos = from;
        for (k, (s, n)) in audio_spans(ids, markers)?.into_iter().enumerate() {
            if n == 0 || s + n <= from {
                continue;
            }
            let a = audio(k)?;
            let rows = a.dim(0)?;
            if rows != n {
                candle_core::bail!(
                    "audio span {k} has {n} placeholders but its audio gives {rows} embeddings"
                );
            }
            let skip = from.saturating_sub(s);
            if s > pos {
                parts.push(text.narrow(0, pos - from, s - pos)?);
            }
            parts.push(a.narrow(0, skip, n - skip)?.to_dtype(text.dtype())?);
            pos = s + n;
        }
        if parts.is_empty() {
            return Ok(text);
        }
        if pos < ids.len() {
            parts.push(text.narrow(0, pos - from, ids.len() - pos)?);
        }
        Tensor::cat(&parts, 0)
    }
}
