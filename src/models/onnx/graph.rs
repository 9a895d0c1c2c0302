//! An ONNX graph evaluated node by node on candle tensors, for exported graphs that are not
//! mapped onto module names (batch norms partly folded into convolutions, anonymous
//! initializers, quantize / dequantize pairs around every operator).
//!
//! Its arithmetic runs on the graph's device (`on`: float initializers there, the input moved
//! there), its shape plumbing (Shape, Gather of dims, integer constants) on the host, and an
//! operator that meets both moves the host operand over. The evaluator covers the operators such
//! exports contain (convolutions, batch norm, layer norm, softmax, pooling, reductions,
//! elementwise arithmetic, the QDQ quantization ops and the shape plumbing around them); an
//! operator outside that set is reported by name when the file is opened.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use super::eval::{eval, QuantRanges};
use super::fold::Fold;
use super::{dtype, to_tensor, ModelProto, NodeProto};

const SUPPORTED: &[&str] = &[
    "Abs",
    "Add",
    "AveragePool",
    "BatchNormalization",
    "Cast",
    "Clip",
    "Concat",
    "Constant",
    "ConstantOfShape",
    "Conv",
    "DequantizeLinear",
    "Div",
    "Equal",
    "Erf",
    "Exp",
    "Expand",
    "Flatten",
    "Gather",
    "Gemm",
    "Identity",
    "LayerNormalization",
    "Log",
    "MatMul",
    "Max",
    "Min",
    "Mul",
    "Neg",
    "Pow",
    "QuantizeLinear",
    "ReduceMean",
    "ReduceProd",
    "ReduceSum",
    "Relu",
    "Reshape",
    "Shape",
    "Sigmoid",
    "Slice",
    "Softmax",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Tanh",
    "Transpose",
    "Unsqueeze",
    "Where",
];

/// Input shapes folded at most (a reference is always cut to one length, so one is used).
pub const MAX_FOLDS: usize = 4;

/// An ONNX graph ready to evaluate.
#[derive(Debug, Clone)]
pub struct OnnxGraph {
    nodes: Vec<NodeProto>,
    inits: HashMap<String, Tensor>,
    input: String,
    output: String,
    device: Device,
    /// What the first evaluation of each input shape left for the next runs of that shape (a
    /// few shapes at most; a fold is never dropped while its graph lives, since a captured run
    /// reads its operands).
    folds: std::sync::Arc<std::sync::Mutex<Vec<std::sync::Arc<Fold>>>>,
    /// The range a `QuantizeLinear` saturates to, by the name of its zero point (the zero point's
    /// element type sets it: uint8 0..=255, int8 -128..=127).
    ranges: QuantRanges,
}

impl OnnxGraph {
    pub fn from_model(m: &ModelProto, what: &str) -> Result<Self> {
        let g = m.graph.as_ref().ok_or_else(|| anyhow!("{what}: no graph"))?;
        let unsupported: Vec<&str> = g
            .node
            .iter()
            .map(|n| n.op_type.as_str())
            .filter(|op| !SUPPORTED.contains(op))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        if !unsupported.is_empty() {
            bail!("{what}: unsupported ONNX operators {}", unsupported.join(", "));
        }
        let mut inits = HashMap::new();
        let mut ranges = QuantRanges::new();
        for t in &g.initializer {
            match t.data_type {
                dtype::UINT8 => ranges.insert(t.name.clone(), (0.0, 255.0)),
                dtype::INT8 => ranges.insert(t.name.clone(), (-128.0, 127.0)),
                _ => None,
            };
            inits.insert(
                t.name.clone(),
                to_tensor(t).with_context(|| format!("{what}: initializer {}", t.name))?,
            );
        }
        let input = g
            .input
            .iter()
            .map(|v| v.name.clone())
            .find(|n| !inits.contains_key(n))
            .ok_or_else(|| anyhow!("{what}: the graph has no data input"))?;
        let output = g
            .output
            .first()
            .map(|v| v.name.clone())
            .ok_or_else(|| anyhow!("{what}: the graph has no output"))?;
        Ok(Self {
            nodes: g.node.clone(),
            inits,
            input,
            output,
            device: Device::Cpu,
            folds: Default::default(),
            ranges,
        })
    }

    /// The graph with its activations left in float: every `QuantizeLinear` of a computed value
    /// and the `DequantizeLinear` that reads it back are dropped (the weights' dequantization
    /// stays). A QDQ export rounds every activation to 8 bits; evaluated literally in float, a
    /// change in the last bit of one value can move a rounding and, through a few layers, the
    /// output by tenths, so the float path is the one that gives the same answer for the same
    /// speech on every machine.
    pub fn with_float_activations(mut self) -> Self {
        let quantized: HashMap<String, String> = self
            .nodes
            .iter()
            .filter(|n| {
                n.op_type == "QuantizeLinear"
                    && n.input.first().is_some_and(|x| !self.inits.contains_key(x))
            })
            .filter_map(|n| Some((n.output.first()?.clone(), n.input.first()?.clone())))
            .collect();
        let mut same: HashMap<String, String> = HashMap::new();
        for n in &self.nodes {
            if let (true, Some(x), Some(y)) =
                (n.op_type == "DequantizeLinear", n.input.first(), n.output.first())
            {
                if let Some(original) = quantized.get(x) {
                    same.insert(y.clone(), original.clone());
                }
            }
        }
        let dropped = |n: &NodeProto| {
            n.output.first().is_some_and(|o| quantized.contains_key(o) || same.contains_key(o))
        };
        self.nodes.retain(|n| !dropped(n));
        for n in &mut self.nodes {
            for i in &mut n.input {
                if let Some(original) = same.get(i.as_str()) {
                    *i = original.clone();
                }
            }
        }
        if let Some(original) = same.get(&self.output) {
            self.output = original.clone();
        }
        self.folds = Default::default();
        self
    }

    /// The graph with its arithmetic on `dev`: the float initializers moved there (integer ones,
    /// shape plumbing, stay on the host).
    pub fn on(mut self, dev: &Device) -> Result<Self> {
        for t in self.inits.values_mut() {
            if t.dtype().is_float() {
                *t = t.to_device(dev)?;
            }
        }
        self.device = dev.clone();
        self.folds = Default::default();
        Ok(self)
    }

    /// Evaluates the graph on one input (f32, on the graph's device). The first run of an input
    /// shape evaluates every node and keeps a [`Fold`]; later runs of that shape evaluate only
    /// the nodes that depend on the input's data, with nothing moved between host and device.
    pub fn run(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_device(&self.device)?.to_dtype(DType::F32)?;
        let fold = self
            .folds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|f| f.dims == x.dims())
            .cloned();
        let mut env: HashMap<&str, Tensor> = HashMap::new();
        env.insert(self.input.as_str(), x.clone());
        for (i, n) in self.nodes.iter().enumerate() {
            if fold.as_ref().is_some_and(|f| !f.dynamic[i]) {
                continue;
            }
            let get = |k: usize| -> Result<Option<Tensor>> {
                match n.input.get(k) {
                    None => Ok(None),
                    Some(s) if s.is_empty() => Ok(None),
                    Some(s) => fold
                        .as_ref()
                        .and_then(|f| f.operands.get(&(i, k)).or_else(|| f.values.get(s)))
                        .or_else(|| env.get(s.as_str()))
                        .or_else(|| self.inits.get(s))
                        .cloned()
                        .map(Some)
                        .ok_or_else(|| {
                            anyhow!(
                                "node {} ({}) reads {s}, which nothing produced",
                                n.name,
                                n.op_type
                            )
                        }),
                }
            };
            let out = eval(n, &get, &self.ranges)
                .with_context(|| format!("evaluating node {} ({})", n.name, n.op_type))?;
            let name = n.output.first().ok_or_else(|| anyhow!("node {} has no output", n.name))?;
            env.insert(name.as_str(), out);
        }
        let mut folds = self.folds.lock().unwrap_or_else(|e| e.into_inner());
        if fold.is_none() && folds.len() < MAX_FOLDS && !folds.iter().any(|f| f.dims == x.dims()) {
            folds.push(std::sync::Arc::new(Fold::new(
                &self.nodes,
                &self.input,
                x.dims().to_vec(),
                &env,
                &self.inits,
                &self.device,
            )?));
        }
        drop(folds);
        env.remove(self.output.as_str())
            .ok_or_else(|| anyhow!("the graph never produced its output {}", self.output))
    }

    /// The device the graph's arithmetic runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether a run over an input of these dimensions is folded (issues only kernels, so a
    /// CUDA graph can capture it).
    pub fn is_folded(&self, dims: &[usize]) -> bool {
        self.folds.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|f| f.dims == dims)
    }
}
