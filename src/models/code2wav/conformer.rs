//! The flow's token encoder: `UpsampleConformerEncoderV2` (`encoder.` in `flow.pt`).
//!
//! `embed.out.{0,1}` (Linear + LayerNorm, then ×√d), `pre_lookahead_layer.{conv1,conv2}` (the
//! chunk's last `pre_lookahead_len` tokens are look-ahead only), `encoders.N` (Conformer blocks
//! with relative-position self-attention: `norm_mha`, `self_attn.{linear_q,k,v,out,pos}`,
//! `pos_bias_{u,v}`, `norm_ff`, `feed_forward.{w_1,w_2}` with swish), `up_layer.conv` (nearest
//! ×2 then a causal conv), `up_embed.out.{0,1}`, `up_encoders.N`, `after_norm`.
//!
//! Streaming only (`forward_chunk` of the reference): every position of a chunk attends to the
//! whole cache and to every position of the chunk.

use candle_core::{Device, Module, Result, Tensor};
use candle_nn::{Conv1d, Conv1dConfig, LayerNorm, Linear, VarBuilder};

/// Hyper-parameters (`flow.encoder` in `flow.yaml`).
#[derive(Debug, Clone, PartialEq)]
pub struct ConformerConfig {
    pub input_size: usize,
    pub output_size: usize,
    pub pre_lookahead_len: usize,
    pub num_blocks: usize,
    pub num_up_blocks: usize,
    pub up_stride: usize,
    pub attention_heads: usize,
    pub linear_units: usize,
    pub key_bias: bool,
}

impl Default for ConformerConfig {
    fn default() -> Self {
        Self {
            input_size: 512,
            output_size: 512,
            pre_lookahead_len: 3,
            num_blocks: 6,
            num_up_blocks: 4,
            up_stride: 2,
            attention_heads: 8,
            linear_units: 2048,
            key_bias: true,
        }
    }
}

pub(crate) fn linear(vb: VarBuilder, i: usize, o: usize, bias: bool) -> Result<Linear> {
    let w = vb.get((o, i), "weight")?;
    let b = if bias { Some(vb.get(o, "bias")?) } else { None };
    Ok(Linear::new(w, b))
}

pub(crate) fn conv1d(
    vb: VarBuilder,
    i: usize,
    o: usize,
    k: usize,
    cfg: Conv1dConfig,
    bias: bool,
) -> Result<Conv1d> {
    let w = vb.get((o, i / cfg.groups, k), "weight")?;
    let b = if bias { Some(vb.get(o, "bias")?) } else { None };
    Ok(Conv1d::new(w, b, cfg))
}

/// `LinearNoSubsampling`: Linear, LayerNorm (eps 1e-5), then ×√d.
#[derive(Debug, Clone)]
struct LinearEmbed {
    linear: Linear,
    norm: LayerNorm,
    xscale: f64,
}

impl LinearEmbed {
    fn load(vb: VarBuilder, i: usize, o: usize) -> Result<Self> {
        Ok(Self {
            linear: linear(vb.pp("out").pp(0), i, o, true)?,
            norm: candle_nn::layer_norm(o, 1e-5, vb.pp("out").pp(1))?,
            xscale: (o as f64).sqrt(),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.norm.forward(&self.linear.forward(x)?)? * self.xscale
    }
}

/// ESPnet relative positional encoding rows for relative positions `size-1 .. -(size-1)`:
/// `[2 size - 1, d]`, sin on even and cos on odd channels.
pub fn rel_positions(size: usize, d: usize, dev: &Device) -> Result<Tensor> {
    let half = d / 2;
    let div: Vec<f32> =
        (0..half).map(|i| ((2 * i) as f32 * -(10000f32.ln() / d as f32)).exp()).collect();
    let rows = 2 * size - 1;
    let mut pe = vec![0f32; rows * d];
    for k in 0..rows {
        let r = size as i64 - 1 - k as i64;
        for (i, dv) in div.iter().enumerate() {
            let a = (r as f32) * dv;
            pe[k * d + 2 * i] = a.sin();
            pe[k * d + 2 * i + 1] = a.cos();
        }
    }
    Tensor::from_vec(pe, (rows, d), dev)
}

#[derive(Debug, Clone)]
struct RelSelfAttention {
    linear_q: Linear,
    linear_k: Linear,
    linear_v: Linear,
    linear_out: Linear,
    linear_pos: Linear,
    pos_bias_u: Tensor,
    pos_bias_v: Tensor,
    heads: usize,
    dk: usize,
}

impl RelSelfAttention {
    fn load(vb: VarBuilder, cfg: &ConformerConfig) -> Result<Self> {
        let (d, h) = (cfg.output_size, cfg.attention_heads);
        Ok(Self {
            linear_q: linear(vb.pp("linear_q"), d, d, true)?,
            linear_k: linear(vb.pp("linear_k"), d, d, cfg.key_bias)?,
            linear_v: linear(vb.pp("linear_v"), d, d, true)?,
            linear_out: linear(vb.pp("linear_out"), d, d, true)?,
            linear_pos: linear(vb.pp("linear_pos"), d, d, false)?,
            pos_bias_u: vb.get((h, d / h), "pos_bias_u")?,
            pos_bias_v: vb.get((h, d / h), "pos_bias_v")?,
            heads: h,
            dk: d / h,
        })
    }

    /// `x: [B, T, d]`, `cache: [B, h, L, 2 dk]` (K | V), `pos: [2 (L+T) - 1, d]`, `shift`: the
    /// relative shift's index `[1, 1, T, L+T]` ([`ConformerEncoder::shift`]).
    fn forward(
        &self,
        x: &Tensor,
        cache: Option<&Tensor>,
        pos: &Tensor,
        shift: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (b, t, d) = x.dims3()?;
        let heads = |y: Tensor| y.reshape((b, t, self.heads, self.dk))?.transpose(1, 2);
        let q = self.linear_q.forward(x)?.reshape((b, t, self.heads, self.dk))?;
        let mut k = heads(self.linear_k.forward(x)?)?;
        let mut v = heads(self.linear_v.forward(x)?)?;
        if let Some(c) = cache {
            if c.dim(2)? > 0 {
                k = Tensor::cat(&[&c.narrow(3, 0, self.dk)?, &k], 2)?;
                v = Tensor::cat(&[&c.narrow(3, self.dk, self.dk)?, &v], 2)?;
            }
        }
        let new_cache = Tensor::cat(&[&k, &v], 3)?;
        let s = k.dim(2)?;
        let p = self
            .linear_pos
            .forward(pos)?
            .reshape((2 * s - 1, self.heads, self.dk))?
            .transpose(0, 1)?; // [h, 2S-1, dk]
        let qu = q.broadcast_add(&self.pos_bias_u)?.transpose(1, 2)?.contiguous()?; // [B, h, T, dk]
        let qv = q.broadcast_add(&self.pos_bias_v)?.transpose(1, 2)?.contiguous()?;
        let ac = qu.matmul(&k.transpose(2, 3)?.contiguous()?)?; // [B, h, T, S]
        let bd = qv.broadcast_matmul(&p.t()?.contiguous()?.unsqueeze(0)?)?; // [B, h, T, 2S-1]
        if shift.dims() != [1, 1, t, s] {
            candle_core::bail!(
                "relative shift index {:?} for {t} queries against {s} keys",
                shift.dims()
            );
        }
        let idx = shift.broadcast_as((b, self.heads, t, s))?.contiguous()?;
        let bd = bd.contiguous()?.gather(&idx, 3)?;
        let scores = ((ac + bd)? / (self.dk as f64).sqrt())?;
        let att = candle_nn::ops::softmax_last_dim(&scores)?;
        let o = att.matmul(&v.contiguous()?)?.transpose(1, 2)?.reshape((b, t, d))?;
        Ok((self.linear_out.forward(&o)?, new_cache))
    }
}

#[derive(Debug, Clone)]
struct ConformerLayer {
    norm_mha: LayerNorm,
    self_attn: RelSelfAttention,
    norm_ff: LayerNorm,
    w_1: Linear,
    w_2: Linear,
}

impl ConformerLayer {
    fn load(vb: VarBuilder, cfg: &ConformerConfig) -> Result<Self> {
        let d = cfg.output_size;
        Ok(Self {
            norm_mha: candle_nn::layer_norm(d, 1e-12, vb.pp("norm_mha"))?,
            self_attn: RelSelfAttention::load(vb.pp("self_attn"), cfg)?,
            norm_ff: candle_nn::layer_norm(d, 1e-12, vb.pp("norm_ff"))?,
            w_1: linear(vb.pp("feed_forward").pp("w_1"), d, cfg.linear_units, true)?,
            w_2: linear(vb.pp("feed_forward").pp("w_2"), cfg.linear_units, d, true)?,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        cache: Option<&Tensor>,
        pos: &Tensor,
        shift: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (a, new_cache) =
            self.self_attn.forward(&self.norm_mha.forward(x)?, cache, pos, shift)?;
        let x = (x + a)?;
        let h = self
            .w_2
            .forward(&candle_nn::ops::silu(&self.w_1.forward(&self.norm_ff.forward(&x)?)?)?)?;
        Ok(((x + h)?, new_cache))
    }
}

/// Streaming caches of the encoder for a batch of `B` streams.
#[derive(Debug, Clone)]
pub struct ConformerCache {
    /// `[B, C, 2 + 2 up_stride]`: the look-ahead layer's conv2 input tail, then the upsampler's.
    pub cnn: Tensor,
    /// Token-rate layers: `[B, h, t1, 2 dk]` each (K | V, oldest first).
    pub att_token: Vec<Tensor>,
    /// Mel-rate (upsampled) layers: `[B, h, t2, 2 dk]` each.
    pub att_mel: Vec<Tensor>,
}

impl ConformerCache {
    /// Token positions held.
    pub fn token_len(&self) -> usize {
        self.att_token.first().and_then(|t| t.dim(2).ok()).unwrap_or(0)
    }

    /// Keeps the first `prompt_frames` mel frames (half as many tokens) and the last `history`
    /// mel frames once the mel-rate cache is longer than both together (the reference's trim).
    pub fn trim(&mut self, prompt_frames: usize, history: usize) -> Result<()> {
        let t1 = self.token_len();
        if 2 * t1 <= prompt_frames + history {
            return Ok(());
        }
        let keep = |t: &Tensor, head: usize, tail: usize| -> Result<Tensor> {
            let n = t.dim(2)?;
            Tensor::cat(&[&t.narrow(2, 0, head)?, &t.narrow(2, n - tail, tail)?], 2)
        };
        for t in self.att_token.iter_mut() {
            *t = keep(t, prompt_frames / 2, history / 2)?;
        }
        for t in self.att_mel.iter_mut() {
            *t = keep(t, prompt_frames, history)?;
        }
        Ok(())
    }

    /// Stacks equal-shaped caches of several streams along the batch dimension.
    pub fn stack(caches: &[&ConformerCache]) -> Result<ConformerCache> {
        let cat = |f: &dyn Fn(&ConformerCache) -> &Tensor| -> Result<Tensor> {
            Tensor::cat(&caches.iter().map(|c| f(c)).collect::<Vec<_>>(), 0)
        };
        let n1 = caches[0].att_token.len();
        let n2 = caches[0].att_mel.len();
        Ok(ConformerCache {
            cnn: cat(&|c| &c.cnn)?,
            att_token: (0..n1).map(|i| cat(&|c| &c.att_token[i])).collect::<Result<_>>()?,
            att_mel: (0..n2).map(|i| cat(&|c| &c.att_mel[i])).collect::<Result<_>>()?,
        })
    }

    /// Row `i` of a batched cache.
    pub fn row(&self, i: usize) -> Result<ConformerCache> {
        Ok(ConformerCache {
            cnn: self.cnn.narrow(0, i, 1)?,
            att_token: self.att_token.iter().map(|t| t.narrow(0, i, 1)).collect::<Result<_>>()?,
            att_mel: self.att_mel.iter().map(|t| t.narrow(0, i, 1)).collect::<Result<_>>()?,
        })
    }
}

#[derive(Debug, Clone)]
pub struct ConformerEncoder {
    embed: LinearEmbed,
    pre_conv1: Conv1d,
    pre_conv2: Conv1d,
    encoders: Vec<ConformerLayer>,
    up_conv: Conv1d,
    up_embed: LinearEmbed,
    up_encoders: Vec<ConformerLayer>,
    after_norm: LayerNorm,
    cfg: ConformerConfig,
    /// [`rel_positions`] for [`POS_TABLE`] positions in the model's dtype, made once: a smaller
    /// size is a slice of it (each row depends only on its relative position).
    pos_table: Tensor,
    /// The relative shift's gather index per (queries, keys), made once each (a few shapes: the
    /// chunk lengths against the cache lengths); a run then moves nothing from the host.
    shifts: Shifts,
}

/// Relative-shift indices by (queries, keys).
type Shifts = std::sync::Arc<std::sync::Mutex<Vec<((usize, usize), Tensor)>>>;

/// Positions the encoder's relative-position table covers (longer runs compute theirs).
const POS_TABLE: usize = 2048;
/// Shift indices kept at most (the oldest goes first).
const SHIFTS: usize = 64;

impl ConformerEncoder {
    /// `vb` points at `encoder`.
    pub fn load(vb: VarBuilder, cfg: &ConformerConfig) -> Result<Self> {
        let c = cfg.output_size;
        if cfg.input_size != c {
            candle_core::bail!(
                "flow encoder: input_size {} must equal output_size {c}",
                cfg.input_size
            );
        }
        let nopad = Conv1dConfig::default();
        let p = vb.pp("pre_lookahead_layer");
        Ok(Self {
            embed: LinearEmbed::load(vb.pp("embed"), cfg.input_size, c)?,
            pre_conv1: conv1d(p.pp("conv1"), c, c, cfg.pre_lookahead_len + 1, nopad, true)?,
            pre_conv2: conv1d(p.pp("conv2"), c, c, 3, nopad, true)?,
            encoders: (0..cfg.num_blocks)
                .map(|i| ConformerLayer::load(vb.pp("encoders").pp(i), cfg))
                .collect::<Result<_>>()?,
            up_conv: conv1d(
                vb.pp("up_layer").pp("conv"),
                c,
                c,
                2 * cfg.up_stride + 1,
                nopad,
                true,
            )?,
            up_embed: LinearEmbed::load(vb.pp("up_embed"), cfg.input_size, c)?,
            up_encoders: (0..cfg.num_up_blocks)
                .map(|i| ConformerLayer::load(vb.pp("up_encoders").pp(i), cfg))
                .collect::<Result<_>>()?,
            after_norm: candle_nn::layer_norm(c, 1e-5, vb.pp("after_norm"))?,
            cfg: cfg.clone(),
            pos_table: rel_positions(POS_TABLE, c, vb.device())?.to_dtype(vb.dtype())?,
            shifts: Default::default(),
        })
    }

    /// Relative-position rows for `size` positions, `[2 size - 1, C]` in `dtype`.
    fn positions(&self, size: usize, dtype: candle_core::DType, dev: &Device) -> Result<Tensor> {
        if size <= POS_TABLE
            && self.pos_table.dtype() == dtype
            && self.pos_table.device().same_device(dev)
        {
            return self.pos_table.narrow(0, POS_TABLE - size, 2 * size - 1);
        }
        rel_positions(size, self.cfg.output_size, dev)?.to_dtype(dtype)
    }

    /// The relative shift's index for `t` queries against `s` keys: query `i` (absolute position
    /// `s - t + i`) against key `j` reads row `j + t - 1 - i`; `[1, 1, t, s]` u32.
    fn shift(&self, t: usize, s: usize, dev: &Device) -> Result<Tensor> {
        let mut shifts = self.shifts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, idx)) =
            shifts.iter().find(|(k, idx)| *k == (t, s) && idx.device().same_device(dev))
        {
            return Ok(idx.clone());
        }
        let idx: Vec<u32> =
            (0..t).flat_map(|i| (0..s).map(move |j| (j + t - 1 - i) as u32)).collect();
        let idx = Tensor::from_vec(idx, (1, 1, t, s), dev)?;
        if shifts.len() >= SHIFTS {
            shifts.remove(0);
        }
        shifts.push(((t, s), idx.clone()));
        Ok(idx)
    }

    pub fn config(&self) -> &ConformerConfig {
        &self.cfg
    }

    /// One chunk of token embeddings `xs: [B, T, input]` -> `[B, up_stride (T - L), C]` (without
    /// the look-ahead `L`; on the last chunk zeros stand in for it and every token is emitted).
    pub fn forward_chunk(
        &self,
        xs: &Tensor,
        last_chunk: bool,
        cache: Option<&ConformerCache>,
    ) -> Result<(Tensor, ConformerCache)> {
        let la = self.cfg.pre_lookahead_len;
        let stride = self.cfg.up_stride;
        let (b, _, _) = xs.dims3()?;
        let c = self.cfg.output_size;
        let dev = xs.device();
        // 1. embedding (+ zero look-ahead on the last chunk)
        let mut x = self.embed.forward(xs)?;
        if last_chunk {
            x = Tensor::cat(&[&x, &Tensor::zeros((b, la, c), x.dtype(), dev)?], 1)?;
        }
        let t = x.dim(1)?;
        if t <= la {
            candle_core::bail!("a chunk needs more than {la} tokens (got {t} with padding)");
        }
        // 2. look-ahead layer: conv1 sees the look-ahead, conv2 is causal with a 2-frame cache
        let xt = x.transpose(1, 2)?.contiguous()?;
        let o = candle_nn::ops::leaky_relu(&self.pre_conv1.forward(&xt)?, 0.01)?; // [B, C, T-la]
        let t1 = t - la;
        let new_cnn1 = if t1 >= 2 {
            o.narrow(2, t1 - 2, 2)?
        } else {
            candle_core::bail!("a chunk needs at least {} tokens", la + 2)
        };
        let cache1 = match cache {
            Some(cc) => cc.cnn.narrow(2, 0, 2)?,
            None => Tensor::zeros((b, c, 2), o.dtype(), dev)?,
        };
        let o = self.pre_conv2.forward(&Tensor::cat(&[&cache1, &o], 2)?)?;
        let mut x = (o.transpose(1, 2)? + x.narrow(1, 0, t1)?)?;
        // 3. token-rate Conformer blocks
        let offset1 = cache.map(|cc| cc.token_len()).unwrap_or(0);
        let pos = self.positions(offset1 + t1, x.dtype(), dev)?;
        let shift = self.shift(t1, offset1 + t1, dev)?;
        let mut att_token = Vec::with_capacity(self.encoders.len());
        for (i, l) in self.encoders.iter().enumerate() {
            let (y, nc) = l.forward(&x, cache.map(|cc| &cc.att_token[i]), &pos, &shift)?;
            x = y;
            att_token.push(nc);
        }
        // 4. upsample: nearest ×stride, causal conv over a 2·stride cache
        let xt = x.transpose(1, 2)?.contiguous()?; // [B, C, T1]
        let up = xt.unsqueeze(3)?.broadcast_as((b, c, t1, stride))?.reshape((b, c, t1 * stride))?;
        let cache2 = match cache {
            Some(cc) => cc.cnn.narrow(2, 2, 2 * stride)?,
            None => Tensor::zeros((b, c, 2 * stride), up.dtype(), dev)?,
        };
        let up = Tensor::cat(&[&cache2, &up], 2)?;
        let n = up.dim(2)?;
        let new_cnn2 = up.narrow(2, n - 2 * stride, 2 * stride)?;
        let x = self.up_conv.forward(&up)?.transpose(1, 2)?; // [B, 2 T1, C]
                                                             // 5. mel-rate Conformer blocks
        let mut x = self.up_embed.forward(&x.contiguous()?)?;
        let t2 = x.dim(1)?;
        let pos = self.positions(offset1 * stride + t2, x.dtype(), dev)?;
        let shift = self.shift(t2, offset1 * stride + t2, dev)?;
        let mut att_mel = Vec::with_capacity(self.up_encoders.len());
        for (i, l) in self.up_encoders.iter().enumerate() {
            let (y, nc) = l.forward(&x, cache.map(|cc| &cc.att_mel[i]), &pos, &shift)?;
            x = y;
            att_mel.push(nc);
        }
        let x = self.after_norm.forward(&x)?;
        let cnn = Tensor::cat(&[&new_cnn1, &new_cnn2], 2)?.contiguous()?;
        Ok((x, ConformerCache { cnn, att_token, att_mel }))
    }
}

/// Mish, for the DiT's convolution blocks.
pub(crate) fn mish(x: &Tensor) -> Result<Tensor> {
    // x * tanh(softplus(x)); softplus = ln(1 + e^x) (for large x the tanh saturates at 1 anyway)
    let sp = (x.exp()? + 1.0)?.log()?;
    x * sp.tanh()?
}
