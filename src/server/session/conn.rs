//! A connection as a session sees it: the bounded queue to the socket's writer, and the kick that
//! closes the socket of a client that stopped reading.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

/// How long a resume's replay waits for room in a connection's queue before it takes the client
/// for one that stopped reading.
pub const REPLAY_STALL: Duration = Duration::from_secs(10);

impl Conn {
    pub fn new(
        tx: tokio::sync::mpsc::Sender<Outbound>,
        kick: Arc<tokio::sync::watch::Sender<bool>>,
    ) -> Self {
        Self { id: NEXT_CONN.fetch_add(1, Ordering::Relaxed), tx, kick }
    }

    pub fn send(&self, m: Outbound) {
        if let Err(tokio::sync::mpsc::error::TrySendError::Full(_)) = self.tx.try_send(m) {
            if !*self.kick.borrow() {
                tracing::warn!(
                    conn = self.id,
                    "outbound queue full: closing the slow reader's socket"
                );
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

    /// Free places in the queue.
    pub fn capacity(&self) -> usize {
        self.tx.capacity()
    }

    /// The queue's bound.
    pub fn max_capacity(&self) -> usize {
        self.tx.max_capacity()
    }

    /// Calls `wake` (with this connection's id) once `places` places of the queue are free at once;
    /// a client that takes nothing from it for [`REPLAY_STALL`] is a reader that stopped reading,
    /// and its socket is closed as a full queue's is (the session parks, resumable).
    pub fn when_room(&self, places: usize, wake: impl FnOnce(ConnId) + Send + 'static) {
        let (tx, id, n, kick) =
            (self.tx.clone(), self.id, places.clamp(1, self.tx.max_capacity()), self.kick.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(REPLAY_STALL, tx.reserve_many(n)).await {
                Ok(Ok(permits)) => {
                    drop(permits);
                    wake(id);
                }
                Ok(Err(_)) => {}
                Err(_) => {
                    tracing::warn!(
                        conn = id,
                        "a resume's replay made no progress: closing the slow reader's socket"
                    );
                    kick.send_replace(true);
                }
            }
        });
    }
}
