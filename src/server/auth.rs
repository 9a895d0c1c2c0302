//! API keys and the checks that use them: keys and resume tokens compared in constant time, the
//! `Bearer` scheme matched case-insensitively (RFC 7235), and the operational endpoints closed
//! on a server with keys unless `auth.open_metrics` says otherwise.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use super::config::AuthSection;
use super::Shared;

/// Equality of secrets in time that does not depend on where they differ.
pub fn secret_eq(a: &str, b: &str) -> bool {
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

/// The key a request presents: `Authorization: Bearer <key>` (any case of the scheme), else
/// `?token=<key>`.
pub fn presented_key(headers: &HeaderMap, query: Option<&str>) -> Option<String> {
    let bearer = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, k)| k.trim().to_string());
    bearer
        .or_else(|| query?.split('&').find_map(|kv| kv.strip_prefix("token=")).map(percent_decode))
}

/// `%XX` escapes of a query value decoded (`+` stays itself: keys are not form text).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `key` is one of the configured keys (every key compared, in constant time).
pub fn key_ok(auth: &AuthSection, key: Option<&str>) -> bool {
    let Some(key) = key else { return false };
    auth.api_keys.iter().fold(false, |ok, k| ok | secret_eq(k, key))
}

/// Middleware of `/metrics` and `/api/build_info`: on a server with keys they need one too,
/// unless `auth.open_metrics`.
pub async fn operational(State(shared): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let auth = &shared.config.auth;
    if !auth.api_keys.is_empty()
        && !auth.open_metrics
        && !key_ok(auth, presented_key(req.headers(), req.uri().query()).as_deref())
    {
        return (StatusCode::UNAUTHORIZED, "missing or wrong API key").into_response();
    }
    next.run(req).await
}

/// Middleware of the voice registry (`/v1/voices`): on a server with keys, the same keys as the
/// WebSocket.
pub async fn keyed(State(shared): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let auth = &shared.config.auth;
    if !auth.api_keys.is_empty()
        && !key_ok(auth, presented_key(req.headers(), req.uri().query()).as_deref())
    {
        return (
            StatusCode::UNAUTHORIZED,
            axum::Json(serde_json::json!({"error": {"code": "unauthorized",
            "message": "missing or wrong API key"}})),
        )
            .into_response();
    }
    next.run(req).await
}
