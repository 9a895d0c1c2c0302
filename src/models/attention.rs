//! Attention primitives shared by every transformer here: rotary position tables and their
//! application, the causal mask, and masked scaled-dot-product attention over whole tensors.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Device, Result, Tensor, D};

/// Whether [`attend`]'s causal softmax runs as one kernel on CUDA.
static CAUSAL_SOFTMAX_KERNEL: AtomicBool = AtomicBool::new(true);

/// Process-wide: on CUDA, [`attend`] with a causal mask runs its softmax as one kernel
/// ([`crate::fused::causal_softmax`]) instead of adding the mask and taking the softmax (a prompt
/// chunk late in a long call spent ~87 % of its step there: docs/performance.md, run 85).
pub fn set_causal_softmax_kernel(on: bool) {
    CAUSAL_SOFTMAX_KERNEL.store(on, Ordering::Relaxed);
}

/// Rotary position tables (`cos`, `sin`: `[max_positions, head_dim / 2]`).
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    pub fn new(
        head_dim: usize,
        theta: f64,
        max_positions: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Self> {
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let inv_freq = Tensor::from_vec(inv_freq, (1, half), dev)?;
        let pos = Tensor::arange(0u32, max_positions as u32, dev)?
            .to_dtype(DType::F32)?
            .reshape((max_positions, 1))?;
        let freqs = pos.broadcast_mul(&inv_freq)?;
        Ok(Self { cos: freqs.cos()?.to_dtype(dtype)?, sin: freqs.sin()?.to_dtype(dtype)? })
    }

    pub fn max_positions(&self) -> usize {
        self.cos.dim(0).unwrap_or(0)
    }

    /// The whole `cos`, `sin` tables (`[max_positions, head_dim / 2]`).
    pub fn full_tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// `cos`, `sin` rows for the given positions, shaped `[n, 1, half]` to broadcast over heads.
    pub fn tables(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let cos = self.cos.index_select(positions, 0)?.unsqueeze(1)?;
        let sin = self.sin.index_select(positions, 0)?.unsqueeze(1)?;
        Ok((cos, sin))
    }

    /// `cos`, `sin` rows for the given positions, shaped `[n, 1, half]` (contiguous), for
    /// [`Rope::apply_fused`].
    pub fn tables_fused(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = positions.dim(0)?;
        let half = self.cos.dim(1)?;
        let cos = self.cos.index_select(positions, 0)?.reshape((n, 1, half))?;
        let sin = self.sin.index_select(positions, 0)?.reshape((n, 1, half))?;
        Ok((cos, sin))
    }

    /// The same rotation as [`Rope::apply`] in one kernel: `x: [n, heads, head_dim]`, each row
    /// with its own position (`cos`, `sin` from [`Rope::tables_fused`]).
    pub fn apply_fused(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (n, h, d) = x.dims3()?;
        candle_nn::rotary_emb::rope(&x.contiguous()?.reshape((n, h, 1, d))?, cos, sin)?
            .reshape((n, h, d))
    }

    /// Rotate-half RoPE of `x: [n, heads, head_dim]`.
    pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let half = x.dim(D::Minus1)? / 2;
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        let a = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
        let b = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
        Tensor::cat(&[a, b], D::Minus1)
    }
}

/// How the `n` new positions of [`attend`] (the last `n` of `L`) see each other.
#[derive(Debug, Clone)]
pub enum CausalMask {
    /// Every position sees the whole history and each other (one new position needs no mask).
    Open,
    /// Causally, taken by the softmax kernel from `n` alone: no mask made, uploaded or added.
    InKernel,
    /// Causally, through the additive mask `[1, 1, n, L]` (0 or -inf) added before the softmax.
    Additive(Tensor),
}

/// The causal mask of `n` new positions at the end of `l`: [`CausalMask::Open`] for one position,
/// [`CausalMask::InKernel`] on CUDA with the kernel on, else the additive mask. The same for every
/// layer: made once per step.
pub fn causal_mask(n: usize, l: usize, dtype: DType, dev: &Device) -> Result<CausalMask> {
    if n <= 1 {
        return Ok(CausalMask::Open);
    }
    if dev.is_cuda() && CAUSAL_SOFTMAX_KERNEL.load(Ordering::Relaxed) {
        return Ok(CausalMask::InKernel);
    }
    Ok(CausalMask::Additive(additive_causal_mask(n, l, dtype, dev)?))
}

/// The additive causal mask of `n` new positions at the end of `l` (`[1, 1, n, l]`).
pub fn additive_causal_mask(n: usize, l: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    let offset = l - n;
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..l).map(move |j| if j > offset + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Tensor::from_vec(mask, (1, 1, n, l), dev)?.to_dtype(dtype)
}

/// Softmax attention of one stream: `q: [heads, n, d]` (already scaled) against `k`, `v:
/// [kv_heads, L, d]`, the new positions being the last `n` of `L`, seeing each other as `mask`
/// says (from [`causal_mask`], or [`CausalMask::Open`]).
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: &CausalMask) -> Result<Tensor> {
    let (hq, n, d) = q.dims3()?;
    let (hkv, l, _) = k.dims3()?;
    let group = hq / hkv;
    // Query heads h = j * group + r share KV head j: group them without copying K and V.
    let qg = q.contiguous()?.reshape((hkv, group * n, d))?;
    // scores in the cache's dtype (as the reference's eager attention); the softmax kernel
    // accumulates in f32 whatever the storage
    let att = qg.matmul(&k.t()?)?;
    let att = match mask {
        CausalMask::InKernel => crate::fused::causal_softmax(&att, n)?,
        CausalMask::Additive(mask) => {
            let att = att.reshape((hkv, group, n, l))?.broadcast_add(mask)?;
            candle_nn::ops::softmax_last_dim(&att.reshape((hkv, group * n, l))?)?
        }
        CausalMask::Open => candle_nn::ops::softmax_last_dim(&att)?,
    };
    att.matmul(v)?.reshape((hq, n, d))
}
