//! Audio encoder: the Whisper(-medium) encoder (`apm.` in the checkpoint, transformers'
//! `WhisperEncoder` as subclassed by MiniCPM-o).
//!
//! `apm.conv1`, `apm.conv2` (GELU after each, conv2 stride 2: 100 mel frames/s -> 50 positions/s),
//! `apm.embed_positions` (learned, 1500 rows), `apm.layers.N.{self_attn_layer_norm,
//! self_attn.{q_proj,k_proj (no bias),v_proj,out_proj}, final_layer_norm, fc1, fc2}` (pre-LN),
//! `apm.layer_norm`.
//!
//! Two entry points: a whole clip (positions from 0, no state kept), and streaming units where
//! every position attends to the stream's earlier units through a per-stream attention cache (the
//! duplex path). A stream's cache starts afresh when the next unit would reach the end of the
//! position table.

use candle_core::{Module, Result, Tensor, D};
use candle_nn::{Conv1d, Conv1dConfig, LayerNorm, Linear, VarBuilder};

use super::attention::{attend, CausalMask};
use super::config::WhisperConfig;
use super::decoder::KvCache;

const LN_EPS: f64 = 1e-5;

#[derive(Debug, Clone)]
struct EncoderLayer {
    self_attn_layer_norm: LayerNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    final_layer_norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

fn linear(vb: VarBuilder, in_dim: usize, out_dim: usize, bias: bool) -> Result<Linear> {
    let w = vb.get((out_dim, in_dim), "weight")?;
    let b = if bias { Some(vb.get(out_dim, "bias")?) } else { None };
    Ok(Linear::new(w, b))
}

impl EncoderLayer {
    fn load(vb: VarBuilder, cfg: &WhisperConfig) -> Result<Self> {
        let (d, f) = (cfg.d_model, cfg.encoder_ffn_dim);
        let a = vb.pp("self_attn");
        Ok(Self {
            self_attn_layer_norm: candle_nn::layer_norm(d, LN_EPS, vb.pp("self_attn_layer_norm"))?,
            q_proj: linear(a.pp("q_proj"), d, d, true)?,
            k_proj: linear(a.pp("k_proj"), d, d, false)?,
            v_proj: linear(a.pp("v_proj"), d, d, true)?,
            out_proj: linear(a.pp("out_proj"), d, d, true)?,
            final_layer_norm: candle_nn::layer_norm(d, LN_EPS, vb.pp("final_layer_norm"))?,
            fc1: linear(vb.pp("fc1"), d, f, true)?,
            fc2: linear(vb.pp("fc2"), f, d, true)?,
        })
    }
}

/// The encoder (`apm`).
#[derive(Debug, Clone)]
pub struct WhisperEncoder {
    conv1: Conv1d,
    conv2: Conv1d,
    embed_positions: Tensor,
    layers: Vec<EncoderLayer>,
    layer_norm: LayerNorm,
    cfg: WhisperConfig,
}

/// One stream's share of a batched encoder step.
pub struct EncoderStep<'a> {
    /// The stream's attention cache; `None` encodes a whole clip from position 0.
    pub cache: Option<&'a mut KvCache>,
    /// Log-mel `[n_mels, frames]`.
    pub mel: Tensor,
}

/// Where whole clips padded to one length are real ([`WhisperEncoder::forward_clips_padded`]): for
/// `B` clips padded to `frames` log-mel frames (zero past each clip), `conv` (`[B, 1, frames]`, 1
/// or 0) zeroes conv1's outputs past each clip (conv2 then sees the zeros the clip's own padding
/// gives it) and `keys` (`[B, 1, 1, positions]`, 0 or -inf) hides each clip's padding from its
/// attention, so every real position is computed from exactly what the unpadded clip gives it.
pub struct ClipMask {
    pub conv: Tensor,
    pub keys: Tensor,
}

impl WhisperEncoder {
    /// `vb` points at `apm`.
    pub fn load(vb: VarBuilder, cfg: &WhisperConfig) -> Result<Self> {
        let d = cfg.d_model;
        let c1 = Conv1dConfig { padding: 1, stride: 1, ..Default::default() };
        let c2 = Conv1dConfig { padding: 1, stride: 2, ..Default::default() };
        let conv1 = Conv1d::new(
            vb.pp("conv1").get((d, cfg.num_mel_bins, 3), "weight")?,
            Some(vb.pp("conv1").get(d, "bias")?),
            c1,
        );
        let conv2 = Conv1d::new(
            vb.pp("conv2").get((d, d, 3), "weight")?,
            Some(vb.pp("conv2").get(d, "bias")?),
            c2,
        );
        let embed_positions =
            vb.pp("embed_positions").get((cfg.max_source_positions, d), "weight")?;
        let layers = (0..cfg.encoder_layers)
            .map(|i| EncoderLayer::load(vb.pp("layers").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let layer_norm = candle_nn::layer_norm(d, LN_EPS, vb.pp("layer_norm"))?;
        Ok(Self { conv1, conv2, embed_positions, layers, layer_norm, cfg: cfg.clone() })
    }

    pub fn config(&self) -> &WhisperConfig {
        &self.cfg
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.cfg.encoder_layers)
    }

    /// Encoder positions produced by `frames` mel frames (conv2 has stride 2).
    pub fn positions_for(frames: usize) -> usize {
        if frames == 0 {
            0
        } else {
            (frames - 1) / 2 + 1
        }
    }

    /// Convolutional front end: `[n_mels, frames]` -> `[positions, d_model]`.
    fn front(&self, mel: &Tensor) -> Result<Tensor> {
        let x = mel.unsqueeze(0)?;
        let x = self.conv1.forward(&x)?.gelu_erf()?;
        let x = self.conv2.forward(&x)?.gelu_erf()?;
        x.squeeze(0)?.t()
    }

    /// Learned positions `offset .. offset + n`; past the table the last row repeats.
    fn positions(&self, offset: usize, n: usize) -> Result<Tensor> {
        let max = self.cfg.max_source_positions;
        if offset + n <= max {
            // (the same rows as the gather below, with nothing from the host)
            return self.embed_positions.narrow(0, offset, n);
        }
        let idx: Vec<u32> = (offset..offset + n).map(|p| p.min(max - 1) as u32).collect();
        let idx = Tensor::from_vec(idx, n, self.embed_positions.device())?;
        self.embed_positions.index_select(&idx, 0)
    }

    /// Encodes one whole clip (`[n_mels, frames]`, at most `2 * max_source_positions` frames) to
    /// `[positions, d_model]` (after the final layer norm).
    pub fn forward_clip(&self, mel: &Tensor) -> Result<Tensor> {
        let mut out = self.forward(&mut [EncoderStep { cache: None, mel: mel.clone() }])?;
        Ok(out.pop().expect("one stream in, one out"))
    }

    /// `B` whole clips padded to one length (`mels: [B, n_mels, frames]`, at most
    /// `2 * max_source_positions` frames), each masked by its rows of `mask`: `[B, positions,
    /// d_model]` (after the final layer norm), every real position of a clip what that clip alone
    /// gives it (the padding's positions hold whatever they hold). The clips share every matrix
    /// product; attention is one batched product over all of them.
    pub fn forward_clips_padded(&self, mels: &Tensor, mask: &ClipMask) -> Result<Tensor> {
        let b = mels.dim(0)?;
        let (heads, d) = (self.cfg.encoder_attention_heads, self.cfg.d_model);
        let hd = d / heads;
        let x = self.conv1.forward(mels)?.gelu_erf()?.broadcast_mul(&mask.conv)?;
        let x = self.conv2.forward(&x)?.gelu_erf()?;
        let p = x.dim(2)?;
        if p > self.cfg.max_source_positions {
            candle_core::bail!(
                "audio clip of {p} encoder positions exceeds {}; split it first",
                self.cfg.max_source_positions
            );
        }
        let mut x =
            x.transpose(1, 2)?.broadcast_add(&self.positions(0, p)?)?.reshape((b * p, d))?;
        let scale = (hd as f64).powf(-0.5);
        let split = |t: Tensor| t.reshape((b, p, heads, hd))?.transpose(1, 2)?.contiguous();
        for l in &self.layers {
            let h = l.self_attn_layer_norm.forward(&x)?;
            let q = split((l.q_proj.forward(&h)? * scale)?)?;
            let k = split(l.k_proj.forward(&h)?)?;
            let v = split(l.v_proj.forward(&h)?)?;
            // scores in the activations' dtype, the softmax accumulating in f32 (as `attend`)
            let att = q.matmul(&k.t()?)?.broadcast_add(&mask.keys)?;
            let o = candle_nn::ops::softmax_last_dim(&att)?
                .matmul(&v)?
                .transpose(1, 2)?
                .reshape((b * p, d))?;
            x = (x + l.out_proj.forward(&o)?)?;
            let h = l.final_layer_norm.forward(&x)?;
            let h = l.fc2.forward(&l.fc1.forward(&h)?.gelu_erf()?)?;
            x = (x + h)?;
        }
        self.layer_norm.forward(&x)?.reshape((b, p, d))
    }

    /// Batched step over streams: each entry is a whole clip (`cache: None`) or the next unit of a
    /// streaming session (its cache advances). Returns `[positions, d_model]` per entry.
    pub fn forward(&self, steps: &mut [EncoderStep<'_>]) -> Result<Vec<Tensor>> {
        let max = self.cfg.max_source_positions;
        let heads = self.cfg.encoder_attention_heads;
        let d = self.cfg.d_model;
        let hd = d / heads;
        // 1. conv front end and positions, per stream; fresh caches where the table would run out
        let mut temp: Vec<KvCache> = Vec::new();
        let mut rows = Vec::with_capacity(steps.len());
        let mut spans = Vec::with_capacity(steps.len());
        let mut start = 0;
        for s in steps.iter_mut() {
            if s.mel.dim(1)? == 0 {
                candle_core::bail!("audio encoder input has no frames");
            }
            let x = self.front(&s.mel)?;
            let n = x.dim(0)?;
            let offset = match s.cache.as_deref_mut() {
                Some(c) => {
                    if c.len() + n >= max {
                        c.reset();
                    }
                    c.len()
                }
                None => {
                    if n > max {
                        candle_core::bail!(
                            "audio clip of {n} encoder positions exceeds {max}; split it first"
                        );
                    }
                    temp.push(self.new_cache());
                    0
                }
            };
            rows.push(x.broadcast_add(&self.positions(offset, n)?)?);
            spans.push((start, n));
            start += n;
        }
        let mut x = if rows.len() == 1 { rows.pop().expect("one") } else { Tensor::cat(&rows, 0)? };
        let mut temp_iter = temp.iter_mut();
        let mut caches: Vec<&mut KvCache> = steps
            .iter_mut()
            .map(|s| match s.cache.as_deref_mut() {
                Some(c) => c,
                None => temp_iter.next().expect("one temporary cache per clip"),
            })
            .collect();
        // 2. pre-LN transformer layers; attention per stream over its history + this unit
        let scale = (hd as f64).powf(-0.5);
        for (li, l) in self.layers.iter().enumerate() {
            let h = l.self_attn_layer_norm.forward(&x)?;
            let q = (l.q_proj.forward(&h)? * scale)?.reshape((start, heads, hd))?;
            let k = l.k_proj.forward(&h)?.reshape((start, heads, hd))?;
            let v = l.v_proj.forward(&h)?.reshape((start, heads, hd))?;
            let mut outs = Vec::with_capacity(spans.len());
            for (cache, &(s, n)) in caches.iter_mut().zip(&spans) {
                let qs = q.narrow(0, s, n)?.transpose(0, 1)?;
                let (ka, va) = cache.append(
                    li,
                    &k.narrow(0, s, n)?.transpose(0, 1)?,
                    &v.narrow(0, s, n)?.transpose(0, 1)?,
                )?;
                outs.push(
                    attend(&qs, &ka, &va, &CausalMask::Open)?.transpose(0, 1)?.reshape((n, d))?,
                );
            }
            let o = if outs.len() == 1 { outs.pop().expect("one") } else { Tensor::cat(&outs, 0)? };
            x = (x + l.out_proj.forward(&o)?)?;
            let h = l.final_layer_norm.forward(&x)?;
            let h = l.fc2.forward(&l.fc1.forward(&h)?.gelu_erf()?)?;
            x = (x + h)?;
        }
        for (cache, &(_, n)) in caches.iter_mut().zip(&spans) {
            cache.advance(n);
        }
        // 3. final layer norm
        let x = self.layer_norm.forward(&x)?;
        spans.iter().map(|&(s, n)| x.narrow(0, s, n)).collect()
    }
}

/// Average pooling over time by `step` (AvgPool1d(step, step): a partial last window is dropped):
/// `[t, c]` -> `[t / step, c]`.
pub fn avg_pool_time(x: &Tensor, step: usize) -> Result<Tensor> {
    let (t, c) = x.dims2()?;
    let n = t / step;
    if n == 0 {
        return Tensor::zeros((0, c), x.dtype(), x.device());
    }
    x.narrow(0, 0, n * step)?.reshape((n, step, c))?.mean(D::Minus2)
}
