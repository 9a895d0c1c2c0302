//! Synthetic token2wav assets: the flow, HiFT, S3 tokenizer and CAM++ at a preset's widths, in
//! memory or written in the real file formats (torch zip state dicts, YAML, ONNX).

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

use antiphon_models::code2wav::campplus::CamPlusPlus;
use antiphon_models::code2wav::flow::{Flow, FlowConfig};
use antiphon_models::code2wav::hift::{HiftConfig, HiftGenerator};
use antiphon_models::code2wav::s3tokenizer::S3Tokenizer;
use antiphon_models::code2wav::{self as c2w, BufferSeeds, Code2Wav, Vocoder};

use super::*;
use crate::onnx::{attr_float, attr_int, attr_ints, GraphBuilder, ModelProto};

/// The Code2Wav dimensions of a preset.
#[derive(Debug, Clone, PartialEq)]
pub struct Code2WavDims {
    pub flow: FlowConfig,
    pub hift: HiftConfig,
    /// S3 tokenizer width and depth (128 mel bins, 64-dim heads).
    pub s3_state: usize,
    pub s3_layers: usize,
    pub cam: CamConfig,
}

impl Preset {
    pub fn code2wav(self) -> Code2WavDims {
        use antiphon_models::code2wav::conformer::ConformerConfig;
        use antiphon_models::code2wav::dit::DitConfig;
        match self {
            Preset::Full => Code2WavDims {
                flow: FlowConfig::default(),
                hift: HiftConfig::causal(),
                s3_state: 1280,
                s3_layers: 6,
                cam: CamConfig::real(),
            },
            Preset::Tiny => Code2WavDims {
                flow: FlowConfig {
                    input_size: 64,
                    encoder: ConformerConfig {
                        input_size: 64,
                        output_size: 64,
                        num_blocks: 2,
                        num_up_blocks: 2,
                        attention_heads: 2,
                        linear_units: 128,
                        ..ConformerConfig::default()
                    },
                    estimator: DitConfig {
                        hidden_size: 64,
                        depth: 2,
                        num_heads: 2,
                        head_dim: 32,
                        mlp_ratio: 2.0,
                        ..DitConfig::default()
                    },
                    ..FlowConfig::default()
                },
                hift: HiftConfig { base_channels: 32, f0_channels: 32, ..HiftConfig::causal() },
                s3_state: 64,
                s3_layers: 2,
                cam: CamConfig::tiny(),
            },
        }
    }
}

/// A backend that makes whatever tensor a loader asks for from `(seed, name, shape)`, recording it
/// (for writing files). Weight-normed modules see the parametrization spelling.
pub struct LazySynthetic {
    seed: u64,
    record: Option<std::sync::Mutex<Vec<(String, Tensor)>>>,
}

impl LazySynthetic {
    pub fn new(seed: u64, record: bool) -> Self {
        Self { seed, record: record.then(|| std::sync::Mutex::new(Vec::new())) }
    }

    pub fn take(&self) -> Vec<(String, Tensor)> {
        self.record
            .as_ref()
            .map(|m| std::mem::take(&mut *m.lock().expect("not poisoned")))
            .unwrap_or_default()
    }
}

impl SimpleBackend for LazySynthetic {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = init_tensor(self.seed, name, s.dims(), dtype, dev)?;
        if let Some(r) = &self.record {
            r.lock().expect("not poisoned").push((name.to_string(), t.clone()));
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("synthetic weights need a shape for {name}")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        !(name.ends_with("weight_g") || name.ends_with("weight_v"))
    }
}

/// Runs `build` over a lazy synthetic `VarBuilder` and returns what it built and the tensors read.
fn synthesize<T>(
    seed: u64,
    dtype: DType,
    dev: &Device,
    record: bool,
    build: impl FnOnce(VarBuilder<'static>) -> Result<T>,
) -> Result<(T, Vec<(String, Tensor)>)> {
    let lazy = std::sync::Arc::new(LazySynthetic::new(seed, record));
    let vb = VarBuilder::from_backend(
        Box::new(crate::checkpoint::SharedBackend(lazy.clone())),
        dtype,
        dev.clone(),
    );
    let built = build(vb)?;
    Ok((built, lazy.take()))
}

/// `flow.yaml` for a flow configuration (hyperpyyaml, as the checkpoint ships it).
pub fn flow_yaml(c: &FlowConfig) -> String {
    let e = &c.encoder;
    let d = &c.estimator;
    format!(
        concat!(
            "flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec\n",
            "    input_size: {}\n",
            "    output_size: {}\n",
            "    spk_embed_dim: {}\n",
            "    output_type: 'mel'\n",
            "    vocab_size: {}\n",
            "    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2",
            ".UpsampleConformerEncoderV2\n",
            "        input_size: {}\n",
            "        output_size: {}\n",
            "        input_layer: 'linear'\n",
            "        pre_lookahead_len: {}\n",
            "        num_blocks: {}\n",
            "        num_up_blocks: {}\n",
            "        up_stride: {}\n",
            "        up_scale_factor: {}\n",
            "        attention_heads: {}\n",
            "        pos_enc_layer_type: 'rel_pos_espnet'\n",
            "        selfattention_layer_type: 'rel_selfattn'\n",
            "        key_bias: {}\n",
            "        linear_units: {}\n",
            "        dropout_rate: 0.1\n",
            "        positional_dropout_rate: 0.1\n",
            "        attention_dropout_rate: 0.1\n",
            "        normalize_before: true\n",
            "    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM\n",
            "        inference_cfg_rate: {}\n",
            "        estimator: !new:cosyvoice2.flow.decoder_dit.DiT\n",
            "            in_channels: {}\n",
            "            out_channels: {}\n",
            "            mlp_ratio: {:?}\n",
            "            depth: {}\n",
            "            num_heads: {}\n",
            "            head_dim: {}\n",
            "            hidden_size: {}\n",
        ),
        c.input_size,
        c.output_size,
        c.spk_embed_dim,
        c.vocab_size,
        e.input_size,
        e.output_size,
        e.pre_lookahead_len,
        e.num_blocks,
        e.num_up_blocks,
        e.up_stride,
        e.up_stride,
        e.attention_heads,
        e.key_bias,
        e.linear_units,
        c.inference_cfg_rate,
        d.in_channels,
        d.out_channels,
        d.mlp_ratio,
        d.depth,
        d.num_heads,
        d.head_dim,
        d.hidden_size
    )
}

/// `config.yaml` of the causal vocoder.
pub fn hift_yaml(h: &HiftConfig) -> String {
    let list = |v: &[usize]| {
        format!("[{}]", v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", "))
    };
    let lists = |v: &[Vec<usize>]| {
        format!("[{}]", v.iter().map(|x| list(x)).collect::<Vec<_>>().join(", "))
    };
    format!(
        concat!(
            "sample_rate: {sr}\n",
            "hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator\n",
            "    in_channels: {}\n",
            "    base_channels: {}\n",
            "    nb_harmonics: {}\n",
            "    sampling_rate: !ref <sample_rate>\n",
            "    nsf_alpha: {:?}\n",
            "    nsf_sigma: {:?}\n",
            "    nsf_voiced_threshold: {:?}\n",
            "    upsample_rates: {}\n",
            "    upsample_kernel_sizes: {}\n",
            "    istft_params:\n",
            "        n_fft: {}\n",
            "        hop_len: {}\n",
            "    resblock_kernel_sizes: {}\n",
            "    resblock_dilation_sizes: {}\n",
            "    source_resblock_kernel_sizes: {}\n",
            "    source_resblock_dilation_sizes: {}\n",
            "    lrelu_slope: {:?}\n",
            "    audio_limit: {:?}\n",
            "    conv_pre_look_right: {}\n",
            "    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor\n",
            "        num_class: 1\n",
            "        in_channels: {}\n",
            "        cond_channels: {}\n",
            "feat_extractor: !name:matcha.utils.audio.mel_spectrogram\n",
            "    n_fft: 1920\n",
            "    num_mels: 80\n",
            "    sampling_rate: !ref <sample_rate>\n",
            "    hop_size: 480\n",
            "    win_size: 1920\n",
            "    fmin: 0\n",
            "    fmax: 8000\n",
            "    center: False\n",
        ),
        h.in_channels,
        h.base_channels,
        h.nb_harmonics,
        h.nsf_alpha,
        h.nsf_sigma,
        h.nsf_voiced_threshold,
        list(&h.upsample_rates),
        list(&h.upsample_kernel_sizes),
        h.istft_n_fft,
        h.istft_hop,
        list(&h.resblock_kernel_sizes),
        lists(&h.resblock_dilation_sizes),
        list(&h.source_resblock_kernel_sizes),
        lists(&h.source_resblock_dilation_sizes),
        h.lrelu_slope,
        h.audio_limit,
        h.conv_pre_look_right,
        h.in_channels,
        h.f0_channels,
        sr = h.sampling_rate
    )
}

fn cam_weight(
    seed: u64,
    dtype: DType,
    dev: &Device,
) -> impl FnMut(&str, &[usize]) -> Result<Tensor> {
    let dev = dev.clone();
    move |name: &str, shape: &[usize]| {
        Ok(init_tensor(seed, name, shape, dtype, &dev)?
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?)
    }
}

/// Builds Code2Wav from synthetic weights without touching the disk (the full preset directly on a
/// GPU for speed runs).
pub fn code2wav_in_memory(
    preset: Preset,
    seed: u64,
    dtype: DType,
    dev: &Device,
) -> Result<Code2Wav> {
    let d = preset.code2wav();
    let seeds = BufferSeeds { seed, ..BufferSeeds::default() };
    let noise = c2w::gaussian(d.flow.output_size, seeds.noise_frames, seeds.seed, dev)?;
    let (flow, _) =
        synthesize(seed ^ 0xf10, dtype, dev, false, |vb| Ok(Flow::load(vb, &d.flow, noise)?))?;
    let table = antiphon_models::code2wav::hift::noise_table(
        seeds.table_samples,
        d.hift.nb_harmonics + 1,
        seeds.seed ^ 0x5eed,
        &Device::Cpu,
    )?;
    let (hift, _) = synthesize(seed ^ 0x41f7, DType::F32, dev, false, |vb| {
        Ok(HiftGenerator::load(vb, &d.hift, Some(&table))?)
    })?;
    // the S3 tokenizer rounds to codes: it runs in f32 whatever the flow's dtype
    let (s3, _) = synthesize(seed ^ 0x53, DType::F32, dev, false, |vb| {
        S3Tokenizer::load(vb, d.s3_state, 128, d.s3_layers)
    })?;
    let cam = CamPlusPlus::from_model(&build_graph(
        &d.cam,
        &mut cam_weight(seed ^ 0xca, DType::F32, &Device::Cpu),
    )?)?
    .on(dev)?;
    Ok(Code2Wav::new(flow, Vocoder::Causal(hift), s3, cam, dev))
}

/// Writes `assets/token2wav/` in the real formats: `flow.pt` + `flow.yaml`, the causal `hift.pt`
/// + `config.yaml`, `hift_original.pt`, `campplus.onnx`, `speech_tokenizer_v2_25hz.onnx`.
pub fn write_token2wav(dir: &Path, preset: Preset, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let d = preset.code2wav();
    let cpu = Device::Cpu;
    let noise = Tensor::zeros((d.flow.output_size, 1), DType::F32, &cpu)?;
    let (_, flow_t) =
        synthesize(seed ^ 0xf10, DType::F32, &cpu, true, |vb| Ok(Flow::load(vb, &d.flow, noise)?))?;
    crate::torchsave::save_state_dict(&dir.join(c2w::FLOW_PT), "flow", &flow_t)?;
    std::fs::write(dir.join(c2w::FLOW_YAML), flow_yaml(&d.flow))?;
    let table = Tensor::zeros((1, d.hift.nb_harmonics + 1), DType::F32, &cpu)?;
    let (_, hift_t) = synthesize(seed ^ 0x41f7, DType::F32, &cpu, true, |vb| {
        Ok(HiftGenerator::load(vb, &d.hift, Some(&table))?)
    })?;
    crate::torchsave::save_state_dict(&dir.join(c2w::HIFT_PT), "hift", &hift_t)?;
    std::fs::write(dir.join(c2w::HIFT_CONFIG), hift_yaml(&d.hift))?;
    let orig_cfg = HiftConfig {
        base_channels: d.hift.base_channels,
        f0_channels: d.hift.f0_channels,
        ..HiftConfig::original()
    };
    let (_, orig_t) = synthesize(seed ^ 0x0619, DType::F32, &cpu, true, |vb| {
        Ok(HiftGenerator::load(vb, &orig_cfg, None)?)
    })?;
    let orig_t: Vec<(String, Tensor)> =
        orig_t.into_iter().map(|(k, v)| (format!("generator.{k}"), v)).collect();
    crate::torchsave::save_state_dict(&dir.join(c2w::HIFT_ORIGINAL_PT), "hift_original", &orig_t)?;
    let (_, s3_t) = synthesize(seed ^ 0x53, DType::F32, &cpu, true, |vb| {
        S3Tokenizer::load(vb, d.s3_state, 128, d.s3_layers)
    })?;
    let s3_map: HashMap<String, Tensor> = s3_t.into_iter().collect();
    crate::onnx::write_model(&dir.join(c2w::TOKENIZER_ONNX), &build_onnx(&s3_map, d.s3_layers)?)?;
    let cam = build_graph(&d.cam, &mut cam_weight(seed ^ 0xca, DType::F32, &cpu))?;
    crate::onnx::write_model(&dir.join(c2w::CAMPPLUS_ONNX), &cam)?;
    Ok(())
}

/// Every model of a preset from synthetic weights, in memory (the embedded default's models).
pub fn models_in_memory(
    preset: Preset,
    seed: u64,
    dtype: DType,
    dev: &Device,
) -> Result<antiphon_models::Models> {
    models_on(preset, seed, dtype, &antiphon_models::gpu::StageDevices::same(dev))
}

/// As [`models_in_memory`], each stage's model on its own device (stream).
pub fn models_on(
    preset: Preset,
    seed: u64,
    dtype: DType,
    devs: &antiphon_models::gpu::StageDevices,
) -> Result<antiphon_models::Models> {
    let cfg = preset.config();
    let vb = SyntheticBackend::var_builder(&cfg, seed, dtype, &devs.thinker);
    let (thinker, talker) = crate::checkpoint::load_models_on(&vb, &cfg, &devs.talker)?;
    let tokenizer = antiphon_models::tokenizer::TextTokenizer::from_bytes(
        tokenizer_json(&preset.special_ids(), &preset.tool_ids()).to_string().as_bytes(),
    )?;
    let code2wav = code2wav_in_memory(preset, seed, dtype, &devs.code2wav)?;
    Ok(antiphon_models::Models { thinker, talker, code2wav, tokenizer })
}

/// Writes tokenizer weights (torch names, as [`state_dict_from_onnx`] produces them) into an ONNX
/// graph with the initializer and node names s3tokenizer's loader maps: the v2_25hz conv
/// initializers, `/blocks.K/…/MatMul|Add|LayerNormalization|fsmn_block/Conv` nodes, and the
/// quantizer's `onnx::MatMul_2536` / `quantizer.project_in.bias`.
pub fn build_onnx(sd: &HashMap<String, Tensor>, n_layer: usize) -> Result<ModelProto> {
    let get =
        |k: &str| sd.get(k).ok_or_else(|| anyhow::anyhow!("speech tokenizer weights lack {k}"));
    let mut g = GraphBuilder::new("speech_tokenizer_v2_25hz");
    g.input("mel", &[Some(1), Some(128), None]);
    let conv_attrs = || {
        vec![
            attr_ints("kernel_shape", &[3]),
            attr_ints("strides", &[2]),
            attr_ints("pads", &[1, 1]),
        ]
    };
    let w1 = g.init("onnx::Conv_2216", get("encoder.conv1.weight")?)?;
    let b1 = g.init("onnx::Conv_2217", get("encoder.conv1.bias")?)?;
    let mut x = g.node("Conv", "/conv1/Conv", &["mel", &w1, &b1], conv_attrs());
    let w2 = g.init("onnx::Conv_2218", get("encoder.conv2.weight")?)?;
    let b2 = g.init("onnx::Conv_2219", get("encoder.conv2.bias")?)?;
    x = g.node("Conv", "/conv2/Conv", &[&x, &w2, &b2], conv_attrs());
    for k in 0..n_layer {
        let (p, q) = (format!("/blocks.{k}"), format!("encoder.blocks.{k}"));
        let ln = |g: &mut GraphBuilder, x: &str, part: &str, eps: f32| -> Result<String> {
            let s = g.init(&format!("{q}.{part}.scale"), get(&format!("{q}.{part}.weight"))?)?;
            let b = g.init(&format!("{q}.{part}.b"), get(&format!("{q}.{part}.bias"))?)?;
            Ok(g.node(
                "LayerNormalization",
                &format!("{p}/{part}/LayerNormalization"),
                &[x, &s, &b],
                vec![attr_float("epsilon", eps)],
            ))
        };
        let h = ln(&mut g, &x, "attn_ln", 1e-6)?;
        for proj in ["query", "key", "value", "out"] {
            let w = g.init(
                &format!("onnx::MatMul_{k}_{proj}"),
                &get(&format!("{q}.attn.{proj}.weight"))?.t()?.contiguous()?,
            )?;
            let m = g.node("MatMul", &format!("{p}/attn/{proj}/MatMul"), &[&h, &w], vec![]);
            if let Some(b) = sd.get(&format!("{q}.attn.{proj}.bias")) {
                let b = g.init(&format!("{q}.attn.{proj}.bias_init"), b)?;
                g.node("Add", &format!("{p}/attn/{proj}/Add"), &[&m, &b], vec![]);
            }
        }
        let fw = get(&format!("{q}.attn.fsmn_block.weight"))?;
        let groups = fw.dim(0)? as i64;
        let f = g.init(&format!("onnx::Conv_fsmn_{k}"), fw)?;
        g.node(
            "Conv",
            &format!("{p}/attn/fsmn_block/Conv"),
            &[&h, &f],
            vec![attr_int("group", groups), attr_ints("kernel_shape", &[31])],
        );
        let h = ln(&mut g, &x, "mlp_ln", 1e-5)?;
        for i in ["0", "2"] {
            let w = g.init(
                &format!("onnx::MatMul_{k}_mlp{i}"),
                &get(&format!("{q}.mlp.{i}.weight"))?.t()?.contiguous()?,
            )?;
            let m = g.node("MatMul", &format!("{p}/mlp/mlp.{i}/MatMul"), &[&h, &w], vec![]);
            let b =
                g.init(&format!("{q}.mlp.{i}.bias_init"), get(&format!("{q}.mlp.{i}.bias"))?)?;
            x = g.node("Add", &format!("{p}/mlp/mlp.{i}/Add"), &[&m, &b], vec![]);
        }
    }
    let w = g.init(
        "onnx::MatMul_2536",
        &get("quantizer._codebook.project_down.weight")?.t()?.contiguous()?,
    )?;
    let m = g.node("MatMul", "/quantizer/project_down/MatMul", &[&x, &w], vec![]);
    let b = g.init("quantizer.project_in.bias", get("quantizer._codebook.project_down.bias")?)?;
    let y = g.node("Add", "/quantizer/project_down/Add", &[&m, &b], vec![]);
    g.output(&y, &[Some(1), None, Some(8)]);
    Ok(g.finish(17))
}
