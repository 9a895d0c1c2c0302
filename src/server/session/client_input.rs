//! A session's client input: `session.update` applied, each client event handled, and the
//! dedupe of input seqs.

use super::*;

impl Session {
    pub(super) fn apply_update(&mut self, u: SessionUpdate) -> Result<(), WireError> {
        // checked before any part of the update applies
        if let Some(g) = &u.generation {
            g.validate(&self.shared.engine.generation_limits())?;
        }
        self.shared.check_instructions(u.instructions.as_deref())?;
        if self.duplex.is_some() && u.tools.is_some() {
            return Err(WireError::new(
                ErrorCode::BadField,
                "field `tools`: only for mode \"turn\"",
            ));
        }
        let mut tools = SessionTools::default();
        match &u.tools {
            Some(t) => tools.declare(t.clone(), self.shared.engine.serves_tools())?,
            None => std::mem::swap(&mut tools, &mut self.tools),
        }
        let checked = tools.check_choice(u.generation.as_ref().unwrap_or(&self.generation));
        if u.tools.is_none() {
            std::mem::swap(&mut tools, &mut self.tools);
        }
        checked?;
        if let Some(i) = &u.input_audio {
            self.input = InputAudio::new(i.codec, i.sample_rate)
                .map_err(|e| {
                    WireError::new(
                        ErrorCode::BadField,
                        format!("field `input_audio.sample_rate`: {e}"),
                    )
                })?
                .with_limit_s(self.shared.config.server.max_input_audio_s);
            if let Some(d) = &mut self.duplex {
                d.unit_in = (i.sample_rate as u64 * self.shared.config.engine.duplex.unit_ms as u64
                    / 1000) as usize;
            }
        }
        if let Some(o) = u.output_audio {
            OutputAudio::new(o.codec, o.frame_ms()).map_err(|e| {
                WireError::new(ErrorCode::BadField, format!("field `output_audio.frame_ms`: {e}"))
            })?;
            self.pending_output =
                Some(OutputFormat { codec: o.codec, frame_ms: Some(o.frame_ms()) });
        }
        if self.duplex.is_some()
            && (u.voice.is_some()
                || u.instructions.is_some()
                || u.generation.is_some()
                || u.duplex.is_some())
        {
            return Err(WireError::new(
                ErrorCode::BadField,
                "session.update: a duplex session's voice, instructions, generation and policy \
                are fixed at session.create",
            ));
        }
        if self.duplex.is_none() && u.duplex.is_some() {
            return Err(WireError::new(
                ErrorCode::BadField,
                "field `duplex`: only for mode \"duplex\"",
            ));
        }
        if let Some(v) = &u.voice {
            self.voice = resolve_voice(&self.shared, Some(v))?;
        }
        if let Some(i) = u.instructions {
            self.instructions = Some(i);
        }
        if let Some(g) = u.generation {
            self.generation = g;
        }
        if u.tools.is_some() {
            self.tools = tools;
        }
        if let Some(t) = u.input_transcription {
            self.transcription = t;
        }
        Ok(())
    }

    pub(super) fn on_event(&mut self, event: ClientEvent) {
        match event {
            ClientEvent::SessionCreate(_) | ClientEvent::SessionResume(_) => self.send_error(
                WireError::new(ErrorCode::SessionInUse, "this connection already holds a session"),
            ),
            ClientEvent::SessionUpdate(u) => {
                if let Err(e) = self.apply_update(*u) {
                    self.send_error(e);
                }
            }
            ClientEvent::InputText { .. } | ClientEvent::InputCommit { .. }
                if self.duplex.is_some() =>
            {
                if matches!(event, ClientEvent::InputText { .. }) {
                    return self.send_error(WireError::new(
                        ErrorCode::BadField,
                        "input.text: a duplex session listens to audio only",
                    ));
                }
                // the end of the stream: the partial unit goes in, padded with silence
                if let Some(d) = &self.duplex {
                    let n = d.unit_in;
                    self.input.pad_to_multiple(n);
                }
                self.feed_units();
            }
            ClientEvent::InputText { text, generation } => {
                self.start_response(Trigger::Text, UserInput::Text(text), generation);
            }
            ClientEvent::InputCommit { generation } => {
                if self.input.buffered_ms() == 0 {
                    return self.send_error(WireError::new(
                        ErrorCode::BadField,
                        "input.commit: no input audio since the last turn",
                    ));
                }
                match self.input.take_16k().and_then(|a| Ok(SpokenClip::new(a)?)) {
                    Ok(clip) => {
                        self.start_response(Trigger::Commit, UserInput::Audio(clip), generation)
                    }
                    Err(e) => self.send_error(WireError::new(
                        ErrorCode::BadAudio,
                        format!("input audio: {e}"),
                    )),
                }
            }
            ClientEvent::InputToolResult { results, generation } => {
                self.on_tool_result(results, generation)
            }
            ClientEvent::InputClear => self.input.clear(),
            ClientEvent::ConversationAppend { turns } => self.on_append(turns),
            ClientEvent::ConversationClear if self.duplex.is_some() => {
                self.send_error(WireError::new(
                    ErrorCode::BadField,
                    "conversation.clear: a duplex session's conversation is its stream",
                ))
            }
            ClientEvent::ConversationClear => self.history.clear(),
            ClientEvent::ResponseCancel { response_id } => self.cancel_response(response_id),
            ClientEvent::Playback { response_id, played_ms } => {
                self.history.played(response_id, played_ms);
            }
            ClientEvent::Ack { seq } if seq >= self.next_seq => {
                // acking ahead would empty the journal of messages not yet sent (and lose them)
                let sent = self.next_seq - 1;
                self.send_error(WireError::new(
                    ErrorCode::BadField,
                    format!("ack.seq: {seq} is beyond the highest seq sent ({sent})"),
                ));
            }
            ClientEvent::Ack { seq } => {
                self.journal.ack(seq);
                if let Some(m) = &self.manager {
                    m.set_journal_bytes(&self.id, self.journal.bytes());
                }
            }
            ClientEvent::Ping { id } => {
                if let Some(c) = &self.conn {
                    c.send_event(&ServerEvent::Pong { id });
                }
            }
            ClientEvent::SessionClose => self.end(false, Some((1000, "session closed"))),
        }
    }

    /// Input dedupe: true if this seq was already applied.
    pub(super) fn seen(&mut self, seq: Option<u64>) -> bool {
        self.input_since_ack = true;
        match seq {
            Some(s) if s <= self.applied_input => true,
            Some(s) => {
                self.applied_input = s;
                false
            }
            None => false,
        }
    }
}
