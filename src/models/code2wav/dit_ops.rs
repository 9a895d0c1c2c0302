//! The flow DiT block's fused ops. On CUDA each is one kernel of ours (`kernels/dit.cu`) where the
//! op-by-op path launched two to six, several of them broadcasts or strided copies (the block's
//! cost at B ≥ 8 was those, not its matrix products); elsewhere each is the tensor-op sequence it
//! replaces (the twins below), which defines the result.
//!
//! Row ops work over the last axis of contiguous tensors; per-channel vectors are `[H]` (or any
//! shape of `H` elements).

use candle_core::{Result, Tensor, D};

fn vector(t: &Tensor, h: usize, what: &str) -> Result<Tensor> {
    if t.elem_count() != h {
        candle_core::bail!("{what}: {} elements for {h} channels", t.elem_count());
    }
    t.flatten_all()?.contiguous()
}

#[cfg(feature = "cuda")]
fn on_cuda(x: &Tensor) -> bool {
    x.device().is_cuda()
}

fn layer_norm_plain(x: &Tensor, eps: f64) -> Result<Tensor> {
    let h = x.dim(D::Minus1)?;
    let ones = Tensor::ones(h, x.dtype(), x.device())?;
    candle_nn::ops::layer_norm(&x.contiguous()?, &ones, &ones.zeros_like()?, eps as f32)
}

/// `LN(x) · (1 + scale) + shift` (LN without affine, over the last axis).
pub fn ln_modulate(x: &Tensor, shift: &Tensor, scale: &Tensor, eps: f64) -> Result<Tensor> {
    let h = x.dim(D::Minus1)?;
    let (shift, scale) =
        (vector(shift, h, "ln_modulate shift")?, vector(scale, h, "ln_modulate scale")?);
    #[cfg(feature = "cuda")]
    if on_cuda(x) {
        let rows = (x.elem_count() / h) as u32;
        return cuda::launch(
            "ln_modulate",
            x,
            &[Some(&shift), Some(&scale)],
            &[h as i32],
            &[],
            &[eps as f32],
            (rows, 256),
        );
    }
    layer_norm_plain(x, eps)?.broadcast_mul(&(scale + 1.0)?)?.broadcast_add(&shift)
}

/// `mish(LN(x + bias) · w + b)` over the last axis.
pub fn bias_ln_mish(x: &Tensor, bias: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let h = x.dim(D::Minus1)?;
    let (bias, w, b) = (
        vector(bias, h, "bias_ln_mish bias")?,
        vector(w, h, "bias_ln_mish weight")?,
        vector(b, h, "bias_ln_mish bias")?,
    );
    #[cfg(feature = "cuda")]
    if on_cuda(x) {
        let rows = (x.elem_count() / h) as u32;
        return cuda::launch(
            "bias_ln_mish",
            x,
            &[Some(&bias), Some(&w), Some(&b)],
            &[h as i32],
            &[],
            &[eps as f32],
            (rows, 256),
        );
    }
    let y = candle_nn::ops::layer_norm(&x.broadcast_add(&bias)?.contiguous()?, &w, &b, eps as f32)?;
    super::conformer::mish(&y)
}

/// `x + (a + bias) · gate` (`bias` optional, `gate` per channel).
pub fn gate_residual(
    x: &Tensor,
    a: &Tensor,
    bias: Option<&Tensor>,
    gate: &Tensor,
) -> Result<Tensor> {
    let h = x.dim(D::Minus1)?;
    if a.shape() != x.shape() {
        candle_core::bail!("gate_residual: {:?} and {:?}", x.shape(), a.shape());
    }
    let bias = bias.map(|b| vector(b, h, "gate_residual bias")).transpose()?;
    let gate = vector(gate, h, "gate_residual gate")?;
    #[cfg(feature = "cuda")]
    if on_cuda(x) {
        let total = x.elem_count();
        return cuda::launch(
            "gate_residual",
            x,
            &[Some(&a.contiguous()?), bias.as_ref(), Some(&gate)],
            &[h as i32],
            &[total as u64],
            &[],
            cuda::grid(total),
        );
    }
    let a = match &bias {
        Some(b) => a.broadcast_add(b)?,
        None => a.clone(),
    };
    x + a.broadcast_mul(&gate)?
}

/// [`gate_residual`] and [`ln_modulate`] of its result in one pass (one kernel on CUDA, equal to
/// the two): `(r, LN(r) · (1 + scale) + shift)` with `r = x + (a + bias) · gate`.
#[allow(clippy::too_many_arguments)]
pub fn gate_residual_ln_modulate(
    x: &Tensor,
    a: &Tensor,
    bias: Option<&Tensor>,
    gate: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if on_cuda(x) {
        let h = x.dim(D::Minus1)?;
        if a.shape() != x.shape() {
            candle_core::bail!("gate_residual_ln_modulate: {:?} and {:?}", x.shape(), a.shape());
        }
        let bias = bias.map(|b| vector(b, h, "gate_residual bias")).transpose()?;
        let vs = [(gate, "gate"), (shift, "shift"), (scale, "scale")]
            .map(|(t, what)| vector(t, h, what));
        let [gate, shift, scale] = vs;
        let (gate, shift, scale) = (gate?, shift?, scale?);
        let rows = x.elem_count() / h;
        let mut dims = vec![2];
        dims.extend_from_slice(x.dims());
        let out = cuda::launch_shaped(
            "gate_residual_ln",
            x,
            &[Some(&a.contiguous()?), bias.as_ref(), Some(&gate), Some(&shift), Some(&scale)],
            &[h as i32, rows as i32],
            &[],
            &[eps as f32],
            (rows as u32, 256),
            Some(candle_core::Shape::from(dims)),
        )?;
        return Ok((out.get(0)?, out.get(1)?));
    }
    let r = gate_residual(x, a, bias, gate)?;
    let y = ln_modulate(&r, shift, scale, eps)?;
    Ok((r, y))
}

/// `gelu_tanh(a + bias)`.
pub fn bias_gelu(a: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let h = a.dim(D::Minus1)?;
    let bias = vector(bias, h, "bias_gelu bias")?;
    #[cfg(feature = "cuda")]
    if on_cuda(a) {
        let total = a.elem_count();
        return cuda::launch(
            "bias_gelu",
            a,
            &[Some(&bias)],
            &[h as i32],
            &[total as u64],
            &[],
            cuda::grid(total),
        );
    }
    a.broadcast_add(&bias)?.gelu()
}

/// The rows of a causal kernel-3 convolution in time-major layout: `x: [N, T, C]` -> `[N, T, 3 C]`
/// with row `t` = `[src(t - 2), src(t - 1), src(t)]`, the two frames before `x` from `tail` (zeros
/// when `None`): `(cache, offset)`, channels `offset..offset + C` of a contiguous `[N, 2, W]`
/// cache, read where they lie (the DiT's conv cache holds both convs' tails side by side, and
/// taking one out was a copy kernel per conv).
pub fn causal_im2col(x: &Tensor, tail: Option<(&Tensor, usize)>) -> Result<Tensor> {
    let (n, t, c) = x.dims3()?;
    if let Some((p, off)) = tail {
        let (pn, two, w) = p.dims3()?;
        if pn != n || two != 2 || off + c > w {
            candle_core::bail!(
                "causal_im2col: tail {:?} from channel {off} for x {:?}",
                p.shape(),
                x.shape()
            );
        }
    }
    #[cfg(feature = "cuda")]
    if on_cuda(x) {
        let total = n * t * 3 * c;
        // (the whole cache, contiguous; the kernel reads its frames at their stride)
        let (tail, off, stride) = match tail {
            Some((p, off)) => (Some(p.contiguous()?), off, p.dim(2)?),
            None => (None, 0, c),
        };
        let shape = candle_core::Shape::from((n, t, 3 * c));
        return cuda::launch_shaped(
            "causal_im2col",
            x,
            &[tail.as_ref()],
            &[t as i32, c as i32, off as i32, stride as i32],
            &[total as u64],
            &[],
            cuda::grid(total),
            Some(shape),
        );
    }
    let pre = match tail {
        Some((p, off)) => p.narrow(2, off, c)?,
        None => Tensor::zeros((n, 2, c), x.dtype(), x.device())?,
    };
    let xin = Tensor::cat(&[&pre, x], 1)?;
    Tensor::cat(&[xin.narrow(1, 0, t)?, xin.narrow(1, 1, t)?, xin.narrow(1, 2, t)?], 2)
}

/// The attention's heads from the fused projection `qkv: [N, T, 3 h d]` (q | k | v, each h heads
/// of d) plus `bias` (`[3 h d]`): `[3, N, h, T, d]` with q and k LayerNormed per head (`qw`, `qb`,
/// `kw`, `kb`: `[d]`), v as it is.
#[allow(clippy::too_many_arguments)]
pub fn qkv_heads(
    qkv: &Tensor,
    bias: &Tensor,
    q_norm: (&Tensor, &Tensor),
    k_norm: (&Tensor, &Tensor),
    h: usize,
    d: usize,
    eps: f64,
) -> Result<Tensor> {
    let (n, t, w) = qkv.dims3()?;
    if w != 3 * h * d || d > 128 {
        candle_core::bail!("qkv_heads: {w} columns for 3 x {h} heads of {d} (at most 128)");
    }
    let bias = vector(bias, w, "qkv_heads bias")?;
    let norms = [q_norm.0, q_norm.1, k_norm.0, k_norm.1].map(|t| vector(t, d, "qkv_heads norm"));
    let [qw, qb, kw, kb] = norms;
    let (qw, qb, kw, kb) = (qw?, qb?, kw?, kb?);
    #[cfg(feature = "cuda")]
    if on_cuda(qkv) {
        let warps = n * t * 3 * h;
        let out = cuda::launch(
            "qkv_heads",
            &qkv.contiguous()?,
            &[Some(&bias), Some(&qw), Some(&qb), Some(&kw), Some(&kb)],
            &[n as i32, t as i32, h as i32, d as i32],
            &[],
            &[eps as f32],
            ((warps * 32).div_ceil(128) as u32, 128),
        )?;
        return out.reshape((3, n, h, t, d));
    }
    let x = qkv.broadcast_add(&bias)?.reshape((n, t, 3, h, d))?;
    let part = |i: usize| x.narrow(2, i, 1)?.squeeze(2)?.contiguous();
    let q = candle_nn::ops::layer_norm(&part(0)?, &qw, &qb, eps as f32)?;
    let k = candle_nn::ops::layer_norm(&part(1)?, &kw, &kb, eps as f32)?;
    let v = part(2)?;
    Tensor::stack(
        &[q, k, v].iter().map(|p| p.transpose(1, 2)?.contiguous()).collect::<Result<Vec<_>>>()?,
        0,
    )
}

/// The longest row `masked_softmax` gives a warp on CUDA (`SM_WARP_VALUES` × 32 in kernels/dit.cu:
/// the row in the warp's registers); longer rows take a block each.
pub const MASKED_SOFTMAX_WARP_ROW: usize = 1024;

/// `softmax(att + mask)` over the last axis: `att: [N, h, T, L]`, `mask: [N, 1, 1, L]`.
pub fn masked_softmax(att: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let (n, _h, _t, l) = att.dims4()?;
    if mask.dims() != [n, 1, 1, l] {
        candle_core::bail!("masked_softmax: mask {:?} for scores {:?}", mask.shape(), att.shape());
    }
    #[cfg(feature = "cuda")]
    if on_cuda(att) {
        let mask = mask.to_dtype(att.dtype())?.contiguous()?;
        let rows = _h * _t;
        let att = att.contiguous()?;
        if l <= MASKED_SOFTMAX_WARP_ROW {
            // a warp a row, 8 rows a block of 256 threads
            let all = n * rows;
            let ints = [l as i32, rows as i32, all as i32];
            return cuda::launch(
                "masked_softmax_rows",
                &att,
                &[Some(&mask)],
                &ints,
                &[],
                &[],
                (all.div_ceil(8) as u32, 256),
            );
        }
        return cuda::launch(
            "masked_softmax",
            &att,
            &[Some(&mask)],
            &[l as i32, rows as i32],
            &[],
            &[],
            ((n * rows) as u32, 256),
        );
    }
    candle_nn::ops::softmax_last_dim(&att.broadcast_add(mask)?)
}

/// Writes the last two frames of `x` and of `y` (`[N, T, C]` each, `T >= 2`) into `dst` (`[N, 2,
/// 2 C]`, contiguous: a conv cache, or a view of a solve's conv cache buffer) in place: `dst[n, f]
/// = [x[n, e - 2 + f] | y[n, e - 2 + f]]`, `e` = `T`, or row `n`'s own end `ends[n]` (`[N]` u32,
/// `2 ..= T`) when the rows are chunks of different lengths padded to `T`.
pub fn conv_tails_into(dst: &Tensor, x: &Tensor, y: &Tensor, ends: Option<&Tensor>) -> Result<()> {
    let (n, t, c) = x.dims3()?;
    if t < 2
        || y.dims() != x.dims()
        || dst.dims() != [n, 2, 2 * c]
        || !dst.is_contiguous()
        || dst.dtype() != x.dtype()
    {
        candle_core::bail!(
            "conv_tails_into: x {:?}, y {:?} into {:?}",
            x.shape(),
            y.shape(),
            dst.shape()
        );
    }
    if let Some(e) = ends {
        if e.dims() != [n] || e.dtype() != candle_core::DType::U32 {
            candle_core::bail!(
                "conv_tails_into: ends {:?} ({:?}) for {n} rows",
                e.shape(),
                e.dtype()
            );
        }
    }
    #[cfg(feature = "cuda")]
    if on_cuda(x) {
        let total = n * 2 * 2 * c;
        let (x, y) = (x.contiguous()?, y.contiguous()?);
        return match ends {
            Some(e) => cuda::launch_into(
                "conv_tails_at",
                dst,
                &[&x, &y],
                Some(&e.contiguous()?),
                &[t as i32, c as i32],
                &[total as u64],
                cuda::grid(total),
            ),
            None => cuda::launch_into(
                "conv_tails",
                dst,
                &[&x, &y],
                None,
                &[t as i32, c as i32],
                &[total as u64],
                cuda::grid(total),
            ),
        };
    }
    let Some(ends) = ends else {
        return dst.slice_set(
            &Tensor::cat(&[x.narrow(1, t - 2, 2)?, y.narrow(1, t - 2, 2)?], 2)?.contiguous()?,
            0,
            0,
        );
    };
    let ends = ends.to_device(&candle_core::Device::Cpu)?.to_vec1::<u32>()?;
    let rows = ends
        .iter()
        .enumerate()
        .map(|(r, &e)| {
            let e = e as usize;
            if !(2..=t).contains(&e) {
                candle_core::bail!("conv_tails_into: row {r} ends at {e} of {t} frames");
            }
            Tensor::cat(&[x.get(r)?.narrow(0, e - 2, 2)?, y.get(r)?.narrow(0, e - 2, 2)?], 1)
        })
        .collect::<Result<Vec<_>>>()?;
    dst.slice_set(&Tensor::stack(&rows, 0)?.contiguous()?, 0, 0)
}

/// Writes keys and values (`[N, h, L, d]` each) joined on the last axis into `dst` (`[N, h, L, 2
/// d]`, contiguous: a view of a solve's attention cache buffer) in place.
pub fn kv_join_into(dst: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
    let (n, h, l, d) = k.dims4()?;
    if v.dims() != k.dims()
        || dst.dims() != [n, h, l, 2 * d]
        || !dst.is_contiguous()
        || dst.dtype() != k.dtype()
    {
        candle_core::bail!(
            "kv_join_into: k {:?}, v {:?} into {:?}",
            k.shape(),
            v.shape(),
            dst.shape()
        );
    }
    #[cfg(feature = "cuda")]
    if on_cuda(k) {
        let total = n * h * l * 2 * d;
        return cuda::launch_into(
            "kv_join",
            dst,
            &[&k.contiguous()?, &v.contiguous()?],
            None,
            &[d as i32],
            &[total as u64],
            cuda::grid(total),
        );
    }
    dst.slice_set(&k.contiguous()?, 3, 0)?;
    dst.slice_set(&v.contiguous()?, 3, d)
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
