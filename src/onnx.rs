//! A reader and writer for the parts of the ONNX format the token2wav assets use
//! (`speech_tokenizer_v2_25hz.onnx`, `campplus.onnx`): the model, its graph, nodes with their
//! attributes, and initializers. The message types mirror `onnx.proto` (field numbers as there);
//! fields this project never reads are skipped when decoding.

use std::path::Path;

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
    pub const STRING: i32 = 3;
    pub const TENSOR: i32 = 4;
    pub const FLOATS: i32 = 6;
    pub const INTS: i32 = 7;
}

pub fn read_model(path: &Path) -> Result<ModelProto> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let m = ModelProto::decode(bytes.as_slice()).with_context(|| format!("{}: not an ONNX model", path.display()))?;
    if m.graph.is_none() {
        bail!("{}: the ONNX model has no graph", path.display());
    }
    Ok(m)
}

pub fn write_model(path: &Path, m: &ModelProto) -> Result<()> {
    std::fs::write(path, m.encode_to_vec()).with_context(|| format!("writing {}", path.display()))
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
                raw.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
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
                raw.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
            } else {
                t.int64_data.clone()
            };
            check_len(t, v.len(), n)?;
            Tensor::from_vec(v, dims, dev)?
        }
        dtype::INT32 | dtype::BOOL | dtype::UINT8 => {
            let v: Vec<i64> = if !raw.is_empty() {
                match t.data_type {
                    dtype::INT32 => raw.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64).collect(),
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

/// A tensor as an initializer (f32 stays f32 in `raw_data`, integer types become int64).
pub fn from_tensor(name: &str, t: &Tensor) -> Result<TensorProto> {
    let dims = t.dims().iter().map(|&d| d as i64).collect();
    let flat = t.flatten_all()?;
    let (data_type, raw_data) = match t.dtype() {
        DType::I64 | DType::U32 | DType::U8 => {
            let v = flat.to_dtype(DType::I64)?.to_vec1::<i64>()?;
            (dtype::INT64, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
        _ => {
            let v = flat.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            (dtype::FLOAT, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
    };
    Ok(TensorProto { dims, data_type, name: name.to_string(), raw_data, ..Default::default() })
}

/// Attribute constructors for graph building.
pub fn attr_int(name: &str, i: i64) -> AttributeProto {
    AttributeProto { name: name.into(), i, r#type: attr::INT, ..Default::default() }
}

pub fn attr_ints(name: &str, ints: &[i64]) -> AttributeProto {
    AttributeProto { name: name.into(), ints: ints.to_vec(), r#type: attr::INTS, ..Default::default() }
}

pub fn attr_float(name: &str, f: f32) -> AttributeProto {
    AttributeProto { name: name.into(), f, r#type: attr::FLOAT, ..Default::default() }
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

/// A simple graph under construction.
#[derive(Default)]
pub struct GraphBuilder {
    pub graph: GraphProto,
    counter: usize,
}

impl GraphBuilder {
    pub fn new(name: &str) -> Self {
        Self { graph: GraphProto { name: name.into(), ..Default::default() }, counter: 0 }
    }

    /// A fresh value name.
    pub fn fresh(&mut self, hint: &str) -> String {
        self.counter += 1;
        format!("{hint}_{}", self.counter)
    }

    pub fn init(&mut self, name: &str, t: &Tensor) -> Result<String> {
        self.graph.initializer.push(from_tensor(name, t)?);
        Ok(name.to_string())
    }

    /// Adds a node named `name` with one output, returning the output's name.
    pub fn node(&mut self, op: &str, name: &str, inputs: &[&str], attrs: Vec<AttributeProto>) -> String {
        let out = self.fresh(op);
        self.graph.node.push(NodeProto {
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![out.clone()],
            name: name.into(),
            op_type: op.into(),
            attribute: attrs,
            domain: String::new(),
        });
        out
    }

    pub fn input(&mut self, name: &str, dims: &[Option<i64>]) {
        self.graph.input.push(value_info(name, dims));
    }

    pub fn output(&mut self, name: &str, dims: &[Option<i64>]) {
        self.graph.output.push(value_info(name, dims));
    }

    pub fn finish(self, opset: i64) -> ModelProto {
        ModelProto {
            ir_version: 8,
            producer_name: "antiphon".into(),
            producer_version: env!("CARGO_PKG_VERSION").into(),
            graph: Some(self.graph),
            opset_import: vec![OperatorSetIdProto { domain: String::new(), version: opset }],
        }
    }
}

fn value_info(name: &str, dims: &[Option<i64>]) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            tensor_type: Some(TensorTypeProto {
                elem_type: dtype::FLOAT,
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|d| match d {
                            Some(v) => Dimension { dim_value: *v, dim_param: String::new() },
                            None => Dimension { dim_value: 0, dim_param: "T".into() },
                        })
                        .collect(),
                }),
            }),
        }),
    }
}
