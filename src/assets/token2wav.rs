//! `assets/token2wav/`: the flow (`flow.yaml` + `flow.pt`), the vocoder (`hift.pt`, with
//! `config.yaml` for the streaming causal HiFT), the S3 tokenizer and CAM++ ONNX files.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};

use antiphon_models::code2wav::campplus::CamPlusPlus;
use antiphon_models::code2wav::flow::Flow;
use antiphon_models::code2wav::hift::{self, HiftGenerator};
use antiphon_models::code2wav::s3tokenizer::{self, S3Tokenizer};
use antiphon_models::code2wav::{gaussian, BufferSeeds, Code2Wav, Vocoder};
use antiphon_models::code2wav::{
    CAMPPLUS_ONNX, FLOW_PT, FLOW_YAML, HIFT_CONFIG, HIFT_PT, TOKENIZER_ONNX,
};

use crate::yaml;

/// Loads `assets/token2wav/` (the directory itself). The vocoder is chosen by the files
/// present: `config.yaml` + `hift.pt` (+ `hift_original.pt`) is the minicpmo-utils 1.0.7
/// layout whose causal `hift.pt` streams; otherwise `hift.pt` is the original generator.
/// The token2wav files `dir` lacks (those [`load_dir`] needs).
pub fn missing_assets(dir: &Path) -> Vec<&'static str> {
    [FLOW_YAML, FLOW_PT, HIFT_PT, CAMPPLUS_ONNX, TOKENIZER_ONNX]
        .into_iter()
        .filter(|f| !dir.join(f).is_file())
        .collect()
}

pub fn load_dir(dir: &Path, dtype: DType, device: &Device, seeds: BufferSeeds) -> Result<Code2Wav> {
    let missing = missing_assets(dir);
    if !missing.is_empty() {
        bail!("{}: missing token2wav asset(s) {}", dir.display(), missing.join(", "));
    }
    let flow_cfg = yaml::flow_config(&std::fs::read_to_string(dir.join(FLOW_YAML))?)?;
    let noise = gaussian(flow_cfg.output_size, seeds.noise_frames, seeds.seed, device)?;
    let vb = crate::checkpoint::pth_var_builder(&dir.join(FLOW_PT), None, dtype, device)?;
    let flow = Flow::load(vb, &flow_cfg, noise).context("loading flow.pt")?;
    let vocoder = if dir.join(HIFT_CONFIG).is_file() {
        let cfg = yaml::causal_hift_config(&std::fs::read_to_string(dir.join(HIFT_CONFIG))?)?;
        let table = hift::noise_table(
            seeds.table_samples,
            cfg.nb_harmonics + 1,
            seeds.seed ^ 0x5eed,
            &Device::Cpu,
        )?;
        let vb = crate::checkpoint::pth_var_builder(
            &dir.join(HIFT_PT),
            Some("generator."),
            DType::F32,
            device,
        )?;
        Vocoder::Causal(
            HiftGenerator::load(vb, &cfg, Some(&table)).context("loading the causal hift.pt")?,
        )
    } else {
        let vb = crate::checkpoint::pth_var_builder(
            &dir.join(HIFT_PT),
            Some("generator."),
            DType::F32,
            device,
        )?;
        Vocoder::Original(
            HiftGenerator::load(vb, &hift::HiftConfig::original(), None)
                .context("loading hift.pt (original HiFT)")?,
        )
    };
    // the S3 tokenizer rounds to codes: f32 whatever the flow's dtype
    let s3 = load_tokenizer(&dir.join(TOKENIZER_ONNX), DType::F32, device)?;
    let campplus =
        CamPlusPlus::from_model(&crate::onnx::read_model(&dir.join(CAMPPLUS_ONNX))?)?.on(device)?;
    Ok(Code2Wav::new(flow, vocoder, s3, campplus, device))
}

/// Loads the S3 tokenizer from its ONNX file.
pub fn load_tokenizer(path: &Path, dtype: DType, device: &Device) -> Result<S3Tokenizer> {
    let m = crate::onnx::read_model(path)?;
    let sd = s3tokenizer::state_dict_from_onnx(&m)
        .with_context(|| format!("mapping {}", path.display()))?;
    S3Tokenizer::from_state_dict(sd, dtype, device)
        .with_context(|| format!("loading {}", path.display()))
}
