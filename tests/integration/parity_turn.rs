//! Numerical parity of semantic turn detection: Smart Turn v3.2's features (pipecat's vendored
//! Whisper feature extractor) and its probability (the ONNX graph through antiphon's evaluator,
//! activations in float, against onnxruntime over the same graph) over the clips of
//! `assets/turns/`. Fixture: `tests/parity/make_turn_fixtures.py`.
//!
//! The model file is pipecat-ai's (PyPI), never committed: `ANTIPHON_SMART_TURN_MODEL` names it
//! (CI sets it from the venv it builds, .ci/run). Without it the model's tests say so and pass;
//! the features' test needs no model.

use antiphon_models::smart_turn::SmartTurn;
use serde_json::Value;

fn fixture() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/parity_turn/io.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn clip(name: &str, tail_ms: u64) -> Vec<f32> {
    let bytes =
        std::fs::read(format!("{}/assets/turns/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let (mut x, rate) = antiphon_audio::decode_wav(&bytes).unwrap();
    assert_eq!(rate, 16_000, "{name}");
    x.extend(std::iter::repeat_n(0.0, (tail_ms * 16) as usize));
    x
}

fn model() -> Option<SmartTurn> {
    let Ok(path) = std::env::var("ANTIPHON_SMART_TURN_MODEL") else {
        eprintln!("ANTIPHON_SMART_TURN_MODEL is not set: the Smart Turn model is not checked here");
        return None;
    };
    let m = antiphon_assets::onnx::read_model(std::path::Path::new(&path)).unwrap();
    Some(SmartTurn::from_model(&m).unwrap())
}

fn cases(f: &Value) -> impl Iterator<Item = (&str, u64, &Value)> {
    f["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["clip"].as_str().unwrap(), c["tail_ms"].as_u64().unwrap(), c))
}

#[test]
fn parity_turn_features_match_the_whisper_feature_extractor() {
    let f = fixture();
    let stride = f["stride"].as_u64().unwrap() as usize;
    let mel = SmartTurn::feature_extractor();
    for (name, tail, c) in cases(&f) {
        let got = mel.features(&clip(name, tail));
        assert_eq!(got.len(), 80 * 800);
        assert!(got.iter().all(|v| v.is_finite()), "{name}: a feature is not finite");
        let sum: f64 = got.iter().map(|&v| v as f64).sum();
        let want = c["features_sum"].as_f64().unwrap();
        assert!(
            (sum - want).abs() <= 1e-3 * want.abs().max(1.0),
            "{name} +{tail} ms: features sum {sum}, the reference's {want}"
        );
        for (i, w) in c["features_every"].as_array().unwrap().iter().enumerate() {
            let (g, w) = (got[i * stride], w.as_f64().unwrap() as f32);
            assert!(
                (g - w).abs() <= 1e-4,
                "{name} +{tail} ms: feature {} is {g}, the reference's {w}",
                i * stride
            );
        }
    }
}

#[test]
fn parity_turn_probabilities_match_onnxruntime() {
    let Some(m) = model() else { return };
    let f = fixture();
    let mut worst = 0f32;
    for (name, tail, c) in cases(&f) {
        let want = c["probability"].as_f64().unwrap() as f32;
        let got = m.end_of_turn(&clip(name, tail)).unwrap();
        assert!(got.is_finite() && (0.0..=1.0).contains(&got), "{name}: {got}");
        worst = worst.max((got - want).abs());
        assert!((got - want).abs() <= 1e-3, "{name} +{tail} ms: {got}, onnxruntime {want}");
    }
    eprintln!("largest difference from onnxruntime: {worst}");
}
