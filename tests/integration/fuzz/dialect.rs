//! The OpenAI Realtime dialect fuzzed: hostile messages and floods at /openai/v1/realtime.

use super::*;

// ---- the OpenAI Realtime dialect (issue 38): the same properties at /openai/v1/realtime ----

const OAI_EVENTS: &[&str] = &[
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "conversation.item.truncate",
    "conversation.item.delete",
    "conversation.item.retrieve",
    "response.create",
    "response.cancel",
    "output_audio_buffer.clear",
    "transcription_session.update",
    "no.such.event",
];

const OAI_FIELDS: &[&str] = &[
    "session",
    "audio",
    "item",
    "item_id",
    "previous_item_id",
    "content_index",
    "audio_end_ms",
    "response",
    "response_id",
    "event_id",
];

/// A JSON value of any type the SDKs' types could be confused with.
fn oai_value(rng: &mut rand_chacha::ChaCha8Rng) -> Value {
    match rng.random_range(0..10) {
        0 => Value::Null,
        1 => json!(rng.random::<bool>()),
        2 => json!(rng.random::<i64>()),
        3 => json!(-rng.random::<f64>() * 1e12),
        4 => json!("x".repeat(rng.random_range(0..300))),
        5 => json!([1, "two", null]),
        6 => {
            json!({"type": "message", "role": (["user", "assistant", "system",
                "tool"][rng.random_range(0..4)]),
            "content": [{"type": (["input_text", "input_audio", "text", "audio",
                "output_text"][rng.random_range(0..5)]),
                "text": "hi", "audio": "!!notbase64", "transcript": 5}]})
        }
        7 => json!({"type": "realtime", "instructions": "x".repeat(rng.random_range(0..12_000)),
            "audio": {"input": {"format": {"type": (["audio/pcm", "audio/pcmu",
                "audio/x"][rng.random_range(0..3)]), "rate": rng.random::<u32>()},
                "turn_detection": {"type": "semantic_vad", "eagerness": rng.random::<u8>()}}},
            "tools": vec![json!({"type": "function", "name": "f"}); rng.random_range(0..200)],
                "max_output_tokens": rng.random::<i32>()}),
        8 => {
            json!({"input": vec![json!({"type": "item_reference",
                "id": "i0"}); rng.random_range(0..3000)],
            "output_modalities": (["audio", "text", "video"][rng.random_range(0..3)]),
                "conversation": "none", "max_output_tokens": 4})
        }
        _ => json!({"deep": [[[[[[[[rng.random::<u8>()]]]]]]]]}),
    }
}

/// One hostile message of the dialect: a known or unknown event with fields of any type, or a
/// frame that is not an event at all.
fn oai_hostile(rng: &mut rand_chacha::ChaCha8Rng) -> Message {
    match rng.random_range(0..10) {
        0 => Message::Text("{\"type\": \"response.create\"".into()),
        1 => Message::Binary(vec![0u8; rng.random_range(0..64)].into()),
        2 => {
            let audio = base64::engine::general_purpose::STANDARD.encode(
                (0..rng.random_range(0..20_000)).map(|_| rng.random::<u8>()).collect::<Vec<u8>>(),
            );
            Message::Text(
                json!({"type": "input_audio_buffer.append",
                "audio": audio})
                .to_string()
                .into(),
            )
        }
        3 => Message::Text(
            json!({"type": "conversation.item.create", "item": {"id": format!("i{}",
                rng.random_range(0..4)), "type": "message", "role": "user",
                "content": [{"type": "input_text",
                    "text": "z".repeat(rng.random_range(1..30_000))}]}})
            .to_string()
            .into(),
        ),
        _ => {
            let mut o = serde_json::Map::new();
            o.insert("type".into(), json!(OAI_EVENTS[rng.random_range(0..OAI_EVENTS.len())]));
            for _ in 0..rng.random_range(0..4) {
                o.insert(OAI_FIELDS[rng.random_range(0..OAI_FIELDS.len())].into(), oai_value(rng));
            }
            Message::Text(Value::Object(o).to_string().into())
        }
    }
}

/// Sends `m`, then a probe (a retrieve of an item that never exists, with an event_id): every
/// message until the probe's error is an event; every error has a type, a snake_case code and a
/// message. `true` while the socket lives.
async fn oai_case(c: &mut Client, m: Message, n: u64) -> bool {
    c.send_raw(m.clone()).await;
    let probe = format!("probe-{n}");
    c.send(json!({"type": "conversation.item.retrieve", "item_id": "never-created",
        "event_id": probe}))
        .await;
    loop {
        match c.recv().await {
            In::Event(v) if v["type"] == "error" => {
                let e = &v["error"];
                assert!(
                    matches!(e["type"].as_str(), Some("invalid_request_error" | "server_error")),
                    "case {n}: {v}"
                );
                let code = e["code"].as_str().unwrap_or("");
                assert!(
                    !code.is_empty() && code.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                    "case {n}: {v}"
                );
                assert!(
                    e["message"].as_str().is_some_and(|s| !s.is_empty() && s.len() <= 2000),
                    "case {n}: {v}"
                );
                if e["event_id"] == probe.as_str() {
                    assert_eq!(code, "item_retrieve_invalid_item_id", "case {n}: {v}");
                    return true;
                }
            }
            In::Event(v) => assert!(
                v["type"].as_str().is_some_and(|t| !t.is_empty()) && v["event_id"].is_string(),
                "case {n}: {v}"
            ),
            In::Closed(code) => {
                assert!(
                    matches!(code, Some(1000 | 1002 | 1007 | 1008 | 1009)),
                    "case {n} ({m:?}): closed with {code:?}"
                );
                return false;
            }
            In::Audio(_) => panic!("case {n}: a binary frame from the dialect"),
        }
    }
}

async fn oai_connect(s: &antiphon_server::Server) -> Client {
    let mut c = Client::connect_to(&format!("ws://{}/openai/v1/realtime", s.addr)).await.unwrap();
    assert_eq!(c.recv().await.ty(), "session.created");
    c
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None,
        ..ProptestConfig::default() })]

    /// Any text frame is an event of the dialect or an error with a code and a message.
    #[test]
    fn any_dialect_frame_parses_or_is_an_error(text in ".{0,300}") {
        if let Err((_, e)) = antiphon_protocol::openai::parse_client(&text) {
            prop_assert!(!e.code.as_str().is_empty() && !e.message.is_empty());
        }
    }

    /// An event of the dialect with fields of any type parses or names what is wrong.
    #[test]
    fn dialect_events_with_fields_of_any_type_parse_or_name_the_fault(seed in any::<u64>()) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        if let Message::Text(t) = oai_hostile(&mut rng) {
            if let Err((_, e)) = antiphon_protocol::openai::parse_client(&t) {
                prop_assert!(!e.code.as_str().is_empty() && !e.message.is_empty());
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dialect_fed_hostile_messages_stays_up_and_answers_each() {
    let _turn = ONE_SERVER_AT_A_TIME.lock().await;
    let s = server(|c| c.engine.default_max_audio_tokens = 20).await;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(38);
    let mut c = oai_connect(&s).await;
    let mut closed = 0;
    for n in 0..250u64 {
        if !oai_case(&mut c, oai_hostile(&mut rng), n).await {
            closed += 1;
            c = oai_connect(&s).await;
        }
    }
    assert!(closed < 250, "every case closed the socket");
    // a new session of the dialect completes a response
    drop(c);
    let mut d = oai_connect(&s).await;
    d.send(json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "hi"}]}}))
        .await;
    d.send(json!({"type": "response.create"})).await;
    let done = d.until(|m| m.ty() == "response.done").await.pop();
    assert!(
        matches!(&done, Some(In::Event(v)) if v["response"]["status"] == "completed"),
        "{done:?}"
    );
    s.shutdown().await.unwrap();
}

/// Clients of the dialect that flood what the server keeps for them — items of the most text a
/// frame holds, responses whose input names one item thousands of times, audio items — cannot
/// grow the server past a bound (issue 38: one 2 KB frame of references took 1.1 GB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dialect_floods_of_items_and_references_cannot_grow_the_server_without_bound() {
    let _turn = ONE_SERVER_AT_A_TIME.lock().await;
    let s = server(|c| {
        c.engine.default_max_audio_tokens = 20;
        c.server.max_input_audio_s = 10;
    })
    .await;
    let mut warm = oai_connect(&s).await;
    warm.send(json!({"type": "response.create", "response": {"input": [{"type": "message",
        "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}}))
        .await;
    warm.until(|m| m.ty() == "response.done").await;
    let before = rss_bytes();
    let second = base64::engine::general_purpose::STANDARD.encode(vec![0u8; 48_000]);
    for k in 0..4 {
        let mut c = oai_connect(&s).await;
        let item = |id: String, content: Value| {
            json!({"type": "conversation.item.create",
            "item": {"id": id, "type": "message", "role": "user", "content": [content]}})
        };
        // (assistant items: a user's text waiting for a response is held to what one turn takes)
        for i in 0..40 {
            let said = json!({"type": "conversation.item.create", "item": {"id": format!("s{i}"),
                "type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "w".repeat(250_000)}]}});
            c.send(said).await;
        }
        c.send(item("t39".into(), json!({"type": "input_text", "text": "w".repeat(4_000)}))).await;
        for i in 0..8 {
            c.send(item(format!("a{i}"), json!({"type": "input_audio", "audio": second}))).await;
        }
        // ~7000 references in one frame, to the biggest text and to audio, again and again
        for i in 0..20 {
            let id = if i % 2 == 0 { "t39" } else { "a7" };
            let refs = vec![json!({"type": "item_reference", "id": id}); 7000];
            c.send(json!({"type": "response.create", "event_id": format!("r{k}-{i}"),
                "response": {"input": refs}}))
                .await;
        }
        c.send(
            json!({"type": "conversation.item.retrieve", "item_id": "never", "event_id": "end"}),
        )
        .await;
        let got = c.until(|m| matches!(m, In::Event(v) if v["error"]["event_id"] == "end")).await;
        let refused = got
            .iter()
            .filter(|m| {
                matches!(m,
            In::Event(v) if v["error"]["event_id"].as_str().is_some_and(|e| e.starts_with('r')))
            })
            .count();
        assert_eq!(refused, 20, "every flood of references is refused");
        drop(c);
    }
    // the server still serves, and holds within a bound of what it held before
    warm.send(json!({"type": "response.create", "response": {"input": [{"type": "message",
        "role": "user", "content": [{"type": "input_text", "text": "still there?"}]}]}}))
        .await;
    let done = warm.until(|m| m.ty() == "response.done").await.pop();
    assert!(
        matches!(&done, Some(In::Event(v)) if v["response"]["status"] == "completed"),
        "{done:?}"
    );
    let grown = rss_bytes().saturating_sub(before);
    eprintln!("resident memory grew by {} MiB", grown >> 20);
    assert!(grown < 192 << 20, "resident memory grew by {} MiB", grown >> 20);
    s.shutdown().await.unwrap();
}
