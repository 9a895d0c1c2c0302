//! The parts of the ONNX format the exported graphs here use
//! (`speech_tokenizer_v2_25hz.onnx`, `campplus.onnx`, Smart Turn): the model, its graph, nodes with
//! their attributes, and initializers. The message types mirror `onnx.proto` (field numbers as
//! there); fields this project never reads are skipped when decoding.

pub mod graph;

mod eval;
mod fold;
mod ops;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use prost::Message;

#[derive(Clone, PartialEq, Message)]
pub struct ModelProto {
    #[prost(int64, tag = "1")]
    pub ir_version: i64,
    #[prost(string, tag = "2")]
    pub producer_name: String,
    #[prost(string, tag = "3")]
    pub producer_version: String,
    #[prost(message, optional, tag = "7")]
    pub graph: Option<GraphProto>,
    #[prost(message, repeated, tag = "8")]
    pub opset_import: Vec<OperatorSetIdProto>,
}

#[derive(Clone, PartialEq, Message)]
pub struct OperatorSetIdProto {
    #[prost(string, tag = "1")]
    pub domain: String,
    #[prost(int64, tag = "2")]
    pub version: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct GraphProto {
    #[prost(message, repeated, tag = "1")]
    pub node: Vec<NodeProto>,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(message, repeated, tag = "5")]
    pub initializer: Vec<TensorProto>,
    #[prost(message, repeated, tag = "11")]
    pub input: Vec<ValueInfoProto>,
    #[prost(message, repeated, tag = "12")]
    pub output: Vec<ValueInfoProto>,
}

#[derive(Clone, PartialEq, Message)]
pub struct NodeProto {
    #[prost(string, repeated, tag = "1")]
    pub input: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    pub output: Vec<String>,
    #[prost(string, tag = "3")]
    pub name: String,
    #[prost(string, tag = "4")]
    pub op_type: String,
    #[prost(message, repeated, tag = "5")]
    pub attribute: Vec<AttributeProto>,
    #[prost(string, tag = "7")]
    pub domain: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct AttributeProto {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(float, tag = "2")]
    pub f: f32,
    #[prost(int64, tag = "3")]
    pub i: i64,
    #[prost(bytes = "vec", tag = "4")]
    pub s: Vec<u8>,
    #[prost(message, optional, tag = "5")]
    pub t: Option<TensorProto>,
    #[prost(float, repeated, packed = "false", tag = "7")]
    pub floats: Vec<f32>,
    #[prost(int64, repeated, packed = "false", tag = "8")]
    pub ints: Vec<i64>,
    #[prost(int32, tag = "20")]
    pub r#type: i32,
}

#[derive(Clone, PartialEq, Message)]
pub struct TensorProto {
    #[prost(int64, repeated, packed = "false", tag = "1")]
    pub dims: Vec<i64>,
    #[prost(int32, tag = "2")]
    pub data_type: i32,
    #[prost(float, repeated, tag = "4")]
    pub float_data: Vec<f32>,
    #[prost(int32, repeated, tag = "5")]
    pub int32_data: Vec<i32>,
    #[prost(int64, repeated, tag = "7")]
    pub int64_data: Vec<i64>,
    #[prost(string, tag = "8")]
    pub name: String,
    #[prost(bytes = "vec", tag = "9")]
    pub raw_data: Vec<u8>,
    #[prost(double, repeated, tag = "10")]
    pub double_data: Vec<f64>,
    #[prost(int32, tag = "14")]
    pub data_location: i32,
}

#[derive(Clone, PartialEq, Message)]
pub struct ValueInfoProto {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(message, optional, tag = "2")]
    pub r#type: Option<TypeProto>,
}

#[derive(Clone, PartialEq, Message)]
pub struct TypeProto {
    #[prost(message, optional, tag = "1")]
    pub tensor_type: Option<TensorTypeProto>,
}

#[derive(Clone, PartialEq, Message)]
pub struct TensorTypeProto {
    #[prost(int32, tag = "1")]
    pub elem_type: i32,
    #[prost(message, optional, tag = "2")]
    pub shape: Option<TensorShapeProto>,
}

#[derive(Clone, PartialEq, Message)]
pub struct TensorShapeProto {
    #[prost(message, repeated, tag = "1")]
    pub dim: Vec<Dimension>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Dimension {
    #[prost(int64, tag = "1")]
    pub dim_value: i64,
    #[prost(string, tag = "2")]
    pub dim_param: String,
}

/// ONNX element types used here.
pub mod dtype {
    pub const FLOAT: i32 = 1;
    pub const UINT8: i32 = 2;
    pub const INT8: i32 = 3;
    pub const INT32: i32 = 6;
    pub const INT64: i32 = 7;
    pub const BOOL: i32 = 9;
    pub const FLOAT16: i32 = 10;
    pub const DOUBLE: i32 = 11;
}

/// Attribute types.
pub mod attr {
    pub const FLOAT: i32 = 1;
    pub const INT: i32 = 2;
    pub const INTS: i32 = 7;
}

/// Decodes an ONNX model from its bytes (`what` names it in errors).
pub fn decode_model(bytes: &[u8], what: &str) -> Result<ModelProto> {
    let m = ModelProto::decode(bytes).with_context(|| format!("{what}: not an ONNX model"))?;
    if m.graph.is_none() {
        bail!("{what}: the ONNX model has no graph");
    }
    Ok(m)
}

/// An initializer as a CPU tensor: floats as f32, integers and booleans as i64.
pub fn to_tensor(t: &TensorProto) -> Result<Tensor> {
    if t.data_location == 1 {
        bail!("initializer {} keeps its data in an external file, which is not supported", t.name);
    }
    let dims: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
    let n: usize = dims.iter().product();
    let dev = &Device::Cpu;
    let raw = &t.raw_data;
    let out = match t.data_type {
        dtype::FLOAT => {
            let v: Vec<f32> = if !raw.is_empty() {
                raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            } else {
                t.float_data.clone()
            };
            check_len(t, v.len(), n)?;
            Tensor::from_vec(v, dims, dev)?
        }
        dtype::DOUBLE => {
            let v: Vec<f64> = if !raw.is_empty() {
                raw.chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect()
            } else {
                t.double_data.clone()
            };
            check_len(t, v.len(), n)?;
            Tensor::from_vec(v, dims, dev)?.to_dtype(DType::F32)?
        }
        dtype::FLOAT16 => {
            let v: Vec<half::f16> = if !raw.is_empty() {
                raw.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]])).collect()
            } else {
                t.int32_data.iter().map(|&x| half::f16::from_bits(x as u16)).collect()
            };
            check_len(t, v.len(), n)?;
            Tensor::from_vec(v, dims, dev)?.to_dtype(DType::F32)?
        }
        dtype::INT64 => {
            let v: Vec<i64> = if !raw.is_empty() {
                raw.chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect()
            } else {
                t.int64_data.clone()
            };
            check_len(t, v.len(), n)?;
            Tensor::from_vec(v, dims, dev)?
        }
        dtype::INT32 | dtype::BOOL | dtype::UINT8 | dtype::INT8 => {
            let v: Vec<i64> = if !raw.is_empty() {
                match t.data_type {
                    dtype::INT32 => raw
                        .chunks_exact(4)
                        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64)
                        .collect(),
                    dtype::INT8 => raw.iter().map(|&b| b as i8 as i64).collect(),
                    _ => raw.iter().map(|&b| b as i64).collect(),
                }
            } else {
                t.int32_data.iter().map(|&x| x as i64).collect()
            };
            check_len(t, v.len(), n)?;
            Tensor::from_vec(v, dims, dev)?
        }
        other => bail!("initializer {}: ONNX element type {other} is not supported", t.name),
    };
    Ok(out)
}

fn check_len(t: &TensorProto, got: usize, want: usize) -> Result<()> {
    if got != want {
        bail!("initializer {}: {got} values for shape {:?}", t.name, t.dims);
    }
    Ok(())
}

impl NodeProto {
    pub fn attr(&self, name: &str) -> Option<&AttributeProto> {
        self.attribute.iter().find(|a| a.name == name)
    }

    pub fn attr_i(&self, name: &str, default: i64) -> i64 {
        self.attr(name).map(|a| a.i).unwrap_or(default)
    }

    pub fn attr_f(&self, name: &str, default: f32) -> f32 {
        self.attr(name).map(|a| a.f).unwrap_or(default)
    }

    pub fn attr_ints(&self, name: &str) -> Option<&[i64]> {
        self.attr(name).map(|a| a.ints.as_slice())
    }
}
