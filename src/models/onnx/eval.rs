//! What each ONNX operator computes ([`super::graph::OnnxGraph`] walks the nodes in order and
//! calls [`eval`] on each).

use std::collections::HashMap;

use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device, Tensor};

use super::ops::{avg_pool, conv, dequantize, layer_norm, quantize};
use super::{dtype, to_tensor, NodeProto};

/// The saturation range of a quantized type, by the name of the zero point that carries it.
pub type QuantRanges = HashMap<String, (f32, f32)>;

fn need(t: Result<Option<Tensor>>, what: &str) -> Result<Tensor> {
    t?.ok_or_else(|| anyhow!("missing input {what}"))
}

fn ints(t: &Tensor) -> Result<Vec<i64>> {
    Ok(t.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?)
}

pub(super) fn axis(a: i64, rank: usize) -> usize {
    if a < 0 {
        (a + rank as i64) as usize
    } else {
        a as usize
    }
}

/// Both operands on one device: a host operand moves to the other's device.
fn colocate(a: Tensor, b: Tensor) -> Result<(Tensor, Tensor)> {
    if a.device().same_device(b.device()) {
        return Ok((a, b));
    }
    if a.device().is_cpu() {
        Ok((a.to_device(b.device())?, b))
    } else {
        let b = b.to_device(a.device())?;
        Ok((a, b))
    }
}

/// Same device and dtype for both operands of a binary op (integers stay integers when both are).
fn unify(a: Tensor, b: Tensor) -> Result<(Tensor, Tensor)> {
    let (a, b) = colocate(a, b)?;
    if a.dtype() == b.dtype() {
        return Ok((a, b));
    }
    Ok((a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?))
}

pub(super) fn eval(
    n: &NodeProto,
    get: &dyn Fn(usize) -> Result<Option<Tensor>>,
    ranges: &QuantRanges,
) -> Result<Tensor> {
    let x = || need(get(0), "0");
    let y = || need(get(1), "1");
    Ok(match n.op_type.as_str() {
        "Identity" => x()?,
        "Constant" => {
            if let Some(t) = n.attr("value").and_then(|a| a.t.as_ref()) {
                to_tensor(t)?
            } else if let Some(a) = n.attr("value_float") {
                Tensor::new(a.f, &Device::Cpu)?
            } else if let Some(a) = n.attr("value_int") {
                Tensor::new(a.i, &Device::Cpu)?
            } else if let Some(a) = n.attr("value_ints") {
                Tensor::new(a.ints.as_slice(), &Device::Cpu)?
            } else {
                bail!("Constant without a supported value attribute")
            }
        }
        "Shape" => {
            let dims: Vec<i64> = x()?.dims().iter().map(|&d| d as i64).collect();
            let r = dims.len() as i64;
            let s = n.attr("start").map(|a| a.i).unwrap_or(0);
            let e = n.attr("end").map(|a| a.i).unwrap_or(r);
            let (s, e) = (
                if s < 0 { s + r } else { s }.clamp(0, r),
                if e < 0 { e + r } else { e }.clamp(0, r),
            );
            let v: Vec<i64> = dims[s as usize..e.max(s) as usize].to_vec();
            let len = v.len();
            Tensor::from_vec(v, len, &Device::Cpu)?
        }
        "Gather" => {
            let data = x()?;
            let idx = y()?;
            let ax = axis(n.attr_i("axis", 0), data.rank());
            if idx.dtype() == DType::U32 && idx.device().same_device(data.device()) {
                // a fold's indices: already non-negative, already on the data's device
                let mut shape: Vec<usize> = data.dims()[..ax].to_vec();
                shape.extend(idx.dims());
                shape.extend(&data.dims()[ax + 1..]);
                return Ok(data.index_select(&idx.flatten_all()?, ax)?.reshape(shape)?);
            }
            let size = data.dim(ax)? as i64;
            let iv: Vec<u32> =
                ints(&idx)?.iter().map(|&i| if i < 0 { i + size } else { i } as u32).collect();
            let count = iv.len();
            let sel = data.index_select(&Tensor::from_vec(iv, count, data.device())?, ax)?;
            let mut shape: Vec<usize> = data.dims()[..ax].to_vec();
            shape.extend(idx.dims());
            shape.extend(&data.dims()[ax + 1..]);
            sel.reshape(shape)?
        }
        "Unsqueeze" => {
            let t = x()?;
            let axes = match get(1)? {
                Some(a) => ints(&a)?,
                None => n.attr_ints("axes").map(|a| a.to_vec()).unwrap_or_default(),
            };
            let out_rank = t.rank() + axes.len();
            let mut axes: Vec<usize> = axes.iter().map(|&a| axis(a, out_rank)).collect();
            axes.sort();
            let mut shape = t.dims().to_vec();
            for a in axes {
                shape.insert(a, 1);
            }
            t.reshape(shape)?
        }
        "Squeeze" => {
            let t = x()?;
            let axes = match get(1)? {
                Some(a) => Some(ints(&a)?),
                None => n.attr_ints("axes").map(|a| a.to_vec()),
            };
            let r = t.rank();
            let shape: Vec<usize> = match axes {
                Some(ax) => {
                    let ax: Vec<usize> = ax.iter().map(|&a| axis(a, r)).collect();
                    t.dims()
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| !ax.contains(i))
                        .map(|(_, &d)| d)
                        .collect()
                }
                None => t.dims().iter().copied().filter(|&d| d != 1).collect(),
            };
            t.reshape(shape)?
        }
        "Concat" => {
            let mut parts = Vec::new();
            let mut i = 0;
            while let Some(t) = get(i)? {
                parts.push(t);
                i += 1;
            }
            let ax = axis(n.attr_i("axis", 0), parts[0].rank());
            if let Some(dev) = parts.iter().map(|p| p.device().clone()).find(|d| !d.is_cpu()) {
                parts = parts
                    .into_iter()
                    .map(|p| p.to_device(&dev))
                    .collect::<candle_core::Result<_>>()?;
            }
            if parts.iter().any(|p| p.dtype() != parts[0].dtype()) {
                parts = parts
                    .into_iter()
                    .map(|p| p.to_dtype(DType::F32))
                    .collect::<candle_core::Result<_>>()?;
            }
            Tensor::cat(&parts, ax)?
        }
        "Reshape" => {
            let t = x()?;
            let spec = ints(&y()?)?;
            let total = t.elem_count();
            let mut shape: Vec<usize> = spec
                .iter()
                .enumerate()
                .map(|(i, &s)| {
                    if s == 0 {
                        t.dims()[i]
                    } else if s < 0 {
                        0
                    } else {
                        s as usize
                    }
                })
                .collect();
            if let Some(p) = spec.iter().position(|&s| s == -1) {
                let known: usize =
                    shape.iter().enumerate().filter(|(i, _)| *i != p).map(|(_, &d)| d).product();
                shape[p] = total / known.max(1);
            }
            t.reshape(shape)?
        }
        "Flatten" => {
            let t = x()?;
            let ax = axis(n.attr_i("axis", 1), t.rank());
            let a: usize = t.dims()[..ax].iter().product();
            t.reshape((a, ()))?
        }
        "Expand" => {
            let t = x()?;
            let spec: Vec<usize> = ints(&y()?)?.iter().map(|&d| d as usize).collect();
            let r = spec.len().max(t.rank());
            let mut a = vec![1usize; r - t.rank()];
            a.extend(t.dims());
            let mut b = vec![1usize; r - spec.len()];
            b.extend(&spec);
            let out: Vec<usize> = a.iter().zip(&b).map(|(&p, &q)| p.max(q)).collect();
            t.reshape(a)?.broadcast_as(out)?.contiguous()?
        }
        "Slice" => {
            let t = x()?;
            let starts = ints(&need(get(1), "starts")?)?;
            let ends = ints(&need(get(2), "ends")?)?;
            let axes: Vec<i64> = match get(3)? {
                Some(a) => ints(&a)?,
                None => (0..starts.len() as i64).collect(),
            };
            if let Some(s) = get(4)? {
                if ints(&s)?.iter().any(|&v| v != 1) {
                    bail!("Slice with steps other than 1");
                }
            }
            let mut t = t;
            for ((&s, &e), &a) in starts.iter().zip(&ends).zip(&axes) {
                let ax = axis(a, t.rank());
                let d = t.dim(ax)? as i64;
                let norm = |v: i64| if v < 0 { (v + d).max(0) } else { v.min(d) };
                let (s, e) = (norm(s), norm(e));
                t = t.narrow(ax, s as usize, (e - s).max(0) as usize)?;
            }
            t.contiguous()?
        }
        "ConstantOfShape" => {
            let shape: Vec<usize> = ints(&x()?)?.iter().map(|&d| d as usize).collect();
            let v = match n.attr("value").and_then(|a| a.t.as_ref()) {
                Some(t) => to_tensor(t)?,
                None => Tensor::new(&[0f32], &Device::Cpu)?,
            };
            v.flatten_all()?.get(0)?.broadcast_as(shape)?.contiguous()?
        }
        "Equal" => {
            let (a, b) = unify(x()?, y()?)?;
            a.broadcast_eq(&b)?
        }
        "Where" => {
            let (a, b) = unify(y()?, need(get(2), "2")?)?;
            let c = x()?.to_device(a.device())?;
            let shape = c.shape().broadcast_shape_binary_op(a.shape(), "where")?;
            let shape = shape.broadcast_shape_binary_op(b.shape(), "where")?;
            c.broadcast_as(shape.clone())?
                .where_cond(&a.broadcast_as(shape.clone())?, &b.broadcast_as(shape)?)?
        }
        "Add" => {
            let (a, b) = unify(x()?, y()?)?;
            a.broadcast_add(&b)?
        }
        "Sub" => {
            let (a, b) = unify(x()?, y()?)?;
            a.broadcast_sub(&b)?
        }
        "Mul" => {
            let (a, b) = unify(x()?, y()?)?;
            a.broadcast_mul(&b)?
        }
        "Div" => {
            let (a, b) = unify(x()?, y()?)?;
            a.broadcast_div(&b)?
        }
        "Pow" => {
            let (a, b) = colocate(x()?.to_dtype(DType::F32)?, y()?.to_dtype(DType::F32)?)?;
            a.broadcast_pow(&b)?
        }
        "Max" => {
            let (a, b) = unify(x()?, y()?)?;
            a.broadcast_maximum(&b)?
        }
        "Min" => {
            let (a, b) = unify(x()?, y()?)?;
            a.broadcast_minimum(&b)?
        }
        "Clip" => {
            let mut t = x()?;
            if let Some(lo) = get(1)? {
                t = t.broadcast_maximum(&lo.to_dtype(t.dtype())?.to_device(t.device())?)?;
            }
            if let Some(hi) = get(2)? {
                t = t.broadcast_minimum(&hi.to_dtype(t.dtype())?.to_device(t.device())?)?;
            }
            t
        }
        "Sqrt" => x()?.sqrt()?,
        "Exp" => x()?.exp()?,
        "Log" => x()?.log()?,
        "Tanh" => x()?.tanh()?,
        "Abs" => x()?.abs()?,
        "Neg" => x()?.neg()?,
        "Relu" => x()?.relu()?,
        "Sigmoid" => candle_nn::ops::sigmoid(&x()?)?,
        "Erf" => x()?.erf()?,
        "Softmax" => {
            let t = x()?;
            let ax = axis(n.attr_i("axis", -1), t.rank());
            candle_nn::ops::softmax(&t, ax)?
        }
        "LayerNormalization" => {
            let t = x()?;
            let ax = axis(n.attr_i("axis", -1), t.rank());
            layer_norm(t, ax, need(get(1), "scale")?, get(2)?, n.attr_f("epsilon", 1e-5) as f64)?
        }
        "QuantizeLinear" => {
            // (no zero point: uint8, as ONNX defines it)
            let zp_name = n.input.get(2).filter(|s| !s.is_empty());
            let range = zp_name.and_then(|s| ranges.get(s)).copied().unwrap_or((0.0, 255.0));
            quantize(x()?, need(get(1), "scale")?, get(2)?, n.attr_i("axis", 1), range)?
        }
        "DequantizeLinear" => {
            dequantize(x()?, need(get(1), "scale")?, get(2)?, n.attr_i("axis", 1))?
        }
        "Cast" => {
            let to = n.attr_i("to", dtype::FLOAT as i64) as i32;
            match to {
                dtype::FLOAT | dtype::DOUBLE | dtype::FLOAT16 => x()?.to_dtype(DType::F32)?,
                dtype::INT64 | dtype::INT32 => x()?.to_dtype(DType::I64)?,
                dtype::BOOL | dtype::UINT8 => x()?.ne(0f64)?.to_dtype(DType::U8)?,
                other => bail!("Cast to ONNX type {other}"),
            }
        }
        "ReduceMean" | "ReduceSum" | "ReduceProd" => {
            let t = x()?;
            let r = t.rank();
            let axes: Vec<usize> = match get(1)? {
                Some(a) => ints(&a)?.iter().map(|&v| axis(v, r)).collect(),
                None => match n.attr_ints("axes") {
                    Some(a) => a.iter().map(|&v| axis(v, r)).collect(),
                    None => (0..r).collect(),
                },
            };
            let keep = n.attr_i("keepdims", 1) == 1;
            let mut out = t.clone();
            let mut sorted = axes.clone();
            sorted.sort();
            for &a in sorted.iter().rev() {
                out = match n.op_type.as_str() {
                    "ReduceMean" => out.mean_keepdim(a)?,
                    "ReduceSum" => out.sum_keepdim(a)?,
                    _ => {
                        // products of small integer shape values, on the host
                        let dims = out.dims().to_vec();
                        let v = out.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                        let (outer, len, inner): (usize, usize, usize) =
                            (dims[..a].iter().product(), dims[a], dims[a + 1..].iter().product());
                        let mut res = vec![1f64; outer * inner];
                        for o in 0..outer {
                            for l in 0..len {
                                for i in 0..inner {
                                    res[o * inner + i] *= v[(o * len + l) * inner + i];
                                }
                            }
                        }
                        let mut nd = dims.clone();
                        nd[a] = 1;
                        Tensor::from_vec(res, nd, out.device())?.to_dtype(out.dtype())?
                    }
                };
            }
            if !keep {
                let shape: Vec<usize> = out
                    .dims()
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !sorted.contains(i))
                    .map(|(_, &d)| d)
                    .collect();
                out = out.reshape(shape)?;
            }
            out
        }
        "Transpose" => {
            let t = x()?;
            let perm: Vec<usize> = match n.attr_ints("perm") {
                Some(p) => p.iter().map(|&v| v as usize).collect(),
                None => (0..t.rank()).rev().collect(),
            };
            t.permute(perm)?.contiguous()?
        }
        "MatMul" => {
            let (a, b) = unify(x()?, y()?)?;
            a.broadcast_matmul(&b)?
        }
        "Gemm" => {
            let (mut a, mut b) = colocate(x()?, y()?)?;
            if n.attr_i("transA", 0) == 1 {
                a = a.t()?;
            }
            if n.attr_i("transB", 0) == 1 {
                b = b.t()?;
            }
            let mut out = (a.matmul(&b)? * n.attr_f("alpha", 1.0) as f64)?;
            if let Some(c) = get(2)? {
                out = out
                    .broadcast_add(&(c.to_device(out.device())? * n.attr_f("beta", 1.0) as f64)?)?;
            }
            out
        }
        "BatchNormalization" => {
            let t = x()?;
            let (scale, bias, mean, var) = (
                need(get(1), "scale")?,
                need(get(2), "B")?,
                need(get(3), "mean")?,
                need(get(4), "var")?,
            );
            let eps = n.attr_f("epsilon", 1e-5) as f64;
            let mut shape = vec![1usize; t.rank()];
            shape[1] = t.dim(1)?;
            let r = |v: Tensor| v.to_device(t.device())?.reshape(shape.clone());
            let inv = (r(var)? + eps)?.sqrt()?.recip()?;
            t.broadcast_sub(&r(mean)?)?
                .broadcast_mul(&inv)?
                .broadcast_mul(&r(scale)?)?
                .broadcast_add(&r(bias)?)?
        }
        "Conv" => {
            let (x, w) = colocate(x()?, y()?)?;
            let b = get(2)?.map(|b| b.to_device(w.device())).transpose()?;
            conv(n, x, w, b)?
        }
        "AveragePool" => avg_pool(n, x()?)?,
        other => bail!("operator {other}"),
    })
}
