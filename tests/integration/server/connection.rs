//! A connection's edges: auth and origin before the upgrade, shutdown, acks and the journal, TLS.

use super::*;

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
