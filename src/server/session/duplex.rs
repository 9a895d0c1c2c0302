//! The duplex side of a session: the engine's duplex stream opened with the session, units cut
//! from the received audio, and the stream's decisions and turns turned into protocol events (a
//! response per spoken turn).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::{Resp, Session, SessionMsg};
use antiphon_engine::{DuplexEnd, DuplexEvent, DuplexPolicy, DuplexSpec, RequestId};
use antiphon_protocol::{ClosingReason, ErrorCode, ServerEvent, Trigger, WireError};

/// A duplex session's own state: the unit cutter and the engine turns it maps to responses.
pub(super) struct DuplexState {
    pub policy: DuplexPolicy,
    /// Input samples per unit, at the input rate.
    pub unit_in: usize,
    pub units_sent: u64,
    pub turns: HashMap<RequestId, u32>,
}

impl Session {
    pub(super) fn open_duplex(&mut self) {
        let Some(d) = &self.duplex else { return };
        let g = &self.generation;
        let spec = DuplexSpec {
            session: self.id.clone(),
            policy: d.policy,
            instructions: self.instructions.clone(),
            voice: self.voice.clone(),
            generation: super::response::params(g),
        };
        let me = self.me.clone().expect("started");
        let sink = Arc::new(move |e: DuplexEvent| {
            let _ = me.send(SessionMsg::Duplex(e));
        });
        if let Err(e) = self.shared.engine.open_duplex(spec, sink) {
            self.send_error(super::internal_error(
                "opening the duplex stream",
                &format!("{e:#}"),
                true,
            ));
        }
    }

    /// Cuts every whole unit gathered so far and hands it to the engine.
    pub(super) fn feed_units(&mut self) {
        let Some(d) = &mut self.duplex else { return };
        while let Some(unit) = self.input.take_block_16k(d.unit_in) {
            let sent =
                unit.map_err(|e| WireError::new(ErrorCode::BadAudio, format!("input audio: {e}")))
                    .and_then(|x| {
                        self.shared.engine.duplex_unit(&self.id, x).map_err(|e| {
                            super::internal_error("duplex unit", &format!("{e:#}"), false)
                        })
                    });
            match sent {
                Ok(()) => d.units_sent += 1,
                Err(e) => {
                    self.send_error(e);
                    return;
                }
            }
        }
    }

    pub(super) fn on_duplex(&mut self, e: DuplexEvent) {
        match e {
            DuplexEvent::Listen { unit, .. } => {
                self.send_event(ServerEvent::DuplexListen { seq: 0, unit })
            }
            DuplexEvent::Speak { unit, turn, new_turn, .. } => {
                self.send_event(ServerEvent::DuplexSpeak { seq: 0, unit });
                if !new_turn {
                    return;
                }
                if self.closing {
                    self.shared.engine.cancel(&turn);
                    return;
                }
                let Some(out) = self.new_output() else {
                    self.shared.engine.cancel(&turn);
                    return;
                };
                self.responses += 1;
                let rid = self.responses;
                self.send_event(ServerEvent::ResponseCreated {
                    seq: 0,
                    response_id: rid,
                    trigger: Trigger::Duplex,
                });
                let resp = Resp {
                    id: rid,
                    out,
                    engine_id: turn.clone(),
                    trigger: Trigger::Duplex,
                    user: None,
                    text: String::new(),
                    calls: Vec::new(),
                    transcript_asked: false,
                    usage: Default::default(),
                    remember: true,
                    packets: 0,
                    chunks: 0,
                    audio_samples: 0,
                    started: Instant::now(),
                    first_packet: false,
                };
                if let Some(old) = self.current.replace(resp) {
                    self.older.push(old);
                }
                if let Some(d) = &mut self.duplex {
                    d.turns.insert(turn, rid);
                }
                tracing::info!(response = rid, unit, "duplex turn started");
            }
            DuplexEvent::Response { turn, event } => {
                if let Some(rid) = self.duplex.as_ref().and_then(|d| d.turns.get(&turn).copied()) {
                    self.on_engine(rid, event);
                }
            }
            DuplexEvent::Closed { reason } => {
                if reason == DuplexEnd::Closed || self.ended {
                    return;
                }
                tracing::info!(%reason, "duplex stream ended");
                let why = match &reason {
                    DuplexEnd::ContextFull => ClosingReason::ContextFull,
                    DuplexEnd::Closed | DuplexEnd::Failed(_) => {
                        self.send_error(super::internal_error(
                            "the duplex stream ended",
                            &reason.to_string(),
                            false,
                        ));
                        ClosingReason::Failed
                    }
                };
                self.send_event(ServerEvent::SessionClosing {
                    seq: 0,
                    reason: why,
                    retry_after_ms: None,
                });
                self.end(false, Some((1000, why.as_str())));
            }
        }
    }
}
