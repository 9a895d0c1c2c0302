//! CAM++ over several voices at once: one run of the graph for a burst of new references, whose
//! kernels are small enough that a batch costs about what one voice does.

use anyhow::Result;
use candle_core::Tensor;

use super::CamPlusPlus;

/// Largest batch run at once (batches are padded to powers of two up to it, so that a few folded
/// shapes, and their CUDA graphs, serve every count).
pub const MAX_BATCH: usize = 8;

impl CamPlusPlus {
    /// [`CamPlusPlus::embed`] of several fbanks of one shape in runs of up to [`MAX_BATCH`]
    /// (`[B, frames, 80]`), padded to a power of two with copies of the last. `None` when the
    /// graph does not take a batch (an exported graph may fix its batch at 1): its output is not
    /// `[B, 192]`, or the first voice's row is not what that voice gets alone. That is checked on
    /// the first batch and kept, and then the caller embeds voice by voice.
    pub fn embed_batch(&self, fbanks: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
        if fbanks.len() < 2
            || fbanks.iter().any(|f| f.dims() != fbanks[0].dims())
            || self.batches.get() == Some(&false)
        {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(fbanks.len());
        for part in fbanks.chunks(MAX_BATCH) {
            let mut xs: Vec<&Tensor> = part.to_vec();
            xs.resize(part.len().next_power_of_two(), part[part.len() - 1]);
            let rows = match self.run_input(&Tensor::stack(&xs, 0)?) {
                Ok(y) if y.dim(0)? == xs.len() && y.elem_count() % xs.len() == 0 => {
                    y.reshape((xs.len(), ()))?
                }
                other => {
                    if let Err(e) = other {
                        tracing::debug!("campplus.onnx over a batch: {e:#}");
                    }
                    tracing::info!(
                        "campplus.onnx does not take a batch of voices: each voice is \
                        embedded alone"
                    );
                    let _ = self.batches.set(false);
                    return Ok(None);
                }
            };
            if self.batches.get().is_none() {
                let ok = agrees(&rows.get(0)?, &self.embed(part[0])?)?;
                let _ = self.batches.set(ok);
                if !ok {
                    tracing::info!(
                        "campplus.onnx over a batch differs from one voice alone: each \
                        voice is embedded alone"
                    );
                    return Ok(None);
                }
            }
            for i in 0..part.len() {
                out.push(rows.get(i)?);
            }
        }
        Ok(Some(out))
    }
}

/// Whether a batched row is the voice's own embedding: finite, and within 1e-3 of it relative to
/// its largest value (kernels over other shapes may sum in other orders; a graph that mixes its
/// batch's voices is far off).
fn agrees(batched: &Tensor, alone: &Tensor) -> Result<bool> {
    let (a, b) = (batched.flatten_all()?.to_vec1::<f32>()?, alone.flatten_all()?.to_vec1::<f32>()?);
    if a.len() != b.len() || a.iter().chain(&b).any(|v| !v.is_finite()) {
        return Ok(false);
    }
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    Ok(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-3 * scale))
}
