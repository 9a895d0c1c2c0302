//! The server's edges: connection caps (WebSockets and TCP), deadlines for a request head and for
//! the first event, path segments longer than any file name (against a real server on port 0),
//! the bounded outbound queue, a reader that stops reading, and the shape of `internal` errors.

// (shared with tests/integration/server.rs, which uses all of it)
#[allow(dead_code)]
use crate::wire;

use std::time::{Duration, Instant};

use serde_json::json;
use tokio_tungstenite::tungstenite::Message;
use wire::{is_done, one_place, reqwest_like_get, server, short, Client, In};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_refused_and_a_freed_permit_is_reused() {
    let s = server(|c| c.server.max_connections = 1).await;
    let mut a = Client::connect(&s).await;
    a.create(json!({})).await;
    let url = format!("ws://{}/v1/realtime", s.addr);
    match Client::connect_to(&url).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => assert_eq!(r.status(), 503),
        Err(e) => panic!("expected a 503, got {e}"),
        Ok(_) => panic!("a second connection was accepted beyond the cap of 1"),
    }
    // the first socket ends (clean close): its permit comes back
    a.send(json!({"type": "session.close"})).await;
    assert!(matches!(a.until(|m| matches!(m, In::Closed(_))).await.last(), Some(In::Closed(_))));
    drop(a);
    a_session_once_a_permit_is_back(&url, "the permit never came back").await;
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_that_never_creates_a_session_is_closed() {
    let s = server(|c| c.server.first_event_timeout_s = 1).await;
    let mut c = Client::connect(&s).await;
    let e = c.event("error").await;
    assert_eq!(e["code"], "not_in_session", "{e}");
    assert_eq!(e["fatal"], true);
    assert!(matches!(c.recv().await, In::Closed(Some(1008))));
    // a client that creates its session in time keeps it past the deadline
    let mut d = Client::connect(&s).await;
    d.create(json!({})).await;
    d.send(json!({"type": "ping", "id": "p"})).await;
    let pong = d.event("pong").await;
    assert_eq!(pong["id"], "p");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlong_path_segments_are_not_found() {
    let s = server(|_| {}).await;
    let r = reqwest_like_get(&s, &format!("/{}", "a".repeat(300))).await;
    assert!(r.starts_with("HTTP/1.1 404"), "{}", r.lines().next().unwrap_or(""));
    let r = reqwest_like_get(&s, "/healthz").await;
    assert!(r.starts_with("HTTP/1.1 200"));
    s.shutdown().await.unwrap();
}

/// A connection's queue is bounded: a message that finds it full is not queued and marks the
/// connection overrun (its socket is then closed; the session's journal keeps what it missed).
#[tokio::test]
async fn a_full_outbound_queue_marks_the_connection_overrun() {
    use antiphon_server::session::{Conn, Outbound};
    let (tx, mut rx) = tokio::sync::mpsc::channel(2);
    let (kick, mut kicked) = tokio::sync::watch::channel(false);
    let conn = Conn::new(tx, std::sync::Arc::new(kick));
    conn.send(Outbound::Text("1".into()));
    conn.send(Outbound::Text("2".into()));
    assert!(!conn.overrun());
    conn.send(Outbound::Text("3".into()));
    assert!(conn.overrun());
    kicked.wait_for(|k| *k).await.unwrap();
    assert_eq!(rx.recv().await, Some(Outbound::Text("1".into())));
    assert_eq!(rx.recv().await, Some(Outbound::Text("2".into())));
    assert!(rx.try_recv().is_err(), "the third message was not queued");
}

/// An `internal` error tells the client what failed in one line, never a backtrace, and names an
/// incident the log holds.
#[test]
fn internal_errors_are_one_short_line() {
    let detail = format!(
        "the Talker's step failed: out of memory\n{}",
        "   at some::frame::of::a::backtrace\n".repeat(50)
    );
    let e = antiphon_server::session::internal_error("response 3 failed", &detail, false);
    assert_eq!(e.code, antiphon_protocol::ErrorCode::Internal);
    assert!(!e.fatal);
    assert!(!e.message.contains('\n') && !e.message.contains("backtrace"), "{}", e.message);
    assert!(
        e.message
            .starts_with("response 3 failed: the Talker's step failed: out of memory (incident "),
        "{}",
        e.message
    );
    let long = antiphon_server::session::internal_error("x", &"y".repeat(10_000), true);
    assert!(long.fatal && long.message.len() < 300, "{}", long.message.len());
}

/// A raw HTTP GET with extra header lines; the whole answer.
async fn get_with(s: &antiphon_server::Server, path: &str, headers: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut t = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    t.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = String::new();
    t.read_to_string(&mut buf).await.unwrap();
    buf
}

/// With keys: the scheme is matched in any case, a wrong key is refused, the operational endpoints
/// need a key unless opened; every answer carries the security headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_guard_the_operational_endpoints_and_bearer_is_case_insensitive() {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let s = server(|c| c.auth.api_keys = vec!["k1".into(), "k2".into()]).await;
    let url = format!("ws://{}/v1/realtime", s.addr);
    for (value, ok) in
        [("bearer k2", true), ("BEARER k1", true), ("Bearer k3", false), ("Basic k1", false)]
    {
        let mut req = url.clone().into_client_request().unwrap();
        req.headers_mut().insert("authorization", value.parse().unwrap());
        assert_eq!(tokio_tungstenite::connect_async(req).await.is_ok(), ok, "{value}");
    }
    for path in ["/metrics", "/api/build_info"] {
        assert!(get_with(&s, path, "").await.starts_with("HTTP/1.1 401"), "{path} without a key");
        assert!(
            get_with(&s, path, "Authorization: bearer k1\r\n").await.starts_with("HTTP/1.1 200"),
            "{path} with a key"
        );
        assert!(
            get_with(&s, &format!("{path}?token=k2"), "").await.starts_with("HTTP/1.1 200"),
            "{path} with ?token"
        );
    }
    let page = get_with(&s, "/healthz", "").await.to_ascii_lowercase();
    for h in
        ["x-content-type-options: nosniff", "x-frame-options: deny", "referrer-policy: no-referrer"]
    {
        assert!(page.contains(h), "{h} in {page}");
    }
    s.shutdown().await.unwrap();
    let open = server(|c| {
        c.auth.api_keys = vec!["k1".into()];
        c.auth.open_metrics = true;
    })
    .await;
    assert!(
        get_with(&open, "/metrics", "").await.starts_with("HTTP/1.1 200"),
        "opened by auth.open_metrics"
    );
    open.shutdown().await.unwrap();
}

#[test]
fn secrets_compare_equal_only_when_equal() {
    use antiphon_server::auth::secret_eq;
    assert!(secret_eq("tok", "tok"));
    assert!(!secret_eq("tok", "tol") && !secret_eq("tok", "to") && !secret_eq("", "x"));
}

/// A client that sends faster than its session handles messages is slowed down, not buffered
/// without bound and not dropped: with room for two messages in the session's inbox, 300 pings
/// sent at once all get their pong, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_into_a_small_session_inbox_is_slowed_not_dropped() {
    let s = server(|c| c.server.session_inbox = 2).await;
    let mut c = Client::connect(&s).await;
    c.create(json!({})).await;
    for i in 0..300 {
        c.send(json!({"type": "ping", "id": format!("p{i}")})).await;
    }
    for i in 0..300 {
        let pong = c.event("pong").await;
        assert_eq!(pong["id"], format!("p{i}"), "pongs in order, none lost");
    }
    s.shutdown().await.unwrap();
}

/// Instructions beyond the limit are refused where they come in, naming the field; the session
/// is not created, or an update changes nothing and the session goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_instructions_are_refused_at_create_and_update() {
    let s = server(|_| {}).await;
    let long = "x".repeat(antiphon_protocol::MAX_INSTRUCTIONS_CHARS + 1);
    let mut c = Client::connect(&s).await;
    c.send(json!({"type": "session.create", "mode": "turn", "input_audio": {"codec": "pcm16",
        "sample_rate": 16000},
        "output_audio": {"codec": "pcm16"}, "instructions": long}))
        .await;
    let e = c.event("error").await;
    assert_eq!(e["code"], "bad_field", "{e}");
    assert!(e["message"].as_str().unwrap().contains("instructions"), "{e}");
    let mut d = Client::connect(&s).await;
    d.create(json!({"instructions": "Be brief."})).await;
    d.send(json!({"type": "session.update", "instructions": long})).await;
    let e = d.event("error").await;
    assert_eq!(e["code"], "bad_field", "{e}");
    d.send(json!({"type": "ping", "id": "still"})).await;
    assert_eq!(d.event("pong").await["id"], "still");
    s.shutdown().await.unwrap();
    // within the characters but beyond the tokens
    let s = server(|c| c.server.max_instructions_tokens = 16).await;
    let mut c = Client::connect(&s).await;
    c.create(json!({"instructions": "Be brief."})).await;
    c.send(json!({"type": "session.update", "instructions": "word ".repeat(200)})).await;
    let e = c.event("error").await;
    assert_eq!(e["code"], "bad_field", "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("tokens")
            && e["message"].as_str().unwrap().contains("at most 16"),
        "{e}"
    );
    s.shutdown().await.unwrap();
}

/// At the drain deadline a response still running is cancelled, not cut: its `response.done`
/// (cancelled) goes out, then the socket closes with 1001.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_deadline_cancels_what_runs_and_closes_1001() {
    let s = server(|c| c.server.shutdown_drain_s = 0).await;
    let mut c = Client::connect(&s).await;
    c.create(json!({})).await;
    c.send(json!({"type": "input.text", "text": "a long one", "generation": wire::short(2000)}))
        .await;
    c.until(|m| matches!(m, In::Audio(_))).await;
    let stop = tokio::spawn(s.shutdown());
    let ms = c.until(|m| matches!(m, In::Closed(_))).await;
    assert!(
        ms.iter().any(|m| matches!(m,
        In::Event(v) if v["type"] == "response.done" && v["status"] == "cancelled")),
        "{ms:?}"
    );
    assert!(matches!(ms.last(), Some(In::Closed(Some(1001)))), "{:?}", ms.last());
    stop.await.unwrap().unwrap();
}

/// A reconnection names its session in the URL for a proxy to route on; `session.resume` is the
/// authority, and a mismatch between the two is a `bad_field` (the socket stays open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_whose_url_names_another_session_is_a_bad_field() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    let created = c.create(json!({})).await;
    let (id, token) = (
        created["session_id"].as_str().unwrap().to_string(),
        created["resume_token"].as_str().unwrap().to_string(),
    );
    drop(c); // parked
    let resume =
        json!({"type": "session.resume", "session_id": id, "resume_token": token, "last_seq": 1});
    let mut other = Client::connect_to(&format!("ws://{}/v1/realtime?session_id=s_other", s.addr))
        .await
        .unwrap();
    other.send(resume.clone()).await;
    let e = other.event("error").await;
    assert!(
        e["code"] == "bad_field"
            && e["fatal"] == false
            && e["message"].as_str().unwrap().contains("session_id"),
        "{e}"
    );
    // a URL that names the same session resumes it
    let mut right =
        Client::connect_to(&format!("ws://{}/v1/realtime?session_id={id}", s.addr)).await.unwrap();
    right.send(resume).await;
    let r = right.event("session.resumed").await;
    assert_eq!(r["session_id"], id.as_str());
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_heads_that_never_end_are_cut_and_tcp_connections_are_capped() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = server(|c| {
        c.server.max_connections = 2;
        c.server.max_tcp_connections = 3;
        c.server.header_timeout_s = 1;
    })
    .await;
    // three sockets that send half a request head, then nothing (slowloris)
    let mut idle = Vec::new();
    for _ in 0..3 {
        let mut t = tokio::net::TcpStream::connect(s.addr).await.unwrap();
        t.write_all(b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        idle.push(t);
    }
    // a fourth TCP connection is answered at once with a plain 503, its request unread
    let mut t = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let mut reply = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(30), t.read_to_end(&mut reply))
        .await
        .expect("refused, not held")
        .ok();
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
    // the half heads are cut at the header timeout: each socket ends
    for mut t in idle {
        let mut rest = Vec::new();
        let ended =
            tokio::time::timeout(std::time::Duration::from_secs(30), t.read_to_end(&mut rest))
                .await;
        assert!(ended.is_ok(), "a request head that never ends holds its socket");
    }
    // their permits come back: a session works again
    let url = format!("ws://{}/v1/realtime", s.addr);
    a_session_once_a_permit_is_back(&url, "the TCP permits never came back").await;
    s.shutdown().await.unwrap();
}

/// Connects until a connection is accepted again (a freed permit comes back a moment after its
/// socket ends; bounded at 30 s), and creates a session on it.
async fn a_session_once_a_permit_is_back(url: &str, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match Client::connect_to(url).await {
            Ok(mut c) => {
                c.create(json!({})).await;
                return;
            }
            Err(_) if std::time::Instant::now() < deadline => tokio::task::yield_now().await,
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// Admission by load at the server's edge: with one stream place and no queue, a second
/// session's response while the first plays is refused at once (`capacity`, not fatal, with
/// `retry_after_ms`, and its `response.done` failed) and a new call is refused (fatal) while no
/// place is free; the admitted response plays on, and once it has ended, both are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_beyond_the_places_is_refused_at_once_and_the_admitted_one_plays() {
    let s = server(one_place).await;
    let (mut a, mut b) = (Client::connect(&s).await, Client::connect(&s).await);
    a.create(json!({})).await;
    b.create(json!({})).await;
    a.send(json!({"type": "input.text", "text": "talk a while",
        "generation": {"min_audio_tokens": 2000, "max_audio_tokens": 2000}}))
        .await;
    // A plays: its place is taken
    a.until(|m| matches!(m, In::Audio(_))).await;
    b.send(json!({"type": "input.text", "text": "me too"})).await;
    let e = b.event("error").await;
    assert_eq!(e["code"], "capacity", "{e}");
    assert_eq!(e["fatal"], false);
    assert!(e["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{e}");
    let done = b.event("response.done").await;
    assert_eq!(done["status"], "failed", "{done}");
    // a new call while no place is free (one is kept for admitted calls): refused, fatal
    let mut c = Client::connect(&s).await;
    c.send(json!({"type": "session.create", "mode": "turn", "input_audio": {"codec": "pcm16",
        "sample_rate": 16000},
        "output_audio": {"codec": "opus"}}))
        .await;
    let e = c.event("error").await;
    assert_eq!((e["code"].as_str(), e["fatal"].as_bool()), (Some("capacity"), Some(true)), "{e}");
    assert!(e["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{e}");
    let ready = reqwest_like_get(&s, "/readyz").await;
    assert!(
        ready.starts_with("HTTP/1.1 503") && ready.contains("\"accepts_calls\":false"),
        "{ready}"
    );
    // the admitted response plays on (more audio comes), until its caller stops it
    a.until(|m| matches!(m, In::Audio(_))).await;
    a.send(json!({"type": "response.cancel"})).await;
    let done = a.event("response.done").await;
    assert_eq!(done["status"], "cancelled", "{done}");
    // its place is back: B is served, and a new call is taken
    b.send(json!({"type": "input.text", "text": "now?"})).await;
    assert_eq!(b.event("response.done").await["status"], "completed");
    let mut d = Client::connect(&s).await;
    d.create(json!({})).await;
    s.shutdown().await.unwrap();
}

/// A client that stops reading mid-reply has its socket closed within a bounded time whatever it
/// does, and the socket counts as open (a place of `server.max_connections`) until then (issue 38:
/// a kicked reader's socket stayed open with megabytes queued, and stopped counting). The reply
/// (140 s of PCM16, 6.7 MB) is more than the kernel's buffers take (up to 4 MiB), so the server's
/// close frame cannot be written either: the server must let the socket go all the same. Seen
/// from the server's side of the TCP connection (`/proc/net/tcp`), as well as its metric.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_reading_is_closed_and_counted_until_then() {
    use futures_util::SinkExt;
    // (a queue of 64: the kick comes once the kernel's buffers are full, where a queue of 8 kicked
    // at the first chunk's burst, with room left for the close frame)
    let s = server(|c| c.server.outbound_queue = 64).await;
    let open = || s.shared.metrics.connections_open.get();
    // a small receive window, and nothing read after the upgrade
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let tcp = sock.connect(s.addr).await.unwrap();
    let client_port = tcp.local_addr().unwrap().port();
    let (mut ws, _) =
        tokio_tungstenite::client_async(format!("ws://{}/v1/realtime", s.addr), tcp).await.unwrap();
    let create = json!({"type": "session.create", "mode": "turn", "input_audio": {"codec": "pcm16",
        "sample_rate": 16000},
        "output_audio": {"codec": "pcm16"}});
    ws.send(Message::Text(create.to_string().into())).await.unwrap();
    ws.send(Message::Text(
        json!({"type": "input.text", "text": "talk", "generation": short(3500)}).to_string().into(),
    ))
    .await
    .unwrap();
    assert_eq!(open(), 1, "the socket counts while it is open");
    let held = || server_side_held(s.addr.port(), client_port);
    assert!(
        std::path::Path::new("/proc/net/tcp").exists(),
        "this test reads the server's side of the connection from Linux's /proc/net/tcp"
    );
    assert!(held(), "the server holds its side of the connection");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        // (the gauge goes down only after the socket is closed: read first, it bounds what follows)
        let counted = open();
        let still = held();
        assert!(counted > 0 || !still, "a socket the server holds is counted");
        if !still && counted == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the socket of a client that stopped reading was never \
            let go (held: {still}, counted: {counted})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = reqwest_like_get(&s, "/metrics").await;
    assert!(m.contains("antiphon_connections_open 0"), "{m}");
    drop(ws);
    s.shutdown().await.unwrap();
}

/// Whether this process holds the server's side (local `port`, remote `peer`) of a TCP connection
/// open: established and owned by a socket (a socket the server let go has no inode, or is gone).
fn server_side_held(port: u16, peer: u16) -> bool {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let port_of =
        |addr: &str| addr.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
    table.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 9
            && port_of(f[1]) == Some(port)
            && port_of(f[2]) == Some(peer)
            && f[3] == "01"
            && f[9] != "0"
    })
}

/// A resume whose replay is far longer than the connection's queue replays at the pace the socket
/// takes it: every message the client lacked arrives, in order, and the session is live after it
/// (issue 38: the whole replay was pushed at once, found the queue full, and closed the socket it
/// was resuming on, every time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_longer_than_the_queue_resumes_at_the_sockets_pace() {
    let s = server(|c| c.server.outbound_queue = 16).await;
    let mut c = Client::connect(&s).await;
    let created = c.create(json!({})).await;
    let (id, token) = (
        created["session_id"].as_str().unwrap().to_string(),
        created["resume_token"].as_str().unwrap().to_string(),
    );
    c.send(json!({"type": "input.text", "text": "a long answer", "generation": short(150)})).await;
    drop(c); // parked: the reply goes to the journal alone
    let completed =
        || s.shared.metrics.responses.at(antiphon_server::ResponseLabel::Completed).get();
    let deadline = Instant::now() + Duration::from_secs(120);
    while completed() < 1 {
        assert!(Instant::now() < deadline, "the reply never completed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut r = Client::connect(&s).await;
    let last = created["seq"].as_u64().unwrap_or(0);
    r.send(json!({"type": "session.resume", "session_id": id, "resume_token": token,
        "last_seq": last}))
        .await;
    let got = r.until(is_done).await;
    assert!(
        matches!(got.first(), Some(In::Event(v)) if v["type"] == "session.resumed"),
        "{:?}",
        got.first()
    );
    let seqs: Vec<u64> = got.iter().filter_map(In::seq).collect();
    assert_eq!(
        seqs,
        (last + 1..last + 1 + seqs.len() as u64).collect::<Vec<_>>(),
        "every message after the last seen, in order"
    );
    let frames = got.iter().filter(|m| matches!(m, In::Audio(_))).count();
    assert!(frames > 4 * 16, "{frames} audio frames: the replay must be longer than the queue");
    // live after the replay: the session answers on this socket
    r.send(json!({"type": "ping", "id": "after"})).await;
    assert_eq!(r.event("pong").await["id"], "after");
    s.shutdown().await.unwrap();
}
