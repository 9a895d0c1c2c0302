//! The OpenAI Realtime dialect (`/openai/v1/realtime`) against raw WebSocket clients on
//! 127.0.0.1:0 with the tiny engine: the event sequence of a turn, G.711 output, the three ways
//! to present a key and the `realtime` subprotocol, bad input answered with errors that carry the
//! client's `event_id` while the session goes on, and the v1 session behind a socket ending with
//! it. (The official SDKs and pipecat are run against a real server by .ci/run.)

use std::time::{Duration, Instant};

use antiphon_server::Server;
use base64::Engine as _;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

#[allow(dead_code)]
use crate::wire;
use wire::{one_place, server, Client, In};

mod bounds;

fn quick(c: &mut antiphon_server::config::Config) {
    c.engine.default_max_audio_tokens = 30;
}

async fn connect(s: &Server) -> Client {
    let mut c =
        Client::connect_to(&format!("ws://{}/openai/v1/realtime?model=gpt-realtime", s.addr))
            .await
            .unwrap();
    let first = c.recv().await;
    assert_eq!(first.ty(), "session.created", "{first:?}");
    c
}

async fn event(c: &mut Client) -> Value {
    match c.recv().await {
        In::Event(v) => {
            assert!(
                v["event_id"].as_str().is_some_and(|s| !s.is_empty()),
                "every event has an event_id: {v}"
            );
            v
        }
        other => panic!("expected an event, got {other:?}"),
    }
}

async fn until(c: &mut Client, ty: &str) -> Vec<Value> {
    let mut out = vec![];
    loop {
        let v = event(c).await;
        let done = v["type"] == ty;
        out.push(v);
        if done {
            return out;
        }
    }
}

async fn error(c: &mut Client) -> Value {
    let v = event(c).await;
    assert_eq!(v["type"], "error", "{v}");
    v["error"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_turn_in_g711_with_the_full_event_sequence() {
    let s = server(quick).await;
    let mut c = connect(&s).await;
    c.send(json!({"type": "session.update", "session": {"type": "realtime",
        "instructions": "Be brief.",
        "audio": {"input": {"turn_detection": null}, "output": {"format": {"type": "audio/pcmu"},
            "voice": "marin"}}}}))
        .await;
    let u = event(&mut c).await;
    assert_eq!(u["type"], "session.updated");
    assert_eq!(u["session"]["audio"]["output"]["format"]["type"], "audio/pcmu");
    assert_eq!(u["session"]["audio"]["output"]["voice"], "marin");
    assert!(u["session"]["audio"]["input"]["turn_detection"].is_null());
    c.send(json!({"type": "conversation.item.create", "item": {"id": "u1", "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "Hello"}]}}))
        .await;
    assert_eq!(event(&mut c).await["item"]["id"], "u1");
    assert_eq!(event(&mut c).await["type"], "conversation.item.done");
    c.send(json!({"type": "response.create", "response": {"metadata": {"k": "v"}}})).await;
    let evs = until(&mut c, "response.done").await;
    let types: Vec<&str> = evs
        .iter()
        .map(|v| v["type"].as_str().unwrap())
        .filter(|t| !t.ends_with(".delta"))
        .collect();
    assert_eq!(
        types,
        [
            "response.created",
            "response.output_item.added",
            "conversation.item.added",
            "response.content_part.added",
            "response.output_audio.done",
            "response.output_audio_transcript.done",
            "response.content_part.done",
            "conversation.item.done",
            "response.output_item.done",
            "response.done"
        ]
    );
    assert_eq!(evs[0]["response"]["metadata"], json!({"k": "v"}));
    let done = &evs.last().unwrap()["response"];
    assert_eq!(done["status"], "completed");
    // G.711 is one byte per 8 kHz sample: (3 + 30 codes) x 40 ms + 160 ms of audio = 1480 ms
    let bytes: usize = evs
        .iter()
        .filter(|v| v["type"] == "response.output_audio.delta")
        .map(|v| {
            base64::engine::general_purpose::STANDARD
                .decode(v["delta"].as_str().unwrap())
                .unwrap()
                .len()
        })
        .sum();
    assert_eq!(bytes, 1480 * 8, "8 bytes a millisecond");
    assert_eq!(done["usage"]["output_token_details"]["audio_tokens"], 1480 * 25 / 1000);
    let transcript: String = evs
        .iter()
        .filter(|v| v["type"] == "response.output_audio_transcript.delta")
        .map(|v| v["delta"].as_str().unwrap())
        .collect();
    assert_eq!(
        done["output"][0]["content"][0],
        json!({"type": "output_audio", "transcript": transcript})
    );
    // every v1 message was acked: the journal behind the dialect holds nothing for a resume
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        s.shared.sessions.journal_bytes() < 4096,
        "v1 journal {} bytes",
        s.shared.sessions.journal_bytes()
    );
    // truncation of the answer's audio, beyond its length refused
    let item = done["output"][0]["id"].as_str().unwrap().to_string();
    c.send(json!({"type": "conversation.item.truncate", "item_id": item, "content_index": 0,
        "audio_end_ms": 5000, "event_id": "t1"}))
        .await;
    let e = error(&mut c).await;
    assert_eq!(
        (e["param"].as_str(), e["event_id"].as_str()),
        (Some("audio_end_ms"), Some("t1")),
        "{e}"
    );
    c.send(json!({"type": "conversation.item.truncate", "item_id": item, "content_index": 0,
        "audio_end_ms": 500}))
        .await;
    assert_eq!(event(&mut c).await["type"], "conversation.item.truncated");
    c.send(json!({"type": "conversation.item.retrieve", "item_id": item})).await;
    let r = event(&mut c).await;
    assert_eq!(r["type"], "conversation.item.retrieved");
    let kept = r["item"]["content"][0]["transcript"].as_str().unwrap().chars().count();
    assert_eq!(
        kept,
        transcript.chars().count() * 500 / 1480,
        "the transcript is cut to what was heard"
    );
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_errors_with_the_event_id_and_the_session_goes_on() {
    let s = server(quick).await;
    let mut c = connect(&s).await;
    c.send_raw(Message::Text("{not json".into())).await;
    assert_eq!(error(&mut c).await["code"], "invalid_json");
    c.send(json!({"type": "no.such.event", "event_id": "e1"})).await;
    let e = error(&mut c).await;
    assert_eq!((e["code"].as_str(), e["event_id"].as_str()), (Some("invalid_event"), Some("e1")));
    c.send_raw(Message::Binary(vec![1, 2, 3].into())).await;
    assert_eq!(error(&mut c).await["code"], "invalid_event");
    c.send(json!({"type": "input_audio_buffer.append", "audio": "AAEC", "event_id": "odd"})).await;
    assert_eq!(error(&mut c).await["event_id"], "odd");
    c.send(json!({"type": "session.update", "session": {"type": "realtime",
        "audio": {"input": {"turn_detection": null}}}}))
        .await;
    assert_eq!(event(&mut c).await["type"], "session.updated");
    c.send(json!({"type": "input_audio_buffer.commit"})).await;
    assert_eq!(error(&mut c).await["code"], "input_audio_buffer_commit_empty");
    // one sample is too little to be a turn: refused when committed (issue 38: accepted, and the
    // response failed), and kept: with 100 ms more the commit takes both
    let pcm =
        |samples: usize| base64::engine::general_purpose::STANDARD.encode(vec![0u8; 2 * samples]);
    c.send(json!({"type": "input_audio_buffer.append", "audio": pcm(1)})).await;
    c.send(json!({"type": "input_audio_buffer.commit", "event_id": "tiny"})).await;
    let e = error(&mut c).await;
    assert_eq!(
        (e["code"].as_str(), e["event_id"].as_str()),
        (Some("input_audio_buffer_commit_empty"), Some("tiny")),
        "{e}"
    );
    assert!(e["message"].as_str().unwrap().contains("100 ms"), "{e}");
    c.send(json!({"type": "input_audio_buffer.append", "audio": pcm(2400)})).await;
    c.send(json!({"type": "input_audio_buffer.commit"})).await;
    assert_eq!(event(&mut c).await["type"], "input_audio_buffer.committed");
    assert_eq!(event(&mut c).await["type"], "conversation.item.added");
    assert_eq!(event(&mut c).await["type"], "conversation.item.done");
    c.send(json!({"type": "response.cancel"})).await;
    assert_eq!(error(&mut c).await["code"], "response_cancel_not_active");
    c.send(
        json!({"type": "conversation.item.retrieve", "item_id": "nope", "event_id": "rci_nope"}),
    )
    .await;
    let e = error(&mut c).await;
    assert_eq!(
        (e["code"].as_str(), e["event_id"].as_str()),
        (Some("item_retrieve_invalid_item_id"), Some("rci_nope"))
    );
    c.send(json!({"type": "session.update", "session": {"type": "realtime",
        "instructions": "x".repeat(9000)}}))
        .await;
    assert_eq!(error(&mut c).await["param"], "session.instructions");
    // a response while one runs is the benign conflict pipecat expects
    c.send(json!({"type": "response.create"})).await;
    c.send(json!({"type": "response.create"})).await;
    let mut conflict = false;
    for v in until(&mut c, "response.done").await {
        conflict |= v["type"] == "error"
            && v["error"]["code"] == "conversation_already_has_active_response";
    }
    assert!(conflict, "the second response.create is refused");
    // and the session still answers
    c.send(json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Hi"}]}}))
        .await;
    c.send(json!({"type": "response.create"})).await;
    let done = until(&mut c, "response.done").await;
    assert_eq!(done.last().unwrap()["response"]["status"], "completed");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_by_header_subprotocol_or_query_and_the_session_ends_with_its_socket() {
    let s = server(|c| {
        quick(c);
        c.auth.api_keys = vec!["k1".into()];
    })
    .await;
    let url = format!("ws://{}/openai/v1/realtime", s.addr);
    assert!(tokio_tungstenite::connect_async(url.as_str()).await.is_err(), "no key: refused");
    let mut req = url.as_str().into_client_request().unwrap();
    req.headers_mut().insert("authorization", "Bearer k1".parse().unwrap());
    assert!(tokio_tungstenite::connect_async(req).await.is_ok());
    assert!(tokio_tungstenite::connect_async(format!("{url}?model=m&token=k1")).await.is_ok());
    let mut req = url.as_str().into_client_request().unwrap();
    req.headers_mut()
        .insert("sec-websocket-protocol", "realtime, openai-insecure-api-key.k2".parse().unwrap());
    assert!(
        tokio_tungstenite::connect_async(req).await.is_err(),
        "a wrong key in the subprotocol: refused"
    );
    let mut req = url.as_str().into_client_request().unwrap();
    req.headers_mut()
        .insert("sec-websocket-protocol", "realtime, openai-insecure-api-key.k1".parse().unwrap());
    let (mut ws, resp) = tokio_tungstenite::connect_async(req).await.unwrap();
    assert_eq!(
        resp.headers().get("sec-websocket-protocol").unwrap(),
        "realtime",
        "the subprotocol is answered"
    );
    use futures_util::StreamExt;
    let first = ws.next().await.unwrap().unwrap();
    assert!(first.to_text().unwrap().contains("session.created"));
    drop(ws);
    // no resume in this dialect: every session ends with its socket
    let deadline = Instant::now() + Duration::from_secs(30);
    while !s.shared.sessions.is_empty() {
        assert!(
            Instant::now() < deadline,
            "{} sessions left after their sockets closed",
            s.shared.sessions.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(s.shared.sessions.parked(), 0);
    s.shutdown().await.unwrap();
}

/// Frames the transport refuses are said as v1 says them: a text frame just over the limit, far
/// over it, and one of invalid UTF-8 get the dialect's `error` and then 1009 / 1007, never a
/// silent close (issue 38).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_over_the_limit_or_not_utf8_get_an_error_and_a_close_code() {
    let s = server(quick).await;
    let limit = s.shared.config.server.max_text_frame;
    let frames = [
        (Message::Text("x".repeat(limit + 1).into()), "message_too_large", 1009),
        (Message::Text("x".repeat(10 << 20).into()), "message_too_large", 1009),
        (Message::Binary(vec![b'x'; limit + 1].into()), "message_too_large", 1009),
    ];
    for (n, (frame, code, close)) in frames.into_iter().enumerate() {
        let mut c = connect(&s).await;
        c.send_raw(frame).await;
        let ms = c.until(|m| matches!(m, In::Closed(_))).await;
        assert!(
            ms.iter().any(
                |m| matches!(m, In::Event(v) if v["type"] == "error" && v["error"]["code"] == code)
            ),
            "frame {n}: {ms:?}"
        );
        assert!(matches!(ms.last(), Some(In::Closed(Some(c))) if *c == close), "frame {n}: {ms:?}");
    }
    // invalid UTF-8 in a text frame (a raw frame: the library's text messages are valid UTF-8)
    let mut c = connect(&s).await;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    c.send_raw(Message::Frame(Frame::message(
        vec![b'{', 0xff, 0xfe, b'}'],
        OpCode::Data(Data::Text),
        true,
    )))
    .await;
    let ms = c.until(|m| matches!(m, In::Closed(_))).await;
    assert!(
        ms.iter().any(|m| matches!(m,
        In::Event(v) if v["type"] == "error" && v["error"]["code"] == "invalid_json")),
        "{ms:?}"
    );
    assert!(matches!(ms.last(), Some(In::Closed(Some(1007)))), "{ms:?}");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_streaming_silence_is_active_and_an_idle_one_is_closed() {
    let s = server(|c| {
        quick(c);
        c.server.idle_timeout_s = 2;
    })
    .await;
    let mut c = connect(&s).await;
    // 4 s of silence in 100 ms appends, 100 ms apart: turn detection holds it all (no turn), yet
    // the session stays: the client is active
    let silence = base64::engine::general_purpose::STANDARD.encode(vec![0u8; 4800]);
    for _ in 0..40 {
        c.send(json!({"type": "input_audio_buffer.append", "audio": silence})).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.send(json!({"type": "session.update", "session": {"type": "realtime"}})).await;
    assert_eq!(
        event(&mut c).await["type"],
        "session.updated",
        "the session outlived 4 s of streamed silence"
    );
    // then nothing: the idle timeout ends it, and the client is told why before the close
    let e = error(&mut c).await;
    assert_eq!(e["code"], "session_closing", "{e}");
    assert!(matches!(c.recv().await, In::Closed(_)));
    s.shutdown().await.unwrap();
}

/// Busy is said with when to try again, in the dialect as in v1: a response the server has no
/// place for fails with `status_details.error.code` `capacity` and its `retry_after_ms`, and a call
/// refused at connect gets an `error` with both before its close 1013.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_says_when_to_try_again() {
    let s = server(one_place).await;
    let mut b = connect(&s).await;
    let mut a = Client::connect(&s).await;
    a.create(json!({})).await;
    a.send(json!({"type": "input.text", "text": "talk a while",
        "generation": {"min_audio_tokens": 2000, "max_audio_tokens": 2000}}))
        .await;
    a.until(|m| matches!(m, In::Audio(_))).await;
    b.send(json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "me too"}]}}))
        .await;
    b.send(json!({"type": "response.create"})).await;
    let done = until(&mut b, "response.done").await.pop().unwrap();
    let details = &done["response"]["status_details"];
    assert_eq!(done["response"]["status"], "failed", "{done}");
    assert_eq!(details["error"]["code"], "capacity", "{done}");
    assert!(details["error"]["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{done}");
    // a new call while no place is free
    let mut c =
        Client::connect_to(&format!("ws://{}/openai/v1/realtime?model=gpt-realtime", s.addr))
            .await
            .unwrap();
    let e = error(&mut c).await;
    assert_eq!(e["code"], "capacity", "{e}");
    assert!(e["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{e}");
    assert!(matches!(c.recv().await, In::Closed(Some(1013))));
    a.send(json!({"type": "response.cancel"})).await;
    s.shutdown().await.unwrap();
}
