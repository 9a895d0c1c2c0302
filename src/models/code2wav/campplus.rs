//! The speaker model (`campplus.onnx`, CAM++): 80-bin kaldi fbank `[frames, 80]` (mean-normalized)
//! -> a 192-d speaker embedding.
//!
//! The file is an exported graph whose batch norms are partly folded into convolutions and whose
//! initializers are partly anonymous, so it is not mapped onto module names: the graph itself is
//! walked and evaluated node by node ([`OnnxGraph`]).

use anyhow::{anyhow, Result};
use candle_core::{DType, Device, Tensor};

use crate::onnx::graph::{OnnxGraph, MAX_FOLDS};
use crate::onnx::ModelProto;

mod batch;
pub use batch::MAX_BATCH;

/// The speaker model.
#[derive(Debug, Clone)]
pub struct CamPlusPlus {
    graph: OnnxGraph,
    /// Folded runs replayed as a CUDA graph per input shape, when on (a clone starts with none).
    graphs: crate::cuda_graph::GraphSlot,
    /// Whether the graph takes a batch of voices ([`CamPlusPlus::embed_batch`]), once known.
    batches: std::sync::OnceLock<bool>,
}

impl CamPlusPlus {
    pub fn from_model(m: &ModelProto) -> Result<Self> {
        Ok(Self {
            graph: OnnxGraph::from_model(m, "campplus.onnx")?,
            graphs: crate::cuda_graph::GraphSlot::off(),
            batches: Default::default(),
        })
    }

    /// The model with its arithmetic on `dev` (see [`OnnxGraph::on`]).
    pub fn on(self, dev: &Device) -> Result<Self> {
        Ok(Self {
            graph: self.graph.on(dev)?,
            graphs: crate::cuda_graph::GraphSlot::off(),
            batches: Default::default(),
        })
    }

    /// Runs of a folded input shape replayed as a CUDA graph (from the shape's third run; where
    /// the device cannot capture, op by op over fixed buffers).
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = if on {
            crate::cuda_graph::GraphSlot::on(MAX_FOLDS)
        } else {
            crate::cuda_graph::GraphSlot::off()
        };
    }

    /// Mean-normalized fbank `[frames, 80]` (on any device) -> `[192]` on the model's device.
    pub fn embed(&self, fbank: &Tensor) -> Result<Tensor> {
        Ok(self.run_input(&fbank.unsqueeze(0)?)?.flatten_all()?)
    }

    /// The graph over `x` (`[B, frames, 80]`, any device), through its CUDA graph once folded.
    fn run_input(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_device(self.graph.device())?.to_dtype(DType::F32)?;
        let run = |ins: &[Tensor]| -> candle_core::Result<Vec<Tensor>> {
            Ok(vec![self
                .graph
                .run(&ins[0])
                .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?])
        };
        // (only a folded shape is captured: an unfolded run moves constants from the host)
        let out = if self.graphs.is_on() && self.graph.is_folded(x.dims()) {
            self.graphs.run(0, &[&x], &run)?
        } else {
            vec![self.graph.run(&x)?]
        };
        out.into_iter().next().ok_or_else(|| anyhow!("campplus.onnx gave no output"))
    }
}
