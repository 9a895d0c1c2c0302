//! Numerical parity of reference-voice preparation: kaldi fbank (torchaudio), the flow's prompt
//! mel, the S3 tokenizer (its mel and exact codes, through the ONNX file), CAM++ (the ONNX graph
//! against onnxruntime). Fixtures: `tests/parity/make_prompt_fixtures.py`.

use crate::common;

use antiphon_assets::token2wav::load_tokenizer;
use antiphon_models::code2wav::campplus::CamPlusPlus;
use antiphon_models::code2wav::prompt;
use antiphon_models::mel::{kaldi_fbank, mean_normalize, FlowMel, WhisperLogMel};
use candle_core::{DType, Tensor};
use common::{assert_close, ids, load_io, load_meta};

const FIX: &str = "parity_prompt";
const TOL: f32 = 1e-4;

fn v(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn parity_prompt_kaldi_fbank() {
    let io = load_io(FIX);
    let (fb, frames) = kaldi_fbank(&v(&io["audio_16k"]), 16_000, 80);
    let got = Tensor::from_vec(fb, (frames, 80), &common::device()).unwrap();
    assert_close("kaldi fbank", &got, &io["fbank"], TOL);
}

#[test]
fn parity_prompt_flow_mel_24k() {
    let io = load_io(FIX);
    let (m, frames) = FlowMel::standard().compute(&v(&io["audio_24k"]));
    assert_eq!(frames, 300, "6 s at 50 frames/s");
    let got = Tensor::from_vec(m, (80, frames), &common::device()).unwrap();
    assert_close("24 kHz prompt mel", &got, &io["mel_24k"], TOL);
}

#[test]
fn parity_prompt_s3_mel_and_codes_exact() {
    let io = load_io(FIX);
    let meta = load_meta(FIX);
    let (m, frames) = WhisperLogMel::new(128).compute(&v(&io["audio_16k"]));
    let mel = Tensor::from_vec(m, (128, frames), &common::device()).unwrap();
    assert_close("S3 128-bin log-mel", &mel, &io["mel_128"], TOL);
    let tok = load_tokenizer(
        &common::fixture_dir(FIX).join("speech_tokenizer_v2_25hz.onnx"),
        DType::F32,
        &common::device(),
    )
    .unwrap();
    let want = ids(&meta["s3_codes"]);
    assert_eq!(want.len(), 150, "150 codes for 6 s");
    assert_eq!(tok.quantize(&io["mel_128"]).unwrap(), want, "codes from the reference mel");
    assert_eq!(tok.quantize(&mel).unwrap(), want, "codes from our mel");
    // as the server runs it: the device part over fixed buffers (a CUDA graph from the second run
    // on a GPU), its tables made once
    let mut tok = tok;
    tok.set_graphs(true);
    for run in 0..4 {
        assert_eq!(tok.quantize(&mel).unwrap(), want, "codes of graphed run {run}");
    }
}

#[test]
fn parity_prompt_campplus_embedding() {
    let io = load_io(FIX);
    let m =
        antiphon_assets::onnx::read_model(&common::fixture_dir(FIX).join("campplus.onnx")).unwrap();
    let cam = CamPlusPlus::from_model(&m).unwrap().on(&common::device()).unwrap();
    let mut fb = v(&io["fbank"]);
    mean_normalize(&mut fb, 80);
    let n = fb.len() / 80;
    let fb = Tensor::from_vec(fb, (n, 80), &common::device()).unwrap();
    let emb = cam.embed(&fb).unwrap();
    assert_eq!(emb.dims(), &[192]);
    assert_close("CAM++ embedding vs onnxruntime", &emb, &io["spk_emb"], TOL);
    assert_close("CAM++ embedding vs the torch model", &emb, &io["spk_emb_torch"], 1e-3);
    // the later runs of that shape evaluate only what depends on the input (the fold), then, as
    // the server runs them, over fixed buffers (a CUDA graph from the third run on a GPU)
    let mut cam = cam;
    cam.set_graphs(true);
    for run in 0..4 {
        let again = cam.embed(&fb).unwrap();
        assert_close(&format!("CAM++ embedding, folded run {run}"), &again, &io["spk_emb"], TOL);
        assert_close(
            &format!("CAM++ embedding, folded run {run}, against the first"),
            &again,
            &emb,
            1e-6,
        );
    }
    // a burst's voices in one run where the graph takes a batch (this export fixes nothing but the
    // frame count): each row that voice's own embedding, in order; else none, and voice by voice
    let other = (fb.affine(0.5, 0.1).unwrap() + fb.sin().unwrap()).unwrap();
    let alone = cam.embed(&other).unwrap();
    for run in 0..4 {
        match cam.embed_batch(&[&fb, &other, &fb]).unwrap() {
            Some(rows) => {
                assert_eq!(rows.len(), 3);
                assert_close(&format!("CAM++ batch row 0, run {run}"), &rows[0], &emb, 1e-3);
                assert_close(&format!("CAM++ batch row 1, run {run}"), &rows[1], &alone, 1e-3);
                assert_close(&format!("CAM++ batch row 2, run {run}"), &rows[2], &emb, 1e-3);
            }
            None => eprintln!("CAM++ fixture graph takes no batch: voice by voice"),
        }
    }
}

#[test]
fn parity_prompt_features_end_to_end() {
    let io = load_io(FIX);
    let meta = load_meta(FIX);
    let dir = common::fixture_dir(FIX);
    let tok =
        load_tokenizer(&dir.join("speech_tokenizer_v2_25hz.onnx"), DType::F32, &common::device())
            .unwrap();
    let cam = CamPlusPlus::from_model(
        &antiphon_assets::onnx::read_model(&dir.join("campplus.onnx")).unwrap(),
    )
    .unwrap()
    .on(&common::device())
    .unwrap();
    let f = prompt::prepare_features(
        &v(&io["audio_16k"]),
        &v(&io["audio_24k"]),
        &tok,
        &cam,
        &FlowMel::standard(),
        2,
        &common::device(),
    )
    .unwrap();
    assert_eq!(f.codes, ids(&meta["s3_codes"]));
    assert_eq!(f.mel.dims(), &[300, 80], "prompt mel padded to 2 × 150 frames");
    assert_close("prompt mel", &f.mel, &io["mel_24k"].t().unwrap(), TOL);
    assert_close("speaker", &f.speaker, &io["spk_emb"], TOL);
}

#[test]
fn materialize_normalizes_to_six_seconds_and_hashes_content() {
    let io = load_io(FIX);
    let a16 = v(&io["audio_16k"]);
    let short = &a16[..16_000 * 2];
    let r = prompt::Reference::materialize(short, 16_000).unwrap();
    assert_eq!(r.samples.len(), 144_000);
    assert!(r.samples[50_000..].iter().all(|&x| x == 0.0), "zero padded after 2 s");
    let again = prompt::Reference::materialize(short, 16_000).unwrap();
    assert_eq!(r.key, again.key);
    let mut other = short.to_vec();
    other[100] += 0.01;
    assert_ne!(prompt::Reference::materialize(&other, 16_000).unwrap().key, r.key);
    let long = prompt::Reference::materialize(&v(&io["audio_24k"]).repeat(2), 24_000).unwrap();
    assert_eq!(long.samples.len(), 144_000, "cut to 6 s");
    assert!(prompt::Reference::materialize(&[], 16_000).is_err());
    // from a stereo 48 kHz WAV: mixed down, resampled, normalized
    let stereo: Vec<f32> = v(&io["audio_24k"]).iter().flat_map(|&s| [s, s]).collect();
    let wav = {
        let spec = hound::WavSpec {
            channels: 2,
            sample_rate: 24_000,
            bits_per_sample: 32,
            sample_format: hound::SampleFormat::Float,
        };
        let mut c = std::io::Cursor::new(Vec::new());
        let mut w = hound::WavWriter::new(&mut c, spec).unwrap();
        for s in &stereo {
            w.write_sample(*s).unwrap();
        }
        w.finalize().unwrap();
        c.into_inner()
    };
    let r = prompt::Reference::from_wav(&wav).unwrap();
    assert_eq!(r.samples, v(&io["audio_24k"]), "24 kHz mono input passes through unchanged");
    assert!(prompt::Reference::from_wav(b"RIFF....garbage").is_err());
    assert!(prompt::Reference::materialize(&[f32::NAN; 10], 16_000).is_err());
}

/// The comparisons every parity test uses fail on a NaN or an infinity on either side (a fold
/// with `f32::max` would drop a NaN and pass an all-NaN output).
#[test]
fn comparisons_fail_on_nan_and_inf() {
    let dev = candle_core::Device::Cpu;
    let want = Tensor::new(&[1f32, 2.0, 3.0], &dev).unwrap();
    for bad in [
        [f32::NAN; 3],
        [1.0, f32::NAN, 3.0],
        [1.0, 2.0, f32::INFINITY],
        [f32::NEG_INFINITY, 2.0, 3.0],
    ] {
        let got = Tensor::new(&bad, &dev).unwrap();
        assert_eq!(common::rel_err(&got, &want), f32::INFINITY, "{bad:?} against {want}");
        assert_eq!(common::rel_err(&want, &got), f32::INFINITY, "{want} against {bad:?}");
        assert_eq!(common::max_abs_diff(&bad, &[1.0, 2.0, 3.0]), f32::INFINITY, "{bad:?}");
    }
    assert!(common::rel_err(&want, &want) == 0.0);
}
