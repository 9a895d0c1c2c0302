//! The OpenAI Realtime dialect at `/openai/v1/realtime` (docs/openai-realtime.md): the same
//! sessions, engine, voices, limits, auth and metrics as protocol v1, reached by the clients that
//! speak OpenAI's event shapes. Each connection is a v1 turn session (PCM16 at 24 kHz both ways)
//! with a translator in front of it ([`translate`], [`respond`]): the translator is the v1
//! session's one connection, and it writes the dialect's events to the socket.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use axum::extract::{Query, State, WebSocketUpgrade};
use axum::http::HeaderMap;
use axum::response::Response;
use futures_util::{SinkExt, StreamExt};

use crate::session::{random_token, Conn, Outbound, SessionMsg};
use crate::Shared;
use antiphon_protocol::openai::server::{ErrorView, OaiServerEvent};
use antiphon_protocol::openai::{parse_client, OaiError, OaiErrorCode};
use antiphon_protocol::ClientEvent;

mod history;
mod input;
mod items;
mod respond;
mod start;
mod translate;

pub use translate::Translator;

/// The subprotocol a browser-style client offers its API key in.
const KEY_SUBPROTOCOL: &str = "openai-insecure-api-key.";

/// The writing end of a dialect connection: a bounded queue to its socket's writer. A message
/// that finds it full closes the connection (the client stopped reading).
#[derive(Clone)]
pub struct Out {
    tx: tokio::sync::mpsc::Sender<Message>,
    overrun: Arc<tokio::sync::watch::Sender<bool>>,
    prefix: Arc<str>,
    next: Arc<AtomicU64>,
}

impl Out {
    pub fn event(&self, e: &OaiServerEvent) {
        let id = format!("event_{}{}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed));
        self.send(Message::Text(e.to_json(&id).into()));
    }

    fn send(&self, m: Message) {
        if let Err(tokio::sync::mpsc::error::TrySendError::Full(_)) = self.tx.try_send(m) {
            self.overrun.send_replace(true);
        }
    }
}

#[derive(serde::Deserialize)]
pub struct OpenAiQuery {
    token: Option<String>,
    model: Option<String>,
}

/// `GET /openai/v1/realtime`: the key from `Authorization: Bearer`, the
/// `openai-insecure-api-key.<key>` subprotocol, or `?token=`; the `realtime` subprotocol is
/// answered when offered (browser-style clients fail without it).
pub async fn realtime(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    q: Query<OpenAiQuery>,
    ws: WebSocketUpgrade,
) -> Response {
    let offered: Vec<String> = headers
        .get_all(axum::http::header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|p| p.trim().to_string()))
        .collect();
    let key = crate::auth::presented_key(&headers, None)
        .or_else(|| {
            offered.iter().find_map(|p| p.strip_prefix(KEY_SUBPROTOCOL).map(str::to_string))
        })
        .or_else(|| q.token.clone());
    let permit = match crate::admit(&shared, &headers, key.as_deref()) {
        Ok(p) => p,
        Err(r) => return axum::response::IntoResponse::into_response(r),
    };
    let model: String = q.0.model.unwrap_or_else(|| "antiphon".into()).chars().take(64).collect();
    let limit = shared.config.server.max_text_frame;
    let ws = if offered.iter().any(|p| p == "realtime") { ws.protocols(["realtime"]) } else { ws };
    ws.max_message_size(limit)
        .max_frame_size(limit)
        .on_upgrade(move |socket| handle_socket(socket, shared, model, permit))
}

/// `permit`: the connection's place under `server.max_connections`, held until the writer has
/// closed the socket.
async fn handle_socket(
    socket: WebSocket,
    shared: Arc<Shared>,
    model: String,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    shared.metrics.connections.inc();
    shared.metrics.connections_open.inc();
    let still_open = shared.metrics.connections_open.clone();
    let (mut sink, mut stream) = socket.split();
    let limits = &shared.config.server;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Message>(limits.outbound_queue);
    let (overrun, mut overrun_rx) = tokio::sync::watch::channel(false);
    let out = Out {
        tx,
        overrun: Arc::new(overrun),
        prefix: random_token(6).into(),
        next: Arc::new(AtomicU64::new(1)),
    };
    let mut writer_overrun = overrun_rx.clone();
    let writer = tokio::spawn(async move {
        loop {
            let m = tokio::select! {
                m = rx.recv() => m,
                Ok(_) = writer_overrun.wait_for(|k| *k) => None,
            };
            let Some(m) = m else { break };
            let close = matches!(m, Message::Close(_));
            let sent = tokio::select! {
                r = sink.send(m) => r.is_ok(),
                Ok(_) = writer_overrun.wait_for(|k| *k) => false,
                // (a close frame waits for a client that does not read only so long)
                _ = tokio::time::sleep(crate::ws::CLOSE_GRACE), if close => false,
            };
            if !sent || close {
                break;
            }
        }
        // (a client that stopped reading would hold the close handshake, and the socket, forever)
        let _ = tokio::time::timeout(crate::ws::CLOSE_GRACE, sink.close()).await;
        drop(sink);
        drop(permit);
        still_open.dec();
    });
    let close = |out: &Out, code: u16, why: &str| {
        out.send(Message::Close(Some(CloseFrame { code, reason: why.to_string().into() })))
    };

    // the v1 session behind this connection: its one connection is the translator
    let (v1_tx, mut v1_rx) = tokio::sync::mpsc::channel::<Outbound>(limits.outbound_queue);
    let (kick, mut kicked) = tokio::sync::watch::channel(false);
    let conn = Conn::new(v1_tx, Arc::new(kick));
    let handle = match shared.sessions.create(
        &shared,
        translate::v1_create(antiphon_engine::DEFAULT_INSTRUCTIONS),
        conn,
    ) {
        Ok(id) => shared.sessions.handle(&id),
        Err(e) => {
            shared.metrics.errors.at(e.code.into()).inc();
            let code = OaiErrorCode::from_v1_failure(e.code, OaiErrorCode::ServerError);
            let retry_after_ms = e.retry_after_ms;
            out.event(&OaiServerEvent::Error(ErrorView {
                retry_after_ms,
                ..ErrorView::server(code, e.message)
            }));
            close(&out, 1013, "try again later");
            drop(out);
            let _ = writer.await;
            return;
        }
    };
    let Some(handle) = handle else { return };
    let mut t =
        Translator::new(shared.clone(), handle.input.clone(), out.clone(), String::new(), model);
    // the dialect's first event is session.created: the client's events wait for it
    match v1_rx.recv().await {
        Some(Outbound::Text(s)) => {
            if let Some(antiphon_protocol::Received::SessionCreated { session_id, .. }) =
                antiphon_protocol::parse_server(&s)
            {
                t.session.id = format!("sess_{session_id}");
            }
            t.on_v1_text(&s).await;
        }
        _ => return,
    }
    let mut ended = false;
    enum Next {
        Client(Option<Result<Message, axum::Error>>),
        V1(Option<Outbound>),
        Kicked,
        Overrun,
    }
    loop {
        // (the select only picks: what it picked is handled after, outside it)
        let next = tokio::select! {
            f = stream.next() => Next::Client(f),
            m = v1_rx.recv() => Next::V1(m),
            Ok(_) = kicked.wait_for(|k| *k) => Next::Kicked,
            Ok(_) = overrun_rx.wait_for(|k| *k) => Next::Overrun,
        };
        match next {
            Next::Client(f) => {
                let frame = match f {
                    Some(Ok(frame)) => frame,
                    // an oversized frame, invalid UTF-8, a protocol violation: said as v1 says it
                    // (an error event, then 1009 / 1007 / 1002), never a silent close
                    Some(Err(e)) => {
                        let (code, close_with) =
                            crate::ws::transport_error(&e, limits.max_text_frame);
                        if let Some(code) = code {
                            shared.metrics.errors.at(code.into()).inc();
                            let (code, why) = match code {
                                antiphon_protocol::ErrorCode::MessageTooLarge => (
                                    OaiErrorCode::MessageTooLarge,
                                    format!(
                                        "a frame is over the {} bytes this server takes",
                                        limits.max_text_frame
                                    ),
                                ),
                                _ => (
                                    OaiErrorCode::InvalidJson,
                                    "a text frame is not valid UTF-8".to_string(),
                                ),
                            };
                            t.error(None, OaiError::new(code, why));
                        }
                        if let Some((code, why)) = close_with {
                            close(&out, code, &why);
                        }
                        break;
                    }
                    None => break,
                };
                match frame {
                    Message::Text(text) => match parse_client(text.as_str()) {
                        Ok(inc) => t.on_client(inc.event_id, inc.event).await,
                        Err((event_id, e)) => t.error(event_id, e),
                    },
                    Message::Binary(_) => t.error(
                        None,
                        OaiError::new(
                            OaiErrorCode::InvalidEvent,
                            "binary frames are not part of \
                            this dialect: send input_audio_buffer.append",
                        ),
                    ),
                    Message::Close(_) => break,
                    Message::Ping(_) | Message::Pong(_) => {}
                }
            }
            Next::V1(m) => {
                let Some(m) = m else { break };
                // what v1 sent in one go is handled in one go, so its audio joins into fewer deltas
                let mut next = Some(m);
                let mut n = 0;
                while let Some(m) = next.take() {
                    match m {
                        Outbound::Text(s) => t.on_v1_text(&s).await,
                        Outbound::Binary(b) => t.on_v1_audio(&b).await,
                        Outbound::Close(code, why) => {
                            t.flush_audio();
                            close(&out, code, &why);
                            ended = true;
                        }
                    }
                    n += 1;
                    if !ended && n < 64 {
                        next = v1_rx.try_recv().ok();
                    }
                }
                t.flush_audio();
                if ended {
                    break;
                }
            }
            Next::Kicked => break,
            Next::Overrun => {
                shared.metrics.errors.at(crate::ErrorLabel::SlowReader).inc();
                break;
            }
        }
    }
    if !ended {
        // no resume in this dialect: the session ends with its socket
        let _ = handle
            .input
            .send(SessionMsg::Event { seq: None, event: ClientEvent::SessionClose })
            .await;
    }
    drop(t);
    drop(out);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), writer).await;
}
