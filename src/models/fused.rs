//! Fused position-wise ops of the decoder step. Each is one kernel of ours on CUDA
//! (`kernels/fused.cu`) where the op-by-op path launches two to six; on the CPU (and as the
//! definition of the result) each is the tensor-op sequence it replaces.
//!
//! - [`add_rmsnorm`]: the residual add and the next RMSNorm.
//! - [`silu_mul`]: SwiGLU's `silu(gate) * up` over the fused gate/up projection.
//! - [`causal_softmax`]: attention's softmax under the causal mask, the mask never made.
//! - [`snake`]: the vocoder's activation (`x + sin²(αx) / (α + 1e-9)`, six ops op by op).
//! - [`qk_norm_rope_store_twin`]: one position's heads after the fused q/k/v projection —
//!   per-head RMSNorm of q and k (Qwen3) and RoPE (the definition of the batched step's kernel,
//!   which also writes K and V into the cache; see `batch_decode`).

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

use super::attention::Rope;

/// An RMSNorm (`weight`, `eps`), as `candle_nn::RmsNorm` computes it.
#[derive(Debug, Clone)]
pub struct Norm {
    pub weight: Tensor,
    pub eps: f64,
}

impl Norm {
    /// `<vb>.weight` of `size`.
    pub fn load(vb: VarBuilder, size: usize, eps: f64) -> Result<Self> {
        Ok(Self { weight: vb.get(size, "weight")?, eps })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps as f32)
    }
}

/// `(x + a, norm(x + a))` for `x`, `a: [n, h]`.
pub fn add_rmsnorm(x: &Tensor, a: &Tensor, norm: &Norm) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && x.rank() == 2
        && x.shape() == a.shape()
        && x.dim(1)? <= cuda::NORM_MAX
    {
        let both = x.contiguous()?.apply_op2_no_bwd(
            &a.contiguous()?,
            &cuda::AddRmsNorm { w: norm.weight.clone(), eps: norm.eps as f32 },
        )?;
        return Ok((both.get(0)?, both.get(1)?));
    }
    let s = (x + a)?;
    let h = norm.forward(&s)?;
    Ok((s, h))
}

/// `silu(gu[:, ..inter]) * gu[:, inter..]` for `gu: [n, 2 inter]`.
pub fn silu_mul(gu: &Tensor, inter: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gu.device().is_cuda() && gu.rank() == 2 && gu.dim(1)? == 2 * inter {
        return gu.contiguous()?.apply_op1_no_bwd(&cuda::SiluMul { inter });
    }
    candle_nn::ops::silu(&gu.narrow(1, 0, inter)?)? * gu.narrow(1, inter, inter)?
}

/// Softmax over the last axis of `att: [.., R, L]` whose `R` rows are groups of `n` queries at the
/// last `n` of `L` positions, each seeing the positions up to its own: the mask of
/// [`additive_causal_mask`](crate::attention::additive_causal_mask) added, then the softmax. One
/// kernel on CUDA (no mask made, read or added); elsewhere [`causal_softmax_twin`].
pub fn causal_softmax(att: &Tensor, n: usize) -> Result<Tensor> {
    rows_and_positions(att, n)?;
    #[cfg(feature = "cuda")]
    if att.device().is_cuda() {
        return att.contiguous()?.apply_op1_no_bwd(&cuda::CausalSoftmax { n });
    }
    causal_softmax_twin(att, n)
}

/// [`causal_softmax`] as the op-by-op path computes it: the causal mask added, then the softmax.
pub fn causal_softmax_twin(att: &Tensor, n: usize) -> Result<Tensor> {
    let (rows, l) = rows_and_positions(att, n)?;
    if n == 1 {
        return candle_nn::ops::softmax_last_dim(att);
    }
    let mask = crate::attention::additive_causal_mask(n, l, att.dtype(), att.device())?;
    let groups = att.elem_count() / (rows * l) * (rows / n);
    let masked = att.reshape((groups, n, l))?.broadcast_add(&mask.squeeze(0)?)?;
    candle_nn::ops::softmax_last_dim(&masked.reshape(att.shape())?)
}

/// `att`'s rows and positions, checked against `n` queries a group.
fn rows_and_positions(att: &Tensor, n: usize) -> Result<(usize, usize)> {
    let dims = att.dims();
    if dims.len() < 2 {
        candle_core::bail!("causal_softmax: scores of rank {}", dims.len());
    }
    let (rows, l) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    if n == 0 || !rows.is_multiple_of(n) || n > l {
        candle_core::bail!("causal_softmax: {rows} rows of {l} positions for {n} queries");
    }
    Ok((rows, l))
}

/// Snake, the vocoder's activation: `x + sin²(αx) / (α + 1e-9)` for `x: [B, C, T]`, `alpha:
/// [C]`.
pub fn snake(x: &Tensor, alpha: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.rank() == 3 && x.dtype() == alpha.dtype() {
        return x.contiguous()?.apply_op2_no_bwd(&alpha.contiguous()?, &cuda::Snake);
    }
    snake_twin(x, alpha)
}

/// The tensor-op definition of [`snake`].
pub fn snake_twin(x: &Tensor, alpha: &Tensor) -> Result<Tensor> {
    let a = alpha.reshape((1, (), 1))?;
    let s = x.broadcast_mul(&a)?.sin()?.sqr()?;
    x + s.broadcast_div(&(a + 1e-9)?)?
}

/// Per-head RMSNorm (when `norm` = (per-head weights `[heads, d]`, `[d]` ones) is given) and
/// rotate-half RoPE of `qk: [n, heads, d]`, `cos`, `sin` from [`Rope::tables_fused`]: the op-by-op
/// q/k path of every step, and the definition of the batched step's q/k kernel.
pub fn qk_norm_rope(
    qk: &Tensor,
    norm: Option<(&Tensor, &Tensor)>,
    eps: f64,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let qk = match norm {
        Some((w, ones)) => {
            candle_nn::ops::rms_norm(&qk.contiguous()?, ones, eps as f32)?.broadcast_mul(w)?
        }
        None => qk.clone(),
    };
    Rope::apply_fused(&qk, cos, sin)
}

/// The heads of one position, `qkv: [hq + 2 hkv, d]` (q heads, k heads, v heads): q and k heads
/// normed per head with the rows of `w` (`[hq + hkv, d]`, when given), both rotated by `rope` at
/// the position in `pos` (`[1]` u32); v heads as they are. The definition of the batched step's
/// `qk_store_batch` kernel for one row (see [`crate::batch_decode`]), which also writes K and V.
pub fn qk_norm_rope_store_twin(
    qkv: &Tensor,
    hq: usize,
    hkv: usize,
    w: Option<&Tensor>,
    eps: f64,
    rope: &Rope,
    pos: &Tensor,
) -> Result<Tensor> {
    let d = qkv.dim(1)?;
    let ones = Tensor::ones(d, qkv.dtype(), qkv.device())?;
    let (cos, sin) = rope.tables_fused(pos)?;
    let qk = qk_norm_rope(
        &qkv.narrow(0, 0, hq + hkv)?.unsqueeze(0)?,
        w.map(|w| (w, &ones)),
        eps,
        &cos,
        &sin,
    )?
    .squeeze(0)?;
    let v = qkv.narrow(0, hq + hkv, hkv)?;
    Tensor::cat(&[qk, v.contiguous()?], 0)
}

/// The flow's slot-pool store: new keys and values `k`, `v: [P, N, h, T, d]` written into the pools
/// `kp`, `vp: [P, R, h, cap, d]` (contiguous; views of a larger pool are fine) at row `rows[n]`
/// (`[N]` u32) and position `pos[n, t]` (`[N, T]` u32), in place. One kernel on CUDA; elsewhere
/// slice copies (one per run of consecutive positions), which define the result.
pub fn kv_rows_store(
    kp: &Tensor,
    vp: &Tensor,
    k: &Tensor,
    v: &Tensor,
    rows: &Tensor,
    pos: &Tensor,
) -> Result<()> {
    let (p, n, h, t, d) = k.dims5()?;
    let (pp, _, ph, _, pd) = kp.dims5()?;
    if v.shape() != k.shape()
        || vp.shape() != kp.shape()
        || pp != p
        || ph != h
        || pd != d
        || rows.dims1()? != n
        || pos.dims2()? != (n, t)
    {
        candle_core::bail!(
            "kv_rows_store: k {:?} into pool {:?} with {:?} rows, {:?} positions",
            k.shape(),
            kp.shape(),
            rows.shape(),
            pos.shape()
        );
    }
    if !kp.is_contiguous() || !vp.is_contiguous() || kp.dtype() != k.dtype() {
        candle_core::bail!("kv_rows_store: the pools must be contiguous and of the keys' dtype");
    }
    #[cfg(feature = "cuda")]
    if kp.device().is_cuda() {
        let op = cuda::KvRowsStore {
            vp: vp.clone(),
            k: k.contiguous()?,
            v: v.contiguous()?,
            rows: rows.contiguous()?,
            pos: pos.contiguous()?,
        };
        return kp.inplace_op1(&op);
    }
    let cpu = candle_core::Device::Cpu;
    let rows = rows.to_device(&cpu)?.to_vec1::<u32>()?;
    let pos = pos.to_device(&cpu)?.to_vec2::<u32>()?;
    for pl in 0..p {
        for (r, (&row, ps)) in rows.iter().zip(&pos).enumerate() {
            let (kd, vd) = (kp.get(pl)?.get(row as usize)?, vp.get(pl)?.get(row as usize)?);
            let (ks, vs) = (k.get(pl)?.get(r)?, v.get(pl)?.get(r)?);
            // runs of frames whose positions step by +1 (copied as they are) or -1 (reversed)
            let mut a = 0;
            while a < t {
                let mut b = a + 1;
                let step = if b < t { ps[b] as i64 - ps[a] as i64 } else { 1 };
                let step = if step == 1 || step == -1 { step } else { 1 };
                while b < t && ps[b] as i64 - ps[b - 1] as i64 == step {
                    b += 1;
                }
                let frames: Vec<u32> = if step == 1 {
                    (a as u32..b as u32).collect()
                } else {
                    (a as u32..b as u32).rev().collect()
                };
                let idx = Tensor::new(frames.as_slice(), k.device())?;
                let at = if step == 1 { ps[a] } else { ps[b - 1] } as usize;
                kd.slice_set(&ks.index_select(&idx, 1)?.contiguous()?, 1, at)?;
                vd.slice_set(&vs.index_select(&idx, 1)?.contiguous()?, 1, at)?;
                a = b;
            }
        }
    }
    Ok(())
}

/// `src.index_select(rows, 0)` for a contiguous `src: [S, …]` and `rows: [N]` u32: on CUDA one
/// kernel copying 16 bytes a thread (candle's index_select moves one element a thread with its
/// index arithmetic: 25 % of the flow's B8 kernel time, gathering the pool's slots), elsewhere
/// (or for rows not of whole 16-byte pieces) index_select itself, which defines the result.
pub fn rows_gather(src: &Tensor, rows: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if src.device().is_cuda()
        && src.is_contiguous()
        && src.rank() >= 1
        && rows.dtype() == candle_core::DType::U32
        && matches!(
            src.dtype(),
            candle_core::DType::F32 | candle_core::DType::BF16 | candle_core::DType::F16
        )
    {
        let row_bytes = src.elem_count() / src.dim(0)?.max(1) * src.dtype().size_in_bytes();
        let start = src.layout().start_offset() * src.dtype().size_in_bytes();
        if row_bytes > 0
            && row_bytes.is_multiple_of(16)
            && start.is_multiple_of(16)
            && rows.dims1()? > 0
        {
            return src.apply_op1_no_bwd(&cuda::RowsGather { rows: rows.contiguous()?, row_bytes });
        }
    }
    src.index_select(rows, 0)
}

/// `$body` with the type `$t` standing for the Rust type of the storage dtype `$dtype` (f32, bf16,
/// f16: the types our kernels exist for); any other dtype is an error naming `$what`.
#[cfg(feature = "cuda")]
macro_rules! by_dtype {
    ($what:expr, $dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => candle_core::bail!("{}: no kernel for {other:?}", $what),
        }
    };
}
#[cfg(feature = "cuda")]
pub(crate) use by_dtype;

/// What the CUDA ops share: our PTX modules and how they see a tensor's memory.
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
