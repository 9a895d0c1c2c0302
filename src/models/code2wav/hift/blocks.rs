//! The HiFT generators' building blocks: convolutions in their six kinds (plain, causal left or
//! right padded, strided down, nearest up, transposed), the Snake residual blocks, the F0
//! predictor, and the fixed STFT / iSTFT pair.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};

use super::super::conv_cols::{self, Cols};
use super::HiftConfig;
use crate::talker::load_weight_norm;

/// `CausalConv1d`'s padding: `(k·d − d) / 2 · 2 + (k + 1) mod 2`.
pub(super) fn causal_padding(k: usize, d: usize) -> usize {
    (k * d - d) / 2 * 2 + (k + 1) % 2
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum ConvKind {
    /// Symmetric zero padding.
    Plain { padding: usize, stride: usize },
    /// `padding` zeros (or a cache) before the input.
    Left { padding: usize },
    /// `padding` zeros (or the real future frames) after the input.
    Right { padding: usize },
    /// Causal strided downsampling: `stride - 1` zeros before.
    Down { stride: usize },
    /// Nearest upsampling by `scale`, then `k - 1` zeros before.
    Up { scale: usize },
    /// Transposed convolution.
    Transpose { stride: usize, padding: usize },
}

#[derive(Debug, Clone)]
pub(super) struct Conv {
    pub(super) w: Tensor,
    b: Option<Tensor>,
    pub(super) kind: ConvKind,
    pub(super) dilation: usize,
    /// `[O, C k + 1]`: the weight as a matrix with the bias as its last column (not for transposed
    /// convolutions).
    cols: Option<Tensor>,
    /// `cols` in f16, where the f32 vocoder multiplies f16 columns on CUDA
    /// ([`Conv::set_half_columns`]).
    cols_half: Option<Tensor>,
}

impl Conv {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn load(
        vb: VarBuilder,
        i: usize,
        o: usize,
        k: usize,
        kind: ConvKind,
        dilation: usize,
        weight_norm: bool,
        bias: bool,
    ) -> Result<Self> {
        let shape = match kind {
            ConvKind::Transpose { .. } => [i, o, k],
            _ => [o, i, k],
        };
        let w = if weight_norm {
            load_weight_norm(&vb, &shape)?
        } else {
            vb.get(&shape[..], "weight")?
        };
        let b = if bias { Some(vb.get(o, "bias")?) } else { None };
        let cols = match kind {
            ConvKind::Transpose { .. } => None,
            _ => Some(conv_cols::cols_weight(&w, b.as_ref())?),
        };
        Ok(Self { w, b, kind, dilation, cols, cols_half: None })
    }

    /// With `on`, an f32 conv writes its columns in f16 and multiplies them by the weight in f16
    /// into f32 sums ([`conv_cols::half_columns_product`]: one kernel and one cuBLAS product on
    /// CUDA; on the CPU the same rounding through the tensor ops, a check of its effect rather
    /// than a speed-up); off, the columns stay in the input's dtype.
    pub(super) fn set_half_columns(&mut self, on: bool) -> Result<()> {
        self.cols_half = match &self.cols {
            Some(w) if on && w.dtype() == DType::F32 => Some(w.to_dtype(DType::F16)?),
            _ => None,
        };
        Ok(())
    }

    /// On a GPU, the conv with zero padding `(before, after)`, a stride and a nearest upsampling
    /// of its input first, as its columns times the weight with the bias folded in: two kernels,
    /// no padded or upsampled copy, no transposed output, no broadcast bias add (candle's conv1d:
    /// im2col, the product, a transposing copy, then ours).
    fn by_columns(
        &self,
        x: &Tensor,
        pad_l: usize,
        pad_r: usize,
        stride: usize,
        up: usize,
    ) -> Result<Option<Tensor>> {
        self.by_columns_snake(
            x,
            Cols { k: self.kernel(), d: self.dilation, pad_l, pad_r, stride, up },
            None,
        )
    }

    /// [`Conv::by_columns`] of `snake(x, alpha)` when `alpha` is given (the Snake in the columns'
    /// kernel).
    fn by_columns_snake(
        &self,
        x: &Tensor,
        p: Cols,
        alpha: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let Some(w) = &self.cols else { return Ok(None) };
        if let (Some(wh), DType::F32) = (&self.cols_half, x.dtype()) {
            let cols = conv_cols::conv_cols_half(x, p, alpha)?;
            return Ok(Some(conv_cols::half_columns_product(wh, &cols)?));
        }
        // (our kernels exist for f32, bf16 and f16; the F0 predictor runs in f64)
        if !x.device().is_cuda() || !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return Ok(None);
        }
        let cols = conv_cols::conv_cols_snake(x, p, alpha)?;
        Ok(Some(w.broadcast_left(x.dim(0)?)?.matmul(&cols)?))
    }

    /// `forward(snake(x, alpha), None)` for a left-padded conv: on a GPU one columns kernel does
    /// both (the residual blocks' every conv).
    pub(super) fn forward_snake(&self, x: &Tensor, alpha: &Tensor) -> Result<Tensor> {
        if let ConvKind::Left { padding } = self.kind {
            let p = Cols {
                k: self.kernel(),
                d: self.dilation,
                pad_l: padding,
                pad_r: 0,
                stride: 1,
                up: 1,
            };
            if let Some(y) = self.by_columns_snake(x, p, Some(alpha))? {
                return Ok(y);
            }
        }
        self.forward(&snake(x, alpha)?, None)
    }

    pub(super) fn kernel(&self) -> usize {
        self.w.dim(2).unwrap_or(1)
    }

    /// `x: [B, C, T]`; `right`: the frames after `x` for a right-looking conv (zeros if `None`).
    pub(super) fn forward(&self, x: &Tensor, right: Option<&Tensor>) -> Result<Tensor> {
        let (b, c, _) = x.dims3()?;
        let fast = match self.kind {
            ConvKind::Plain { padding, stride } => {
                self.by_columns(x, padding, padding, stride, 1)?
            }
            ConvKind::Left { padding } => self.by_columns(x, padding, 0, 1, 1)?,
            ConvKind::Right { padding } => match right {
                Some(r) => self.by_columns(&Tensor::cat(&[x, r], 2)?, 0, 0, 1, 1)?,
                None => self.by_columns(x, 0, padding, 1, 1)?,
            },
            ConvKind::Down { stride } => self.by_columns(x, stride - 1, 0, stride, 1)?,
            ConvKind::Up { scale } => self.by_columns(x, self.kernel() - 1, 0, 1, scale)?,
            ConvKind::Transpose { .. } => None,
        };
        if let Some(y) = fast {
            return Ok(y);
        }
        let zeros = |n: usize| Tensor::zeros((b, c, n), x.dtype(), x.device());
        let y = match self.kind {
            ConvKind::Plain { padding, stride } => {
                x.conv1d(&self.w, padding, stride, self.dilation, 1)?
            }
            ConvKind::Left { padding } => {
                Tensor::cat(&[&zeros(padding)?, x], 2)?.conv1d(&self.w, 0, 1, self.dilation, 1)?
            }
            ConvKind::Right { padding } => {
                let r = match right {
                    Some(r) => r.clone(),
                    None => zeros(padding)?,
                };
                Tensor::cat(&[x, &r], 2)?.conv1d(&self.w, 0, 1, self.dilation, 1)?
            }
            ConvKind::Down { stride } => {
                Tensor::cat(&[&zeros(stride - 1)?, x], 2)?.conv1d(&self.w, 0, stride, 1, 1)?
            }
            ConvKind::Up { scale } => {
                let t = x.dim(2)?;
                let up =
                    x.unsqueeze(3)?.broadcast_as((b, c, t, scale))?.reshape((b, c, t * scale))?;
                let k = self.kernel();
                Tensor::cat(&[&Tensor::zeros((b, c, k - 1), x.dtype(), x.device())?, &up], 2)?
                    .conv1d(&self.w, 0, 1, 1, 1)?
            }
            ConvKind::Transpose { stride, padding } => {
                x.conv_transpose1d(&self.w, padding, 0, stride, 1, 1)?
            }
        };
        match &self.b {
            Some(bias) => y.broadcast_add(&bias.reshape((1, (), 1))?),
            None => Ok(y),
        }
    }
}

/// Snake: `x + sin²(αx) / (α + 1e-9)` (one kernel on a GPU).
fn snake(x: &Tensor, alpha: &Tensor) -> Result<Tensor> {
    crate::fused::snake(x, alpha)
}

#[derive(Debug, Clone)]
pub(super) struct ResBlock {
    convs1: Vec<Conv>,
    convs2: Vec<Conv>,
    alpha1: Vec<Tensor>,
    alpha2: Vec<Tensor>,
}

impl ResBlock {
    pub(super) fn load(
        vb: VarBuilder,
        ch: usize,
        k: usize,
        dilations: &[usize],
        causal: bool,
    ) -> Result<Self> {
        let mut s = Self { convs1: vec![], convs2: vec![], alpha1: vec![], alpha2: vec![] };
        for (i, &d) in dilations.iter().enumerate() {
            let kind = |d: usize| {
                if causal {
                    ConvKind::Left { padding: causal_padding(k, d) }
                } else {
                    ConvKind::Plain { padding: (k * d - d) / 2, stride: 1 }
                }
            };
            s.convs1.push(Conv::load(vb.pp("convs1").pp(i), ch, ch, k, kind(d), d, true, true)?);
            s.convs2.push(Conv::load(vb.pp("convs2").pp(i), ch, ch, k, kind(1), 1, true, true)?);
            s.alpha1.push(vb.pp("activations1").pp(i).get(ch, "alpha")?);
            s.alpha2.push(vb.pp("activations2").pp(i).get(ch, "alpha")?);
        }
        Ok(s)
    }

    pub(super) fn set_half_columns(&mut self, on: bool) -> Result<()> {
        self.convs1.iter_mut().chain(&mut self.convs2).try_for_each(|c| c.set_half_columns(on))
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for i in 0..self.convs1.len() {
            let t = self.convs1[i].forward_snake(&x, &self.alpha1[i])?;
            let t = self.convs2[i].forward_snake(&t, &self.alpha2[i])?;
            x = (t + x)?;
        }
        Ok(x)
    }

    pub(super) fn history(&self) -> usize {
        let pad = |c: &Conv| match c.kind {
            ConvKind::Left { padding } => padding,
            _ => 0,
        };
        self.convs1.iter().chain(&self.convs2).map(pad).sum()
    }
}

/// The F0 predictor (`f0_predictor.`), run in f64.
#[derive(Debug, Clone)]
pub(super) struct F0Predictor {
    condnet: Vec<Conv>,
    classifier: Linear,
}

impl F0Predictor {
    pub(super) fn load(vb: VarBuilder, cfg: &HiftConfig) -> Result<Self> {
        let vb = vb.set_dtype(DType::F64);
        let c = cfg.f0_channels;
        let mut condnet = Vec::with_capacity(5);
        for i in 0..5 {
            let inp = if i == 0 { cfg.in_channels } else { c };
            let (k, kind) = match (cfg.causal, i) {
                (true, 0) => (4, ConvKind::Right { padding: causal_padding(4, 1) }),
                (true, _) => (3, ConvKind::Left { padding: causal_padding(3, 1) }),
                (false, _) => (3, ConvKind::Plain { padding: 1, stride: 1 }),
            };
            condnet.push(Conv::load(vb.pp("condnet").pp(2 * i), inp, c, k, kind, 1, true, true)?);
        }
        let classifier = Linear::new(
            vb.pp("classifier").get((1, c), "weight")?,
            Some(vb.pp("classifier").get(1, "bias")?),
        );
        Ok(Self { condnet, classifier })
    }

    pub(super) fn right(&self) -> usize {
        match self.condnet[0].kind {
            ConvKind::Right { padding } => padding,
            _ => 0,
        }
    }

    pub(super) fn left(&self) -> usize {
        self.condnet[1..]
            .iter()
            .map(|c| match c.kind {
                ConvKind::Left { padding } => padding,
                _ => 0,
            })
            .sum()
    }

    /// `mel: [B, 80, F]` -> F0 `[B, F']` (f32) where F' = F, or F - right when not finalizing.
    pub(super) fn forward(&self, mel: &Tensor, finalize: bool) -> Result<Tensor> {
        let x = mel.to_dtype(DType::F64)?;
        let r = self.right();
        let mut x = if finalize || r == 0 {
            self.condnet[0].forward(&x, None)?
        } else {
            let f = x.dim(2)?;
            self.condnet[0].forward(&x.narrow(2, 0, f - r)?, Some(&x.narrow(2, f - r, r)?))?
        };
        x = x.elu(1.0)?;
        for c in &self.condnet[1..] {
            x = c.forward(&x, None)?.elu(1.0)?;
        }
        // (contiguous: candle's CPU matmul gets a transposed batch against a broadcast weight
        // wrong)
        let y = self.classifier.forward(&x.transpose(1, 2)?.contiguous()?)?.abs()?; // [B, F', 1]
        y.squeeze(2)?.to_dtype(DType::F32)
    }
}

/// Fixed STFT / iSTFT bases (n_fft 16 with a periodic Hann window): small convolutions that run the
/// same on any device.
#[derive(Debug, Clone)]
pub(super) struct Spectral {
    n_fft: usize,
    hop: usize,
    /// `[n_fft + 2, 1, n_fft]`: windowed cos rows then −sin rows.
    analysis: Tensor,
    /// `[n_fft, n_freq]` each: inverse real DFT basis with the synthesis window.
    inv_cos: Tensor,
    inv_sin: Tensor,
    /// `[n_fft, 1, n_fft]` identity for overlap-add by transposed convolution.
    ola: Tensor,
    window: Vec<f64>,
    /// Tensors that depend only on a length (the STFT's reflection indices, the iSTFT's window
    /// normalisation), made once per length: no host upload after the first (which a CUDA graph
    /// could not replay).
    by_len: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<(bool, usize), Tensor>>>,
}

impl Spectral {
    pub(super) fn new(n_fft: usize, hop: usize, dev: &Device, dtype: DType) -> Result<Self> {
        let nf = n_fft / 2 + 1;
        let w = crate::mel::hann_periodic(n_fft);
        let tau = 2.0 * std::f64::consts::PI;
        let mut a = vec![0f32; 2 * nf * n_fft];
        for k in 0..nf {
            for n in 0..n_fft {
                let ang = tau * (k * n) as f64 / n_fft as f64;
                a[k * n_fft + n] = (w[n] * ang.cos()) as f32;
                a[(nf + k) * n_fft + n] = (-w[n] * ang.sin()) as f32;
            }
        }
        let mut ic = vec![0f32; n_fft * nf];
        let mut is = vec![0f32; n_fft * nf];
        for n in 0..n_fft {
            for k in 0..nf {
                let c = if k == 0 || 2 * k == n_fft { 1.0 } else { 2.0 };
                let ang = tau * (k * n) as f64 / n_fft as f64;
                ic[n * nf + k] = (w[n] * c * ang.cos() / n_fft as f64) as f32;
                is[n * nf + k] = (-w[n] * c * ang.sin() / n_fft as f64) as f32;
            }
        }
        let mut ola = vec![0f32; n_fft * n_fft];
        for i in 0..n_fft {
            ola[i * n_fft + i] = 1.0;
        }
        let t = |v: Vec<f32>, s: &[usize]| Tensor::from_vec(v, s, dev)?.to_dtype(dtype);
        Ok(Self {
            n_fft,
            hop,
            analysis: t(a, &[2 * nf, 1, n_fft])?,
            inv_cos: t(ic, &[n_fft, nf])?,
            inv_sin: t(is, &[n_fft, nf])?,
            ola: t(ola, &[n_fft, 1, n_fft])?,
            window: w,
            by_len: Default::default(),
        })
    }

    /// The memoised tensor of `(kind, len)`, made by `make` the first time.
    fn memo(&self, key: (bool, usize), make: impl FnOnce() -> Result<Tensor>) -> Result<Tensor> {
        let mut m = self.by_len.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = m.get(&key) {
            return Ok(t.clone());
        }
        let t = make()?;
        m.insert(key, t.clone());
        Ok(t)
    }

    /// `torch.stft(center=True, reflect)` as `[B, 2 n_freq, frames]` (real rows, then imaginary).
    pub(super) fn stft(&self, s: &Tensor) -> Result<Tensor> {
        let (b, l) = s.dims2()?;
        let p = self.n_fft / 2;
        let idx = self.memo((false, l), || self.reflect_indices(l, s.device()))?;
        let padded = s.index_select(&idx, 1)?.reshape((b, 1, l + 2 * p))?;
        padded.conv1d(&self.analysis, 0, self.hop, 1, 1)
    }

    /// The sample indices of a reflect-padded signal of `l` samples.
    fn reflect_indices(&self, l: usize, dev: &Device) -> Result<Tensor> {
        let p = self.n_fft / 2;
        let mut idx: Vec<u32> = Vec::with_capacity(l + 2 * p);
        let refl = |i: i64| -> u32 {
            let n = l as i64;
            let mut j = i;
            if j < 0 {
                j = -j;
            }
            if j >= n {
                j = 2 * (n - 1) - j;
            }
            j.clamp(0, n - 1) as u32
        };
        for i in -(p as i64)..(l + p) as i64 {
            idx.push(refl(i));
        }
        Tensor::from_vec(idx, l + 2 * p, dev)
    }

    /// Overlap-add of frames `[B, n_fft, T]` at the hop: `[B, n_fft + hop (T − 1)]`. With the hop
    /// dividing n_fft, as shifted sums of the frames' hop-long pieces; otherwise by transposed
    /// convolution row by row (candle's CPU `conv_transpose1d` gets rows after the first wrong in
    /// a batch).
    fn overlap_add(&self, frames: &Tensor) -> Result<Tensor> {
        let (b, n, t) = frames.dims3()?;
        if n % self.hop != 0 {
            let rows = (0..b)
                .map(|i| frames.narrow(0, i, 1)?.conv_transpose1d(&self.ola, 0, 0, self.hop, 1, 1))
                .collect::<Result<Vec<_>>>()?;
            return Tensor::cat(&rows, 0)?.squeeze(1);
        }
        let pieces = n / self.hop;
        let total = n + self.hop * (t - 1);
        let mut y: Option<Tensor> = None;
        for k in 0..pieces {
            // piece k of frame f lands at (f + k) · hop
            let p = frames
                .narrow(1, k * self.hop, self.hop)?
                .transpose(1, 2)?
                .reshape((b, t * self.hop))?;
            let p = p.pad_with_zeros(1, k * self.hop, total - t * self.hop - k * self.hop)?;
            y = Some(match y {
                Some(acc) => (acc + p)?,
                None => p,
            });
        }
        y.ok_or_else(|| candle_core::Error::Msg("an n_fft of zero".into()))
    }

    /// `torch.istft(center=True)` of `mag · e^{i·phase}`, `[B, n_freq, T]` -> `[B, hop (T −
    /// 1)]`.
    pub(super) fn istft(&self, mag: &Tensor, phase: &Tensor) -> Result<Tensor> {
        let (b, _, t) = mag.dims3()?;
        let mag = mag.clamp(f64::NEG_INFINITY, 1e2)?;
        let re = (&mag * phase.cos()?)?;
        let im = (&mag * phase.sin()?)?;
        // [B, n_fft, T]
        let frames = (self.inv_cos.broadcast_matmul(&re)? + self.inv_sin.broadcast_matmul(&im)?)?;
        let y = self.overlap_add(&frames)?; // [B, n_fft + hop (T-1)]
        let total = self.n_fft + self.hop * (t - 1);
        let p = self.n_fft / 2;
        let out_len = self.hop * (t - 1);
        let inv = self.memo((true, t), || {
            let mut env = vec![0f64; total];
            for f in 0..t {
                for n in 0..self.n_fft {
                    env[f * self.hop + n] += self.window[n] * self.window[n];
                }
            }
            let inv: Vec<f32> = env[p..p + out_len]
                .iter()
                .map(|&e| if e > 1e-11 { (1.0 / e) as f32 } else { 0.0 })
                .collect();
            Tensor::from_vec(inv, (1, out_len), y.device())?.to_dtype(y.dtype())
        })?;
        y.reshape((b, total))?.narrow(1, p, out_len)?.broadcast_mul(&inv)
    }
}

/// Exact rational arithmetic for the history bound.
#[derive(Debug, Clone, Copy)]
pub(super) struct Frac(i128, i128);

impl Frac {
    pub(super) fn new(n: i128, d: i128) -> Self {
        fn gcd(a: i128, b: i128) -> i128 {
            if b == 0 {
                a.abs()
            } else {
                gcd(b, a % b)
            }
        }
        let g = gcd(n, d).max(1);
        Frac(n / g, d / g)
    }
    pub(super) fn add(self, o: Frac) -> Frac {
        Frac::new(self.0 * o.1 + o.0 * self.1, self.1 * o.1)
    }
    pub(super) fn max(self, o: Frac) -> Frac {
        if self.0 * o.1 >= o.0 * self.1 {
            self
        } else {
            o
        }
    }
    pub(super) fn ceil(self) -> i128 {
        (self.0 + self.1 - 1).div_euclid(self.1)
    }
}
