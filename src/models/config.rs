//! `config.json` of a MiniCPM-o 4.5 checkpoint, as serde types.
//!
//! The field names mirror the checkpoint's own file: the Thinker LLM's Qwen3 fields sit flat at
//! the top level, the Whisper encoder's fields under `audio_config`, the Talker's under
//! `tts_config`. Unknown fields (vision, slicing, ...) are ignored on read. Values that the
//! reference code takes from library defaults (the Talker's norm epsilon and RoPE theta) have the
//! same defaults here.

use serde::{Deserialize, Serialize};

fn default_rms_eps() -> f64 {
    1e-6
}
fn default_qwen_rope_theta() -> f64 {
    1_000_000.0
}
fn default_llama_rope_theta() -> f64 {
    10_000.0
}
fn default_pool_step() -> usize {
    5
}
fn default_true() -> bool {
    true
}
fn default_silu() -> String {
    "silu".to_string()
}
fn default_gelu() -> String {
    "gelu".to_string()
}

/// The whole `config.json` (the parts this server uses).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MiniCpmoConfig {
    // ---- Thinker LLM (Qwen3 dense), flat at the top level ----
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Qwen3 states it explicitly; older files may omit it (then hidden / heads).
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_silu")]
    pub hidden_act: String,
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_qwen_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    /// Multiplier of the token embeddings, when present (absent in MiniCPM-o 4.5 as far as known).
    #[serde(default)]
    pub scale_emb: Option<f64>,
    /// Average pooling of the projected audio encoder output (5 -> 10 embeddings per second).
    #[serde(default = "default_pool_step")]
    pub audio_pool_step: usize,
    pub audio_config: WhisperConfig,
    pub tts_config: TtsConfig,
}

/// `audio_config`: the Whisper-medium encoder.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WhisperConfig {
    pub d_model: usize,
    pub encoder_layers: usize,
    pub encoder_attention_heads: usize,
    pub encoder_ffn_dim: usize,
    pub num_mel_bins: usize,
    pub max_source_positions: usize,
    #[serde(default = "default_gelu")]
    pub activation_function: String,
}

/// `tts_config`: the Talker (MiniCPMTTS, Llama backbone).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TtsConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_hidden_layers: usize,
    pub num_key_value_heads: usize,
    pub max_position_embeddings: usize,
    /// Width of the Thinker hidden states fed to `projector_semantic`.
    pub llm_dim: usize,
    /// Speech codes + end-of-speech; the end code is `num_audio_tokens - 1`.
    pub num_audio_tokens: usize,
    pub num_text_tokens: usize,
    /// Id into `tts.emb_text` (not an LLM token) that opens the audio.
    pub audio_bos_token_id: u32,
    /// Id into `tts.emb_text` that closes the text (turn mode only).
    pub text_eos_token_id: u32,
    #[serde(default = "default_true")]
    pub normalize_projected_hidden: bool,
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_llama_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub num_vq: Option<usize>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub top_k: Option<usize>,
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
}

impl MiniCpmoConfig {
    pub fn from_json(text: &str) -> anyhow::Result<Self> {
        let cfg: Self = serde_json::from_str(text)?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// Refuses what this implementation does not compute, naming the field.
    pub fn validate(&self) -> anyhow::Result<()> {
        use anyhow::bail;
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            bail!("config.json: rope_scaling is set; only plain RoPE is implemented");
        }
        if self.attention_bias {
            bail!("config.json: attention_bias = true is not a Qwen3 dense layout");
        }
        if self.hidden_act != "silu" {
            bail!("config.json: hidden_act {:?} (expected \"silu\")", self.hidden_act);
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            bail!(
                "config.json: num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if !self.head_dim().is_multiple_of(2) {
            bail!("config.json: head_dim {} must be even for RoPE", self.head_dim());
        }
        let a = &self.audio_config;
        if a.activation_function != "gelu" {
            bail!(
                "config.json: audio_config.activation_function {:?} (expected \"gelu\")",
                a.activation_function
            );
        }
        if !a.d_model.is_multiple_of(a.encoder_attention_heads) {
            bail!("config.json: audio_config.d_model is not a multiple of encoder_attention_heads");
        }
        // The reference sizes the audio projector's input as encoder_ffn_dim / 4.
        if a.encoder_ffn_dim / 4 != a.d_model {
            bail!(
                "config.json: audio_config.encoder_ffn_dim / 4 = {} but d_model = {}; the audio \
                projector input would not match",
                a.encoder_ffn_dim / 4,
                a.d_model
            );
        }
        let t = &self.tts_config;
        if t.num_vq.unwrap_or(1) != 1 {
            bail!("config.json: tts_config.num_vq = {:?}; only 1 is supported", t.num_vq);
        }
        if t.llm_dim != self.hidden_size {
            bail!(
                "config.json: tts_config.llm_dim {} differs from the Thinker hidden_size {}",
                t.llm_dim,
                self.hidden_size
            );
        }
        if !t.num_attention_heads.is_multiple_of(t.num_key_value_heads)
            || !t.hidden_size.is_multiple_of(t.num_attention_heads)
        {
            bail!("config.json: tts_config head counts do not divide hidden_size");
        }
        if t.num_audio_tokens < 2 {
            bail!("config.json: tts_config.num_audio_tokens must be at least 2");
        }
        if (t.audio_bos_token_id as usize) >= t.num_text_tokens
            || (t.text_eos_token_id as usize) >= t.num_text_tokens
        {
            bail!(
                "config.json: tts_config audio_bos/text_eos ids lie outside emb_text ({} rows)",
                t.num_text_tokens
            );
        }
        if self.vocab_size > t.num_text_tokens {
            bail!(
                "config.json: the Talker's emb_text has {} rows but the Thinker vocabulary has \
                {} ids",
                t.num_text_tokens,
                self.vocab_size
            );
        }
        Ok(())
    }

    /// The Thinker LLM's decoder shape.
    pub fn llm_decoder(&self) -> super::decoder::DecoderConfig {
        super::decoder::DecoderConfig {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim(),
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            max_positions: self.max_position_embeddings,
            qk_norm: true,
        }
    }
}

impl TtsConfig {
    /// The code that ends an utterance.
    pub fn eos_code(&self) -> u32 {
        (self.num_audio_tokens - 1) as u32
    }

    pub fn decoder(&self) -> super::decoder::DecoderConfig {
        super::decoder::DecoderConfig {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads,
            head_dim: self.hidden_size / self.num_attention_heads,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            max_positions: self.max_position_embeddings,
            qk_norm: false,
        }
    }
}
