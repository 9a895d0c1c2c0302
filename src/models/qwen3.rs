//! Thinker LLM: Qwen3 dense (`llm.` in the checkpoint, transformers' `Qwen3ForCausalLM`).
//!
//! `llm.model.embed_tokens`, `llm.model.layers.N.*`, `llm.model.norm`, `llm.lm_head` (untied).

use candle_core::{Module, Result, Tensor};
use candle_nn::{Embedding, Linear, VarBuilder};

use super::config::MiniCpmoConfig;
use super::decoder::{Decoder, KvCache, StreamStep};

#[derive(Debug, Clone)]
pub struct Qwen3 {
    embed_tokens: Embedding,
    model: Decoder,
    lm_head: Linear,
    vocab_size: usize,
    hidden_size: usize,
    scale_emb: Option<f64>,
}

impl Qwen3 {
    /// `vb` points at `llm`.
    pub fn load(vb: VarBuilder, cfg: &MiniCpmoConfig) -> Result<Self> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        // 1. token embeddings
        let embed_tokens =
            Embedding::new(vb.pp("model").pp("embed_tokens").get((v, h), "weight")?, h);
        // 2. decoder stack with per-head q/k norm
        let model = Decoder::load(vb.pp("model"), &cfg.llm_decoder())?;
        // 3. output head (untied unless the config says otherwise)
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(embed_tokens.embeddings().clone(), None)
        } else {
            Linear::new(vb.pp("lm_head").get((v, h), "weight")?, None)
        };
        Ok(Self {
            embed_tokens,
            model,
            lm_head,
            vocab_size: v,
            hidden_size: h,
            scale_emb: cfg.scale_emb,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    pub fn new_cache(&self) -> KvCache {
        self.model.new_cache()
    }

    pub fn set_decode_mode(&mut self, mode: super::decoder::DecodeMode) {
        self.model.set_decode_mode(mode);
    }

    pub fn decoder(&self) -> &Decoder {
        &self.model
    }

    /// See [`Decoder::set_ragged_prefill`].
    pub fn set_ragged_prefill(&mut self, on: bool) {
        self.model.set_ragged_prefill(on);
    }

    /// See [`Decoder::set_prefill_graph_rows`].
    pub fn set_prefill_graph_rows(&mut self, rows: usize) {
        self.model.set_prefill_graph_rows(rows);
    }

    /// See [`Decoder::set_prefill_graph_raised`].
    pub fn set_prefill_graph_raised(&mut self, raised: bool) {
        self.model.set_prefill_graph_raised(raised);
    }

    /// Token embeddings `[n, hidden]`; ids outside the vocabulary are an error.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.vocab_size) {
            candle_core::bail!("token id {bad} is outside the vocabulary of {}", self.vocab_size);
        }
        let ids = Tensor::new(ids, self.embed_tokens.embeddings().device())?;
        let e = self.embed_tokens.forward(&ids)?;
        match self.scale_emb {
            Some(s) => e * s,
            None => Ok(e),
        }
    }

    /// Batched step: per stream, the hidden states of its new positions after the final norm.
    pub fn forward(&self, streams: &mut [StreamStep<'_>]) -> Result<Vec<Tensor>> {
        self.model.forward(streams)
    }

    /// Logits `[rows, vocab]` of hidden rows `[rows, hidden]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)
    }
}
