//! The duplex side of a session: the engine's duplex stream opened with the session, units cut
//! from the received audio, and the stream's decisions and turns turned into protocol events (a
//! response per spoken turn).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::{Resp, Session, SessionMsg};
use antiphon_engine::{DuplexEnd, DuplexEvent, DuplexPolicy, DuplexSpec, RequestId, UnitRefused};
use antiphon_protocol::{ClosingReason, ErrorCode, ServerEvent, Trigger, WireError};

/// A duplex session's own state: the unit cutter, how far its units run ahead of the model's
/// decisions, and the engine turns it maps to responses.
pub(super) struct DuplexState {
    pub policy: DuplexPolicy,
    /// Input samples per unit, at the input rate.
    pub unit_in: usize,
    units_sent: u64,
    /// Units the model has decided (listen or speak).
    units_decided: u64,
    /// Units sent and not yet decided, at most: beyond, the session takes no more input from its
    /// socket (the client's sends wait: TCP's flow control) until the model catches up.
    max_ahead: u64,
    /// A unit the engine had no room for, offered again first.
    held: Option<Vec<f32>>,
    pub turns: HashMap<RequestId, u32>,
}

/// How far a duplex session's audio may run ahead of the model's decisions: this much audio, or
/// two units when they are longer. A client streaming in real time stays well within it; one that
/// sends faster than real time is paced by the model, and nothing it sends is dropped.
pub(super) const UNITS_AHEAD_MS: u64 = 3_000;

impl DuplexState {
    pub fn new(policy: DuplexPolicy, unit_in: usize, unit_ms: u32) -> Self {
        let unit_ms = u64::from(unit_ms.max(1));
        Self {
            policy,
            unit_in,
            units_sent: 0,
            units_decided: 0,
            max_ahead: UNITS_AHEAD_MS.div_ceil(unit_ms).max(2),
            held: None,
            turns: HashMap::new(),
        }
    }

    /// Whether the session may take more input now.
    pub fn takes_input(&self) -> bool {
        self.held.is_none() && self.ahead() < self.max_ahead
    }

    /// Units sent and not yet decided.
    fn ahead(&self) -> u64 {
        self.units_sent.saturating_sub(self.units_decided)
    }

    fn decided(&mut self, unit: u64) {
        self.units_decided = self.units_decided.max(unit + 1);
    }
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

    /// Cuts every whole unit gathered so far and hands it to the engine, as far as the units may
    /// run ahead of the model's decisions (a unit the engine had no room for goes first).
    pub(super) fn feed_units(&mut self) {
        loop {
            let Some(d) = &mut self.duplex else { return };
            if d.ahead() >= d.max_ahead {
                return;
            }
            let unit = match d.held.take() {
                Some(unit) => unit,
                None => match self.input.take_block_16k(d.unit_in) {
                    None => return,
                    Some(Ok(unit)) => unit,
                    Some(Err(e)) => {
                        let e = WireError::new(ErrorCode::BadAudio, format!("input audio: {e}"));
                        return self.send_error(e);
                    }
                },
            };
            match self.shared.engine.duplex_unit(&self.id, unit) {
                Ok(()) => d.units_sent += 1,
                // (offered again when the model decides a unit, or on the next tick)
                Err(UnitRefused::Full(unit)) => {
                    d.held = Some(unit);
                    return;
                }
                Err(UnitRefused::Invalid(why)) => {
                    let e = WireError::new(ErrorCode::BadAudio, format!("input audio: {why}"));
                    return self.send_error(e);
                }
                Err(e @ UnitRefused::Stopped) => {
                    let e = super::internal_error("duplex unit", &e.to_string(), false);
                    return self.send_error(e);
                }
            }
        }
    }

    /// The model decided a unit: the units held back (by the bound on how far they run ahead, or
    /// a full inbox) go on.
    fn on_decided(&mut self, unit: u64) {
        // (a session paced by the model is not idle)
        self.last_activity = Instant::now();
        if let Some(d) = &mut self.duplex {
            d.decided(unit);
        }
        self.feed_units();
    }

    pub(super) fn on_duplex(&mut self, e: DuplexEvent) {
        match e {
            DuplexEvent::Listen { unit, .. } => {
                self.on_decided(unit);
                self.send_event(ServerEvent::DuplexListen { seq: 0, unit })
            }
            DuplexEvent::Speak { unit, turn, new_turn, .. } => {
                self.on_decided(unit);
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
