//! ONNX files: reading and writing the token2wav ONNX models, and building graphs for synthetic
//! assets. The message types and their decoding live in `antiphon_models::onnx`.

use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use prost::Message;

pub use antiphon_models::onnx::*;

pub fn read_model(path: &Path) -> Result<ModelProto> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    decode_model(&bytes, &path.display().to_string())
}

pub fn write_model(path: &Path, m: &ModelProto) -> Result<()> {
    std::fs::write(path, m.encode_to_vec()).with_context(|| format!("writing {}", path.display()))
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
    AttributeProto {
        name: name.into(),
        ints: ints.to_vec(),
        r#type: attr::INTS,
        ..Default::default()
    }
}

pub fn attr_float(name: &str, f: f32) -> AttributeProto {
    AttributeProto { name: name.into(), f, r#type: attr::FLOAT, ..Default::default() }
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
    pub fn node(
        &mut self,
        op: &str,
        name: &str,
        inputs: &[&str],
        attrs: Vec<AttributeProto>,
    ) -> String {
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
