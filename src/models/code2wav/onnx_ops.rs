//! The convolution and pooling operators of the ONNX evaluator ([`super::campplus`]).

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
                // candle's conv2d takes one stride / dilation for both axes: do rows via subsampling
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
    let k = n.attr_ints("kernel_shape").ok_or_else(|| anyhow!("AveragePool without kernel_shape"))?;
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
