//! A connection as a session sees it: the bounded queue to the socket's writer, and the kick that
//! closes the socket of a client that stopped reading.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use antiphon_protocol::ServerEvent;

pub type ConnId = u64;

/// What a session (or the connection itself) writes to a socket.
#[derive(Debug, Clone, PartialEq)]
pub enum Outbound {
    Text(String),
    Binary(Vec<u8>),
    Close(u16, String),
}

/// The writing end of a connection: a bounded queue to its writer. A message that finds the queue
/// full is not queued and the connection is marked overrun (`kick`): its socket is then closed,
/// and what it missed stays in the session's journal for a resume.
#[derive(Clone)]
pub struct Conn {
    pub id: ConnId,
    tx: tokio::sync::mpsc::Sender<Outbound>,
    kick: Arc<tokio::sync::watch::Sender<bool>>,
}

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);
impl Conn {
    pub fn new(tx: tokio::sync::mpsc::Sender<Outbound>, kick: Arc<tokio::sync::watch::Sender<bool>>) -> Self {
        Self { id: NEXT_CONN.fetch_add(1, Ordering::Relaxed), tx, kick }
    }

    pub fn send(&self, m: Outbound) {
        if let Err(tokio::sync::mpsc::error::TrySendError::Full(_)) = self.tx.try_send(m) {
            if !*self.kick.borrow() {
                tracing::warn!(conn = self.id, "outbound queue full: closing the slow reader's socket");
            }
            self.kick.send_replace(true);
        }
    }

    /// Whether a message found the queue full.
    pub fn overrun(&self) -> bool {
        *self.kick.borrow()
    }

    pub fn send_event(&self, e: &ServerEvent) {
        self.send(Outbound::Text(e.to_json()));
    }
}
