//! The session manager: every live session by id (with its resume token), the recently expired
//! ones (so a late resume gets `session_expired`), and the counts the operations endpoints report.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use tokio::sync::mpsc::{channel, unbounded_channel, Sender, UnboundedSender};
use tracing::Instrument;

use super::{Conn, Session, SessionMsg};
use crate::Shared;
use antiphon_protocol::{ErrorCode, SessionCreate, WireError};

/// The manager's view of a session.
#[derive(Clone)]
pub struct Handle {
    pub token: String,
    /// The engine's, the server's and the session's own messages (bounded by what the engine
    /// makes: a response's events are bounded by its generation limits).
    pub tx: UnboundedSender<SessionMsg>,
    /// What its connections send (`server.session_inbox` messages; a sender waits when full).
    pub input: Sender<SessionMsg>,
}

/// All sessions of the server, and the ids of recently expired ones.
#[derive(Default)]
pub struct SessionManager {
    inner: Mutex<ManagerState>,
}

#[derive(Default)]
struct ManagerState {
    sessions: HashMap<String, Handle>,
    expired: HashMap<String, Instant>,
    parked: std::collections::HashSet<String>,
    journal_bytes: HashMap<String, usize>,
}

/// `bytes` random bytes as URL-safe base64 (letters, digits, `-` and `_`).
pub(crate) fn random_token(bytes: usize) -> String {
    use rand::RngCore;
    let mut b = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut b);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

impl SessionManager {
    pub fn len(&self) -> usize {
        self.inner.lock().expect("manager").sessions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn parked(&self) -> usize {
        self.inner.lock().expect("manager").parked.len()
    }

    pub fn journal_bytes(&self) -> usize {
        self.inner.lock().expect("manager").journal_bytes.values().sum()
    }

    pub(super) fn set_parked(&self, id: &str, parked: bool) {
        let mut m = self.inner.lock().expect("manager");
        if parked {
            m.parked.insert(id.to_string());
        } else {
            m.parked.remove(id);
        }
    }

    pub(super) fn set_journal_bytes(&self, id: &str, bytes: usize) {
        self.inner.lock().expect("manager").journal_bytes.insert(id.to_string(), bytes);
    }

    /// Handles of every live session (for shutdown).
    pub fn all(&self) -> Vec<Handle> {
        self.inner.lock().expect("manager").sessions.values().cloned().collect()
    }

    pub(super) fn remove(&self, id: &str, expired: bool) {
        let mut m = self.inner.lock().expect("manager");
        m.sessions.remove(id);
        m.parked.remove(id);
        m.journal_bytes.remove(id);
        if expired {
            let now = Instant::now();
            m.expired.retain(|_, t| now.duration_since(*t) < Duration::from_secs(3600));
            m.expired.insert(id.to_string(), now);
        }
    }

    pub fn handle(&self, id: &str) -> Option<Handle> {
        self.inner.lock().expect("manager").sessions.get(id).cloned()
    }

    /// Looks a session up for a resume.
    pub fn resume(&self, id: &str, token: &str) -> Result<Handle, WireError> {
        let m = self.inner.lock().expect("manager");
        match m.sessions.get(id) {
            Some(h) if crate::auth::secret_eq(&h.token, token) => Ok(h.clone()),
            Some(_) => Err(WireError::new(
                ErrorCode::BadResumeToken,
                "the resume token does not match this session",
            )),
            None if m.expired.contains_key(id) => Err(WireError::new(
                ErrorCode::SessionExpired,
                "the session expired after its grace period",
            )),
            None => Err(WireError::new(ErrorCode::SessionNotFound, format!("no session {id}"))),
        }
    }

    /// Creates a session attached to `conn` (its `session.created` is sent by the session task).
    pub fn create(
        self: &Arc<Self>,
        shared: &Arc<Shared>,
        c: SessionCreate,
        conn: Conn,
    ) -> Result<String, WireError> {
        let cfg = &shared.config.server;
        if shared.is_shutting_down() {
            return Err(WireError::fatal(ErrorCode::Capacity, "the server is shutting down")
                .retry_after(cfg.retry_after_ms));
        }
        let session = Session::new(shared.clone(), &c)?;
        let id = match cfg.replica_id.as_str() {
            "" => format!("s_{}", random_token(12)),
            replica => format!("{replica}.{}", random_token(12)),
        };
        let token = random_token(24);
        let (tx, rx) = unbounded_channel();
        let (input, input_rx) = channel(cfg.session_inbox);
        {
            let mut m = self.inner.lock().expect("manager");
            if m.sessions.len() >= cfg.max_sessions {
                return Err(WireError::fatal(
                    ErrorCode::Capacity,
                    "the server has no free session",
                )
                .retry_after(cfg.retry_after_ms));
            }
            // admission by load: a call begins only when the engine has room for it (a duplex
            // session takes its place now, for its life)
            let admitted = match c.mode {
                antiphon_protocol::Mode::Duplex => shared.engine.reserve_duplex(&id),
                antiphon_protocol::Mode::Turn => shared.engine.accepts_call(),
            };
            if let Err(b) = admitted {
                let e = WireError::fatal(
                    ErrorCode::Capacity,
                    "the server is at capacity: no room for another call now",
                );
                return Err(e.retry_after(b.retry_after_ms));
            }
            m.sessions.insert(id.clone(), Handle { token: token.clone(), tx: tx.clone(), input });
        }
        shared.metrics.sessions_created.inc();
        let span = tracing::info_span!("session", id = %id);
        let actor = session.start(id.clone(), token, tx, conn, self.clone());
        tokio::spawn(actor.run(rx, input_rx).instrument(span));
        Ok(id)
    }
}
