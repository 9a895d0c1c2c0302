//! The flow's decoder: conditional flow matching (`decoder.`) whose velocity estimator is a DiT
//! (`decoder.estimator.`).
//!
//! Estimator: `t_embedder.mlp.{0,2}` (sinusoidal timestep × 1000, 256 frequencies), `in_proj`
//! (concat of x, mu, speaker, condition: 4 × 80 channels), `blocks.N` (adaLN-zero modulation
//! `adaLN_modulation.1` into 9 parts; attention `attn.{to_q,to_k,to_v,q_norm,k_norm,proj}`;
//! a causal conv block `conv.block.{1,3,6}` with Mish; MLP `mlp.{fc1,fc2}` with tanh-GELU),
//! `final_layer.{adaLN_modulation.1, linear}`.
//!
//! Streaming caches per Euler step and block: the attention K | V of everything seen so far,
//! newest chunk first (the reference's order; attention itself is order-free), and the two causal
//! convs' 2-frame input tails, time-major (`[N, 2, 2 H]`: conv 1's | conv 2's; the reference
//! holds the same values as `[N, 2 H, 2]`).
//!
//! The block's position-wise work runs as fused ops ([`super::dit_ops`]), its matrix products as
//! plain 2-D products with the biases folded into the op after them.
//!
//! The solver over the estimator (Euler steps with classifier-free guidance) is [`Cfm`] in
//! `cfm.rs`.

pub use super::cfm::{cosine_t_span, Cfm, GraphPolicy};

use candle_core::{Module, Result, Tensor, D};

use candle_nn::{Conv1d, Conv1dConfig, LayerNorm, Linear, VarBuilder};

use super::conformer::{conv1d, linear};
use super::dit_ops;

mod caches;
use caches::BlockSink;
pub use caches::{Att, EstimatorCache, Sink};

/// Hyper-parameters (`flow.decoder.estimator` in `flow.yaml`).
#[derive(Debug, Clone, PartialEq)]
pub struct DitConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub hidden_size: usize,
    pub depth: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub mlp_ratio: f64,
}

impl Default for DitConfig {
    fn default() -> Self {
        Self {
            in_channels: 320,
            out_channels: 80,
            hidden_size: 512,
            depth: 16,
            num_heads: 8,
            head_dim: 64,
            mlp_ratio: 4.0,
        }
    }
}

const FREQ_EMB: usize = 256;

/// `x [.., K] · wᵀ` (`w: [N, K]`) as one 2-D matrix product.
fn mm(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let k = *dims.last().ok_or_else(|| candle_core::Error::Msg("mm of a scalar".into()))?;
    let rows = x.elem_count() / k.max(1);
    let y = x.contiguous()?.reshape((rows, k))?.matmul(&w.t()?)?;
    *dims.last_mut().expect("not empty") = w.dim(0)?;
    y.reshape(dims)
}

fn bias_of(l: &Linear, what: &str) -> Result<Tensor> {
    l.bias().cloned().ok_or_else(|| candle_core::Error::Msg(format!("DiT {what} has a bias")))
}

#[derive(Debug, Clone)]
/// `to_q`, `to_k`, `to_v` fused into one projection (`w_qkv`, its bias apart); the 1/sqrt(d)
/// scale folded into `q_norm`.
struct Attention {
    w_qkv: Tensor,
    b_qkv: Tensor,
    q_norm: LayerNorm,
    k_norm: LayerNorm,
    /// `proj` (its bias goes into the gated residual).
    w_proj: Tensor,
    b_proj: Tensor,
    heads: usize,
    hd: usize,
}

/// The causal conv block (`conv.block.{1,3,6}`: conv k=3, LayerNorm + Mish, conv k=3), run
/// time-major: each conv is one matrix product over rows `[x(t-2), x(t-1), x(t)]` with its weight
/// reordered to `[out, 3 × in]` (tap-major).
#[derive(Debug, Clone)]
struct ConvBlock {
    w1: Tensor,
    b1: Tensor,
    norm: LayerNorm,
    w2: Tensor,
    b2: Tensor,
    channels: usize,
}

impl ConvBlock {
    fn load(vb: VarBuilder, h: usize) -> Result<Self> {
        let nopad = Conv1dConfig::default();
        let tap_major = |c: &Conv1d| -> Result<(Tensor, Tensor)> {
            let w = c.weight().permute((0, 2, 1))?.contiguous()?.reshape((h, 3 * h))?;
            let b = c
                .bias()
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg("DiT convs have biases".into()))?;
            Ok((w, b))
        };
        let (w1, b1) = tap_major(&conv1d(vb.pp(1), h, h, 3, nopad, true)?)?;
        let (w2, b2) = tap_major(&conv1d(vb.pp(6), h, h, 3, nopad, true)?)?;
        Ok(Self { w1, b1, norm: candle_nn::layer_norm(h, 1e-5, vb.pp(3))?, w2, b2, channels: h })
    }

    /// `x: [N, T, C]`, `cache: [N, 2, 2C]` (the last two input frames of conv 1 | of conv 2,
    /// time-major) -> conv 2's output before its bias, `[N, T, C]`; the new cache is written into
    /// `dst` (`[N, 2, 2C]`, contiguous), taken where each row's frames end (`ends`, `[N]` u32, for
    /// chunks of different lengths padded to `T`; `None`: at `T`).
    fn forward(
        &self,
        x: &Tensor,
        cache: Option<&Tensor>,
        dst: &Tensor,
        ends: Option<&Tensor>,
    ) -> Result<Tensor> {
        let c = self.channels;
        // (each conv's two cached frames read where they lie: conv 1's channels, then conv 2's)
        let y = mm(&dit_ops::causal_im2col(x, cache.map(|t| (t, 0)))?, &self.w1)?;
        let y = dit_ops::bias_ln_mish(
            &y,
            &self.b1,
            self.norm.weight(),
            self.norm.bias().expect("layer_norm has a bias"),
            1e-5,
        )?;
        let z = mm(&dit_ops::causal_im2col(&y, cache.map(|t| (t, c)))?, &self.w2)?;
        let t = x.dim(1)?;
        if t >= 2 {
            dit_ops::conv_tails_into(dst, x, &y, ends)?;
        } else if ends.is_some() {
            candle_core::bail!("a padded chunk of {t} frames");
        } else {
            // a chunk shorter than the cache: its frames after the cached ones
            let (t1, t2) = match cache {
                Some(t) => (Some(t.narrow(2, 0, c)?), Some(t.narrow(2, c, c)?)),
                None => (None, None),
            };
            let tail = |x: &Tensor, pre: Option<&Tensor>| -> Result<Tensor> {
                let pre = match pre {
                    Some(p) => p.clone(),
                    None => x.narrow(1, 0, 1)?.zeros_like()?.repeat((1, 2, 1))?,
                };
                Tensor::cat(&[&pre, x], 1)?.narrow(1, t, 2)
            };
            dst.slice_set(
                &Tensor::cat(&[tail(x, t1.as_ref())?, tail(&y, t2.as_ref())?], 2)?.contiguous()?,
                0,
                0,
            )?;
        }
        Ok(z)
    }
}

#[derive(Debug, Clone)]
struct Block {
    attn: Attention,
    /// `mlp.fc1` / `fc2`, biases apart (fused into GELU / the gated residual).
    w_fc1: Tensor,
    b_fc1: Tensor,
    w_fc2: Tensor,
    b_fc2: Tensor,
    conv: ConvBlock,
}

impl Block {
    /// The block and its `adaLN_modulation.1` (kept apart: the estimator runs all blocks'
    /// modulations as one matmul, their input being the same).
    fn load(vb: VarBuilder, cfg: &DitConfig) -> Result<(Self, Linear)> {
        let h = cfg.hidden_size;
        let inner = cfg.num_heads * cfg.head_dim;
        let scale = (cfg.head_dim as f64).powf(-0.5);
        let (q, k, v) = (
            linear(vb.pp("attn").pp("to_q"), h, inner, true)?,
            linear(vb.pp("attn").pp("to_k"), h, inner, true)?,
            linear(vb.pp("attn").pp("to_v"), h, inner, true)?,
        );
        let qn = candle_nn::layer_norm(cfg.head_dim, 1e-5, vb.pp("attn").pp("q_norm"))?;
        let q_norm = LayerNorm::new(
            (qn.weight() * scale)?,
            (qn.bias().expect("layer_norm has a bias") * scale)?,
            qn.eps(),
        );
        let a = vb.pp("attn");
        let mlp = (h as f64 * cfg.mlp_ratio) as usize;
        let (proj, fc1, fc2) = (
            linear(a.pp("proj"), inner, h, true)?,
            linear(vb.pp("mlp").pp("fc1"), h, mlp, true)?,
            linear(vb.pp("mlp").pp("fc2"), mlp, h, true)?,
        );
        let block = Self {
            attn: Attention {
                w_qkv: Tensor::cat(&[q.weight(), k.weight(), v.weight()], 0)?,
                b_qkv: Tensor::cat(
                    &[bias_of(&q, "to_q")?, bias_of(&k, "to_k")?, bias_of(&v, "to_v")?],
                    0,
                )?,
                q_norm,
                k_norm: candle_nn::layer_norm(cfg.head_dim, 1e-5, a.pp("k_norm"))?,
                w_proj: proj.weight().clone(),
                b_proj: bias_of(&proj, "proj")?,
                heads: cfg.num_heads,
                hd: cfg.head_dim,
            },
            w_fc1: fc1.weight().clone(),
            b_fc1: bias_of(&fc1, "fc1")?,
            w_fc2: fc2.weight().clone(),
            b_fc2: bias_of(&fc2, "fc2")?,
            conv: ConvBlock::load(vb.pp("conv").pp("block"), h)?,
        };
        Ok((block, linear(vb.pp("adaLN_modulation").pp(1), h, 9 * h, true)?))
    }

    /// `x: [N, T, H]` and `xm`, its attention input (`x` normed and modulated by this block's
    /// `shift_msa` / `scale_msa`); `m`: this block's modulation, `[1, 9 H]`; `att`: this block's
    /// cached keys and values (a block's share of [`Att`]); the new caches go into `sink` (this
    /// block's share). Returns the block's output and it normed and modulated by `next` (the next
    /// block's `shift_msa` / `scale_msa`, or the final layer's): the last residual and the next
    /// norm in one pass.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: &Tensor,
        xm: &Tensor,
        m: &Tensor,
        next: (&Tensor, &Tensor),
        cnn: Option<&Tensor>,
        att: Att<'_>,
        sink: &BlockSink<'_>,
    ) -> Result<(Tensor, Tensor)> {
        let m = m.chunk(9, D::Minus1)?;
        let gate_msa = &m[2];
        let (shift_mlp, scale_mlp, gate_mlp) = (&m[3], &m[4], &m[5]);
        let (shift_conv, scale_conv, gate_conv) = (&m[6], &m[7], &m[8]);
        // attention
        let o = self.attn_forward(xm, att, sink.att)?;
        // (each residual and the next part's modulated input in one pass)
        let (x, hc) = dit_ops::gate_residual_ln_modulate(
            x,
            &mm(&o, &self.attn.w_proj)?,
            Some(&self.attn.b_proj),
            gate_msa,
            shift_conv,
            scale_conv,
            1e-6,
        )?;
        // conv
        let cv = self.conv.forward(&hc, cnn, sink.cnn, sink.ends)?;
        let (x, hm) = dit_ops::gate_residual_ln_modulate(
            &x,
            &cv,
            Some(&self.conv.b2),
            gate_conv,
            shift_mlp,
            scale_mlp,
            1e-6,
        )?;
        // mlp
        let h = dit_ops::bias_gelu(&mm(&hm, &self.w_fc1)?, &self.b_fc1)?;
        dit_ops::gate_residual_ln_modulate(
            &x,
            &mm(&h, &self.w_fc2)?,
            Some(&self.b_fc2),
            gate_mlp,
            next.0,
            next.1,
            1e-6,
        )
    }

    /// Attention over the chunk's new keys and the cache ([`Att`]): returns the heads' output
    /// `[N, T, h hd]` (before `proj`); for caches held apart the new keys and values (newest
    /// first) go into `dst` (`[N, h, T + L, 2 hd]`), a pool's slots are written in place.
    fn attn_forward(&self, x: &Tensor, cache: Att<'_>, dst: Option<&Tensor>) -> Result<Tensor> {
        let a = &self.attn;
        let norm =
            |l: &LayerNorm| (l.weight().clone(), l.bias().expect("layer_norm has a bias").clone());
        let ((qw, qb), (kw, kb)) = (norm(&a.q_norm), norm(&a.k_norm));
        let heads = dit_ops::qkv_heads(
            &mm(x, &a.w_qkv)?,
            &a.b_qkv,
            (&qw, &qb),
            (&kw, &kb),
            a.heads,
            a.hd,
            a.q_norm.eps(),
        )?;
        let (q, mut k, mut v) = (heads.get(0)?, heads.get(1)?, heads.get(2)?);
        // (contiguous pieces: one plain copy each, and the key matrix transposes for free)
        let mask = match cache {
            Att::Empty => None,
            Att::Joined { k: ck, v: cv, mask } => {
                if ck.dim(2)? > 0 {
                    k = Tensor::cat(&[&k, ck], 2)?;
                    v = Tensor::cat(&[&v, cv], 2)?;
                }
                mask
            }
            Att::Pool { k: pk, v: pv, rows, pos, mask, mode } => {
                // (the new keys into the rows' slots, then attention over the slots)
                crate::fused::kv_rows_store(
                    &pk.unsqueeze(0)?,
                    &pv.unsqueeze(0)?,
                    &k.unsqueeze(0)?,
                    &v.unsqueeze(0)?,
                    rows,
                    pos,
                )?;
                return super::dit_attention::attend_pool(mode, &q, pk, pv, rows, mask);
            }
        };
        let Some(dst) = dst else {
            candle_core::bail!("DiT attention: no buffer for the new keys and values")
        };
        dit_ops::kv_join_into(dst, &k, &v)?;
        super::dit_attention::attend(&q, &k, &v, mask)
    }
}

/// The velocity estimator.
#[derive(Debug, Clone)]
pub struct Dit {
    t_mlp0: Linear,
    t_mlp2: Linear,
    in_proj: Linear,
    blocks: Vec<Block>,
    /// Every block's `adaLN_modulation.1`, stacked: `[depth × 9 H, H]`.
    ada_all: Linear,
    final_ada: Linear,
    final_linear: Linear,
    cfg: DitConfig,
}

impl Dit {
    /// `vb` points at `decoder.estimator`.
    pub fn load(vb: VarBuilder, cfg: &DitConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        if cfg.num_heads * cfg.head_dim != h {
            candle_core::bail!("DiT: num_heads × head_dim must equal hidden_size");
        }
        let t = vb.pp("t_embedder").pp("mlp");
        let (blocks, adas): (Vec<Block>, Vec<Linear>) = (0..cfg.depth)
            .map(|i| Block::load(vb.pp("blocks").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let ada_w: Vec<&Tensor> = adas.iter().map(|l| l.weight()).collect();
        let ada_b: Vec<Tensor> = adas
            .iter()
            .map(|l| {
                l.bias().cloned().ok_or_else(|| candle_core::Error::Msg("adaLN has a bias".into()))
            })
            .collect::<Result<_>>()?;
        let ada_all = Linear::new(Tensor::cat(&ada_w, 0)?, Some(Tensor::cat(&ada_b, 0)?));
        Ok(Self {
            t_mlp0: linear(t.pp(0), FREQ_EMB, h, true)?,
            t_mlp2: linear(t.pp(2), h, h, true)?,
            in_proj: linear(vb.pp("in_proj"), cfg.in_channels, h, true)?,
            blocks,
            ada_all,
            final_ada: linear(vb.pp("final_layer").pp("adaLN_modulation").pp(1), h, 2 * h, true)?,
            final_linear: linear(vb.pp("final_layer").pp("linear"), h, cfg.out_channels, true)?,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &DitConfig {
        &self.cfg
    }

    fn time_embedding(&self, t: f32, dev: &candle_core::Device) -> Result<Tensor> {
        let half = FREQ_EMB / 2;
        let ts = t * 1000.0;
        let mut e = vec![0f32; FREQ_EMB];
        for i in 0..half {
            let f = (-(10000f32.ln()) * i as f32 / half as f32).exp();
            let a = ts * f;
            e[i] = a.cos();
            e[half + i] = a.sin();
        }
        let e = Tensor::from_vec(e, (1, FREQ_EMB), dev)?.to_dtype(self.in_proj.weight().dtype())?;
        self.t_mlp2.forward(&candle_nn::ops::silu(&self.t_mlp0.forward(&e)?)?)
    }

    /// The time conditioning of one flow time `t`: every block's modulation and the final
    /// layer's. It depends on `t` alone, so a solver computes it once per Euler step and schedule.
    pub fn step_condition(&self, t: f32, dev: &candle_core::Device) -> Result<StepCondition> {
        let c = candle_nn::ops::silu(&self.time_embedding(t, dev)?)?;
        Ok(StepCondition { blocks: self.ada_all.forward(&c)?, last: self.final_ada.forward(&c)? })
    }

    /// One estimator evaluation over a chunk. `x`, `mu`, `cond`: `[N, 80, T]`; `spks`: `[N, 80]`;
    /// `t`: the (shared) flow time; caches `[depth, N, …]`. Returns the velocity `[N, 80, T]` and
    /// the new caches.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_chunk(
        &self,
        x: &Tensor,
        mu: &Tensor,
        t: f32,
        spks: &Tensor,
        cond: &Tensor,
        cnn: Option<&Tensor>,
        att: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let sc = self.step_condition(t, x.device())?;
        self.forward_conditioned(x, mu, &sc, spks, cond, cnn, att)
    }

    /// [`Dit::forward_chunk`] with the time conditioning made beforehand.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_conditioned(
        &self,
        x: &Tensor,
        mu: &Tensor,
        sc: &StepCondition,
        spks: &Tensor,
        cond: &Tensor,
        cnn: Option<&Tensor>,
        att: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        self.forward_masked(x, mu, sc, spks, cond, cnn, att, None)
    }

    /// [`Dit::forward_conditioned`] with an additive attention key mask `[N, 1, 1, T + L]` over
    /// `[new; cache]` keys (for caches padded to a common length).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_masked(
        &self,
        x: &Tensor,
        mu: &Tensor,
        sc: &StepCondition,
        spks: &Tensor,
        cond: &Tensor,
        cnn: Option<&Tensor>,
        att: Option<&Tensor>,
        mask: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let hd = self.cfg.head_dim;
        let split = att
            .map(|a| {
                Ok::<_, candle_core::Error>((
                    a.narrow(4, 0, hd)?.contiguous()?,
                    a.narrow(4, hd, hd)?.contiguous()?,
                ))
            })
            .transpose()?;
        let l = split.as_ref().map(|(k, _)| k.dim(3)).transpose()?.unwrap_or(0);
        let att = match &split {
            Some((k, v)) => Att::Joined { k, v, mask },
            None => Att::Empty,
        };
        let (n, _, t) = x.dims3()?;
        let (cnn_out, att_out) = Sink::buffers(&self.cfg, 1, n, t, l, false, x)?;
        let (cnn_out, att_out) = (cnn_out.get(0)?, att_out.expect("caches held apart").get(0)?);
        let out = self.forward_into(
            x,
            mu,
            sc,
            spks,
            cond,
            cnn,
            att,
            &Sink { cnn: &cnn_out, att: Some(&att_out), ends: None },
        )?;
        Ok((out, cnn_out, att_out))
    }

    /// The estimator over attention caches `att` (keys and values with a leading `depth` axis):
    /// returns the velocity; the new conv caches and (unless the cache is a pool's, written in
    /// place) the new keys and values go into `sink`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_into(
        &self,
        x: &Tensor,
        mu: &Tensor,
        sc: &StepCondition,
        spks: &Tensor,
        cond: &Tensor,
        cnn: Option<&Tensor>,
        att: Att<'_>,
        sink: &Sink<'_>,
    ) -> Result<Tensor> {
        let (n, _, tl) = x.dims3()?;
        // the time condition is the same for every row: one row, broadcast where used
        let h9 = 9 * self.cfg.hidden_size;
        let s = spks.unsqueeze(2)?.broadcast_as((n, spks.dim(1)?, tl))?;
        let h = Tensor::cat(&[x, mu, &s, cond], 1)?.transpose(1, 2)?.contiguous()?;
        let mut h = self.in_proj.forward(&h)?;
        // each block's attention input (its `shift_msa`, `scale_msa`: the first two of its nine)
        // comes out of the block before it; the first block's is made here, the final layer's
        // comes out of the last block
        let hs = self.cfg.hidden_size;
        let msa = |i: usize| -> Result<(Tensor, Tensor)> {
            Ok((sc.blocks.narrow(1, i * h9, hs)?, sc.blocks.narrow(1, i * h9 + hs, hs)?))
        };
        let last = sc.last.chunk(2, D::Minus1)?;
        let (shift, scale) = msa(0)?;
        let mut hm = dit_ops::ln_modulate(&h, &shift, &scale, 1e-6)?;
        for (i, b) in self.blocks.iter().enumerate() {
            let cc = cnn.map(|t| t.get(i)).transpose()?;
            let ac = att.block(i)?;
            let (sc_cnn, sc_att) = (sink.cnn.get(i)?, sink.att.map(|a| a.get(i)).transpose()?);
            let next = if i + 1 < self.blocks.len() {
                msa(i + 1)?
            } else {
                (last[0].clone(), last[1].clone())
            };
            (h, hm) = b.forward(
                &h,
                &hm,
                &sc.blocks.narrow(1, i * h9, h9)?,
                (&next.0, &next.1),
                cc.as_ref(),
                ac.as_att(),
                &BlockSink { cnn: &sc_cnn, att: sc_att.as_ref(), ends: sink.ends },
            )?;
        }
        self.final_linear.forward(&hm)?.transpose(1, 2)
    }
}

/// The time conditioning of one Euler step: `blocks` = every block's adaLN modulation
/// `[1, depth × 9 H]`, `last` = the final layer's `[1, 2 H]`.
#[derive(Debug, Clone)]
pub struct StepCondition {
    pub blocks: Tensor,
    pub last: Tensor,
}
