//! The S3 speech tokenizer v2 (`speech_tokenizer_v2_25hz.onnx`): 128-bin Whisper log-mel at 16 kHz
//! -> conv1 + conv2 (stride 2 each: 25 positions/s) -> Transformer blocks whose attention adds an
//! FSMN memory (a depthwise conv over the values) and uses RoPE -> FSQ: project to 8 dims, tanh, 3
//! levels each, base-3 index (0..6560).
//!
//! Weights arrive as ONNX initializers and are renamed the way the s3tokenizer package's own
//! loader (`onnx2torch`) renames them, so names below are its torch module names:
//! `encoder.conv{1,2}`, `encoder.blocks.K.{attn_ln, attn.{query,key,value,out,fsmn_block}, mlp_ln,
//! mlp.{0,2}}`, `quantizer._codebook.project_down`.

use std::collections::HashMap;

use anyhow::{bail, Result};
use candle_core::{Module, Tensor};
use candle_nn::{Conv1d, Conv1dConfig, LayerNorm, Linear, VarBuilder};

use crate::attention::Rope;
use crate::onnx::{to_tensor, ModelProto};

/// Head width fixed by the model's RoPE (64 dims).
const HEAD_DIM: usize = 64;
const FSMN_KERNEL: usize = 31;

/// A depthwise convolution `x: [C, T]`, `w: [C, 1, K]`, zero padded by `pad_l` before and
/// `pad_r` after -> `[C, T + pad_l + pad_r - K + 1]`, as three ops: the K shifted views gathered at
/// once, times the taps, summed. (candle runs a grouped conv as one conv per group: 1280 of them
/// per block here, which made the tokenizer ~200 ms on a GPU.)
pub fn depthwise_conv(x: &Tensor, w: &Tensor, pad_l: usize, pad_r: usize) -> Result<Tensor> {
    let (c, t) = x.dims2()?;
    let (wc, one, k) = w.dims3()?;
    if wc != c || one != 1 || t + pad_l + pad_r < k {
        bail!("depthwise conv: weight {:?} for [{c}, {t}] padded by {pad_l} + {pad_r}", w.shape());
    }
    let l = t + pad_l + pad_r + 1 - k;
    depthwise_conv_at(x, w, &window_index(l, k, x.device())?, pad_l, pad_r)
}

/// The gather index of [`depthwise_conv`]'s `l` windows of `k` taps.
fn window_index(l: usize, k: usize, dev: &candle_core::Device) -> Result<Tensor> {
    let idx: Vec<u32> = (0..l).flat_map(|i| (0..k).map(move |j| (i + j) as u32)).collect();
    Ok(Tensor::from_vec(idx, l * k, dev)?)
}

/// [`depthwise_conv`] with its gather index made beforehand (nothing comes from the host).
fn depthwise_conv_at(
    x: &Tensor,
    w: &Tensor,
    idx: &Tensor,
    pad_l: usize,
    pad_r: usize,
) -> Result<Tensor> {
    let c = x.dim(0)?;
    let k = w.dim(2)?;
    let l = idx.elem_count() / k.max(1);
    let xp = x.pad_with_zeros(1, pad_l, pad_r)?;
    let win = xp.contiguous()?.index_select(idx, 1)?.reshape((c, l, k))?;
    Ok(win.broadcast_mul(&w.reshape((c, 1, k))?.to_dtype(x.dtype())?)?.sum(2)?)
}

/// Renames the initializers of an S3 tokenizer ONNX graph to torch state-dict names, as
/// s3tokenizer's `onnx2torch` does (2-D weights of MatMul nodes transposed to `[out, in]`).
pub fn state_dict_from_onnx(model: &ModelProto) -> Result<HashMap<String, Tensor>> {
    let g = model.graph.as_ref().expect("checked at read");
    let inits: HashMap<&str, &crate::onnx::TensorProto> =
        g.initializer.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut raw: HashMap<String, Tensor> = HashMap::new();
    for node in &g.node {
        for input in &node.input {
            let Some(init) = inits.get(input.as_str()) else {
                continue;
            };
            let fixed = match input.as_str() {
                "onnx::Conv_1519" | "encoders.conv1.weight" | "onnx::Conv_2216" => {
                    Some("encoder.conv1.weight")
                }
                "onnx::Conv_1520" | "encoders.conv1.bias" | "onnx::Conv_2217" => {
                    Some("encoder.conv1.bias")
                }
                "onnx::Conv_1521" | "encoders.conv2.weight" | "onnx::Conv_2218" => {
                    Some("encoder.conv2.weight")
                }
                "onnx::Conv_1522" | "encoders.conv2.bias" | "onnx::Conv_2219" => {
                    Some("encoder.conv2.bias")
                }
                "encoders.positional_embedding" => Some("encoder.positional_embedding"),
                "quantizer.project_in.bias" => Some("quantizer._codebook.project_down.bias"),
                "onnx::MatMul_2536" => Some("quantizer._codebook.project_down.weight"),
                _ => None,
            };
            if fixed.is_none() && node.op_type == "LayerNormalization" {
                let ln = node.name.replace("/LayerNormalization", "");
                for (slot, suffix) in [(1usize, "weight"), (2, "bias")] {
                    if let Some(t) = node.input.get(slot).and_then(|n| inits.get(n.as_str())) {
                        raw.insert(format!("{ln}.{suffix}"), to_tensor(t)?);
                    }
                }
                continue;
            }
            let name = fixed.map(str::to_string).unwrap_or_else(|| node.name.clone());
            let t = to_tensor(init)?;
            let t = if t.rank() == 2 && name != "encoder.positional_embedding" {
                t.t()?.contiguous()?
            } else {
                t
            };
            raw.insert(name, t);
        }
    }
    let mut out = HashMap::new();
    for (k, v) in raw {
        if k.contains("quantizer") {
            if k.contains("project_down") {
                out.insert(k, v);
            }
        } else if k.contains("positional_embedding") || k.contains("conv") {
            out.insert(k, v);
        } else if k.contains("blocks") {
            let nk = k[1..]
                .replace('/', ".")
                .replace("MatMul", "weight")
                .replace("Add_1", "bias")
                .replace("Mul", "weight")
                .replace("Add", "bias")
                .replace("mlp.mlp", "mlp")
                .replace("fsmn_block.Conv", "fsmn_block.weight");
            out.insert(format!("encoder.{nk}"), v);
        } else {
            bail!("speech tokenizer ONNX: initializer for node {k} fits no known weight");
        }
    }
    Ok(out)
}

#[derive(Debug, Clone)]
struct Block {
    attn_ln: LayerNorm,
    query: Linear,
    key: Linear,
    value: Linear,
    out: Linear,
    fsmn: Tensor,
    mlp_ln: LayerNorm,
    mlp0: Linear,
    mlp2: Linear,
}

/// The tokenizer.
#[derive(Debug, Clone)]
pub struct S3Tokenizer {
    conv1: Conv1d,
    conv2: Conv1d,
    blocks: Vec<Block>,
    project_down: Linear,
    rope: Rope,
    n_state: usize,
    n_mels: usize,
    /// Per frame count: the positions and the FSMN's gather index, made once (a captured run reads
    /// them; they live as long as the tokenizer).
    tables: std::sync::Arc<std::sync::Mutex<Vec<(usize, Tensor, Tensor)>>>,
    /// The device part of a run replayed as a CUDA graph per frame count, when on.
    graphs: crate::cuda_graph::GraphSlot,
}

fn lin(vb: &VarBuilder, name: &str, i: usize, o: usize, bias: bool) -> candle_core::Result<Linear> {
    let w = vb.pp(name).get((o, i), "weight")?;
    let b = if bias { Some(vb.pp(name).get(o, "bias")?) } else { None };
    Ok(Linear::new(w, b))
}

impl S3Tokenizer {
    /// `vb` over the renamed state dict; the widths come from the tensors themselves.
    pub fn load(vb: VarBuilder, n_state: usize, n_mels: usize, n_layer: usize) -> Result<Self> {
        if !n_state.is_multiple_of(HEAD_DIM) {
            bail!("speech tokenizer width {n_state} is not a multiple of the 64-dim heads");
        }
        let e = vb.pp("encoder");
        let c = |name: &str, i: usize| -> candle_core::Result<Conv1d> {
            Ok(Conv1d::new(
                e.pp(name).get((n_state, i, 3), "weight")?,
                Some(e.pp(name).get(n_state, "bias")?),
                Conv1dConfig { padding: 1, stride: 2, ..Default::default() },
            ))
        };
        let mut blocks = Vec::with_capacity(n_layer);
        for k in 0..n_layer {
            let b = e.pp("blocks").pp(k);
            let a = b.pp("attn");
            blocks.push(Block {
                attn_ln: candle_nn::layer_norm(n_state, 1e-6, b.pp("attn_ln"))?,
                query: lin(&a, "query", n_state, n_state, true)?,
                key: lin(&a, "key", n_state, n_state, false)?,
                value: lin(&a, "value", n_state, n_state, true)?,
                out: lin(&a, "out", n_state, n_state, true)?,
                fsmn: a.pp("fsmn_block").get((n_state, 1, FSMN_KERNEL), "weight")?,
                mlp_ln: candle_nn::layer_norm(n_state, 1e-5, b.pp("mlp_ln"))?,
                mlp0: lin(&b.pp("mlp"), "0", n_state, 4 * n_state, true)?,
                mlp2: lin(&b.pp("mlp"), "2", 4 * n_state, n_state, true)?,
            });
        }
        let project_down =
            lin(&vb.pp("quantizer").pp("_codebook"), "project_down", n_state, 8, true)?;
        let rope = Rope::new(HEAD_DIM, 10000.0, 2048, vb.dtype(), vb.device())?;
        Ok(Self {
            conv1: c("conv1", n_mels)?,
            conv2: c("conv2", n_state)?,
            blocks,
            project_down,
            rope,
            n_state,
            n_mels,
            tables: Default::default(),
            graphs: crate::cuda_graph::GraphSlot::off(),
        })
    }

    /// Loads from the renamed ONNX state dict, reading the widths off its tensors.
    pub fn from_state_dict(
        sd: HashMap<String, Tensor>,
        dtype: candle_core::DType,
        dev: &candle_core::Device,
    ) -> Result<Self> {
        let conv1 = sd
            .get("encoder.conv1.weight")
            .ok_or_else(|| anyhow::anyhow!("speech tokenizer: no encoder.conv1.weight"))?;
        let (n_state, n_mels, _) = conv1.dims3()?;
        let n_layer = (0..)
            .take_while(|k| sd.contains_key(&format!("encoder.blocks.{k}.attn.query.weight")))
            .count();
        if n_layer == 0 {
            bail!("speech tokenizer: no encoder blocks found");
        }
        let backend = crate::backend::Checked {
            inner: Box::new(sd),
            origin: "speech tokenizer".into(),
            seen: None,
        };
        let vb = VarBuilder::from_backend(Box::new(backend), dtype, dev.clone());
        Self::load(vb, n_state, n_mels, n_layer)
    }

    pub fn n_mels(&self) -> usize {
        self.n_mels
    }

    /// Log-mel `[n_mels, frames]` -> speech codes (frames / 4 of them).
    pub fn quantize(&self, mel: &Tensor) -> Result<Vec<u32>> {
        Self::codes_of(&self.levels_queued(mel)?)
    }

    /// The device part of [`S3Tokenizer::quantize`], queued: the FSQ levels `[T, digits]` (f32),
    /// for [`S3Tokenizer::codes_of`] to read back when they are needed.
    pub fn levels_queued(&self, mel: &Tensor) -> Result<Tensor> {
        // (each conv halves the frames: stride 2, kernel 3, padding 1)
        let t = mel.dim(1)?.div_ceil(2).div_ceil(2);
        let (pos, idx) = self.tables_for(t, mel.device())?;
        let levels = |x: &[Tensor]| -> candle_core::Result<Vec<Tensor>> {
            Ok(vec![self
                .levels(&x[0], &pos, &idx)
                .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?])
        };
        Ok(self.graphs.run(0, &[mel], &levels)?.remove(0))
    }

    /// The speech codes of FSQ levels from [`S3Tokenizer::levels_queued`] (waits for them).
    pub fn codes_of(levels: &Tensor) -> Result<Vec<u32>> {
        let hq = levels.to_vec2::<f32>()?;
        Ok(hq
            .iter()
            .map(|row| {
                row.iter()
                    .enumerate()
                    .map(|(i, &v)| {
                        ((v + 1.0) * 2.0 / 2.0).round_ties_even() as u32 * 3u32.pow(i as u32)
                    })
                    .sum()
            })
            .collect())
    }

    /// The device part of a run replayed as a CUDA graph per frame count (from a count's second
    /// run); off: op by op.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = if on {
            crate::cuda_graph::GraphSlot::on(2)
        } else {
            crate::cuda_graph::GraphSlot::off()
        };
    }

    fn tables_for(&self, t: usize, dev: &candle_core::Device) -> Result<(Tensor, Tensor)> {
        let mut tables = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, p, i)) = tables.iter().find(|e| e.0 == t) {
            return Ok((p.clone(), i.clone()));
        }
        let pos = Tensor::arange(0u32, t as u32, dev)?;
        let idx = window_index(t, FSMN_KERNEL, dev)?;
        if tables.len() < 4 {
            tables.push((t, pos.clone(), idx.clone()));
        }
        Ok((pos, idx))
    }

    /// `mel: [n_mels, frames]` -> the FSQ levels before rounding, `[T, digits]` (f32, tanh'd and
    /// clamped), with nothing from the host.
    fn levels(&self, mel: &Tensor, pos: &Tensor, idx: &Tensor) -> Result<Tensor> {
        let x = self.conv1.forward(&mel.unsqueeze(0)?)?.gelu_erf()?;
        let x = self.conv2.forward(&x)?.gelu_erf()?;
        let mut x = x.squeeze(0)?.t()?.contiguous()?; // [T, C]
        let t = x.dim(0)?;
        if pos.dim(0)? != t {
            bail!("speech tokenizer: {t} frames after the convs, tables for {}", pos.dim(0)?);
        }
        let heads = self.n_state / HEAD_DIM;
        let (cos, sin) = self.rope.tables(pos)?;
        let scale = (HEAD_DIM as f64).powf(-0.25);
        for b in &self.blocks {
            let h = b.attn_ln.forward(&x)?;
            let q = b.query.forward(&h)?.reshape((t, heads, HEAD_DIM))?;
            let k = b.key.forward(&h)?.reshape((t, heads, HEAD_DIM))?;
            let v = b.value.forward(&h)?;
            let q = Rope::apply(&q, &cos, &sin)?;
            let k = Rope::apply(&k, &cos, &sin)?;
            // FSMN memory: depthwise conv over the values (zero padded both sides) plus the values
            let pad = (FSMN_KERNEL - 1) / 2;
            let mem =
                (depthwise_conv_at(&v.t()?, &b.fsmn, idx, pad, FSMN_KERNEL - 1 - pad)?.t()? + &v)?;
            let qh = (q * scale)?.transpose(0, 1)?.contiguous()?; // [H, T, d]
            let kh = (k * scale)?.transpose(0, 1)?.contiguous()?;
            let vh = v.reshape((t, heads, HEAD_DIM))?.transpose(0, 1)?.contiguous()?;
            let att = candle_nn::ops::softmax_last_dim(&qh.matmul(&kh.t()?)?)?;
            let wv = att.matmul(&vh)?.transpose(0, 1)?.reshape((t, self.n_state))?;
            x = (x + (b.out.forward(&wv)? + mem)?)?;
            let h = b.mlp2.forward(&b.mlp0.forward(&b.mlp_ln.forward(&x)?)?.gelu_erf()?)?;
            x = (x + h)?;
        }
        // FSQ: tanh, clamp, round((h + 1) · (L − 1) / 2) with L = 3, base-3 digits
        let hq = self.project_down.forward(&x)?.to_dtype(candle_core::DType::F32)?.tanh()?;
        Ok(hq.clamp(-1.0 + 1e-6, 1.0 - 1e-6)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_depthwise_conv_is_candles_grouped_conv() {
        let dev = Device::Cpu;
        let (c, t, k) = (6, 40, 31);
        let x = Tensor::randn(0f32, 1.0, (c, t), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (c, 1, k), &dev).unwrap();
        let want = x
            .unsqueeze(0)
            .unwrap()
            .pad_with_zeros(2, 15, 15)
            .unwrap()
            .conv1d(&w, 0, 1, 1, c)
            .unwrap()
            .squeeze(0)
            .unwrap();
        let got = depthwise_conv(&x, &w, 15, 15).unwrap();
        assert_eq!(got.dims(), want.dims());
        let diff =
            (got - &want).unwrap().abs().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let scale = want
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .fold(0f32, |m, v| m.max(*v));
        // (a NaN fails: every comparison with it is false)
        assert!(
            diff.iter().all(|d| *d <= 1e-5 * scale),
            "largest difference {:?}",
            diff.iter().fold(0f32, |m, v| m.max(*v))
        );
        assert!(depthwise_conv(&x, &w.narrow(0, 0, 2).unwrap(), 15, 15).is_err());
    }
}
