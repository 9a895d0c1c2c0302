//! Synthetic checkpoints: seeded random weights in the real MiniCPM-o 4.5 layout, at any
//! dimensions.
//!
//! - [`Preset::Tiny`]: small enough for CI and the CPU default; special tokens at compact ids.
//! - [`Preset::Full`]: the real dimensions and the real special-token ids.
//!
//! The same deterministic values come out of [`write_checkpoint`] (a directory with `config.json`,
//! safetensors shards + index and a `tokenizer.json`, the layout a real checkpoint has) and of
//! [`SyntheticBackend`] (tensors made directly on the device, no file: how full-size weights reach
//! a GPU for speed runs). Synthetic weights babble; they exist to exercise every code path and to
//! measure speed at true dimensions.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

use antiphon_models::config::{MiniCpmoConfig, TtsConfig, WhisperConfig};
use antiphon_models::tokenizer::SpecialTokens;
use antiphon_models::tools::ToolTokens;

/// Named dimension sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// Small dimensions for tests and the CPU default.
    Tiny,
    /// MiniCPM-o 4.5's real dimensions.
    Full,
}

/// The real ids of the special tokens, in [`SpecialTokens::NAMES`] order.
pub const REAL_SPECIAL_IDS: [u32; 18] = [
    151643, 151644, 151645, 151667, 151668, 151697, 151699, 128244, 151683, 151684, 151703, 151704,
    151705, 151706, 151717, 151718, 151721, 151722,
];

/// The real ids of the tool template's tags, in [`ToolTokens::NAMES`] order.
pub const REAL_TOOL_IDS: [u32; 4] = [151657, 151658, 151665, 151666];

/// Byte-level BPE has 256 base tokens; the tiny preset puts the special tokens right after them.
const BYTE_TOKENS: u32 = 256;

impl std::str::FromStr for Preset {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "full" => Ok(Preset::Full),
            other => Err(format!("unknown preset {other:?}: expected tiny or full")),
        }
    }
}

impl Preset {
    pub fn config(self) -> MiniCpmoConfig {
        match self {
            Preset::Tiny => MiniCpmoConfig {
                vocab_size: 288,
                hidden_size: 128,
                intermediate_size: 384,
                num_hidden_layers: 4,
                num_attention_heads: 4,
                num_key_value_heads: 2,
                head_dim: Some(32),
                hidden_act: "silu".into(),
                rms_norm_eps: 1e-6,
                rope_theta: 1_000_000.0,
                rope_scaling: None,
                max_position_embeddings: 8192,
                tie_word_embeddings: false,
                attention_bias: false,
                scale_emb: None,
                audio_pool_step: 5,
                audio_config: WhisperConfig {
                    d_model: 64,
                    encoder_layers: 2,
                    encoder_attention_heads: 4,
                    encoder_ffn_dim: 256,
                    num_mel_bins: 80,
                    max_source_positions: 1500,
                    activation_function: "gelu".into(),
                },
                tts_config: TtsConfig {
                    hidden_size: 128,
                    intermediate_size: 384,
                    num_attention_heads: 4,
                    num_hidden_layers: 4,
                    num_key_value_heads: 4,
                    max_position_embeddings: 4096,
                    llm_dim: 128,
                    num_audio_tokens: 6562,
                    num_text_tokens: 288,
                    audio_bos_token_id: 287,
                    text_eos_token_id: 286,
                    normalize_projected_hidden: true,
                    rms_norm_eps: 1e-6,
                    rope_theta: 10_000.0,
                    num_vq: Some(1),
                    top_p: Some(0.85),
                    top_k: Some(25),
                    repetition_penalty: Some(1.05),
                },
            },
            Preset::Full => MiniCpmoConfig {
                vocab_size: 151748,
                hidden_size: 4096,
                intermediate_size: 12288,
                num_hidden_layers: 36,
                num_attention_heads: 32,
                num_key_value_heads: 8,
                head_dim: Some(128),
                hidden_act: "silu".into(),
                rms_norm_eps: 1e-6,
                rope_theta: 1_000_000.0,
                rope_scaling: None,
                max_position_embeddings: 40960,
                tie_word_embeddings: false,
                attention_bias: false,
                scale_emb: None,
                audio_pool_step: 5,
                audio_config: WhisperConfig {
                    d_model: 1024,
                    encoder_layers: 24,
                    encoder_attention_heads: 16,
                    encoder_ffn_dim: 4096,
                    num_mel_bins: 80,
                    max_source_positions: 1500,
                    activation_function: "gelu".into(),
                },
                tts_config: TtsConfig {
                    hidden_size: 768,
                    intermediate_size: 3072,
                    num_attention_heads: 12,
                    num_hidden_layers: 20,
                    num_key_value_heads: 12,
                    max_position_embeddings: 4096,
                    llm_dim: 4096,
                    num_audio_tokens: 6562,
                    num_text_tokens: 152064,
                    audio_bos_token_id: 151687,
                    text_eos_token_id: 151692,
                    normalize_projected_hidden: true,
                    rms_norm_eps: 1e-6,
                    rope_theta: 10_000.0,
                    num_vq: Some(1),
                    top_p: Some(0.85),
                    top_k: Some(25),
                    repetition_penalty: Some(1.05),
                },
            },
        }
    }

    /// Ids of the special tokens in this preset's tokenizer, in [`SpecialTokens::NAMES`] order.
    pub fn special_ids(self) -> [u32; 18] {
        match self {
            Preset::Tiny => std::array::from_fn(|i| BYTE_TOKENS + i as u32),
            Preset::Full => REAL_SPECIAL_IDS,
        }
    }

    /// Ids of the tool template's tags in this preset's tokenizer, in [`ToolTokens::NAMES`] order
    /// (the tiny preset puts them after the special tokens).
    pub fn tool_ids(self) -> [u32; 4] {
        match self {
            Preset::Tiny => {
                std::array::from_fn(|i| BYTE_TOKENS + SpecialTokens::NAMES.len() as u32 + i as u32)
            }
            Preset::Full => REAL_TOOL_IDS,
        }
    }
}

/// Every tensor of the Thinker and Talker in checkpoint names, with its shape.
pub fn tensor_specs(cfg: &MiniCpmoConfig) -> Vec<(String, Vec<usize>)> {
    let mut v: Vec<(String, Vec<usize>)> = Vec::new();
    let mut add = |n: String, s: &[usize]| v.push((n, s.to_vec()));
    // Thinker LLM
    let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
    let (qh, kvh) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    add("llm.model.embed_tokens.weight".into(), &[cfg.vocab_size, h]);
    decoder_specs(&mut add, "llm.model", cfg.num_hidden_layers, h, i, qh, kvh, Some(hd));
    add("llm.lm_head.weight".into(), &[cfg.vocab_size, h]);
    // Audio encoder
    let a = &cfg.audio_config;
    let d = a.d_model;
    add("apm.conv1.weight".into(), &[d, a.num_mel_bins, 3]);
    add("apm.conv1.bias".into(), &[d]);
    add("apm.conv2.weight".into(), &[d, d, 3]);
    add("apm.conv2.bias".into(), &[d]);
    add("apm.embed_positions.weight".into(), &[a.max_source_positions, d]);
    for l in 0..a.encoder_layers {
        let p = format!("apm.layers.{l}");
        for ln in ["self_attn_layer_norm", "final_layer_norm"] {
            add(format!("{p}.{ln}.weight"), &[d]);
            add(format!("{p}.{ln}.bias"), &[d]);
        }
        for proj in ["q_proj", "k_proj", "v_proj", "out_proj"] {
            add(format!("{p}.self_attn.{proj}.weight"), &[d, d]);
            if proj != "k_proj" {
                add(format!("{p}.self_attn.{proj}.bias"), &[d]);
            }
        }
        add(format!("{p}.fc1.weight"), &[a.encoder_ffn_dim, d]);
        add(format!("{p}.fc1.bias"), &[a.encoder_ffn_dim]);
        add(format!("{p}.fc2.weight"), &[d, a.encoder_ffn_dim]);
        add(format!("{p}.fc2.bias"), &[d]);
    }
    add("apm.layer_norm.weight".into(), &[d]);
    add("apm.layer_norm.bias".into(), &[d]);
    let pin = a.encoder_ffn_dim / 4;
    add("audio_projection_layer.linear1.weight".into(), &[h, pin]);
    add("audio_projection_layer.linear1.bias".into(), &[h]);
    add("audio_projection_layer.linear2.weight".into(), &[h, h]);
    add("audio_projection_layer.linear2.bias".into(), &[h]);
    // Talker
    let t = &cfg.tts_config;
    let th = t.hidden_size;
    add("tts.emb_text.weight".into(), &[t.num_text_tokens, th]);
    add("tts.projector_semantic.linear1.weight".into(), &[th, t.llm_dim]);
    add("tts.projector_semantic.linear1.bias".into(), &[th]);
    add("tts.projector_semantic.linear2.weight".into(), &[th, th]);
    add("tts.projector_semantic.linear2.bias".into(), &[th]);
    add("tts.emb_code.0.weight".into(), &[t.num_audio_tokens, th]);
    add("tts.head_code.0.parametrizations.weight.original0".into(), &[t.num_audio_tokens, 1]);
    add("tts.head_code.0.parametrizations.weight.original1".into(), &[t.num_audio_tokens, th]);
    let thd = th / t.num_attention_heads;
    decoder_specs(
        &mut add,
        "tts.model",
        t.num_hidden_layers,
        th,
        t.intermediate_size,
        t.num_attention_heads * thd,
        t.num_key_value_heads * thd,
        None,
    );
    v
}

#[allow(clippy::too_many_arguments)]
fn decoder_specs(
    add: &mut impl FnMut(String, &[usize]),
    prefix: &str,
    layers: usize,
    h: usize,
    i: usize,
    qh: usize,
    kvh: usize,
    qk_norm: Option<usize>,
) {
    for l in 0..layers {
        let p = format!("{prefix}.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), &[h]);
        add(format!("{p}.self_attn.q_proj.weight"), &[qh, h]);
        add(format!("{p}.self_attn.k_proj.weight"), &[kvh, h]);
        add(format!("{p}.self_attn.v_proj.weight"), &[kvh, h]);
        add(format!("{p}.self_attn.o_proj.weight"), &[h, qh]);
        if let Some(hd) = qk_norm {
            add(format!("{p}.self_attn.q_norm.weight"), &[hd]);
            add(format!("{p}.self_attn.k_norm.weight"), &[hd]);
        }
        add(format!("{p}.post_attention_layernorm.weight"), &[h]);
        add(format!("{p}.mlp.gate_proj.weight"), &[i, h]);
        add(format!("{p}.mlp.up_proj.weight"), &[i, h]);
        add(format!("{p}.mlp.down_proj.weight"), &[h, i]);
    }
    add(format!("{prefix}.norm.weight"), &[h]);
}

/// How a tensor is initialized, from its name and shape: norm scales near 1, biases and
/// embeddings small, weight-norm magnitudes 1, other weights with variance 1 / fan-in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InitRule {
    pub mean: f32,
    pub std: f32,
}

pub fn init_rule(name: &str, shape: &[usize]) -> InitRule {
    let fan_in: usize = shape.iter().skip(1).product::<usize>().max(1);
    if name.ends_with(".running_var") {
        InitRule { mean: 1.0, std: 0.0 }
    } else if name.ends_with(".running_mean") {
        InitRule { mean: 0.0, std: 0.02 }
    } else if name.contains("conv_post")
        && (name.ends_with(".original0") || name.ends_with(".weight_g"))
    {
        // a quiet vocoder output layer: the spectrum magnitude is exp() of it
        InitRule { mean: 0.05, std: 0.0 }
    } else if name.ends_with(".original0") || name.ends_with(".weight_g") {
        InitRule { mean: 1.0, std: 0.0 }
    } else if name.ends_with(".bias") {
        InitRule { mean: 0.0, std: 0.02 }
    } else if shape.len() == 1 {
        InitRule { mean: 1.0, std: 0.02 }
    } else if name.contains("emb") || name.contains("embed") {
        InitRule { mean: 0.0, std: 0.02 }
    } else {
        InitRule { mean: 0.0, std: (1.0 / fan_in as f64).sqrt() as f32 }
    }
}

/// 64-bit FNV-1a of the seed and the name: the per-tensor stream of random numbers.
pub fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325 ^ seed.wrapping_mul(0x9E3779B97F4A7C15);
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Deterministic values of one tensor on the host.
pub fn init_values(seed: u64, name: &str, shape: &[usize]) -> Vec<f32> {
    let rule = init_rule(name, shape);
    let n: usize = shape.iter().product();
    if rule.std == 0.0 {
        return vec![rule.mean; n];
    }
    let mut rng = ChaCha8Rng::seed_from_u64(tensor_seed(seed, name));
    (0..n)
        .map(|_| {
            let z: f32 = StandardNormal.sample(&mut rng);
            rule.mean + rule.std * z
        })
        .collect()
}

/// One synthetic tensor. On the CPU the values are [`init_values`]; on an accelerator they are
/// drawn on the device from the same per-tensor seed (same distribution, other numbers), so that
/// full-size weights never cross the host.
pub fn init_tensor(
    seed: u64,
    name: &str,
    shape: &[usize],
    dtype: DType,
    dev: &Device,
) -> candle_core::Result<Tensor> {
    if dev.is_cpu() {
        return Tensor::from_vec(init_values(seed, name, shape), shape, dev)?.to_dtype(dtype);
    }
    let rule = init_rule(name, shape);
    let t = if rule.std == 0.0 {
        (Tensor::ones(shape, DType::F32, dev)? * rule.mean as f64)?
    } else {
        dev.set_seed(tensor_seed(seed, name))?;
        Tensor::randn(rule.mean, rule.std, shape, dev)?
    };
    t.to_dtype(dtype)
}

/// A `VarBuilder` backend that makes every tensor from the seed, for the tensors of
/// [`tensor_specs`] (asking for anything else is an error, as with a checkpoint file).
pub struct SyntheticBackend {
    seed: u64,
    shapes: HashMap<String, Vec<usize>>,
}

impl SyntheticBackend {
    pub fn new(cfg: &MiniCpmoConfig, seed: u64) -> Self {
        Self { seed, shapes: tensor_specs(cfg).into_iter().collect() }
    }

    /// A `VarBuilder` over synthetic weights, checked like a checkpoint.
    pub fn var_builder(
        cfg: &MiniCpmoConfig,
        seed: u64,
        dtype: DType,
        dev: &Device,
    ) -> VarBuilder<'static> {
        let inner = Box::new(Self::new(cfg, seed));
        let checked = crate::checkpoint::Checked {
            inner,
            origin: format!("synthetic(seed {seed})"),
            seen: None,
        };
        VarBuilder::from_backend(Box::new(checked), dtype, dev.clone())
    }
}

impl SimpleBackend for SyntheticBackend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        init_tensor(self.seed, name, s.dims(), dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        match self.shapes.get(name) {
            Some(shape) => init_tensor(self.seed, name, shape, dtype, dev),
            None => candle_core::bail!("synthetic weights have no tensor {name}"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.shapes.contains_key(name)
    }
}

/// `config.json` as a real checkpoint spells it: the typed fields plus the identification ones.
pub fn config_json(cfg: &MiniCpmoConfig, dtype: DType) -> serde_json::Value {
    let mut v = serde_json::to_value(cfg).expect("config serializes");
    let o = v.as_object_mut().expect("an object");
    o.insert("model_type".into(), "minicpmo".into());
    o.insert("architectures".into(), serde_json::json!(["MiniCPMO"]));
    o.insert("version".into(), "4.5".into());
    o.insert(
        "torch_dtype".into(),
        if dtype == DType::BF16 { "bfloat16" } else { "float32" }.into(),
    );
    o.insert("use_sliding_window".into(), false.into());
    o.insert("stream_input".into(), true.into());
    o.insert("synthetic".into(), true.into());
    let t = o.get_mut("tts_config").and_then(|t| t.as_object_mut()).expect("tts_config");
    t.insert("model_type".into(), "minicpmtts".into());
    t.insert("backbone_model".into(), "llama".into());
    t.insert("condition_type".into(), "hidden_text_merge".into());
    t.insert("s3_stream_chunk_size".into(), 25.into());
    t.insert("s3_stream_n_timesteps".into(), 10.into());
    t.insert("s3_stream_prelook_size".into(), 3.into());
    let a = o.get_mut("audio_config").and_then(|t| t.as_object_mut()).expect("audio_config");
    a.insert("model_type".into(), "whisper".into());
    v
}

/// GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> =
        (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut map = vec![' '; 256];
    for (b, c) in printable.iter().zip(chars) {
        map[*b as usize] = char::from_u32(c).expect("valid char");
    }
    map
}

/// A Qwen-style byte-level BPE `tokenizer.json` (no merges: every byte is a token) with the
/// pipeline's special tokens at `special_ids` and the tool template's tags (added, not special, as
/// in Qwen3's tokenizer) at `tool_ids`.
pub fn tokenizer_json(special_ids: &[u32; 18], tool_ids: &[u32; 4]) -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    for (b, c) in byte_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), (b as u32).into());
    }
    let mut added = Vec::new();
    for (name, &id) in SpecialTokens::NAMES.iter().zip(special_ids) {
        // Added tokens keep their ids only if the model's vocabulary holds them too.
        vocab.insert(name.to_string(), id.into());
        added.push(
            serde_json::json!({"id": id, "content": name, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}),
        );
    }
    for (name, &id) in ToolTokens::NAMES.iter().zip(tool_ids) {
        vocab.insert(name.to_string(), id.into());
        added.push(
            serde_json::json!({"id": id, "content": name, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": false}),
        );
    }
    let pattern = concat!(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}",
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    );
    let bl = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": false, "use_regex": false});
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
                "invert": false}, bl]},
        "post_processor": bl,
        "decoder": bl,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
                "ignore_merges": false,
            "vocab": vocab, "merges": []}
    })
}

/// What to write.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub preset: Preset,
    pub seed: u64,
    pub dtype: DType,
    /// Upper bound of one shard's size in bytes.
    pub shard_bytes: usize,
}

impl Default for SynthOptions {
    fn default() -> Self {
        Self { preset: Preset::Tiny, seed: 0, dtype: DType::F32, shard_bytes: 2 << 30 }
    }
}

/// Writes a complete synthetic checkpoint directory: `config.json`, `model-0000k-of-0000n
/// .safetensors` + `model.safetensors.index.json`, `tokenizer.json`, `generation_config.json`.
/// One shard is held in memory at a time.
pub fn write_checkpoint(dir: &Path, opts: &SynthOptions) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cfg = opts.preset.config();
    let specs = tensor_specs(&cfg);
    // Plan the shards.
    let mut shards: Vec<Vec<(String, Vec<usize>)>> = vec![vec![]];
    let mut cur = 0usize;
    for (name, shape) in specs {
        let bytes = shape.iter().product::<usize>() * opts.dtype.size_in_bytes();
        if cur > 0 && cur + bytes > opts.shard_bytes {
            shards.push(vec![]);
            cur = 0;
        }
        cur += bytes;
        shards.last_mut().expect("one shard").push((name, shape));
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut total = 0usize;
    for (k, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", k + 1, n);
        let mut tensors = HashMap::new();
        for (name, shape) in shard {
            let t = init_tensor(opts.seed, name, shape, opts.dtype, &Device::Cpu)?;
            total += t.elem_count() * opts.dtype.size_in_bytes();
            weight_map.insert(name.clone(), file.clone());
            tensors.insert(name.clone(), t);
        }
        candle_core::safetensors::save(&tensors, dir.join(&file))
            .with_context(|| format!("writing {file}"))?;
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index)?,
    )?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config_json(&cfg, opts.dtype))?,
    )?;
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_string(&tokenizer_json(
            &opts.preset.special_ids(),
            &opts.preset.tool_ids(),
        ))?,
    )?;
    let ids = opts.preset.special_ids();
    let gen = serde_json::json!({"bos_token_id": ids[0], "eos_token_id": [ids[2], ids[0]],
        "pad_token_id": ids[0],
        "do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95});
    std::fs::write(dir.join("generation_config.json"), serde_json::to_string_pretty(&gen)?)?;
    write_token2wav(&dir.join("assets").join("token2wav"), opts.preset, opts.seed)?;
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// token2wav assets (Code2Wav)

mod campplus_graph;
mod code2wav;
pub use campplus_graph::*;
pub use code2wav::*;
