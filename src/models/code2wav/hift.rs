//! Vocoders: 80-bin mel at 50 frames/s -> 24 kHz audio (480 samples per frame).
//!
//! Two generators share one structure (HiFT: neural source filter + iSTFT):
//! - the causal HiFT that minicpmo-utils 1.0.7 streams (`hift.pt` + `config.yaml`): causal convs, a
//!   right-looking first conv (`conv_pre`, 4 frames) and F0 predictor (3 frames), streamed by
//!   [`HiftGenerator::stream`] with bounded history (the reference's `BoundedVocoder`): F0 in f64,
//!   a continuous f64 excitation phase, a fixed noise table, 16-frame internal blocks;
//! - the original whole-utterance HiFT (`hift.pt` in the older layout, or `hift_original.pt`):
//!   symmetric convs, transposed-conv upsampling, random source phase and noise.
//!
//! Checkpoint names: `conv_pre`, `ups.N`, `source_downs.N`, `source_resblocks.N`, `resblocks.N`
//! (`convs1.K`, `convs2.K`, `activations{1,2}.K.alpha`), `conv_post`, `m_source.l_linear`,
//! `f0_predictor.condnet.{0,2,4,6,8}`, `f0_predictor.classifier`; weight-normed convs in any of the
//! three spellings; an optional `generator.` prefix.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};

mod blocks;
mod original;
mod streaming;
use blocks::{causal_padding, Conv, ConvKind, F0Predictor, Frac, ResBlock, Spectral};
pub use original::OriginalStreamState;
pub use streaming::{HiftState, StreamLimits};

/// Generator hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct HiftConfig {
    pub in_channels: usize,
    pub base_channels: usize,
    pub nb_harmonics: usize,
    pub sampling_rate: usize,
    pub nsf_alpha: f64,
    pub nsf_sigma: f64,
    pub nsf_voiced_threshold: f64,
    pub upsample_rates: Vec<usize>,
    pub upsample_kernel_sizes: Vec<usize>,
    pub istft_n_fft: usize,
    pub istft_hop: usize,
    pub resblock_kernel_sizes: Vec<usize>,
    pub resblock_dilation_sizes: Vec<Vec<usize>>,
    pub source_resblock_kernel_sizes: Vec<usize>,
    pub source_resblock_dilation_sizes: Vec<Vec<usize>>,
    pub lrelu_slope: f64,
    pub audio_limit: f64,
    /// Right context of the causal `conv_pre` (0 for the original generator).
    pub conv_pre_look_right: usize,
    /// Width of the F0 predictor.
    pub f0_channels: usize,
    pub causal: bool,
}

impl HiftConfig {
    /// The CosyVoice2 24 kHz HiFT (the original generator's defaults).
    pub fn original() -> Self {
        Self {
            in_channels: 80,
            base_channels: 512,
            nb_harmonics: 8,
            sampling_rate: 24000,
            nsf_alpha: 0.1,
            nsf_sigma: 0.003,
            nsf_voiced_threshold: 10.0,
            upsample_rates: vec![8, 5, 3],
            upsample_kernel_sizes: vec![16, 11, 7],
            istft_n_fft: 16,
            istft_hop: 4,
            resblock_kernel_sizes: vec![3, 7, 11],
            resblock_dilation_sizes: vec![vec![1, 3, 5]; 3],
            source_resblock_kernel_sizes: vec![7, 7, 11],
            source_resblock_dilation_sizes: vec![vec![1, 3, 5]; 3],
            lrelu_slope: 0.1,
            audio_limit: 0.99,
            conv_pre_look_right: 0,
            f0_channels: 512,
            causal: false,
        }
    }

    /// The causal generator with CosyVoice3's values (4-frame `conv_pre` look-right).
    pub fn causal() -> Self {
        Self { conv_pre_look_right: 4, causal: true, ..Self::original() }
    }

    /// Audio samples per mel frame.
    pub fn hop(&self) -> usize {
        self.upsample_rates.iter().product::<usize>() * self.istft_hop
    }
}

#[derive(Debug, Clone)]
pub struct HiftGenerator {
    conv_pre: Conv,
    ups: Vec<Conv>,
    source_downs: Vec<Conv>,
    source_resblocks: Vec<ResBlock>,
    resblocks: Vec<ResBlock>,
    conv_post: Conv,
    f0_predictor: F0Predictor,
    l_linear: Linear,
    spectral: Spectral,
    /// Rows of the causal source's fixed noise table `[samples, harmonics + 1]`.
    noise_rows: usize,
    /// `m_source.l_linear` on the host (weights per harmonic, bias), and each noise-table row
    /// through its weights: the causal source merges its harmonics on the host (streaming.rs).
    merge_w: Vec<f32>,
    merge_b: f32,
    noise_merged: Vec<f32>,
    cfg: HiftConfig,
    limits: Option<StreamLimits>,
    /// The streaming F0 predictor and decoder, replayed as CUDA graphs per shape (when on).
    graphs: crate::cuda_graph::GraphSlot,
}

impl HiftGenerator {
    /// Streaming F0 and decode steps replayed as CUDA graphs per shape, at most `max` held
    /// (`None`: op by op, the default). Without capture (CPU) the fixed-buffer path runs op by op.
    pub fn set_graphs(&mut self, max: Option<usize>) {
        self.graphs = match max {
            Some(m) => crate::cuda_graph::GraphSlot::on(m),
            None => crate::cuda_graph::GraphSlot::off(),
        };
    }

    /// The f32 generator's main path (`conv_pre`, the upsampling convs and the residual blocks)
    /// multiplies f16 columns by f16 weights into f32 sums
    /// (`engine.code2wav.vocoder_half_columns`); off, its columns stay f32. The source's path
    /// (`source_downs`, `source_resblocks`) and `conv_post` (the log-magnitudes and phases) stay
    /// f32 either way: in f16 they carried most of the error (on the parity fixtures, 3.8e-3 of the
    /// peak and 1.18 dB of log-spectral distance with them, 7.0e-4 and 0.14 dB without). Set before
    /// the graphs' warm-up captures.
    pub fn set_half_columns(&mut self, on: bool) -> Result<()> {
        self.conv_pre.set_half_columns(on)?;
        self.conv_post.set_half_columns(false)?;
        self.ups.iter_mut().try_for_each(|c| c.set_half_columns(on))?;
        self.source_downs.iter_mut().try_for_each(|c| c.set_half_columns(false))?;
        self.resblocks.iter_mut().try_for_each(|r| r.set_half_columns(on))?;
        self.source_resblocks.iter_mut().try_for_each(|r| r.set_half_columns(false))
    }

    /// Graphs (or fixed-buffer shapes) held now.
    pub fn graphs_held(&self) -> usize {
        self.graphs.held()
    }
    /// `vb` over the generator's state dict (without any `generator.` prefix); `noise_table`:
    /// `[rows, harmonics + 1]` uniform [0, 1) values for the causal source (ignored by the original
    /// generator).
    pub fn load(vb: VarBuilder, cfg: &HiftConfig, noise_table: Option<&Tensor>) -> Result<Self> {
        let base = cfg.base_channels;
        let n = cfg.upsample_rates.len();
        let nfft2 = cfg.istft_n_fft + 2;
        let conv_pre = if cfg.causal {
            let k = cfg.conv_pre_look_right + 1;
            Conv::load(
                vb.pp("conv_pre"),
                cfg.in_channels,
                base,
                k,
                ConvKind::Right { padding: causal_padding(k, 1) },
                1,
                true,
                true,
            )?
        } else {
            Conv::load(
                vb.pp("conv_pre"),
                cfg.in_channels,
                base,
                7,
                ConvKind::Plain { padding: 3, stride: 1 },
                1,
                true,
                true,
            )?
        };
        let mut ups = Vec::with_capacity(n);
        for (i, (&u, &k)) in cfg.upsample_rates.iter().zip(&cfg.upsample_kernel_sizes).enumerate() {
            let (ci, co) = (base >> i, base >> (i + 1));
            let kind = if cfg.causal {
                ConvKind::Up { scale: u }
            } else {
                ConvKind::Transpose { stride: u, padding: (k - u) / 2 }
            };
            ups.push(Conv::load(vb.pp("ups").pp(i), ci, co, k, kind, 1, true, true)?);
        }
        // downsampling of the source spectrum to each stage's rate
        let mut down_rates: Vec<usize> = vec![1];
        down_rates.extend(cfg.upsample_rates.iter().rev().take(n - 1));
        let mut cum: Vec<usize> = down_rates
            .iter()
            .scan(1usize, |acc, &r| {
                *acc *= r;
                Some(*acc)
            })
            .collect();
        cum.reverse();
        let mut source_downs = Vec::with_capacity(n);
        let mut source_resblocks = Vec::with_capacity(n);
        for (i, &u) in cum.iter().enumerate() {
            let co = base >> (i + 1);
            let (k, kind) = match (u, cfg.causal) {
                (1, true) => (1, ConvKind::Left { padding: 0 }),
                (1, false) => (1, ConvKind::Plain { padding: 0, stride: 1 }),
                (u, true) => (2 * u, ConvKind::Down { stride: u }),
                (u, false) => (2 * u, ConvKind::Plain { padding: u / 2, stride: u }),
            };
            source_downs.push(Conv::load(
                vb.pp("source_downs").pp(i),
                nfft2,
                co,
                k,
                kind,
                1,
                false,
                true,
            )?);
            source_resblocks.push(ResBlock::load(
                vb.pp("source_resblocks").pp(i),
                co,
                cfg.source_resblock_kernel_sizes[i],
                &cfg.source_resblock_dilation_sizes[i],
                cfg.causal,
            )?);
        }
        let mut resblocks = Vec::new();
        for i in 0..n {
            let ch = base >> (i + 1);
            for (j, (&k, d)) in
                cfg.resblock_kernel_sizes.iter().zip(&cfg.resblock_dilation_sizes).enumerate()
            {
                let idx = i * cfg.resblock_kernel_sizes.len() + j;
                resblocks.push(ResBlock::load(vb.pp("resblocks").pp(idx), ch, k, d, cfg.causal)?);
            }
        }
        let ch = base >> n;
        let post_kind = if cfg.causal {
            ConvKind::Left { padding: causal_padding(7, 1) }
        } else {
            ConvKind::Plain { padding: 3, stride: 1 }
        };
        let conv_post = Conv::load(vb.pp("conv_post"), ch, nfft2, 7, post_kind, 1, true, true)?;
        let f0_predictor = F0Predictor::load(vb.pp("f0_predictor"), cfg)?;
        let h1 = cfg.nb_harmonics + 1;
        if h1 > 16 {
            candle_core::bail!("at most 15 harmonics are supported");
        }
        let l = vb.pp("m_source").pp("l_linear");
        let l_linear = Linear::new(l.get((1, h1), "weight")?, Some(l.get(1, "bias")?));
        let spectral = Spectral::new(cfg.istft_n_fft, cfg.istft_hop, vb.device(), vb.dtype())?;
        let (noise_table, noise_rows) = match (cfg.causal, noise_table) {
            (true, Some(t)) => {
                let (r, c) = t.dims2()?;
                if c != h1 || r == 0 {
                    candle_core::bail!("vocoder noise table must be [rows, {h1}], got [{r}, {c}]");
                }
                (t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, r)
            }
            (true, None) => candle_core::bail!("the causal vocoder needs its noise table"),
            (false, _) => (vec![], 0),
        };
        // the merge's weights on the host, and the noise table through them (in f64)
        let merge_w = l_linear.weight().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let merge_b = l_linear
            .bias()
            .map(|b| b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>())
            .transpose()?
            .map_or(0.0, |b| b[0]);
        let noise_merged: Vec<f32> = noise_table
            .chunks(h1)
            .map(|row| {
                row.iter().zip(&merge_w).map(|(&x, &w)| x as f64 * w as f64).sum::<f64>() as f32
            })
            .collect();
        let mut g = Self {
            conv_pre,
            ups,
            source_downs,
            source_resblocks,
            resblocks,
            conv_post,
            f0_predictor,
            l_linear,
            spectral,
            noise_rows,
            merge_w,
            merge_b,
            noise_merged,
            cfg: cfg.clone(),
            limits: None,
            graphs: crate::cuda_graph::GraphSlot::off(),
        };
        if cfg.causal {
            g.limits = Some(g.compute_limits());
        }
        Ok(g)
    }

    pub fn config(&self) -> &HiftConfig {
        &self.cfg
    }

    /// Streaming limits (causal generator only).
    pub fn limits(&self) -> Option<StreamLimits> {
        self.limits
    }

    fn compute_limits(&self) -> StreamLimits {
        let cfg = &self.cfg;
        let rate = cfg.upsample_rates.iter().product::<usize>() as i128;
        let hop = rate * cfg.istft_hop as i128;
        let transform = Frac::new(cfg.istft_n_fft as i128, hop);
        let nk = cfg.resblock_kernel_sizes.len();
        let mut history = Frac::new(0, 1);
        let mut scale: i128 = 1;
        for (stage, up) in self.ups.iter().enumerate() {
            scale *= cfg.upsample_rates[stage] as i128;
            history = history.add(Frac::new(up.kernel() as i128 - 1, scale));
            let down = &self.source_downs[stage];
            let source_history = transform
                .add(Frac::new((down.kernel() as i128 - 1) * down.dilation as i128, rate))
                .add(Frac::new(self.source_resblocks[stage].history() as i128, scale));
            let res = self.resblocks[stage * nk..(stage + 1) * nk]
                .iter()
                .map(|r| r.history())
                .max()
                .unwrap_or(0);
            history = history.max(source_history).add(Frac::new(res as i128, scale));
        }
        let post = match self.conv_post.kind {
            ConvKind::Left { padding } => padding,
            _ => 0,
        };
        history = history.add(Frac::new(post as i128 + 1, rate)).add(transform);
        StreamLimits {
            f0_left: self.f0_predictor.left(),
            f0_right: self.f0_predictor.right(),
            history: (history.ceil() + 2) as usize,
            decoder_right: cfg.conv_pre_look_right + 1,
            block_frames: 16,
        }
    }

    /// F0 of `mel: [1, 80, F]` as `[F']` (f32 out, computed in f64).
    pub fn f0(&self, mel: &Tensor, finalize: bool) -> Result<Tensor> {
        self.f0_predictor.forward(mel, finalize)?.squeeze(0)
    }

    /// Mel + excitation -> audio. `x: [1, 80, F]`, `s: [1, 1, F · hop]`. The causal generator
    /// without `finalize` treats the last `conv_pre_look_right` frames as right context only and
    /// holds back one more frame.
    pub fn decode(&self, x: &Tensor, s: &Tensor, finalize: bool) -> Result<Tensor> {
        let cfg = &self.cfg;
        let mut st = self.spectral.stft(&s.squeeze(1)?)?;
        let lr = cfg.conv_pre_look_right;
        let mut x = if cfg.causal && !finalize {
            let f = x.dim(2)?;
            let rate = cfg.upsample_rates.iter().product::<usize>();
            let frames = st.dim(2)?;
            st = st.narrow(2, 0, frames - rate * lr)?;
            self.conv_pre.forward(&x.narrow(2, 0, f - lr)?, Some(&x.narrow(2, f - lr, lr)?))?
        } else {
            self.conv_pre.forward(x, None)?
        };
        let nk = cfg.resblock_kernel_sizes.len();
        let n = self.ups.len();
        // the causal generator's last stage runs on a multiple of 4 frames, zeros after its
        // 120 F + 1 (nothing there reaches the frames before: every conv of that stage looks
        // left only), so its products' rows are 16-byte aligned: with 120 F + 1 columns cuBLAS ran
        // them all with `align1` kernels (20 % of the vocoder's B8 time, H200 run 20)
        let mut frames = None;
        for i in 0..n {
            x = candle_nn::ops::leaky_relu(&x, cfg.lrelu_slope)?;
            x = self.ups[i].forward(&x, None)?;
            let mut pad = 0;
            if i == n - 1 {
                // ReflectionPad1d((1, 0))
                x = Tensor::cat(&[&x.narrow(2, 1, 1)?, &x], 2)?;
                if cfg.causal {
                    let l = x.dim(2)?;
                    pad = l.next_multiple_of(4) - l;
                    frames = Some(l);
                    x = x.pad_with_zeros(2, 0, pad)?;
                }
            }
            let si = self.source_resblocks[i]
                .forward(&self.source_downs[i].forward(&st, None)?.pad_with_zeros(2, 0, pad)?)?;
            x = (x + si)?;
            let mut xs = self.resblocks[i * nk].forward(&x)?;
            for j in 1..nk {
                xs = (xs + self.resblocks[i * nk + j].forward(&x)?)?;
            }
            x = (xs / nk as f64)?;
        }
        x = candle_nn::ops::leaky_relu(&x, 0.01)?;
        x = self.conv_post.forward(&x, None)?;
        if let Some(l) = frames {
            x = x.narrow(2, 0, l)?;
        }
        let nf = cfg.istft_n_fft / 2 + 1;
        let mag = x.narrow(1, 0, nf)?.exp()?;
        let phase = x.narrow(1, nf, nf)?.sin()?;
        let mut y = self.spectral.istft(&mag, &phase)?;
        if cfg.causal && !finalize {
            let l = y.dim(1)?;
            y = y.narrow(1, 0, l - cfg.hop())?;
        }
        y.clamp(-cfg.audio_limit, cfg.audio_limit)
    }

    /// (hop, harmonics + 1, sample rate, sine amplitude, voicing threshold) of the source.
    fn source_params(&self) -> (usize, usize, f32, f32, f32) {
        let cfg = &self.cfg;
        (
            cfg.hop(),
            cfg.nb_harmonics + 1,
            cfg.sampling_rate as f32,
            cfg.nsf_alpha as f32,
            cfg.nsf_voiced_threshold as f32,
        )
    }

    /// Merges per-sample harmonic excitation `[samples × (harmonics + 1)]` into the source signal
    /// `[1, 1, samples]` (`m_source.l_linear`, tanh).
    fn merge_harmonics(&self, exc: Vec<f32>, samples: usize, h1: usize) -> Result<Tensor> {
        let dev = self.conv_pre.w.device();
        let exc = Tensor::from_vec(exc, (1, samples, h1), dev)?
            .to_dtype(self.l_linear.weight().dtype())?;
        self.l_linear.forward(&exc)?.tanh()?.transpose(1, 2)
    }

    // ---------------------------------------------------------------- original generator

    /// The original generator's source for a whole utterance: harmonics of the F0 upsampled to the
    /// sample rate, phase integrated per frame; `rng` draws the initial phases and the noise
    /// (`None` = no randomness, for comparisons).
    pub fn source_original(&self, f0: &[f32], rng: Option<u64>) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (hop, h1, sr, amp, thr) = self.source_params();
        let n = f0.len();
        // per-frame phase increments (the linear downsampling picks each frame's value), cumulated
        let mut phase = vec![0f32; n * h1];
        let mut acc = vec![0f32; h1];
        for t in 0..n {
            for h in 0..h1 {
                let rad = (f0[t] * (h + 1) as f32 / sr).rem_euclid(1.0);
                acc[h] += rad;
                phase[t * h1 + h] = acc[h] * 2.0 * std::f32::consts::PI * hop as f32;
            }
        }
        let mut rng = rng.map(rand_chacha::ChaCha8Rng::seed_from_u64);
        let mut ini = vec![0f32; h1];
        if let Some(r) = rng.as_mut() {
            for v in ini.iter_mut().skip(1) {
                *v = rand::Rng::random::<f32>(r) * 2.0 * std::f32::consts::PI;
            }
        }
        let total = n * hop;
        let mut exc = vec![0f32; total * h1];
        for j in 0..total {
            // linear upsampling (align_corners = false)
            let src = ((j as f32 + 0.5) / hop as f32 - 0.5).max(0.0);
            let i0 = (src.floor() as usize).min(n - 1);
            let i1 = (i0 + 1).min(n - 1);
            let l1 = src - i0 as f32;
            let l0 = 1.0 - l1;
            let t = j / hop;
            let voiced = if f0[t] > thr { 1.0 } else { 0.0 };
            let na = voiced * cfg.nsf_sigma as f32 + (1.0 - voiced) * amp / 3.0;
            for h in 0..h1 {
                let p = l0 * phase[i0 * h1 + h] + l1 * phase[i1 * h1 + h] + ini[h];
                let noise: f32 = match rng.as_mut() {
                    Some(r) => StandardNormal.sample(r),
                    None => 0.0,
                };
                exc[j * h1 + h] = p.sin() * amp * voiced + na * noise;
            }
        }
        self.merge_harmonics(exc, total, h1)
    }
}

/// A deterministic noise table `[rows, cols]` of uniform [0, 1) values (the causal source's).
pub fn noise_table(rows: usize, cols: usize, seed: u64, dev: &Device) -> Result<Tensor> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let v: Vec<f32> = (0..rows * cols).map(|_| rand::Rng::random::<f32>(&mut rng)).collect();
    Tensor::from_vec(v, (rows, cols), dev)
}
