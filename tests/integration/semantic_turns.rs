//! `semantic_vad` over the OpenAI dialect with the real turn model (Smart Turn v3.2, named by
//! ANTIPHON_SMART_TURN_MODEL; CI sets it from pipecat-ai's wheel, .ci/run; without it this says
//! so and passes): a sentence paused for a second in the middle is one turn where `server_vad`
//! makes two, and `session.updated` echoes what was asked.

use base64::Engine as _;
use serde_json::{json, Value};

#[allow(dead_code)]
use crate::wire;
use wire::{server, Client, In};

/// A clip of `assets/turns` (16 kHz) as 24 kHz PCM16 bytes.
fn clip(name: &str) -> Vec<u8> {
    let bytes =
        std::fs::read(format!("{}/assets/turns/{name}.wav", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let (x, rate) = antiphon_audio::decode_wav(&bytes).unwrap();
    let y = antiphon_audio::resample(&x, rate, 24_000).unwrap();
    y.iter().flat_map(|&v| antiphon_audio::f32_to_i16(v).to_le_bytes()).collect()
}

fn silence(ms: usize) -> Vec<u8> {
    vec![0; ms * 48]
}

/// Every event up to the `session.updated` that answers a `session.update` sent after the audio:
/// the session handles its events in order, so by then every append has been looked at.
async fn turns_in(c: &mut Client, turn_detection: Value, audio: &[u8]) -> Vec<Value> {
    c.send(json!({"type": "session.update", "session": {"type": "realtime",
        "audio": {"input": {"turn_detection": turn_detection}}}}))
        .await;
    let mut seen = Vec::new();
    loop {
        if let In::Event(v) = c.recv().await {
            if v["type"] == "session.updated" {
                break;
            }
        }
    }
    for piece in audio.chunks(9600) {
        c.send(json!({"type": "input_audio_buffer.append",
            "audio": base64::engine::general_purpose::STANDARD.encode(piece)}))
            .await;
    }
    c.send(json!({"type": "session.update", "session": {"type": "realtime"}})).await;
    loop {
        match c.recv().await {
            In::Event(v) if v["type"] == "session.updated" => return seen,
            In::Event(v) => seen.push(v),
            other => panic!("{other:?}"),
        }
    }
}

fn count(events: &[Value], ty: &str) -> usize {
    events.iter().filter(|e| e["type"] == ty).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sentence_is_one_semantic_turn_and_two_silence_turns() {
    let Ok(path) = std::env::var("ANTIPHON_SMART_TURN_MODEL") else {
        eprintln!("ANTIPHON_SMART_TURN_MODEL is not set: semantic_vad's model is not run here");
        return;
    };
    let s = server(|c| c.server.smart_turn_model = path.into()).await;
    let mut c =
        Client::connect_to(&format!("ws://{}/openai/v1/realtime?model=gpt-realtime", s.addr))
            .await
            .unwrap();
    assert_eq!(c.recv().await.ty(), "session.created");
    // "I would like a cup of," a second's pause, "I would like a cup of tea.", then 3 s of silence
    let mut audio = silence(500);
    audio.extend(clip("incomplete1"));
    audio.extend(silence(1000));
    let second_at_ms = audio.len() / 48;
    let second = clip("complete1");
    audio.extend(&second);
    let end_ms = (audio.len() / 48) as u64;
    audio.extend(silence(3000));
    let semantic = json!({"type": "semantic_vad", "eagerness": "high", "create_response": false});
    let events = turns_in(&mut c, semantic.clone(), &audio).await;
    assert!(!events.iter().any(|e| e["type"] == "error"), "{events:?}");
    assert_eq!(
        (
            count(&events, "input_audio_buffer.speech_started"),
            count(&events, "input_audio_buffer.speech_stopped")
        ),
        (1, 1),
        "{events:?}"
    );
    let stopped = events.iter().find(|e| e["type"] == "input_audio_buffer.speech_stopped").unwrap();
    let at = stopped["audio_end_ms"].as_u64().unwrap();
    assert!(
        at.abs_diff(end_ms) <= 150,
        "the turn ends with the second phrase ({end_ms} ms of the session's audio), not at {at}"
    );
    assert!(at > second_at_ms as u64);
    // the same audio with server_vad: the pause ends a turn
    let events =
        turns_in(&mut c, json!({"type": "server_vad", "create_response": false}), &audio).await;
    assert_eq!(count(&events, "input_audio_buffer.speech_stopped"), 2, "{events:?}");
    // what was asked is echoed
    c.send(json!({"type": "session.update", "session": {"type": "realtime",
        "audio": {"input": {"turn_detection": semantic}}}}))
        .await;
    let updated = loop {
        if let In::Event(v) = c.recv().await {
            if v["type"] == "session.updated" {
                break v;
            }
        }
    };
    let td = &updated["session"]["audio"]["input"]["turn_detection"];
    assert_eq!(
        (td["type"].as_str(), td["eagerness"].as_str()),
        (Some("semantic_vad"), Some("high")),
        "{updated}"
    );
    let metrics = wire::reqwest_like_get(&s, "/metrics").await;
    assert!(
        metrics.contains("antiphon_turn_model_verdicts_total{verdict=\"incomplete\"}"),
        "the verdicts are counted"
    );
    s.shutdown().await.unwrap();
}
