//! The server against raw WebSocket clients, on 127.0.0.1:0 with the tiny engine: every event and
//! error code, resume at random cut points with nothing lost or doubled, input dedupe, expiry,
//! replacement, capacity, bad input, an Opus round trip, auth, and shutdown.

use std::time::{Duration, Instant};

use antiphon_protocol::AudioFrame;
use antiphon_server::Server;

use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

use crate::wire;
use wire::{is_done, reqwest_like_get, server, short, Client, In};

mod duplex;

mod connection;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_basic_exchange_with_gapless_seq() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    let created = c.create(json!({})).await;
    assert_eq!(created["seq"], 1);
    assert_eq!(created["protocol"], 1);
    assert_eq!(created["synthetic_weights"], true);
    assert_eq!(created["resume_grace_s"], 30);
    c.send(json!({"type": "input.text", "text": "Hello", "seq": 1, "generation": short(30)})).await;
    let ms = c.until(is_done).await;
    let seqs: Vec<u64> = ms.iter().filter_map(In::seq).collect();
    assert_eq!(
        seqs,
        (2..2 + seqs.len() as u64).collect::<Vec<_>>(),
        "every message of the conversation, +1 each"
    );
    assert_eq!(ms[0].ty(), "response.created");
    let audio: Vec<&AudioFrame> =
        ms.iter().filter_map(|m| if let In::Audio(f) = m { Some(f) } else { None }).collect();
    assert_eq!(audio.len(), 74, "(3 + 30 codes) × 40 ms + 160 ms in 20 ms packets");
    assert!(audio.iter().all(|f| f.response_id == 1 && f.kind == 1));
    assert!(
        audio.last().unwrap().last && audio.iter().filter(|f| f.last).count() == 1,
        "the last packet is flagged"
    );
    let done = match ms.last().unwrap() {
        In::Event(v) => v.clone(),
        _ => unreachable!(),
    };
    assert_eq!(done["status"], "completed");
    assert_eq!(done["packets"], 74);
    assert_eq!(done["audio_ms"], 1480);
    // the server acknowledges the applied input within its ack period (500 ms), which a fast
    // response may finish before
    if !ms.iter().any(|m| m.ty() == "ack") {
        let ack = tokio::time::timeout(std::time::Duration::from_secs(2), c.event("ack"))
            .await
            .expect("the server acknowledges input");
        assert_eq!(ack["input_seq"], 1);
    }
    // ping / pong and a clean close
    c.send(json!({"type": "ping", "id": "p1"})).await;
    assert_eq!(c.event("pong").await["id"], "p1");
    c.send(json!({"type": "session.close"})).await;
    assert!(matches!(c.recv().await, In::Closed(_)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(s.shared.sessions.len(), 0, "session.close frees the session at once");
    let m = reqwest_like_get(&s, "/metrics").await;
    assert!(m.contains("antiphon_ttfa_seconds_count 1"), "{m}");
    assert!(m.contains("antiphon_stage_step_seconds"));
    s.shutdown().await.unwrap();
}

/// Drops the socket without a close frame after `cut` messages of a response, resumes, and checks
/// that the messages seen before and after are exactly 1..=last, once each.
async fn drop_and_resume(s: &Server, cut: usize, codes: u64) {
    let mut c = Client::connect(s).await;
    let created = c.create(json!({})).await;
    let (id, token) = (
        created["session_id"].as_str().unwrap().to_string(),
        created["resume_token"].as_str().unwrap().to_string(),
    );
    c.send(json!({"type": "input.text", "text": "Tell me", "seq": 1, "generation": short(codes)}))
        .await;
    let mut seen: Vec<u64> = vec![1];
    let mut got_done = false;
    for _ in 0..cut {
        let m = c.recv().await;
        if let Some(q) = m.seq() {
            seen.push(q);
        }
        if is_done(&m) {
            got_done = true;
            break;
        }
    }
    drop(c); // unclean: no close frame
    let last = *seen.iter().max().unwrap();
    let mut c = Client::connect(s).await;
    c.send(json!({"type": "session.resume", "session_id": id, "resume_token": token,
        "last_seq": last}))
        .await;
    let resumed = c.event("session.resumed").await;
    assert_eq!(resumed["input_seq"], 1, "the server applied input 1");
    assert!(resumed.get("seq").is_none());
    if !got_done {
        let rest = c.until(is_done).await;
        let after: Vec<u64> = rest.iter().filter_map(In::seq).collect();
        assert_eq!(
            after.first(),
            Some(&(last + 1)),
            "replay starts right after last_seq (cut {cut})"
        );
        seen.extend(after);
    }
    let n = seen.len() as u64;
    assert_eq!(seen, (1..=n).collect::<Vec<_>>(), "nothing lost, nothing doubled (cut {cut})");
    c.send(json!({"type": "session.close"})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_after_unclean_drops_at_random_points_loses_nothing() {
    let s = server(|_| {}).await;
    let mut rng = 12345u64;
    for _ in 0..12 {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let cut = 1 + (rng >> 33) as usize % 60;
        drop_and_resume(&s, cut, 30).await;
    }
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_is_deduplicated_after_a_resume() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    let created = c.create(json!({})).await;
    let (id, token) = (
        created["session_id"].as_str().unwrap().to_string(),
        created["resume_token"].as_str().unwrap().to_string(),
    );
    c.send(json!({"type": "input.text", "text": "one", "seq": 1, "generation": short(10)})).await;
    c.until(is_done).await;
    drop(c);
    let mut c = Client::connect(&s).await;
    c.send(
        json!({"type": "session.resume", "session_id": id, "resume_token": token, "last_seq": 0}),
    )
    .await;
    let r = c.event("session.resumed").await;
    assert_eq!(r["input_seq"], 1);
    // the replay brings everything since seq 1, including the finished response
    let replay = c.until(is_done).await;
    assert_eq!(replay.iter().filter(|m| m.ty() == "response.created").count(), 1);
    // the client resends input 1 (already applied) and sends input 2
    c.send(json!({"type": "input.text", "text": "one", "seq": 1, "generation": short(10)})).await;
    c.send(json!({"type": "input.text", "text": "two", "seq": 2, "generation": short(10)})).await;
    let ms = c.until(is_done).await;
    let created: Vec<&In> = ms.iter().filter(|m| m.ty() == "response.created").collect();
    assert_eq!(created.len(), 1, "input 1 was not applied twice");
    match created[0] {
        In::Event(v) => assert_eq!(v["response_id"], 2),
        _ => unreachable!(),
    }
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_replacement_and_resume_errors() {
    let s = server(|c| c.server.resume_grace_s = 1).await;
    let mut a = Client::connect(&s).await;
    let created = a.create(json!({})).await;
    let (id, token) = (
        created["session_id"].as_str().unwrap().to_string(),
        created["resume_token"].as_str().unwrap().to_string(),
    );
    // a second socket with the right token replaces the first
    let mut b = Client::connect(&s).await;
    b.send(
        json!({"type": "session.resume", "session_id": id, "resume_token": token, "last_seq": 1}),
    )
    .await;
    b.event("session.resumed").await;
    let closing = a.event("session.closing").await;
    assert_eq!(closing["reason"], "replaced");
    assert!(matches!(a.recv().await, In::Closed(_)));
    // wrong token, unknown session
    let mut c = Client::connect(&s).await;
    c.send(
        json!({"type": "session.resume", "session_id": id, "resume_token": "nope", "last_seq": 0}),
    )
    .await;
    assert_eq!(c.event("error").await["code"], "bad_resume_token");
    c.send(json!({"type": "session.resume", "session_id": "s_nobody", "resume_token": "x",
        "last_seq": 0}))
        .await;
    assert_eq!(c.event("error").await["code"], "session_not_found");
    // drop b; after the 1 s grace the session is gone
    drop(b);
    tokio::time::sleep(Duration::from_millis(1800)).await;
    c.send(
        json!({"type": "session.resume", "session_id": id, "resume_token": token, "last_seq": 0}),
    )
    .await;
    assert_eq!(c.event("error").await["code"], "session_expired");
    assert_eq!(s.shared.sessions.len(), 0);
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_is_answered_with_retry_after() {
    let s = server(|c| c.server.max_sessions = 1).await;
    let mut a = Client::connect(&s).await;
    a.create(json!({})).await;
    let mut b = Client::connect(&s).await;
    b.send(json!({"type": "session.create", "mode": "turn", "input_audio": {"codec": "pcm16",
        "sample_rate": 16000},
        "output_audio": {"codec": "opus"}}))
        .await;
    let e = b.event("error").await;
    assert_eq!(e["code"], "capacity");
    assert_eq!(e["fatal"], true);
    assert!(e["retry_after_ms"].as_u64().unwrap() > 0);
    let body = reqwest_like_get(&s, "/readyz").await;
    assert!(body.starts_with("HTTP/1.1 503") && body.contains("\"capacity_left\":0"), "{body}");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_never_ends_the_session() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    // before a session
    c.send(json!({"type": "input.text", "text": "x"})).await;
    assert_eq!(c.event("error").await["code"], "not_in_session");
    c.create(json!({"input_audio": {"codec": "opus", "sample_rate": 16000}})).await;
    let cases: Vec<(Message, &str)> = vec![
        (Message::Text("{not json".into()), "bad_json"),
        (Message::Text("[1,2]".into()), "bad_json"),
        (Message::Text(json!({"type": "dance"}).to_string().into()), "unknown_event"),
        (Message::Text(json!({"type": "input.text"}).to_string().into()), "bad_field"),
        (
            Message::Text(
                json!({"type": "playback", "response_id": "x",
            "played_ms": 1})
                .to_string()
                .into(),
            ),
            "bad_field",
        ),
        (
            Message::Text(
                json!({"type": "session.update",
            "voice": {"id": "nobody"}})
                .to_string()
                .into(),
            ),
            "bad_field",
        ),
        (
            Message::Text(
                json!({"type": "session.update", "output_audio": {"codec": "opus",
            "frame_ms": 7}})
                .to_string()
                .into(),
            ),
            "bad_field",
        ),
        (
            Message::Text(
                json!({"type": "session.create", "mode": "turn",
            "input_audio": {"codec": "pcm16", "sample_rate": 16000},
            "output_audio": {"codec": "opus"}})
                .to_string()
                .into(),
            ),
            "session_in_use",
        ),
        (Message::Binary(vec![1, 0, 0].into()), "bad_audio"),
        (
            Message::Binary(
                AudioFrame {
                    kind: 1,
                    last: false,
                    seq: 0,
                    response_id: 0,
                    payload: vec![0xff; 40],
                }
                .encode()
                .into(),
            ),
            "bad_audio",
        ),
        (Message::Text(json!({"type": "input.commit"}).to_string().into()), "bad_field"),
    ];
    for (m, code) in cases {
        c.send_raw(m).await;
        let e = c.event("error").await;
        assert_eq!(e["code"], code, "{e}");
        assert_eq!(e["fatal"], false);
        assert!(e["seq"].as_u64().is_some(), "errors inside a session carry seq");
    }
    // an unknown binary kind is ignored silently
    c.send_raw(Message::Binary(
        AudioFrame { kind: 9, last: false, seq: 0, response_id: 0, payload: vec![1, 2] }
            .encode()
            .into(),
    ))
    .await;
    // the session still works
    c.send(json!({"type": "input.text", "text": "still here?", "generation": short(8)})).await;
    let ms = c.until(is_done).await;
    assert!(ms.iter().all(|m| m.ty() != "error"), "{ms:?}");
    let m = reqwest_like_get(&s, "/metrics").await;
    assert!(m.contains("antiphon_errors_total{code=\"bad_json\"} 2"), "{m}");
    // oversized frames: an error, then close 1009
    let mut big = Client::connect(&s).await;
    big.create(json!({})).await;
    big.send_raw(Message::Binary(vec![1u8; 20_000].into())).await;
    let ms = big.until(|m| matches!(m, In::Closed(_))).await;
    // (inside a session the error is one of its messages: it carries the next seq)
    assert!(
        ms.iter().any(
            |m| matches!(m, In::Event(v) if v["code"] == "message_too_large" && v["seq"] == 2)
        ),
        "{ms:?}"
    );
    assert!(matches!(ms.last(), Some(In::Closed(Some(1009)))), "{ms:?}");
    // text beyond the limit, just over and far over (the transport refuses it unbuffered)
    for n in [300_000, 2 << 20] {
        let mut big = Client::connect(&s).await;
        big.send_raw(Message::Text("x".repeat(n).into())).await;
        let ms = big.until(|m| matches!(m, In::Closed(_))).await;
        assert!(
            ms.iter().any(|m| matches!(m, In::Event(v) if v["code"] == "message_too_large")),
            "{n}: {ms:?}"
        );
        assert!(matches!(ms.last(), Some(In::Closed(Some(1009)))), "{n}: {ms:?}");
    }
    s.shutdown().await.unwrap();
}

/// Generation values no model holds (the sizes that used to abort the process on allocation) and
/// out-of-range temperatures are a `bad_field` naming the field, through every event that carries
/// them; the session goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_generation_values_are_refused_and_the_server_stays_up() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    c.create(json!({})).await;
    let cases = [
        (json!({"max_text_tokens": 4_294_967_296u64}), "max_text_tokens"),
        (json!({"max_audio_tokens": 100_000_000}), "max_audio_tokens"),
        (json!({"min_text_tokens": 9, "max_text_tokens": 3}), "min_text_tokens"),
        (json!({"temperature": -1.0}), "temperature"),
    ];
    for (g, field) in &cases {
        c.send(json!({"type": "input.text", "text": "hi", "generation": g})).await;
        let e = c.event("error").await;
        assert_eq!(e["code"], "bad_field", "{e}");
        assert!(e["message"].as_str().unwrap().contains(field), "{e}");
    }
    c.send(json!({"type": "session.update", "generation": {"max_audio_tokens": 2_147_483_648u64}}))
        .await;
    assert_eq!(c.event("error").await["code"], "bad_field");
    let mut d = Client::connect(&s).await;
    d.send(json!({"type": "session.create", "mode": "turn", "input_audio": {"codec": "pcm16",
        "sample_rate": 16000},
        "output_audio": {"codec": "opus"}, "generation": {"max_text_tokens": 1_000_000_000}}))
        .await;
    let e = d.event("error").await;
    assert!(
        e["code"] == "bad_field" && e["message"].as_str().unwrap().contains("max_text_tokens"),
        "{e}"
    );
    // the first session still works
    c.send(json!({"type": "input.text", "text": "still here?", "generation": short(8)})).await;
    let ms = c.until(is_done).await;
    assert!(ms.iter().all(|m| m.ty() != "error"), "{ms:?}");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoken_input_in_opus_and_pcm16_output() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    c.create(json!({"input_audio": {"codec": "opus", "sample_rate": 48000},
        "output_audio": {"codec": "pcm16", "frame_ms": 40}}))
        .await;
    let mut enc =
        opus::Encoder::new(48_000, opus::Channels::Mono, opus::Application::Voip).unwrap();
    for k in 0..50u32 {
        let frame: Vec<f32> =
            (0..960).map(|i| 0.3 * (((k * 960 + i) as f32) * 0.03).sin()).collect();
        let p = enc.encode_vec_float(&frame, 4000).unwrap();
        c.send_raw(Message::Binary(
            AudioFrame { kind: 1, last: false, seq: k + 1, response_id: 0, payload: p }
                .encode()
                .into(),
        ))
        .await;
    }
    c.send(json!({"type": "input.commit", "seq": 51, "generation": short(20)})).await;
    let ms = c.until(is_done).await;
    let created = ms.iter().find(|m| m.ty() == "response.created").unwrap();
    assert!(matches!(created, In::Event(v) if v["trigger"] == "commit"));
    let pcm: usize = ms
        .iter()
        .filter_map(|m| if let In::Audio(f) = m { Some(f.payload.len() / 2) } else { None })
        .sum();
    // 20 codes make a single (first and last) chunk: no delay silence in front
    assert_eq!(pcm, (3 + 20) * 2 * 480, "PCM16 carries every sample");
    // the server acknowledges the highest applied input (at least every 500 ms while receiving)
    let mut acked =
        ms.iter().any(|m| matches!(m, In::Event(v) if v["type"] == "ack" && v["input_seq"] == 51));
    for _ in 0..3 {
        if acked {
            break;
        }
        acked = c.event("ack").await["input_seq"] == 51;
    }
    assert!(acked, "an ack reports input 51");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_audio_quickly_and_playback_truncates() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    c.create(json!({})).await;
    c.send(json!({"type": "input.text", "text": "long answer", "generation": short(400)})).await;
    c.until(|m| matches!(m, In::Audio(_))).await;
    let t = Instant::now();
    c.send(json!({"type": "response.cancel"})).await;
    let ms = c.until(is_done).await;
    let took = t.elapsed();
    assert!(took < Duration::from_millis(500), "cancel took {took:?}");
    match ms.last().unwrap() {
        In::Event(v) => assert_eq!(v["status"], "cancelled"),
        _ => unreachable!(),
    }
    // no audio of that response after its done
    let tail = tokio::time::timeout(Duration::from_millis(400), c.recv()).await;
    assert!(!matches!(tail, Ok(In::Audio(_))), "audio after cancel: {tail:?}");
    c.send(json!({"type": "playback", "response_id": 1, "played_ms": 100})).await;
    // a new turn works
    c.send(json!({"type": "input.text", "text": "again", "generation": short(8)})).await;
    let ms = c.until(is_done).await;
    assert!(matches!(ms.last().unwrap(),
            In::Event(v) if v["status"] == "completed" && v["response_id"] == 2));
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacknowledged_journal_overflows_and_a_prompt_beyond_the_context_is_a_bad_field() {
    let s = server(|c| c.server.journal_max_audio_s = 1).await;
    // a response of more than 1 s of audio, never acknowledged
    let mut c = Client::connect(&s).await;
    c.create(json!({})).await;
    c.send(json!({"type": "input.text", "text": "x", "generation": short(60)})).await;
    let ms = c.until(|m| matches!(m, In::Event(v) if v["type"] == "error")).await;
    match ms.last().unwrap() {
        In::Event(v) => {
            assert_eq!(v["code"], "journal_overflow");
            assert_eq!(v["fatal"], true);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(c.recv().await, In::Closed(_)));
    // a request the engine cannot hold (a prompt longer than the context): bad_field, not fatal
    let mut c = Client::connect(&s).await;
    c.create(json!({})).await;
    c.send(json!({"type": "input.text", "text": "la ".repeat(4000), "generation": short(10)}))
        .await;
    let ms = c.until(is_done).await;
    assert!(
        ms.iter()
            .any(|m| matches!(m, In::Event(v) if v["code"] == "bad_field" && v["fatal"] == false)),
        "{ms:?}"
    );
    assert!(matches!(ms.last().unwrap(), In::Event(v) if v["status"] == "failed"));
    c.send(json!({"type": "input.text", "text": "short", "generation": short(10)})).await;
    let ms = c.until(is_done).await;
    assert!(
        matches!(ms.last().unwrap(), In::Event(v) if v["status"] == "completed"),
        "the session goes on: {:?}",
        ms.iter().filter(|m| !matches!(m, In::Audio(_))).collect::<Vec<_>>()
    );
    s.shutdown().await.unwrap();
}

/// An ack beyond the highest seq sent is refused (it would empty the journal of what the client
/// never got) and the journal keeps everything; a resume without `last_seq` is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_ahead_and_resumes_without_last_seq_are_refused() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    let created = c.create(json!({})).await;
    let (id, token) = (
        created["session_id"].as_str().unwrap().to_string(),
        created["resume_token"].as_str().unwrap().to_string(),
    );
    c.send(json!({"type": "input.text", "text": "hi", "generation": short(10)})).await;
    c.until(is_done).await;
    c.send(json!({"type": "ack", "seq": 1_000_000})).await;
    let e = c.event("error").await;
    assert_eq!(e["code"], "bad_field");
    assert!(e["message"].as_str().unwrap().contains("ack.seq"), "{e}");
    drop(c);
    let mut c = Client::connect(&s).await;
    c.send(json!({"type": "session.resume", "session_id": id, "resume_token": token})).await;
    let e = c.event("error").await;
    assert_eq!(e["code"], "bad_field", "{e}");
    assert!(e["message"].as_str().unwrap().contains("last_seq"), "{e}");
    // with last_seq the replay still holds the whole response: the ack ahead emptied nothing
    c.send(
        json!({"type": "session.resume", "session_id": id, "resume_token": token, "last_seq": 1}),
    )
    .await;
    c.event("session.resumed").await;
    let replay = c.until(is_done).await;
    assert_eq!(replay.iter().filter(|m| m.ty() == "response.created").count(), 1);
    s.shutdown().await.unwrap();
}
