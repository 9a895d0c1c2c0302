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

mod dialect;

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
