//! Talker, the Talker (`tts.` in the checkpoint, MiniCPMTTS): a Llama backbone fed with built
//! embeddings.
//!
//! - `tts.emb_text` indexed with the Thinker's token ids and the config's `text_eos_token_id` /
//!   `audio_bos_token_id`;
//! - `tts.projector_semantic.{linear1, linear2}` (ReLU between) over the Thinker's hidden states,
//!   L2-normalized when `normalize_projected_hidden`;
//! - `tts.emb_code.0` embeds the previous code, `tts.head_code.0` (weight norm, materialized here)
//!   gives the next code's logits; code `num_audio_tokens - 1` ends the utterance;
//! - `tts.model.layers.N.*`, `tts.model.norm` (its own `embed_tokens` is never used).

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};

use super::config::TtsConfig;
use super::decoder::{Decoder, KvCache, StreamStep};

/// How the condition ends: turn mode closes the text before opening the audio; duplex segments
/// only open the audio.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConditionMode {
    Turn,
    Duplex,
}

#[derive(Debug, Clone)]
pub struct Talker {
    emb_text: Embedding,
    projector_linear1: Linear,
    projector_linear2: Linear,
    emb_code: Embedding,
    head_code: Linear,
    model: Decoder,
    cfg: TtsConfig,
}

/// `torch._weight_norm(v, g, dim=0)`: every output row of `v` rescaled to norm `g`.
pub fn weight_norm(g: &Tensor, v: &Tensor) -> Result<Tensor> {
    // computed in f32 (or f64 when the weights are f64)
    let ct = if v.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let v32 = v.to_dtype(ct)?;
    let dims: Vec<usize> = (1..v.rank()).collect();
    let mut norm = v32.sqr()?;
    for &d in dims.iter().rev() {
        norm = norm.sum_keepdim(d)?;
    }
    let norm = norm.sqrt()?;
    v32.broadcast_mul(&g.to_dtype(ct)?.broadcast_div(&norm)?)?.to_dtype(v.dtype())
}

/// Loads a weight-normed weight `<prefix>` of shape `shape`, accepting the three spellings: the
/// parametrization (`parametrizations.weight.original0/1`), the legacy `weight_g`/`weight_v`, and
/// a plain materialized `weight`.
pub fn load_weight_norm(vb: &VarBuilder, shape: &[usize]) -> Result<Tensor> {
    let mut gshape = vec![shape[0]];
    gshape.extend(std::iter::repeat_n(1, shape.len() - 1));
    let (g, v) = if vb.contains_tensor("parametrizations.weight.original0") {
        (
            vb.get(gshape.as_slice(), "parametrizations.weight.original0")?,
            vb.get(shape, "parametrizations.weight.original1")?,
        )
    } else if vb.contains_tensor("weight_g") {
        (vb.get(gshape.as_slice(), "weight_g")?, vb.get(shape, "weight_v")?)
    } else {
        return vb.get(shape, "weight");
    };
    weight_norm(&g, &v)
}

impl Talker {
    /// `vb` points at `tts`.
    pub fn load(vb: VarBuilder, cfg: &TtsConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        let emb_text =
            Embedding::new(vb.pp("emb_text").get((cfg.num_text_tokens, h), "weight")?, h);
        let p = vb.pp("projector_semantic");
        let projector_linear1 = Linear::new(
            p.pp("linear1").get((h, cfg.llm_dim), "weight")?,
            Some(p.pp("linear1").get(h, "bias")?),
        );
        let projector_linear2 = Linear::new(
            p.pp("linear2").get((h, h), "weight")?,
            Some(p.pp("linear2").get(h, "bias")?),
        );
        let emb_code =
            Embedding::new(vb.pp("emb_code").pp(0).get((cfg.num_audio_tokens, h), "weight")?, h);
        let head_code = Linear::new(
            load_weight_norm(&vb.pp("head_code").pp(0), &[cfg.num_audio_tokens, h])?,
            None,
        );
        let model = Decoder::load(vb.pp("model"), &cfg.decoder())?;
        Ok(Self {
            emb_text,
            projector_linear1,
            projector_linear2,
            emb_code,
            head_code,
            model,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &TtsConfig {
        &self.cfg
    }

    pub fn eos_code(&self) -> u32 {
        self.cfg.eos_code()
    }

    pub fn new_cache(&self) -> KvCache {
        self.model.new_cache()
    }

    pub fn decoder(&self) -> &Decoder {
        &self.model
    }

    pub fn set_decode_mode(&mut self, mode: super::decoder::DecodeMode) {
        self.model.set_decode_mode(mode);
    }

    /// See [`Decoder::set_prefill_graph_rows`].
    pub fn set_prefill_graph_rows(&mut self, rows: usize) {
        self.model.set_prefill_graph_rows(rows);
    }

    /// See [`Decoder::set_prefill_graph_raised`].
    pub fn set_prefill_graph_raised(&mut self, raised: bool) {
        self.model.set_prefill_graph_raised(raised);
    }

    fn device(&self) -> &candle_core::Device {
        self.emb_text.embeddings().device()
    }

    fn embed_text(&self, ids: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.cfg.num_text_tokens) {
            candle_core::bail!(
                "text id {bad} is outside the Talker's emb_text ({} rows)",
                self.cfg.num_text_tokens
            );
        }
        self.emb_text.forward(&Tensor::new(ids, self.device())?)
    }

    /// Prefill embeddings for a hand-off:
    /// `emb_text(id_i) + L2normalize(projector_semantic(h_i))` per Thinker token, then
    /// `emb_text(text_eos)` (turn mode) and `emb_text(audio_bos)`. `hidden: [n, llm_dim]` (any
    /// float dtype).
    pub fn condition(&self, ids: &[u32], hidden: &Tensor, mode: ConditionMode) -> Result<Tensor> {
        let tail = self.condition_tail(mode)?;
        if ids.is_empty() {
            if hidden.dim(0)? != 0 {
                candle_core::bail!("{} hidden rows for 0 text ids", hidden.dim(0)?);
            }
            return Ok(tail);
        }
        Tensor::cat(&[self.condition_rows(ids, hidden)?, tail], 0)
    }

    /// The per-token part of the condition (so it can be prefilled while the text is still being
    /// written).
    pub fn condition_rows(&self, ids: &[u32], hidden: &Tensor) -> Result<Tensor> {
        let n = ids.len();
        if hidden.dim(0)? != n {
            candle_core::bail!("{} hidden rows for {n} text ids", hidden.dim(0)?);
        }
        let dtype = self.emb_text.embeddings().dtype();
        let h = hidden.to_device(self.device())?.to_dtype(dtype)?;
        let mut p = self.projector_linear2.forward(&self.projector_linear1.forward(&h)?.relu()?)?;
        if self.cfg.normalize_projected_hidden {
            // F.normalize(p, dim=-1): p / max(||p||, 1e-12)
            let norm =
                p.to_dtype(DType::F32)?.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
            p = p.to_dtype(DType::F32)?.broadcast_div(&norm)?.to_dtype(dtype)?;
        }
        self.embed_text(ids)? + p
    }

    /// The closing part of the condition: `emb_text(text_eos)` (turn mode) and
    /// `emb_text(audio_bos)`.
    pub fn condition_tail(&self, mode: ConditionMode) -> Result<Tensor> {
        let mut suffix = Vec::with_capacity(2);
        if mode == ConditionMode::Turn {
            suffix.push(self.cfg.text_eos_token_id);
        }
        suffix.push(self.cfg.audio_bos_token_id);
        self.embed_text(&suffix)
    }

    /// Embeddings of codes fed back as decode inputs.
    pub fn embed_codes(&self, codes: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = codes.iter().find(|&&c| c as usize >= self.cfg.num_audio_tokens) {
            candle_core::bail!(
                "code {bad} is outside the Talker's {} codes",
                self.cfg.num_audio_tokens
            );
        }
        self.emb_code.forward(&Tensor::new(codes, self.device())?)
    }

    /// Batched step: per stream, the backbone's hidden states of its new positions.
    pub fn forward(&self, streams: &mut [StreamStep<'_>]) -> Result<Vec<Tensor>> {
        self.model.forward(streams)
    }

    /// Code logits `[rows, num_audio_tokens]` of hidden rows.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.head_code.forward(hidden)
    }
}
