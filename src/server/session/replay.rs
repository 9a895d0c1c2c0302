//! A resume's replay, at the pace the socket takes it. The journal may hold far more than the
//! connection's outbound queue (`server.outbound_queue`): pushed at once, a long replay would find
//! the queue full and close the socket it was resuming on. So the journal is handed to the queue
//! while it has room, a waiter wakes the session when room comes back, and the session's new
//! messages (journaled as ever) follow in order; once the replay has caught up, the connection is
//! live again.

use super::*;

/// The queue places a replay leaves free for the session's unsequenced messages (acks, pongs,
/// connection-level errors), which are never journaled and would otherwise find it full.
fn margin(queue: usize) -> usize {
    (queue / 4).clamp(1, 64).min(queue.saturating_sub(1))
}

impl Session {
    /// A resume on `conn` (token checked): the old connection, if any, is told it was replaced, the
    /// client's `last_seq` acknowledges the journal up to it, and the rest is replayed.
    pub(super) fn attach(&mut self, conn: Conn, last_seq: u64) {
        if let Some(old) = self.conn.take() {
            if old.id != conn.id {
                old.send_event(&ServerEvent::SessionClosing {
                    seq: 0,
                    reason: ClosingReason::Replaced,
                    retry_after_ms: None,
                });
                old.send(Outbound::Close(1000, "replaced".into()));
            }
        }
        self.journal.ack(last_seq);
        if let Some(m) = &self.manager {
            m.set_journal_bytes(&self.id, self.journal.bytes());
        }
        conn.send_event(&ServerEvent::SessionResumed {
            session_id: self.id.clone(),
            input_seq: self.applied_input,
        });
        self.conn = Some(conn);
        self.replayed = Some(last_seq);
        self.pump();
        self.parked_at = None;
        if let Some(m) = &self.manager {
            m.set_parked(&self.id, false);
        }
        self.shared.metrics.resumes.inc();
        tracing::info!(last_seq, "session resumed");
    }

    /// Hands the replay's next messages to the connection while its queue has room; with more to
    /// come, a waiter sends [`SessionMsg::Pump`] once the queue has room again.
    pub(super) fn pump(&mut self) {
        let (Some(c), Some(mut sent)) = (&self.conn, self.replayed) else { return };
        let keep = margin(c.max_capacity());
        let mut more = false;
        for (seq, m) in self.journal.after(sent) {
            if c.capacity() <= keep {
                more = true;
                break;
            }
            c.send(match m {
                WireMsg::Text(t) => Outbound::Text(t.clone()),
                WireMsg::Binary(b) => Outbound::Binary(b.clone()),
            });
            sent = seq;
        }
        if !more {
            // caught up: the session's messages go to the connection as they are made
            self.replayed = None;
            return;
        }
        self.replayed = Some(sent);
        if self.pump_waiting != Some(c.id) {
            self.pump_waiting = Some(c.id);
            let me = self.me.clone().expect("started");
            c.when_room(keep + 1, move |conn| {
                let _ = me.send(SessionMsg::Pump { conn });
            });
        }
    }

    /// The session ends while its replay has not caught up: the rest goes to the queue at once
    /// (a queue it overruns closes the socket, as any full queue does).
    pub(super) fn flush_replay(&mut self) {
        let (Some(c), Some(sent)) = (&self.conn, self.replayed.take()) else { return };
        for (_, m) in self.journal.after(sent) {
            c.send(match m {
                WireMsg::Text(t) => Outbound::Text(t.clone()),
                WireMsg::Binary(b) => Outbound::Binary(b.clone()),
            });
        }
    }

    /// The queue of `conn` has room again.
    pub(super) fn on_pump(&mut self, conn: ConnId) {
        if self.pump_waiting == Some(conn) {
            self.pump_waiting = None;
        }
        if self.conn.as_ref().is_some_and(|c| c.id == conn) {
            self.pump();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::margin;

    #[test]
    fn a_replay_leaves_room_in_any_queue() {
        assert_eq!(margin(1), 0);
        assert_eq!(margin(2), 1);
        assert_eq!(margin(8), 2);
        assert_eq!(margin(4096), 64);
    }
}
