//! A server as one replica of several (deploy/): its id prefixes every session id, a resume that
//! names its session in the URL lands, and /metrics names the replica, counts resumes and reports
//! the device's memory. (Two replicas behind real nginx: tests/deploy/two_replicas.py in CI.)

use serde_json::json;

// (shared with tests/integration/server.rs, which uses all of it)
#[allow(dead_code)]
use crate::wire;
use wire::{reqwest_like_get, server, short, Client};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_ids_name_their_replica_and_resumes_are_counted() {
    let s = server(|c| c.server.replica_id = "replica-x".into()).await;
    let mut c = Client::connect(&s).await;
    let created = c.create(json!({})).await;
    let id = created["session_id"].as_str().unwrap().to_string();
    let token = created["resume_token"].as_str().unwrap().to_string();
    let (replica, rest) = id.split_once('.').expect("<replica>.<random>");
    assert_eq!(replica, "replica-x");
    assert!(rest.len() >= 16, "{id}: the random part is long enough not to be guessed");
    let m = reqwest_like_get(&s, "/metrics").await;
    assert!(m.contains("antiphon_replica_info{replica=\"replica-x\"} 1"), "{m}");
    assert!(m.contains("antiphon_resumes_total 0"), "{m}");
    assert!(m.contains("antiphon_draining 0"), "{m}");
    let total = m
        .lines()
        .find_map(|l| l.strip_prefix("antiphon_device_memory_bytes{state=\"total\"} "))
        .and_then(|v| v.parse::<f64>().ok())
        .expect("the device's memory is reported");
    assert!(total > 1e8, "host memory on the CPU: {total}");
    let info = reqwest_like_get(&s, "/api/build_info").await;
    assert!(info.contains("\"replica\":\"replica-x\""), "{info}");

    c.send(json!({"type": "input.text", "text": "Hello", "seq": 1, "generation": short(10)})).await;
    c.event("response.created").await;
    drop(c); // no close frame: the session parks
    let url = format!("ws://{}/v1/realtime?session_id={id}", s.addr);
    let mut c = Client::connect_to(&url).await.unwrap();
    c.send(
        json!({"type": "session.resume", "session_id": id, "resume_token": token, "last_seq": 2}),
    )
    .await;
    let resumed = c.event("session.resumed").await;
    assert_eq!(resumed["input_seq"], 1);
    c.event("response.done").await;
    let m = reqwest_like_get(&s, "/metrics").await;
    assert!(m.contains("antiphon_resumes_total 1"), "{m}");
    s.shutdown().await.unwrap();
}
