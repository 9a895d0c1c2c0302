//! The voice registry over HTTP (`/v1/voices`, docs/voices.md): a registered voice serves a
//! session by its id, survives a restart from `server.voice_dir`, and can be deleted; bad uploads
//! and unknown ids get clear errors with their limits named; the API takes the WebSocket's keys.

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

// (shared with tests/integration/server.rs, which uses all of it)
#[allow(dead_code)]
use crate::wire;
use wire::{is_done, server, short, Client, In};

/// A mono PCM16 WAV file of `seconds` of a tone at `rate`.
fn wav(seconds: f32, rate: u32) -> Vec<u8> {
    let n = (seconds * rate as f32) as u32;
    let mut b = Vec::with_capacity(44 + 2 * n as usize);
    b.extend_from_slice(b"RIFF");
    b.extend_from_slice(&(36 + 2 * n).to_le_bytes());
    b.extend_from_slice(b"WAVEfmt ");
    b.extend_from_slice(&16u32.to_le_bytes());
    b.extend_from_slice(&1u16.to_le_bytes()); // PCM
    b.extend_from_slice(&1u16.to_le_bytes()); // mono
    b.extend_from_slice(&rate.to_le_bytes());
    b.extend_from_slice(&(2 * rate).to_le_bytes());
    b.extend_from_slice(&2u16.to_le_bytes());
    b.extend_from_slice(&16u16.to_le_bytes());
    b.extend_from_slice(b"data");
    b.extend_from_slice(&(2 * n).to_le_bytes());
    for i in 0..n {
        b.extend_from_slice(&(((i as f32 * 0.05).sin() * 8000.0) as i16).to_le_bytes());
    }
    b
}

/// One HTTP/1.1 request; the status and the body.
async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: &[u8],
) -> (u16, String) {
    let mut t = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: \
        close\r\nContent-Length: {}\r\n{headers}\r\n",
        body.len()
    );
    t.write_all(head.as_bytes()).await.unwrap();
    // (a refused upload may be answered before all of it is read)
    let _ = t.write_all(body).await;
    let mut buf = Vec::new();
    let _ = t.read_to_end(&mut buf).await;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

/// A counter's value on the server's /metrics (0 when it has no line yet).
async fn metric(addr: std::net::SocketAddr, series: &str) -> f64 {
    let (status, body) = http(addr, "GET", "/metrics", "", b"").await;
    assert_eq!(status, 200);
    body.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|v| v.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

const PREPARATIONS: &str = "antiphon_voice_preparations_total";
const REGISTERED_USES: &str = "antiphon_prefetch_total{event=\"registered\"}";

fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"))
}

/// A session that speaks one short reply in voice `id`; the reply completes with audio.
async fn speak_with(s: &antiphon_server::Server, id: &str) {
    let mut c = Client::connect(s).await;
    c.create(json!({"voice": {"id": id}})).await;
    c.send(json!({"type": "input.text", "text": "Hello", "generation": short(10)})).await;
    let ms = c.until(is_done).await;
    assert!(ms.iter().any(|m| matches!(m, In::Audio(_))), "audio in voice {id}");
    let done = ms.iter().rev().find(|m| m.ty() == "response.done").unwrap();
    let In::Event(done) = done else { unreachable!() };
    assert_eq!(done["status"], "completed", "{done}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_voice_serves_sessions_survives_a_restart_and_can_be_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let voice_dir = dir.path().to_path_buf();
    let s = server(|c| c.server.voice_dir = voice_dir.clone()).await;
    let (status, body) = http(
        s.addr,
        "POST",
        "/v1/voices?name=Alice",
        "Content-Type: audio/wav\r\n",
        &wav(2.0, 16_000),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let v = json_of(&body);
    let id = v["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("v_") && id.len() >= 18, "{id}");
    assert_eq!(
        (v["name"].as_str(), v["kind"].as_str(), v["sample_rate"].as_u64()),
        (Some("Alice"), Some("registered"), Some(16_000))
    );
    assert!((v["seconds"].as_f64().unwrap() - 2.0).abs() < 1e-3, "{v}");
    assert!(
        voice_dir.join(format!("{id}.features.safetensors")).is_file(),
        "its prepared features are kept"
    );
    let (status, body) = http(s.addr, "GET", "/v1/voices", "", b"").await;
    assert_eq!(status, 200);
    let ids: Vec<String> = json_of(&body)["voices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, vec!["default".to_string(), id.clone()], "the configured voice first");
    // prepared once, at its registration: the session finds its features kept
    let prepared = metric(s.addr, PREPARATIONS).await;
    speak_with(&s, &id).await;
    assert_eq!(
        metric(s.addr, PREPARATIONS).await,
        prepared,
        "no new preparation for a registered voice"
    );
    assert!(metric(s.addr, REGISTERED_USES).await >= 1.0);
    s.shutdown().await.unwrap();

    // a new server over the same directory serves it under the same id, from the saved features
    let s = server(|c| c.server.voice_dir = voice_dir.clone()).await;
    let (status, body) = http(s.addr, "GET", &format!("/v1/voices/{id}"), "", b"").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(json_of(&body), v, "the same voice after the restart");
    let prepared = metric(s.addr, PREPARATIONS).await;
    speak_with(&s, &id).await;
    assert_eq!(
        metric(s.addr, PREPARATIONS).await,
        prepared,
        "the restarted server did not prepare it again"
    );
    assert!(metric(s.addr, REGISTERED_USES).await >= 1.0, "served from the installed features");
    let (status, _) = http(s.addr, "DELETE", &format!("/v1/voices/{id}"), "", b"").await;
    assert_eq!(status, 204);
    let (status, body) = http(s.addr, "GET", &format!("/v1/voices/{id}"), "", b"").await;
    assert_eq!((status, json_of(&body)["error"]["code"].as_str()), (404, Some("not_found")));
    assert_eq!(std::fs::read_dir(&voice_dir).unwrap().count(), 0, "its files are gone");
    // a session that names it now gets bad_field
    let mut c = Client::connect(&s).await;
    c.create(json!({})).await;
    c.send(json!({"type": "session.update", "voice": {"id": id}})).await;
    let err = c.event("error").await;
    assert_eq!(err["code"], "bad_field", "{err}");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_uploads_and_unknown_ids_get_clear_errors() {
    let s = server(|c| {
        c.server.max_voices = 1;
        c.server.max_voice_bytes = 40_000;
        c.server.max_voice_s = 1.0;
    })
    .await;
    let code = |body: &str| json_of(body)["error"]["code"].as_str().unwrap_or_default().to_string();
    let mut silent = wav(0.8, 16_000);
    silent[44..].fill(0);
    let cases: [(&str, Vec<u8>, u16, &str, &str); 7] = [
        ("/v1/voices?name=x", b"hello, not audio".to_vec(), 400, "bad_audio", "WAV"),
        // (issue 42: a 0.05 s silent WAV was taken as a voice)
        ("/v1/voices?name=x", wav(0.05, 16_000), 400, "bad_audio", "at least 0.5 s"),
        ("/v1/voices?name=x", silent, 400, "bad_audio", "silent"),
        (
            "/v1/voices?name=x",
            b"RIFF\x10\0\0\0WAVEjunk".to_vec(),
            400,
            "bad_audio",
            "cannot be read",
        ),
        ("/v1/voices?name=x", wav(1.5, 8000), 400, "too_long", "server.max_voice_s"),
        ("/v1/voices?name=x", wav(3.0, 16_000), 413, "too_large", "server.max_voice_bytes"),
        ("/v1/voices", wav(0.5, 16_000), 400, "bad_field", "`name`"),
    ];
    for (path, body, status, want, names) in cases {
        let (got, text) = http(s.addr, "POST", path, "", &body).await;
        assert_eq!((got, code(&text).as_str()), (status, want), "{path}: {text}");
        assert!(text.contains(names), "the error names {names}: {text}");
    }
    let (status, _) = http(s.addr, "POST", "/v1/voices?name=first", "", &wav(0.5, 16_000)).await;
    assert_eq!(status, 201);
    let (status, text) =
        http(s.addr, "POST", "/v1/voices?name=second", "", &wav(0.5, 16_000)).await;
    assert_eq!((status, code(&text).as_str()), (409, "too_many_voices"), "{text}");
    for (method, path, status, want) in [
        ("GET", "/v1/voices/v_nobody", 404, "not_found"),
        ("DELETE", "/v1/voices/v_nobody", 404, "not_found"),
        ("DELETE", "/v1/voices/default", 409, "configured_voice"),
    ] {
        let (got, text) = http(s.addr, method, path, "", b"").await;
        assert_eq!((got, code(&text).as_str()), (status, want), "{method} {path}: {text}");
    }
    // the server still serves sessions in its default voice
    speak_with(&s, "default").await;
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_takes_the_websockets_keys() {
    let s = server(|c| c.auth.api_keys = vec!["k1".into()]).await;
    let (status, text) = http(s.addr, "GET", "/v1/voices", "", b"").await;
    assert_eq!(status, 401, "{text}");
    let (status, _) = http(
        s.addr,
        "POST",
        "/v1/voices?name=x",
        "Authorization: Bearer wrong\r\n",
        &wav(0.5, 16_000),
    )
    .await;
    assert_eq!(status, 401);
    let (status, text) = http(
        s.addr,
        "POST",
        "/v1/voices?name=x",
        "Authorization: bearer k1\r\n",
        &wav(0.5, 16_000),
    )
    .await;
    assert_eq!(status, 201, "{text}");
    let (status, text) = http(s.addr, "GET", "/v1/voices?token=k1", "", b"").await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(json_of(&text)["voices"].as_array().unwrap().len(), 2);
    s.shutdown().await.unwrap();
}
