//! What an ONNX graph's evaluation can do once per input shape instead of on every run.
//!
//! With the input's shape fixed (a reference is always cut to 6 s), the shape plumbing of an
//! exported graph (`Shape`, the integer arithmetic and constants around it) gives the same values
//! every time, and a node that reads such a value on the model's device would move it there on
//! every run (a host-to-device copy each time, which also waits for the stream). A [`Fold`] keeps
//! those values from one full evaluation: the nodes that depend on the input's data only run
//! afterwards, every constant operand they read on the device is already there, and the indices a
//! `Gather` picks are already device indices. So a folded run issues nothing but kernels, which
//! also makes it capturable as a CUDA graph.

use std::collections::HashMap;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

use crate::onnx::NodeProto;

/// Inputs read as host values (shapes, axes, slice bounds): they stay on the host.
fn host_param(op: &str, k: usize) -> bool {
    match op {
        "Unsqueeze" | "Squeeze" | "Reshape" | "Expand" => k == 1,
        "ReduceMean" | "ReduceSum" | "ReduceProd" => k == 1,
        "Slice" => (1..=4).contains(&k),
        "ConstantOfShape" => k == 0,
        _ => false,
    }
}

/// Node `i`'s input `k`, prepared for a folded run.
type Slot = (usize, usize);

#[derive(Debug)]
pub struct Fold {
    /// The input shape this fold is valid for.
    pub dims: Vec<usize>,
    /// Whether node `i` depends on the input's data (it runs every time).
    pub dynamic: Vec<bool>,
    /// The outputs of the other nodes, from the evaluation that made the fold.
    pub values: HashMap<String, Tensor>,
    /// Constant operands of dynamic nodes, already where the node computes (a `Gather`'s indices
    /// as non-negative `u32` on the device).
    pub operands: HashMap<Slot, Tensor>,
}

impl Fold {
    /// After a full evaluation (`env`: every node's output; `inits`: the graph's initializers):
    /// keeps the values of the nodes that do not depend on the input, and places each constant
    /// operand of the others on `dev`.
    pub fn new(
        nodes: &[NodeProto],
        input: &str,
        dims: Vec<usize>,
        env: &HashMap<&str, Tensor>,
        inits: &HashMap<String, Tensor>,
        dev: &Device,
    ) -> Result<Self> {
        // a node depends on the input's data when it reads the input or such a node's output
        // (a `Shape` of it does not: the shape is fixed)
        let mut live: std::collections::HashSet<&str> = std::collections::HashSet::from([input]);
        let mut dynamic = Vec::with_capacity(nodes.len());
        let mut values = HashMap::new();
        for n in nodes {
            let d = n.op_type != "Shape" && n.input.iter().any(|s| live.contains(s.as_str()));
            for o in &n.output {
                if d {
                    live.insert(o.as_str());
                } else if let Some(t) = env.get(o.as_str()) {
                    values.insert(o.clone(), t.clone());
                }
            }
            dynamic.push(d);
        }
        let mut operands = HashMap::new();
        for (i, n) in nodes.iter().enumerate().filter(|(i, _)| dynamic[*i]) {
            for (k, name) in n.input.iter().enumerate() {
                if name.is_empty() || live.contains(name.as_str()) || host_param(&n.op_type, k) {
                    continue;
                }
                let Some(v) = values.get(name).or_else(|| inits.get(name)) else { continue };
                let placed = if n.op_type == "Gather" && k == 1 {
                    // the data's size on the gathered axis, from the evaluation that made the fold
                    let Some(data) = n.input.first().and_then(|s| env.get(s.as_str())) else {
                        continue;
                    };
                    let ax = n.attr_i("axis", 0);
                    let ax = if ax < 0 { (ax + data.rank() as i64) as usize } else { ax as usize };
                    let size = data.dim(ax)? as i64;
                    let idx: Vec<u32> = v
                        .to_dtype(DType::I64)?
                        .flatten_all()?
                        .to_vec1::<i64>()?
                        .iter()
                        .map(|&i| if i < 0 { i + size } else { i } as u32)
                        .collect();
                    Tensor::from_vec(idx, v.dims(), dev)?
                } else if v.device().same_device(dev) {
                    continue;
                } else {
                    v.to_device(dev)?
                };
                operands.insert((i, k), placed);
            }
        }
        Ok(Self { dims, dynamic, values, operands })
    }
}
