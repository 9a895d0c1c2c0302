//! The operations endpoints: `/readyz`, `/metrics` and `/api/build_info`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::config::ModelSource;
use crate::Shared;

pub(crate) async fn readyz(State(shared): State<Arc<Shared>>) -> Response {
    let left = shared.config.server.max_sessions.saturating_sub(shared.sessions.len());
    let ready = shared.ready.load(Ordering::SeqCst) && !shared.is_shutting_down();
    // admission by load: streams running and waiting, the engine's limit, places free beyond the
    // waiting ones, and whether a new call would be taken now
    let a = shared.engine.admission();
    let (running, queued, limit) = a.counts();
    let calls = a.accepts_call().is_ok();
    let body = Json(
        serde_json::json!({"ready": ready, "capacity_left": left, "sessions": shared.sessions.len(),
        "headroom": a.headroom(), "streams": running, "queued": queued, "stream_limit": limit,
            "accepts_calls": calls}),
    );
    if ready && left > 0 && calls {
        (StatusCode::OK, body).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}

pub(crate) async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    use prometheus::Encoder;
    let m = &shared.metrics;
    m.sessions.set(shared.sessions.len() as i64);
    m.parked.set(shared.sessions.parked() as i64);
    m.journal_bytes.set(shared.sessions.journal_bytes() as i64);
    m.draining.set(shared.is_shutting_down() as i64);
    if let Some((used, total)) = device_memory(shared.config.model.device) {
        m.device_memory.at(crate::DeviceMemory::Used).set(used as i64);
        m.device_memory.at(crate::DeviceMemory::Total).set(total as i64);
    }
    let mut buf = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&m.registry.gather(), &mut buf);
    let mut text = String::from_utf8(buf).unwrap_or_default();
    text.push_str(&shared.engine.metrics().render());
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// The model device's memory `(used, total)` in bytes: the GPU's, or on the CPU this process's
/// resident set and the host's memory (Linux `/proc`).
fn device_memory(spec: antiphon_models::gpu::DeviceSpec) -> Option<(u64, u64)> {
    if spec != antiphon_models::gpu::DeviceSpec::Cpu {
        return antiphon_models::gpu::cuda_memory(spec);
    }
    let pages: u64 = std::fs::read_to_string("/proc/self/statm")
        .ok()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let total_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some((pages * 4096, total_kib * 1024))
}

pub(crate) async fn build_info(State(shared): State<Arc<Shared>>) -> Json<serde_json::Value> {
    let c = &shared.config.model;
    Json(serde_json::json!({
        "name": "antiphon",
        "version": env!("CARGO_PKG_VERSION"),
        "git": option_env!("ANTIPHON_GIT").unwrap_or("unknown"),
        "protocol": antiphon_protocol::PROTOCOL_VERSION,
        "replica": shared.config.server.replica_id,
        "model": {
            "source": match c.source { ModelSource::Synthetic => "synthetic",
                ModelSource::Checkpoint => "checkpoint" },
            "preset": format!("{:?}", c.preset).to_lowercase(),
            "path": c.path.as_ref().map(|p| p.display().to_string()),
            "device": c.device.to_string(),
            "dtype": c.dtype.to_string(),
        },
        "synthetic_weights": shared.synthetic,
        "voices": shared.config.voices.iter().map(|v| v.id.clone()).collect::<Vec<_>>(),
        "uptime_s": shared.started.elapsed().as_secs(),
        "cuda": cfg!(feature = "cuda"),
    }))
}
