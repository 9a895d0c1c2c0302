//! Stage 0, the Thinker: the Qwen3 LLM (`llm.`), the Whisper encoder (`apm.`), the audio projector
//! (`audio_projection_layer.`) with average pooling, and the splicing of audio embeddings into the
//! LLM input at `<unk>` placeholder runs between `<|audio_start|>` and `<|audio_end|>`.

use candle_core::{Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};

use super::config::MiniCpmoConfig;
use super::decoder::KvCache;
use super::mel::WhisperLogMel;
use super::qwen3::Qwen3;
use super::whisper::{avg_pool_time, ClipMask, EncoderStep, WhisperEncoder};

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
        Ok(Self { linear1: l("linear1", in_dim, out_dim)?, linear2: l("linear2", out_dim, out_dim)? })
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
                candle_core::bail!("audio span opened at {i} is not closed by <|audio_end|> right after its placeholders");
            }
            spans.push((s, e - s));
            i = e + 1;
        } else {
            i += 1;
        }
    }
    Ok(spans)
}

/// Stage 0's modules.
#[derive(Debug, Clone)]
pub struct Thinker {
    pub llm: Qwen3,
    pub apm: WhisperEncoder,
    pub audio_projection_layer: AudioProjector,
    mel: std::sync::Arc<WhisperLogMel>,
    pool_step: usize,
    /// Clips of at most this many samples (reference voices, cut to a fixed length; short
    /// utterances) are encoded padded to it, as a replayed CUDA graph ([`Thinker::set_clip_graphs`]).
    graph_clip: Option<usize>,
    clip_graphs: crate::cuda_graph::GraphSlot,
}

impl Thinker {
    /// `vb` points at the checkpoint root (`llm.`, `apm.`, `audio_projection_layer.` below it).
    pub fn load(vb: VarBuilder, cfg: &MiniCpmoConfig) -> Result<Self> {
        let llm = Qwen3::load(vb.pp("llm"), cfg)?;
        let apm = WhisperEncoder::load(vb.pp("apm"), &cfg.audio_config)?;
        let audio_projection_layer = AudioProjector::load(vb.pp("audio_projection_layer"), cfg.audio_config.encoder_ffn_dim / 4, cfg.hidden_size)?;
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

    /// Whisper log-mel of 16 kHz samples as a `[n_mels, frames]` tensor on the model's device.
    pub fn log_mel(&self, samples: &[f32]) -> Result<Tensor> {
        let (m, frames) = self.mel.compute(samples);
        Tensor::from_vec(m, (self.mel.n_mels(), frames), self.llm_device())?.to_dtype(self.llm_dtype())
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
        self.clip_graphs = if samples.is_some() { crate::cuda_graph::GraphSlot::on(1) } else { crate::cuda_graph::GraphSlot::off() };
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
                Some(n) if chunk.len() <= n => parts.push(self.encode_padded(chunk, n)?),
                _ => parts.push(self.project(&self.apm.forward_clip(&self.log_mel(chunk)?)?)?),
            }
        }
        Tensor::cat(&parts, 0)
    }

    /// A clip of at most `n` samples encoded as one of `n` samples, the padding masked out
    /// ([`WhisperEncoder::forward_clip_padded`]), replayed as a CUDA graph: the same embeddings as
    /// the clip's own shapes give, for every length up to `n`.
    fn encode_padded(&self, clip: &[f32], n: usize) -> Result<Tensor> {
        let (m, frames) = self.mel.compute(clip);
        let (fmax, nm) = (self.mel.frames_for(n), self.mel.n_mels());
        let (pmax, p) = (WhisperEncoder::positions_for(fmax), WhisperEncoder::positions_for(frames));
        // one upload: the padded mel, conv1's output mask, the attention key mask
        let mut host = vec![0f32; nm * fmax + fmax + pmax];
        for (r, row) in m.chunks_exact(frames).enumerate() {
            host[r * fmax..r * fmax + frames].copy_from_slice(row);
        }
        host[nm * fmax..nm * fmax + frames].fill(1.0);
        host[nm * fmax + fmax + p..].fill(f32::NEG_INFINITY);
        let all = Tensor::from_vec(host, nm * fmax + fmax + pmax, self.llm_device())?.to_dtype(self.llm_dtype())?;
        let mel = all.narrow(0, 0, nm * fmax)?.reshape((nm, fmax))?;
        let conv = all.narrow(0, nm * fmax, fmax)?.reshape((1, fmax))?;
        let keys = all.narrow(0, nm * fmax + fmax, pmax)?.reshape((1, 1, 1, pmax))?;
        let encode = |x: &[Tensor]| -> candle_core::Result<Vec<Tensor>> {
            let mask = ClipMask { conv: x[1].clone(), keys: x[2].clone() };
            Ok(vec![self.project(&self.apm.forward_clip_padded(&x[0], &mask)?)?])
        };
        let pooled = self.clip_graphs.run(0, &[&mel, &conv, &keys], &encode)?.remove(0);
        pooled.narrow(0, 0, p / self.pool_step)
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
    pub fn embed_with_audio(&self, ids: &[u32], markers: &AudioMarkers, audio: &[Tensor]) -> Result<Tensor> {
        let text = self.llm.embed(ids)?;
        let spans = audio_spans(ids, markers)?;
        if spans.len() != audio.len() {
            candle_core::bail!("the prompt has {} audio spans but {} audio inputs were given", spans.len(), audio.len());
        }
        if spans.is_empty() {
            return Ok(text);
        }
        let mut parts = Vec::with_capacity(2 * spans.len() + 1);
        let mut pos = 0;
        for (k, (&(s, n), a)) in spans.iter().zip(audio).enumerate() {
            let rows = a.dim(0)?;
            if rows != n {
                candle_core::bail!("audio span {k} has {n} placeholders but its audio gives {rows} embeddings");
            }
            if s > pos {
                parts.push(text.narrow(0, pos, s - pos)?);
            }
            if n > 0 {
                parts.push(a.to_dtype(text.dtype())?);
            }
            pos = s + n;
        }
        if pos < ids.len() {
            parts.push(text.narrow(0, pos, ids.len() - pos)?);
        }
        Tensor::cat(&parts, 0)
    }
}
