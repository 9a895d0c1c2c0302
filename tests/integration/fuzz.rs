//! Fuzzing of what a client can send (issue 17): the event parser, the binary frame and the
//! generation limits by property (proptest), then a real server on port 0 fed hundreds of random
//! malformed and hostile messages: after each one the server still answers, every error carries a
//! documented code, every close a documented close code, and at the end a new session completes a
//! response. The OpenAI dialect the same way (its parser by property, 250 hostile messages to a
//! real server at /openai/v1/realtime), and the resident memory of clients that never read (v1) or
//! flood items and references (the dialect). Bounded in time for CI (seeded, a fixed number of
//! cases).

// (shared with tests/integration/server.rs, which uses all of it)
#[allow(dead_code)]
use crate::wire;

use antiphon_protocol::{parse_client, AudioFrame, Generation, GenerationLimits};
use base64::Engine as _;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;
use wire::{server, short, Client, In};

/// The tests that run a server take turns: the memory bounds are measured on this process's
/// resident memory, which a server fed by another test beside them would grow.
static ONE_SERVER_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The error codes of docs/protocol.md.
const CODES: &[&str] = &[
    "bad_json",
    "unknown_event",
    "bad_field",
    "not_in_session",
    "session_not_found",
    "bad_resume_token",
    "session_expired",
    "session_in_use",
    "capacity",
    "bad_audio",
    "message_too_large",
    "journal_overflow",
    "internal",
];

const EVENTS: &[&str] = &[
    "session.create",
    "session.resume",
    "session.update",
    "input.text",
    "input.commit",
    "input.clear",
    "response.cancel",
    "playback",
    "ack",
    "ping",
    "session.close",
    "no.such.event",
];

const FIELDS: &[&str] = &[
    "mode",
    "input_audio",
    "output_audio",
    "voice",
    "instructions",
    "generation",
    "session_id",
    "resume_token",
    "last_seq",
    "text",
    "response_id",
    "played_ms",
    "seq",
    "input_seq",
    "id",
    "codec",
    "sample_rate",
    "frame_ms",
    "max_text_tokens",
    "min_text_tokens",
    "max_audio_tokens",
    "min_audio_tokens",
    "temperature",
    "seed",
    "ref_audio_b64",
];

/// Any JSON value, a few levels deep, with the numbers and strings that break naive code.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop_oneof![Just(0i64), Just(-1), Just(i64::MIN), Just(i64::MAX), any::<i64>()]
            .prop_map(Value::from),
        prop_oneof![Just(u64::MAX), Just(4_294_967_296u64), any::<u64>()].prop_map(Value::from),
        prop_oneof![Just(1e308f64), Just(-0.0), Just(5e-324), any::<f64>()].prop_map(|f| {
            serde_json::Number::from_f64(f).map(Value::Number).unwrap_or(Value::Null)
        }),
        ".{0,40}".prop_map(Value::from),
        prop::sample::select(FIELDS).prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(FIELDS), inner), 0..6).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

/// An event of a known (or unknown) type with random fields.
fn any_event() -> impl Strategy<Value = Value> {
    (
        prop::sample::select(EVENTS),
        prop::collection::vec((prop::sample::select(FIELDS), any_json()), 0..6),
    )
        .prop_map(|(ty, kv)| {
            let mut o = serde_json::Map::new();
            for (k, v) in kv {
                o.insert(k.to_string(), v);
            }
            o.insert("type".into(), Value::from(ty));
            Value::Object(o)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None,
        ..ProptestConfig::default() })]

    /// Any text at all: an event or a documented error, never a panic.
    #[test]
    fn any_text_frame_parses_or_is_a_documented_error(text in ".{0,300}") {
        if let Err(e) = parse_client(&text) {
            prop_assert!(CODES.contains(&e.code.as_str()), "{:?}", e);
        }
    }

    /// Events of every type with random fields: parsed, or a documented error; a parsed
    /// session.create's generation validates without panicking either way.
    #[test]
    fn structured_events_parse_or_are_documented_errors(v in any_event()) {
        match parse_client(&v.to_string()) {
            Ok(_) => {}
            Err(e) => prop_assert!(CODES.contains(&e.code.as_str()), "{:?} for {}", e, v),
        }
    }

    /// Any bytes decode to a frame or to nothing; a frame round-trips through its bytes.
    #[test]
    fn binary_frames_decode_without_panics_and_round_trip(
        bytes in prop::collection::vec(any::<u8>(), 0..64),
        kind in any::<u8>(), last in any::<bool>(), seq in any::<u32>(),
            response_id in any::<u32>(),
        payload in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let _ = AudioFrame::decode(&bytes);
        let f = AudioFrame { kind, last, seq, response_id, payload };
        prop_assert_eq!(AudioFrame::decode(&f.encode()), Some(f));
    }

    /// Whatever the counts and temperature, what validates is within the limits.
    #[test]
    fn generation_that_validates_is_within_the_limits(
        counts in prop::collection::vec(prop::option::of(prop_oneof![0usize..300, Just(usize::MAX),
            any::<usize>()]), 4),
        temperature in prop::option::of(prop_oneof![any::<f32>(), Just(f32::NAN),
            Just(f32::INFINITY), -1.0f32..3.0]),
    ) {
        let limits = GenerationLimits { max_text_tokens: 100, max_audio_tokens: 200 };
        let g = Generation {
            max_text_tokens: counts[0], min_text_tokens: counts[1], max_audio_tokens: counts[2],
                min_audio_tokens: counts[3],
            temperature, ..Generation::default()
        };
        if g.validate(&limits).is_ok() {
            prop_assert!(counts[0].is_none_or(|v| v <= 100) && counts[1].is_none_or(|v| v <= 100));
            prop_assert!(counts[2].is_none_or(|v| v <= 200) && counts[3].is_none_or(|v| v <= 200));
            if let (Some(lo), Some(hi)) = (counts[1], counts[0]) { prop_assert!(lo <= hi); }
            if let (Some(lo), Some(hi)) = (counts[3], counts[2]) { prop_assert!(lo <= hi); }
            prop_assert!(temperature.is_none_or(|t| t.is_finite() && (0.0..=2.0).contains(&t)));
        }
    }
}

/// One hostile message: a text frame, a binary frame, or a hostile but well-formed event.
fn hostile(rng: &mut rand_chacha::ChaCha8Rng) -> Message {
    let huge = [4_294_967_296u64, u64::MAX, 1 << 40, 100_000];
    match rng.random_range(0..12) {
        0 => Message::Text("{not json".into()),
        1 => Message::Text(json!([1, 2, 3]).to_string().into()),
        2 => Message::Text(
            json!({"type": EVENTS[rng.random_range(0..EVENTS.len())]}).to_string().into(),
        ),
        3 => {
            let field =
                ["max_text_tokens", "max_audio_tokens", "min_text_tokens", "min_audio_tokens"]
                    [rng.random_range(0..4)];
            let v = huge[rng.random_range(0..huge.len())];
            let mut generation = json!({});
            generation[field] = json!(v);
            let ty = ["input.text", "session.update"][rng.random_range(0..2)];
            Message::Text(
                json!({"type": ty, "text": "hi",
                "generation": generation})
                .to_string()
                .into(),
            )
        }
        4 => Message::Text(
            json!({"type": "session.update",
            "generation": {"temperature": -rng.random::<f64>() * 10.0}})
            .to_string()
            .into(),
        ),
        5 => Message::Text(
            json!({"type": "ack",
            "seq": rng.random::<u32>() as u64 + 1_000_000})
            .to_string()
            .into(),
        ),
        6 => Message::Text(
            json!({"type": "session.update",
            "instructions": "x".repeat(rng.random_range(8193..20_000))})
            .to_string()
            .into(),
        ),
        7 => Message::Text(
            json!({"type": "playback", "response_id": rng.random::<u32>(),
            "played_ms": -5})
            .to_string()
            .into(),
        ),
        8 => Message::Binary(
            (0..rng.random_range(0..40)).map(|_| rng.random::<u8>()).collect::<Vec<u8>>().into(),
        ),
        9 => {
            // a well-framed audio packet whose payload is noise (not Opus, odd PCM16 lengths)
            let payload: Vec<u8> =
                (0..rng.random_range(1..400)).map(|_| rng.random::<u8>()).collect();
            Message::Binary(
                AudioFrame {
                    kind: rng.random_range(0..3),
                    last: false,
                    seq: rng.random(),
                    response_id: 0,
                    payload,
                }
                .encode()
                .into(),
            )
        }
        10 => Message::Text(
            json!({"type": "session.resume", "session_id": "s_nope",
            "resume_token": "x", "last_seq": 0})
            .to_string()
            .into(),
        ),
        _ => {
            let mut o = serde_json::Map::new();
            o.insert("type".into(), json!("session.update"));
            for _ in 0..rng.random_range(1..5) {
                o.insert(
                    FIELDS[rng.random_range(0..FIELDS.len())].into(),
                    json!({"deep": [[[[rng.random::<i64>()]]]]}),
                );
            }
            Message::Text(Value::Object(o).to_string().into())
        }
    }
}

/// Sends `m`, then a ping: every message until its pong is an event with a documented error
/// code (or any other event), or a close with a documented code. `true` while the socket lives.
async fn case(c: &mut Client, m: Message, n: u64) -> bool {
    c.send_raw(m.clone()).await;
    c.send(json!({"type": "ping", "id": format!("case-{n}")})).await;
    loop {
        match c.recv().await {
            In::Event(v) if v["type"] == "pong" && v["id"] == format!("case-{n}") => return true,
            In::Event(v) if v["type"] == "error" => {
                let code = v["code"].as_str().unwrap_or("");
                assert!(CODES.contains(&code), "case {n} ({m:?}): undocumented error {v}");
                assert!(
                    v["message"].as_str().is_some_and(|s| !s.is_empty() && s.len() <= 400),
                    "case {n}: {v}"
                );
            }
            In::Closed(code) => {
                assert!(
                    matches!(code, Some(1000 | 1002 | 1007 | 1008 | 1009)),
                    "case {n} ({m:?}): closed with {code:?}"
                );
                return false;
            }
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_fed_hostile_messages_stays_up_and_answers_each() {
    let _turn = ONE_SERVER_AT_A_TIME.lock().await;
    let s = server(|_| {}).await;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
    let mut c = Client::connect(&s).await;
    c.create(json!({})).await;
    let mut closed = 0;
    for n in 0..300u64 {
        if !case(&mut c, hostile(&mut rng), n).await {
            closed += 1;
            c = Client::connect(&s).await;
            c.create(json!({})).await;
        }
    }
    // the session that took all of it still answers (every case ended with its pong), and a new
    // session completes a response
    drop(c);
    let mut d = Client::connect(&s).await;
    d.create(json!({})).await;
    d.send(json!({"type": "input.text", "text": "hello", "generation": short(12)})).await;
    let done = d.event("response.done").await;
    assert_eq!(done["status"], "completed", "{done}");
    assert!(closed < 300, "every case closed the socket");
    s.shutdown().await.unwrap();
}

/// The process's resident memory in bytes (Linux).
fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    statm.split_whitespace().nth(1).and_then(|p| p.parse::<usize>().ok()).expect("resident pages")
        * 4096
}

/// A client that asks for one response after another, acks far ahead of what it got and never
/// reads: its acks are refused, its socket is closed once its bounded queue is full, and the
/// server (here in this process) does not grow past a bound however long it goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_cannot_grow_the_server_without_bound() {
    let _turn = ONE_SERVER_AT_A_TIME.lock().await;
    let s = server(|c| {
        c.server.outbound_queue = 64;
        c.server.max_sessions = 8;
    })
    .await;
    // a first client that reads: the engine's buffers reach their working size
    let mut warm = Client::connect(&s).await;
    warm.create(json!({})).await;
    warm.send(json!({"type": "input.text", "text": "hello", "generation": short(40)})).await;
    warm.event("response.done").await;
    let before = rss_bytes();
    // (7 sessions beside the warm one: every session the server holds; they park when dropped)
    for round in 0..7 {
        let mut c = Client::connect(&s).await;
        c.create(json!({})).await;
        for k in 0..40u64 {
            c.send_raw(Message::Text(
                json!({"type": "input.text", "text": format!("round {round} turn {k}"),
                    "generation": short(40)})
                .to_string()
                .into(),
            ))
            .await;
            c.send_raw(Message::Text(
                json!({"type": "ack", "seq": 1_000_000 + k}).to_string().into(),
            ))
            .await;
        }
        // (never read: the server either closes the socket or keeps at most its bounds)
        drop(c);
    }
    // one more finds every session held (parked ones included): refused, with a retry hint
    let mut extra = Client::connect(&s).await;
    extra
        .send(json!({"type": "session.create", "mode": "turn",
            "input_audio": {"codec": "pcm16", "sample_rate": 16000},
                "output_audio": {"codec": "opus"}}))
        .await;
    let e = extra.event("error").await;
    assert!(e["code"] == "capacity" && e["retry_after_ms"].as_u64().is_some(), "{e}");
    // the server still serves, and what it holds now is within a bound of what it held before
    warm.send(json!({"type": "input.text", "text": "still there?", "generation": short(12)})).await;
    let done = warm.event("response.done").await;
    assert_eq!(done["status"], "completed", "{done}");
    let grown = rss_bytes().saturating_sub(before);
    eprintln!("resident memory grew by {} MiB", grown >> 20);
    assert!(grown < 192 << 20, "resident memory grew by {} MiB", grown >> 20);
    s.shutdown().await.unwrap();
}

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
