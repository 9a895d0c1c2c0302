use super::*;

fn registry(dir: &Path) -> Voices {
    let configs = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs"));
    let mut cfg = Config::parse(crate::config::DEFAULT_TOML, configs).unwrap();
    cfg.server.voice_dir = dir.to_path_buf();
    Voices::load(&cfg).unwrap()
}

fn wav() -> Vec<u8> {
    let x: Vec<f32> = (0..16_000).map(|i| (i as f32 * 0.05).sin() * 0.3).collect();
    antiphon_audio::encode_wav_pcm16(&x, 16_000).unwrap()
}

fn prepared(key: &str, speaker: f32) -> PreparedVoice {
    PreparedVoice {
        key: key.into(),
        codes: vec![1, 2, 3],
        speaker: vec![speaker; 4],
        mel: vec![0.0; 8],
        mel_bins: 2,
    }
}

/// Busy is not bad audio: a full preparation queue is 503 with `Retry-After`, audio the model
/// cannot use is 400 `bad_audio` (issue 38: a valid upload was refused as `bad_audio` while
/// 16 preparations waited).
#[test]
fn a_busy_registry_says_try_again_and_bad_audio_says_why() {
    use antiphon_engine::voices::PrepareRefused;
    let busy = VoiceError::from_refusal(PrepareRefused::Busy { waiting: 16 });
    assert_eq!(
        (busy.status, busy.code, busy.retry_after_s),
        (StatusCode::SERVICE_UNAVAILABLE, VoiceErrorCode::Busy, Some(1)),
        "{}",
        busy.message
    );
    let r = busy.into_response();
    assert_eq!(
        r.headers().get(axum::http::header::RETRY_AFTER).and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let bad = VoiceError::from_refusal(PrepareRefused::Unusable("too short".into()));
    assert_eq!(
        (bad.status, bad.code, bad.retry_after_s),
        (StatusCode::BAD_REQUEST, VoiceErrorCode::BadAudio, None)
    );
    assert!(bad.message.contains("too short"), "{}", bad.message);
    assert!(bad.into_response().headers().get(axum::http::header::RETRY_AFTER).is_none());
}

#[test]
fn a_voice_that_cannot_be_kept_leaves_no_file_and_no_features() {
    let dir = tempfile::tempdir().unwrap();
    let v = registry(dir.path());
    let files = || std::fs::read_dir(dir.path()).unwrap().count();
    let mut forgotten = Vec::new();
    // its audio is written first; its features (not finite) then cannot be
    let e = v
        .register("x", &wav(), |_| Ok(prepared("k1", f32::NAN)), |k| forgotten.push(k.to_string()))
        .unwrap_err();
    assert_eq!(
        (e.status, e.code),
        (StatusCode::INTERNAL_SERVER_ERROR, VoiceErrorCode::Internal),
        "{}",
        e.message
    );
    assert_eq!(files(), 0, "the audio written before the failure is gone");
    assert_eq!(forgotten, ["k1"], "Code2Wav is told to drop the features");
    assert!(v.list().iter().all(|i| i.kind != VoiceKind::Registered));
    // one that can be kept: its three files, nothing forgotten
    let info = v
        .register("y", &wav(), |_| Ok(prepared("k2", 0.5)), |k| forgotten.push(k.to_string()))
        .unwrap();
    assert_eq!(files(), 3);
    assert_eq!(forgotten, ["k1"]);
    // a failure for audio another voice also has: its features stay (that voice uses them)
    let e = v.register(
        "z",
        &wav(),
        |_| Ok(prepared("k2", f32::NAN)),
        |k| forgotten.push(k.to_string()),
    );
    assert!(e.is_err());
    assert_eq!(forgotten, ["k1"]);
    assert_eq!(files(), 3);
    assert!(v.info(&info.id).is_some());
}
