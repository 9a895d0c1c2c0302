//! One WebSocket connection: checks sizes, parses frames, creates or resumes a session, forwards
//! everything else to it, and writes what the session (or the connection itself) sends. A socket
//! that ends without `session.close` parks its session.

use std::sync::Arc;

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures_util::{SinkExt, StreamExt};

use super::session::{Conn, Outbound, SessionMsg};
use super::Shared;
use antiphon_protocol::{parse_client, AudioFrame, ClientEvent, ErrorCode, ServerEvent, WireError};

/// How long a closing socket's last writes (its close frame, the close handshake) may wait for a
/// client that does not read: then the socket is dropped whatever the client does.
pub(crate) const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// An open socket's place under `server.max_connections` and in the `connections_open` gauge,
/// shared by its writer and its reader: given back when the last of them has let go of its half of
/// the socket (the socket closes when both halves are dropped).
struct OpenSocket {
    _permit: tokio::sync::OwnedSemaphorePermit,
    gauge: prometheus::IntGauge,
}

impl OpenSocket {
    fn new(permit: tokio::sync::OwnedSemaphorePermit, gauge: prometheus::IntGauge) -> Self {
        gauge.inc();
        Self { _permit: permit, gauge }
    }
}

impl Drop for OpenSocket {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// `permit`: the connection's place under `server.max_connections`, held until the socket is
/// closed.
pub async fn handle_socket(
    socket: WebSocket,
    shared: Arc<Shared>,
    routed: Option<String>,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    shared.metrics.connections.inc();
    // (declared before the socket's halves: the reader's share goes after its half)
    let open = Arc::new(OpenSocket::new(permit, shared.metrics.connections_open.clone()));
    let writer_open = open.clone();
    let (mut sink, mut stream) = socket.split();
    let limits = &shared.config.server;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Outbound>(limits.outbound_queue);
    let (kick, kicked) = tokio::sync::watch::channel(false);
    let kick = Arc::new(kick);
    let mut writer_kicked = kicked.clone();
    // the writer is done (a close frame sent, a kick, a failed send): the reader stops too, or a
    // client that neither reads nor writes would hold the socket forever (issue 38: a session
    // closed for its journal's overflow left the socket open, uncounted)
    let (writer_done, mut written) = tokio::sync::watch::channel(false);
    let writer = tokio::spawn(async move {
        loop {
            let m = tokio::select! {
                m = rx.recv() => m,
                // (a dropped sender is no kick: the queue then drains to its end)
                Ok(_) = writer_kicked.wait_for(|k| *k) => None,
            };
            let Some(m) = m else { break };
            let msg = match m {
                Outbound::Text(t) => Message::Text(t.into()),
                Outbound::Binary(b) => Message::Binary(b.into()),
                Outbound::Close(code, reason) => {
                    let _ = tokio::time::timeout(
                        CLOSE_GRACE,
                        sink.send(Message::Close(Some(CloseFrame { code, reason: reason.into() }))),
                    )
                    .await;
                    break;
                }
            };
            // a reader that stopped reading blocks the send: the kick ends it too
            let sent = tokio::select! {
                r = sink.send(msg) => r.is_ok(),
                Ok(_) = writer_kicked.wait_for(|k| *k) => false,
            };
            if !sent {
                break;
            }
        }
        // (a client that stopped reading would hold the close handshake, and the socket, forever)
        let _ = tokio::time::timeout(CLOSE_GRACE, sink.close()).await;
        drop(sink);
        drop(writer_open);
        writer_done.send_replace(true);
    });
    let conn = Conn::new(tx.clone(), kick);
    let mut session: Option<tokio::sync::mpsc::Sender<SessionMsg>> = None;
    let mut clean = false;
    // after a refused frame: the client's unread bytes would make the socket's end a reset that
    // can swallow the close frame, so the socket stays open a moment after the writer is done
    let mut linger = false;
    let error = |e: WireError| {
        shared.metrics.errors.at(e.code.into()).inc();
        conn.send_event(&ServerEvent::error(&e));
    };
    // a refused frame: its error (in the session's order when there is one), then the close frame
    let refuse = |session: &Option<tokio::sync::mpsc::Sender<SessionMsg>>,
                  e: Option<WireError>,
                  close: (u16, String)| {
        let conn = conn.clone();
        let session = session.clone();
        let shared = shared.clone();
        async move {
            match (session, e) {
                (Some(s), Some(error)) => {
                    let _ = s.send(SessionMsg::Refused { error, close }).await;
                }
                (_, e) => {
                    if let Some(e) = e {
                        shared.metrics.errors.at(e.code.into()).inc();
                        conn.send_event(&ServerEvent::error(&e));
                    }
                    conn.send(Outbound::Close(close.0, close.1));
                }
            }
        }
    };
    let first_deadline =
        tokio::time::Instant::now() + std::time::Duration::from_secs(limits.first_event_timeout_s);
    let mut kicked = kicked;
    let mut writer_gone = false;
    loop {
        let next = tokio::select! {
            f = stream.next() => f,
            _ = tokio::time::sleep_until(first_deadline), if session.is_none() => {
                error(WireError::fatal(
                    ErrorCode::NotInSession,
                    format!(
                        "no session.create or session.resume within {} s",
                        limits.first_event_timeout_s
                    ),
                ));
                conn.send(Outbound::Close(1008, "no session".into()));
                clean = true;
                break;
            }
            Ok(_) = kicked.wait_for(|k| *k) => {
                shared.metrics.errors.at(crate::ErrorLabel::SlowReader).inc();
                break;
            }
            Ok(_) = written.wait_for(|d| *d) => {
                writer_gone = true;
                break;
            }
        };
        let Some(frame) = next else { break };
        let frame = match frame {
            Ok(f) => f,
            Err(e) => {
                // the transport refused the frame: say why, with the close code the protocol asks
                // for
                let (code, close) =
                    transport_error(&e, limits.max_text_frame.max(limits.max_binary_frame));
                match close {
                    Some(close) => {
                        refuse(&session, code.map(|c| WireError::fatal(c, e.to_string())), close)
                            .await;
                        linger = true;
                    }
                    None => {
                        if let Some(code) = code {
                            error(WireError::fatal(code, e.to_string()));
                        }
                    }
                }
                break;
            }
        };
        match frame {
            Message::Text(t) => {
                if t.len() > limits.max_text_frame {
                    let e = WireError::fatal(
                        ErrorCode::MessageTooLarge,
                        format!(
                            "text frame of {} bytes (limit {})",
                            t.len(),
                            limits.max_text_frame
                        ),
                    );
                    refuse(&session, Some(e), (1009, "message too large".into())).await;
                    linger = true;
                    break;
                }
                let inc = match parse_client(t.as_str()) {
                    Ok(i) => i,
                    Err(e) => {
                        match &session {
                            Some(s) => {
                                let _ = s.send(SessionMsg::Invalid(e)).await;
                            }
                            None => error(e),
                        }
                        continue;
                    }
                };
                match (&session, inc.event) {
                    (None, ClientEvent::SessionCreate(c)) => {
                        match shared.sessions.create(&shared, *c, conn.clone()) {
                            Ok(id) => {
                                let h = shared.sessions.handle(&id);
                                session = h.map(|h| h.input);
                            }
                            Err(e) => {
                                let fatal = e.fatal;
                                error(e);
                                if fatal {
                                    conn.send(Outbound::Close(1013, "try again later".into()));
                                    clean = true;
                                    break;
                                }
                            }
                        }
                    }
                    (None, ClientEvent::SessionResume(r))
                        if routed.as_ref().is_some_and(|q| *q != r.session_id) =>
                    {
                        error(WireError::new(
                            ErrorCode::BadField,
                            "field `session_id`: it differs from the session_id in the URL (the \
                            proxy routed on that one)",
                        ))
                    }
                    (None, ClientEvent::SessionResume(r)) => {
                        match shared.sessions.resume(&r.session_id, &r.resume_token) {
                            Ok(h) => {
                                let attach =
                                    SessionMsg::Attach { conn: conn.clone(), last_seq: r.last_seq };
                                let _ = h.input.send(attach).await;
                                session = Some(h.input);
                            }
                            Err(e) => error(e),
                        }
                    }
                    (None, ClientEvent::Ping { id }) => conn.send_event(&ServerEvent::Pong { id }),
                    (None, _) => error(WireError::new(
                        ErrorCode::NotInSession,
                        "send session.create or session.resume first",
                    )),
                    (Some(s), event) => {
                        let close = matches!(event, ClientEvent::SessionClose);
                        let _ = s.send(SessionMsg::Event { seq: inc.seq, event }).await;
                        if close {
                            clean = true;
                        }
                    }
                }
            }
            Message::Binary(b) => {
                if b.len() > limits.max_binary_frame {
                    let e = WireError::fatal(
                        ErrorCode::MessageTooLarge,
                        format!(
                            "binary frame of {} bytes (limit {})",
                            b.len(),
                            limits.max_binary_frame
                        ),
                    );
                    refuse(&session, Some(e), (1009, "message too large".into())).await;
                    linger = true;
                    break;
                }
                let Some(s) = &session else {
                    error(WireError::new(ErrorCode::NotInSession, "audio before session.create"));
                    continue;
                };
                match AudioFrame::decode(&b) {
                    Some(f) => {
                        let seq = (f.seq != 0).then_some(f.seq as u64);
                        let _ = s
                            .send(SessionMsg::Audio { seq, kind: f.kind, payload: f.payload })
                            .await;
                    }
                    None => {
                        let _ = s
                            .send(SessionMsg::Invalid(WireError::new(
                                ErrorCode::BadAudio,
                                "binary frame shorter than its 12-byte header",
                            )))
                            .await;
                    }
                }
            }
            Message::Close(_) => break,
            Message::Ping(_) | Message::Pong(_) => {}
        }
    }
    if let Some(s) = &session {
        if !clean {
            let _ = s.send(SessionMsg::Detach { conn: conn.id }).await;
        }
    }
    // the writer ends when the session lets go of this connection (or right away if it has none)
    drop(conn);
    drop(tx);
    if writer_gone {
        // what the client still sends is read up to its close frame, for a while at most: a socket
        // closed with unread bytes resets, and a reset can swallow the close frame
        let _ = tokio::time::timeout(CLOSE_GRACE, async {
            while let Some(Ok(f)) = stream.next().await {
                if matches!(f, Message::Close(_)) {
                    break;
                }
            }
        })
        .await;
    }
    if linger {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), writer).await;
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        drop(stream);
    }
}

/// What a transport error means for the client: the error code to send (if any) and the close
/// frame: an oversized frame is `message_too_large` with 1009, invalid UTF-8 in a text frame 1007,
/// any other protocol violation 1002; a connection that is simply gone gets nothing.
pub(crate) fn transport_error(
    e: &axum::Error,
    limit: usize,
) -> (Option<ErrorCode>, Option<(u16, String)>) {
    let text = e.to_string();
    let lower = text.to_ascii_lowercase();
    if lower.contains("space limit") || lower.contains("too long") || lower.contains("too big") {
        (
            Some(ErrorCode::MessageTooLarge),
            Some((1009, format!("message too large (limit {limit} bytes)"))),
        )
    } else if lower.contains("utf-8") || lower.contains("utf8") {
        (Some(ErrorCode::BadJson), Some((1007, "invalid UTF-8 in a text frame".into())))
    } else if lower.contains("protocol") {
        (None, Some((1002, "protocol error".into())))
    } else {
        (None, None)
    }
}
