//! The DiT's attention over a slot pool ([`super::slots`]): a chunk's queries attend over the keys
//! and values its rows hold in the pool. Three ways ([`PoolAttention`],
//! `engine.code2wav.pool_attention`):
//! - gathered (the definition, and the only way off CUDA): every row's planes gathered out of the
//!   pool, the score product, the masked softmax, the value product, the heads' transpose (at B32
//!   those took ~40 % of a DiT block's kernel time, run 49);
//! - in place (CUDA): the same two products as pointer-array batched cuBLAS calls whose operands
//!   are the pool's planes where they lie (no gather) and whose output is the heads side by side
//!   (no transpose), with the masked softmax between;
//! - kernel (CUDA, 16-bit, heads of 64): one flash-style kernel of ours (`pool_attention` in
//!   `kernels/dit.cu`); slower than the gathered path in all three forms measured (runs 50-51).

use candle_core::{Result, Tensor};
use serde::Deserialize;

use super::dit_ops;

/// How a pooled solve's attention runs (see the module's description). Off CUDA, and where a
/// path does not take the operands, the gathered path runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolAttention {
    #[default]
    Gathered,
    InPlace,
    Kernel,
}

/// [`pool_attention_ops`]'s result the way `mode` asks.
pub fn attend_pool(
    mode: PoolAttention,
    q: &Tensor,
    pk: &Tensor,
    pv: &Tensor,
    rows: &Tensor,
    mask: &Tensor,
) -> Result<Tensor> {
    match mode {
        PoolAttention::Gathered => pool_attention_ops(q, pk, pv, rows, mask),
        PoolAttention::InPlace => pool_attention_in_place(q, pk, pv, rows, mask),
        PoolAttention::Kernel => pool_attention(q, pk, pv, rows, mask),
    }
}

/// `softmax(q kᵀ + mask) v` per row and head, over row `n`'s slot row `rows[n]` of the pool: `q:
/// [N, h, T, d]`; `pk`, `pv`: one block's planes, `[R, h, cap, d]` (contiguous); `rows: [N]` u32;
/// `mask: [N, 1, 1, cap]` (0 or -inf). Returns the heads side by side, `[N, T, h d]`.
pub fn pool_attention(
    q: &Tensor,
    pk: &Tensor,
    pv: &Tensor,
    rows: &Tensor,
    mask: &Tensor,
) -> Result<Tensor> {
    let (n, h, _, d) = q.dims4()?;
    let (_, ph, cap, pd) = pk.dims4()?;
    if pv.shape() != pk.shape()
        || ph != h
        || pd != d
        || rows.dims1()? != n
        || mask.dims() != [n, 1, 1, cap]
    {
        candle_core::bail!(
            "pool_attention: q {:?} over pool {:?} with rows {:?}, mask {:?}",
            q.shape(),
            pk.shape(),
            rows.shape(),
            mask.shape()
        );
    }
    #[cfg(feature = "cuda")]
    if kernel_takes(q, pk, pv, rows, cap) {
        let t = q.dim(2)?;
        // SAFETY: left uninitialised because the kernel writes every element: the block of
        // (row, head, 16 queries) writes its head's 64 columns of those queries below T.
        let out = unsafe { Tensor::empty((n, t, h * d), q.dtype(), q.device()) }?;
        let mask = mask.to_dtype(q.dtype())?.contiguous()?;
        let srcs = [&q.contiguous()?, pk, pv, &mask];
        let ints = [h as i32, t as i32, cap as i32];
        dit_ops::cuda::launch_into(
            "pool_attention",
            &out,
            &srcs,
            Some(&rows.contiguous()?),
            &ints,
            &[],
            ((n * h * t.div_ceil(16)) as u32, 128),
        )?;
        return Ok(out);
    }
    pool_attention_ops(q, pk, pv, rows, mask)
}

/// Whether the kernel takes these operands: on CUDA, 16-bit, heads of 64 and a capacity of whole
/// 16-key pieces (its tiles), the pool's planes contiguous at 32-byte offsets (the tensor cores
/// read them where they are), u32 rows.
#[cfg(feature = "cuda")]
fn kernel_takes(q: &Tensor, pk: &Tensor, pv: &Tensor, rows: &Tensor, cap: usize) -> bool {
    use candle_core::DType;
    let aligned = |p: &Tensor| p.is_contiguous() && p.layout().start_offset().is_multiple_of(16);
    q.device().is_cuda()
        && matches!(q.dtype(), DType::BF16 | DType::F16)
        && pk.dtype() == q.dtype()
        && pv.dtype() == q.dtype()
        && q.dim(3).is_ok_and(|d| d == 64)
        && cap.is_multiple_of(16)
        && aligned(pk)
        && aligned(pv)
        && rows.dtype() == DType::U32
}

/// [`pool_attention_ops`] with the pool read in place: on CUDA two pointer-array batched products
/// (one per row and head: the row's key plane times its queries, then the row's value plane times
/// the probabilities, written straight into the heads-side-by-side output) around the masked
/// softmax; elsewhere [`pool_attention_ops`] itself.
pub fn pool_attention_in_place(
    q: &Tensor,
    pk: &Tensor,
    pv: &Tensor,
    rows: &Tensor,
    mask: &Tensor,
) -> Result<Tensor> {
    let (n, h, _, d) = q.dims4()?;
    let (_, ph, cap, pd) = pk.dims4()?;
    if pv.shape() != pk.shape()
        || ph != h
        || pd != d
        || rows.dims1()? != n
        || mask.dims() != [n, 1, 1, cap]
    {
        candle_core::bail!(
            "pool_attention_in_place: q {:?} over pool {:?} with rows {:?}, mask {:?}",
            q.shape(),
            pk.shape(),
            rows.shape(),
            mask.shape()
        );
    }
    #[cfg(feature = "cuda")]
    if q.device().is_cuda()
        && pk.is_contiguous()
        && pv.is_contiguous()
        && pk.dtype() == q.dtype()
        && pv.dtype() == q.dtype()
        && rows.dtype() == candle_core::DType::U32
    {
        return super::dit_attention_in_place::attend(q, pk, pv, rows, mask);
    }
    pool_attention_ops(q, pk, pv, rows, mask)
}

/// The op-by-op twin of [`pool_attention`]: the rows' planes gathered, then [`attend`].
pub fn pool_attention_ops(
    q: &Tensor,
    pk: &Tensor,
    pv: &Tensor,
    rows: &Tensor,
    mask: &Tensor,
) -> Result<Tensor> {
    attend(
        q,
        &crate::fused::rows_gather(pk, rows)?,
        &crate::fused::rows_gather(pv, rows)?,
        Some(mask),
    )
}

/// Attention op by op over keys and values at hand (`q: [N, h, T, d]`, `k`, `v: [N, h, L, d]`,
/// `mask: [N, 1, 1, L]` or none): the scores as a product, the (masked) softmax, the product with
/// the values, the heads side by side (`[N, T, h d]`).
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    let (n, h, t, d) = q.dims4()?;
    let att = q.contiguous()?.matmul(&k.t()?)?;
    let att = match mask {
        Some(m) => dit_ops::masked_softmax(&att, m)?,
        None => candle_nn::ops::softmax_last_dim(&att)?,
    };
    att.matmul(v)?.transpose(1, 2)?.reshape((n, t, h * d))
}
