//! The operators of the ONNX evaluator ([`super::eval`]) with more than a line of arithmetic:
//! convolution, pooling, layer norm, and the QDQ quantization pair.

use anyhow::{anyhow, bail, Result};
use candle_core::{Tensor, D};

use crate::onnx::NodeProto;

pub(super) fn conv(n: &NodeProto, x: Tensor, w: Tensor, b: Option<Tensor>) -> Result<Tensor> {
    let spatial = w.rank() - 2;
    let strides = n.attr_ints("strides").map(|v| v.to_vec()).unwrap_or(vec![1; spatial]);
    let dil = n.attr_ints("dilations").map(|v| v.to_vec()).unwrap_or(vec![1; spatial]);
    let pads = n.attr_ints("pads").map(|v| v.to_vec()).unwrap_or(vec![0; 2 * spatial]);
    let group = n.attr_i("group", 1) as usize;
    let mut x = x;
    for s in 0..spatial {
        x = x.pad_with_zeros(2 + s, pads[s] as usize, pads[spatial + s] as usize)?;
    }
    let y = match spatial {
        1 => x.conv1d(&w, 0, strides[0] as usize, dil[0] as usize, group)?,
        2 => {
            if strides[0] != strides[1] || dil[0] != dil[1] {
                // candle's conv2d takes one stride / dilation for both axes: do rows via
                // subsampling
                if dil[0] != 1 || dil[1] != 1 {
                    bail!("Conv2d with unequal dilations");
                }
                let full = x.conv2d(&w, 0, 1, 1, group)?;
                every_nth(&every_nth(&full, 2, strides[0] as usize)?, 3, strides[1] as usize)?
            } else {
                x.conv2d(&w, 0, strides[0] as usize, dil[0] as usize, group)?
            }
        }
        _ => bail!("Conv with {spatial} spatial dimensions"),
    };
    Ok(match b {
        Some(b) => {
            let mut shape = vec![1usize; y.rank()];
            shape[1] = b.elem_count();
            y.broadcast_add(&b.reshape(shape)?)?
        }
        None => y,
    })
}

/// Every `s`-th element of `x` along `dim`, from the first (pads to a multiple of `s`, then keeps
/// the first of each group: data movement only, nothing from the host).
fn every_nth(x: &Tensor, dim: usize, s: usize) -> Result<Tensor> {
    if s == 1 {
        return Ok(x.clone());
    }
    let n = x.dim(dim)?;
    let groups = n.div_ceil(s);
    let x = x.pad_with_zeros(dim, 0, groups * s - n)?;
    let mut shape = x.dims().to_vec();
    shape[dim] = groups;
    shape.insert(dim + 1, s);
    Ok(x.reshape(shape)?.narrow(dim + 1, 0, 1)?.squeeze(dim + 1)?.contiguous()?)
}

/// 1-D average pooling (the CAM layer's segment pooling): windows past the end are clipped and
/// averaged over the elements they hold.
pub(super) fn avg_pool(n: &NodeProto, x: Tensor) -> Result<Tensor> {
    let k =
        n.attr_ints("kernel_shape").ok_or_else(|| anyhow!("AveragePool without kernel_shape"))?;
    if k.len() != 1 {
        bail!("AveragePool over {} dimensions", k.len());
    }
    let k = k[0] as usize;
    let s = n.attr_ints("strides").map(|v| v[0] as usize).unwrap_or(1);
    let pads = n.attr_ints("pads").map(|v| v.to_vec()).unwrap_or(vec![0, 0]);
    if pads.iter().any(|&p| p != 0) {
        bail!("AveragePool with padding");
    }
    let ceil = n.attr_i("ceil_mode", 0) == 1;
    let l = x.dim(D::Minus1)?;
    let out = if ceil { l.saturating_sub(k).div_ceil(s) + 1 } else { (l - k) / s + 1 };
    let mut parts = Vec::with_capacity(out);
    for o in 0..out {
        let start = o * s;
        let len = k.min(l - start.min(l));
        parts.push(x.narrow(D::Minus1, start, len)?.mean_keepdim(D::Minus1)?);
    }
    Ok(Tensor::cat(&parts, D::Minus1)?)
}

/// `[.., axis..]` normalized over the dimensions from `axis` on, then scaled and shifted.
pub(super) fn layer_norm(
    x: Tensor,
    axis: usize,
    scale: Tensor,
    bias: Option<Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let inner: usize = dims[axis..].iter().product();
    let flat = x.to_dtype(candle_core::DType::F32)?.reshape(((), inner))?;
    let mean = flat.mean_keepdim(1)?;
    let centered = flat.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?.reshape(dims.as_slice())?;
    let dev = normed.device().clone();
    let out = normed.broadcast_mul(&scale.to_device(&dev)?)?;
    Ok(match bias {
        Some(b) => out.broadcast_add(&b.to_device(&dev)?)?,
        None => out,
    })
}

/// A per-tensor (scalar) or per-axis (1-D, along `axis`) quantization parameter shaped to
/// broadcast against `x`.
fn along(p: Tensor, x: &Tensor, axis: i64) -> Result<Tensor> {
    let p = p.to_device(x.device())?.to_dtype(candle_core::DType::F32)?;
    if p.elem_count() == 1 {
        return Ok(p.flatten_all()?.reshape(())?);
    }
    let ax = super::eval::axis(axis, x.rank());
    let mut shape = vec![1usize; x.rank()];
    shape[ax] = p.elem_count();
    Ok(p.reshape(shape)?)
}

/// `DequantizeLinear`: `(x - zero_point) * scale`, in f32.
pub(super) fn dequantize(
    x: Tensor,
    scale: Tensor,
    zero_point: Option<Tensor>,
    axis: i64,
) -> Result<Tensor> {
    let xf = x.to_dtype(candle_core::DType::F32)?;
    let s = along(scale, &xf, axis)?;
    let shifted = match zero_point {
        Some(z) => xf.broadcast_sub(&along(z, &xf, axis)?)?,
        None => xf,
    };
    Ok(shifted.broadcast_mul(&s)?)
}

/// `QuantizeLinear`: `x / scale` rounded half to even, plus the zero point, saturated to the
/// quantized type's `range`. The result holds those integers as f32 (the `DequantizeLinear` that
/// always follows reads them as they are).
pub(super) fn quantize(
    x: Tensor,
    scale: Tensor,
    zero_point: Option<Tensor>,
    axis: i64,
    range: (f32, f32),
) -> Result<Tensor> {
    let xf = x.to_dtype(candle_core::DType::F32)?;
    let v = xf.broadcast_div(&along(scale, &xf, axis)?)?;
    let r = round_half_even(&v)?;
    let r = match zero_point {
        Some(z) => r.broadcast_add(&along(z, &xf, axis)?)?,
        None => r,
    };
    Ok(r.clamp(range.0, range.1)?)
}

/// Rounds to the nearest integer, ties to the even one (as ONNX's quantization does; candle's
/// `round` sends ties away from zero).
fn round_half_even(v: &Tensor) -> Result<Tensor> {
    let r = v.round()?;
    let tie = (v - v.floor()?)?.eq(0.5)?;
    let odd = ((&r * 0.5)?.floor()? * 2.0)?.ne(&r)?;
    let fix = tie.mul(&odd)?;
    Ok(fix.where_cond(&(&r - v.sign()?)?, &r)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn v(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    #[test]
    fn quantize_rounds_ties_to_even_and_saturates_to_the_type() {
        let x =
            Tensor::new(&[0.5f32, 1.5, 2.5, -2.5, -0.5, 0.7, 300.0, -300.0], &Device::Cpu).unwrap();
        let one = Tensor::new(1f32, &Device::Cpu).unwrap();
        let int8 = quantize(x.clone(), one.clone(), None, 1, (-128.0, 127.0)).unwrap();
        assert_eq!(v(&int8), [0.0, 2.0, 2.0, -2.0, 0.0, 1.0, 127.0, -128.0]);
        let zp = Tensor::new(128f32, &Device::Cpu).unwrap();
        let uint8 = quantize(x, one, Some(zp), 1, (0.0, 255.0)).unwrap();
        assert_eq!(v(&uint8), [128.0, 130.0, 130.0, 126.0, 128.0, 129.0, 255.0, 0.0]);
    }

    #[test]
    fn dequantize_per_axis_scales_each_channel() {
        // a [2, 3] weight quantized per column (axis 1)
        let q = Tensor::new(&[[1i64, 2, 3], [-1, 0, 4]], &Device::Cpu).unwrap();
        let scale = Tensor::new(&[0.5f32, 1.0, 2.0], &Device::Cpu).unwrap();
        let zp = Tensor::new(&[0i64, 1, 0], &Device::Cpu).unwrap();
        let w = dequantize(q, scale, Some(zp), 1).unwrap();
        assert_eq!(v(&w), [0.5, 1.0, 6.0, -0.5, -1.0, 8.0]);
    }
}
