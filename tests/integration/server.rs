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
async fn auth_and_origin_are_checked_before_the_upgrade() {
    let s = server(|c| {
        c.auth.api_keys = vec!["k1".into()];
        c.auth.allowed_origins = vec!["http://good.example".into()];
    })
    .await;
    let url = format!("ws://{}/v1/realtime", s.addr);
    let err = Client::connect_to(&url).await.err().expect("refused without a key");
    assert!(err.to_string().contains("401"), "{err}");
    assert!(Client::connect_to(&format!("{url}?token=k1")).await.is_ok());
    let mut req = url.clone().into_client_request().unwrap();
    req.headers_mut().insert("authorization", "Bearer k1".parse().unwrap());
    req.headers_mut().insert("origin", "http://evil.example".parse().unwrap());
    let err = tokio_tungstenite::connect_async(req).await.expect_err("refused origin");
    assert!(err.to_string().contains("403"), "{err}");
    let mut req = url.into_client_request().unwrap();
    req.headers_mut().insert("authorization", "Bearer k1".parse().unwrap());
    req.headers_mut().insert("origin", "http://good.example".parse().unwrap());
    assert!(tokio_tungstenite::connect_async(req).await.is_ok());
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_tells_sessions_and_drains() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    c.create(json!({})).await;
    c.send(json!({"type": "input.text", "text": "finish me", "generation": short(40)})).await;
    c.until(|m| matches!(m, In::Audio(_))).await;
    let shared = s.shared.clone();
    let stop = tokio::spawn(s.shutdown());
    let ms = c.until(|m| matches!(m, In::Closed(_))).await;
    let closing = ms.iter().position(|m| m.ty() == "session.closing").expect("session.closing");
    match &ms[closing] {
        In::Event(v) => {
            assert_eq!(v["reason"], "shutdown");
            assert!(v["retry_after_ms"].as_u64().is_some());
        }
        _ => unreachable!(),
    }
    // the response in flight finished before the close
    assert!(
        ms.iter().any(|m| matches!(m,
        In::Event(v) if v["type"] == "response.done" && v["status"] == "completed")),
        "{ms:?}"
    );
    stop.await.unwrap().unwrap();
    assert_eq!(shared.sessions.len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_trim_the_journal_and_uploaded_voices_work() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    // an uploaded voice: 1 s of PCM16 at 16 kHz, base64
    use base64::Engine as _;
    let pcm: Vec<u8> = (0..16_000)
        .flat_map(|i| ((((i as f32) * 0.05).sin() * 8000.0) as i16).to_le_bytes())
        .collect();
    let b64 = base64::engine::general_purpose::STANDARD.encode(pcm);
    c.create(
        json!({"voice": {"ref_audio_b64": b64, "sample_rate": 16000}, "instructions": "Be brief."}),
    )
    .await;
    c.send(json!({"type": "input.text", "text": "x", "generation": short(20)})).await;
    let ms = c.until(is_done).await;
    let last = ms.iter().filter_map(In::seq).max().unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(s.shared.sessions.journal_bytes() > 0);
    c.send(json!({"type": "ack", "seq": last})).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(s.shared.sessions.journal_bytes(), 0, "acknowledged messages leave the journal");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_when_a_certificate_is_configured() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cp, kp) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cp, cert.cert.pem()).unwrap();
    std::fs::write(&kp, cert.signing_key.serialize_pem()).unwrap();
    let s = server(|c| {
        c.tls = Some(antiphon_server::config::TlsSection { cert: cp.clone(), key: kp.clone() })
    })
    .await;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg));
    let tcp = TcpStream::connect(s.addr).await.unwrap();
    let mut tls =
        connector.connect("localhost".try_into().unwrap(), tcp).await.expect("TLS handshake");
    tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    let _ = tls.read_to_string(&mut body).await;
    assert!(body.starts_with("HTTP/1.1 200") && body.ends_with("ok"), "{body}");
    // plain HTTP on the TLS port is not served
    let mut plain = TcpStream::connect(s.addr).await.unwrap();
    plain.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut buf = vec![0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), plain.read(&mut buf))
        .await
        .map(|r| r.unwrap_or(0))
        .unwrap_or(0);
    assert!(!String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
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

/// Duplex over the wire: a decision per unit (cut from 24 kHz input), a response per spoken turn,
/// the duplex-only rules, and a drop mid-speech resumed with the unapplied input resent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplex_session_over_the_wire() {
    let s = server(|_| {}).await;
    // `duplex` belongs to duplex sessions only
    let mut t = Client::connect(&s).await;
    t.send(json!({"type": "session.create", "mode": "turn", "input_audio": {"codec": "pcm16",
        "sample_rate": 16000},
        "output_audio": {"codec": "opus"}, "duplex": {"policy": "speak_every", "k": 2}}))
        .await;
    assert_eq!(t.event("error").await["code"], "bad_field");

    let mut c = Client::connect(&s).await;
    let created = c
        .create(json!({"mode": "duplex", "input_audio": {"codec": "pcm16", "sample_rate": 24000},
            "duplex": {"policy": "speak_every", "k": 2}, "generation": short(10)}))
        .await;
    assert_eq!(created["mode"], "duplex");
    let (sid, tok) = (
        created["session_id"].as_str().unwrap().to_string(),
        created["resume_token"].as_str().unwrap().to_string(),
    );
    c.send(json!({"type": "input.text", "text": "hi", "seq": 1})).await;
    let e = c.event("error").await;
    assert_eq!((e["code"].as_str(), e["fatal"].as_bool()), (Some("bad_field"), Some(false)));
    c.send(json!({"type": "session.update", "voice": {"id": "default"}, "seq": 2})).await;
    assert_eq!(c.event("error").await["code"], "bad_field");
    // 5 s of 24 kHz PCM16 in 100 ms frames (seq 3..52): units 1 and 3 speak, unit 4 closes turn 2
    let frames: Vec<Vec<u8>> = (0..50)
        .map(|f| {
            (0..2400)
                .map(|i| (((f * 2400 + i) as f32 * 0.05).sin() * 8000.0) as i16)
                .flat_map(|v| v.to_le_bytes())
                .collect()
        })
        .collect();
    let frame = |k: usize| {
        Message::Binary(
            AudioFrame {
                kind: 1,
                last: false,
                seq: (k + 3) as u32,
                response_id: 0,
                payload: frames[k].clone(),
            }
            .encode()
            .into(),
        )
    };
    for k in 0..50 {
        c.send_raw(frame(k)).await;
    }
    let mut held: Vec<u64> = vec![1, 2, 3];
    let mut got = vec![];
    // drop after the third audio packet of the second response
    loop {
        let m = c.recv().await;
        if let Some(q) = m.seq() {
            held.push(q);
        }
        let cut = matches!(&m, In::Audio(a) if a.response_id == 2)
            && got.iter().filter(|x| matches!(x, In::Audio(a) if a.response_id == 2)).count() == 2;
        got.push(m);
        if cut {
            break;
        }
    }
    drop(c);
    let mut c = Client::connect(&s).await;
    let last = *held.iter().max().unwrap();
    c.send(
        json!({"type": "session.resume", "session_id": sid, "resume_token": tok, "last_seq": last}),
    )
    .await;
    let r = c.event("session.resumed").await;
    let applied = r["input_seq"].as_u64().unwrap();
    for k in (applied as usize).saturating_sub(2)..50 {
        // resend everything after what the server applied (a few before it too: deduplicated)
        c.send_raw(frame(k)).await;
    }
    let mut done = got.iter().filter(|m| is_done(m)).count();
    while done < 2 {
        let m = c.recv().await;
        assert!(!matches!(m, In::Closed(_)), "closed: {got:?}");
        if let Some(q) = m.seq() {
            assert!(!held.contains(&q), "seq {q} twice");
            held.push(q);
        }
        done += is_done(&m) as usize;
        got.push(m);
    }
    held.sort_unstable();
    // error events carry seqs too; everything from 1 to the last arrived exactly once
    assert_eq!(held, (1..=*held.last().unwrap()).collect::<Vec<_>>());
    let ev: Vec<&Value> =
        got.iter().filter_map(|m| if let In::Event(v) = m { Some(v) } else { None }).collect();
    let decisions: Vec<(u64, bool)> = ev
        .iter()
        .filter(|v| v["type"].as_str().unwrap().starts_with("duplex."))
        .map(|v| (v["unit"].as_u64().unwrap(), v["type"] == "duplex.speak"))
        .collect();
    assert_eq!(decisions, (0..5).map(|u| (u, u % 2 == 1)).collect::<Vec<_>>());
    let created: Vec<&&Value> = ev.iter().filter(|v| v["type"] == "response.created").collect();
    assert_eq!(created.len(), 2);
    assert!(created.iter().all(|v| v["trigger"] == "duplex"));
    for v in ev.iter().filter(|v| v["type"] == "response.done") {
        assert_eq!(v["status"], "completed");
        let rid = v["response_id"].as_u64().unwrap() as u32;
        let audio: Vec<&AudioFrame> = got
            .iter()
            .filter_map(|m| {
                if let In::Audio(a) = m {
                    (a.response_id == rid).then_some(a)
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(audio.len() as u64, v["packets"].as_u64().unwrap());
        assert!(audio.last().unwrap().last && audio.iter().filter(|a| a.last).count() == 1);
    }
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
