//! A session's responses: starting one on the engine, its output audio, its events (text, audio
//! chunks, done), cancelling and finishing; generation overrides and voice resolution.

use std::time::Instant;

use base64::Engine as _;

use super::*;

pub(super) struct Resp {
    pub(super) id: u32,
    pub(super) out: OutputAudio,
    pub(super) engine_id: RequestId,
    pub(super) trigger: Trigger,
    /// What the caller said (a duplex turn's caller is the session's stream, not an input).
    pub(super) user: Option<UserInput>,
    pub(super) text: String,
    /// The tools it called, with their ids.
    pub(super) calls: Vec<super::history::IdentifiedCall>,
    /// The transcript of its (spoken) input was asked for.
    pub(super) transcript_asked: bool,
    /// What the engine reported it took and made (known when the engine ends it).
    pub(super) usage: antiphon_engine::Usage,
    /// The turn stays in the conversation (`generation.remember`, true unless set false).
    pub(super) remember: bool,
    pub(super) packets: u64,
    pub(super) chunks: u64,
    pub(super) audio_samples: u64,
    pub(super) started: Instant,
    pub(super) first_packet: bool,
}

impl Resp {
    /// The spoken input whose transcript is due now (once; `on`: the session transcribes).
    fn transcript_due(&mut self, on: bool) -> Option<SpokenClip> {
        match &self.user {
            Some(UserInput::Audio(clip)) if on && !self.transcript_asked => {
                self.transcript_asked = true;
                Some(clip.clone())
            }
            _ => None,
        }
    }
}

impl Session {
    pub(super) fn start_response(
        &mut self,
        trigger: Trigger,
        input: UserInput,
        gen: Option<Generation>,
    ) {
        if self.closing {
            self.send_error(WireError::new(
                ErrorCode::Capacity,
                "the server is shutting down; no new responses",
            ));
            return;
        }
        if trigger != Trigger::ToolResult {
            // results waiting for the calling response are not what this turn answers
            self.tools.forget_waiting();
        }
        if self.current.is_some() {
            // a new turn while answering: the old answer is cut short
            self.cancel_response(None);
        }
        let checked = gen.as_ref().map(|g| {
            merge(&self.generation, Some(g)).validate(&self.shared.engine.generation_limits())
        });
        if let Some(Err(e)) = checked {
            self.send_error(e);
            return;
        }
        if let Err(e) = self.tools.check_choice(&merge(&self.generation, gen.as_ref())) {
            self.send_error(e);
            return;
        }
        let Some(out) = self.new_output() else { return };
        self.responses += 1;
        let rid = self.responses;
        let engine_id = RequestId::response(&self.id, rid);
        let g = merge(&self.generation, gen.as_ref());
        let spec = RequestSpec {
            id: engine_id.clone(),
            mode: Mode::Turn,
            input: input.clone(),
            instructions: self.instructions.clone(),
            history: self.history.turns(),
            voice: self.voice.clone(),
            generation: params(&g),
            tools: self.tools.for_reply(&g),
            text_only: g.text_only.unwrap_or(false),
            task: Default::default(),
        };
        self.send_event(ServerEvent::ResponseCreated { seq: 0, response_id: rid, trigger });
        let me = self.me.clone().expect("started");
        let sink = Arc::new(move |event: EngineEvent| {
            let _ = me.send(SessionMsg::Engine { response_id: rid, event });
        });
        self.current = Some(Resp {
            id: rid,
            out,
            engine_id,
            trigger,
            user: Some(input),
            text: String::new(),
            calls: Vec::new(),
            transcript_asked: false,
            usage: Default::default(),
            remember: g.remember.unwrap_or(true),
            packets: 0,
            chunks: 0,
            audio_samples: 0,
            started: Instant::now(),
            first_packet: false,
        });
        tracing::info!(response = rid, trigger = trigger.as_str(), "response started");
        match self.shared.engine.submit(spec, sink) {
            Ok(()) => {}
            Err(antiphon_engine::SubmitError::Busy(b)) => {
                self.finish_response(rid, Status::Busy(b))
            }
            Err(e) => self.finish_response(rid, Status::Failed(e.to_string())),
        }
    }

    /// The output encoder of a new response (a pending `output_audio` change applies now).
    pub(super) fn new_output(&mut self) -> Option<OutputAudio> {
        if let Some(f) = self.pending_output.take() {
            self.output_format = f;
        }
        let f = &self.output_format;
        match OutputAudio::new(f.codec, f.frame_ms()) {
            Ok(o) => Some(o),
            Err(e) => {
                self.send_error(super::internal_error("output audio", &e.to_string(), false));
                None
            }
        }
    }

    pub(super) fn resp_mut(&mut self, rid: u32) -> Option<&mut Resp> {
        match &mut self.current {
            Some(r) if r.id == rid => Some(r),
            _ => self.older.iter_mut().find(|r| r.id == rid),
        }
    }

    pub(super) fn take_resp(&mut self, rid: u32) -> Option<Resp> {
        if self.current.as_ref().is_some_and(|r| r.id == rid) {
            return self.current.take();
        }
        let i = self.older.iter().position(|r| r.id == rid)?;
        Some(self.older.remove(i))
    }

    pub(super) fn live_responses(&self) -> usize {
        self.older.len() + usize::from(self.current.is_some())
    }

    /// Barge-in: the current response (or the one named) stops now.
    pub(super) fn cancel_response(&mut self, which: Option<u32>) {
        let ids: Vec<u32> = self
            .current
            .iter()
            .chain(&self.older)
            .map(|r| r.id)
            .filter(|id| which.is_none_or(|w| w == *id))
            .collect();
        let ids = if which.is_none() { ids.into_iter().take(1).collect::<Vec<_>>() } else { ids };
        for rid in ids {
            if let Some(r) = self.resp_mut(rid) {
                let e = r.engine_id.clone();
                self.shared.engine.cancel(&e);
                self.finish_response(rid, Status::Cancelled);
            }
        }
    }

    /// Every response still running stops now (each gets its `response.done`, cancelled).
    pub(super) fn cancel_all_responses(&mut self) {
        let ids: Vec<u32> = self.current.iter().chain(&self.older).map(|r| r.id).collect();
        for rid in ids {
            if let Some(r) = self.resp_mut(rid) {
                let e = r.engine_id.clone();
                self.shared.engine.cancel(&e);
                self.finish_response(rid, Status::Cancelled);
            }
        }
    }

    pub(super) fn finish_response(&mut self, rid: u32, status: Status) {
        let Some(mut r) = self.take_resp(rid) else { return };
        if let Some(d) = &mut self.duplex {
            d.turns.remove(&r.engine_id);
        }
        let done = match &status {
            Status::Completed => DoneStatus::Completed,
            Status::Cancelled => DoneStatus::Cancelled,
            Status::Failed(_) | Status::Refused(_) | Status::Busy(_) => DoneStatus::Failed,
        };
        let label = done.as_str();
        match &status {
            Status::Failed(why) => self.send_error(super::internal_error(
                &format!("response {} failed", r.id),
                why,
                false,
            )),
            // what the request asked for does not fit: the client's to change (not fatal)
            Status::Refused(why) => self.send_error(WireError::new(
                ErrorCode::BadField,
                format!("response {}: {why}", r.id),
            )),
            // no place in the engine and its queue full: busy, not the client's fault (not fatal)
            Status::Busy(b) => self.send_error(
                WireError::new(
                    ErrorCode::Capacity,
                    format!("response {}: the server is at capacity; try again later", r.id),
                )
                .retry_after(b.retry_after_ms),
            ),
            _ => {}
        }
        let audio_ms = r.audio_samples * 1000 / crate::audio_edge::OUTPUT_RATE as u64;
        // (a reply that made no audio: its turn's transcript is asked for now)
        if let Some(clip) =
            r.transcript_due(self.transcription).filter(|_| done != DoneStatus::Failed)
        {
            self.transcribe(r.id, clip);
        }
        let u = r.usage;
        let usage = antiphon_protocol::Usage {
            input_tokens: u.input as u64,
            input_audio_tokens: u.input_audio as u64,
            cached_tokens: u.cached as u64,
            output_text_tokens: u.output_text as u64,
            output_audio_tokens: audio_ms * 25 / 1000,
        };
        self.send_event(ServerEvent::ResponseDone {
            seq: 0,
            response_id: r.id,
            status: done,
            audio_ms,
            packets: r.packets,
            chunks: r.chunks,
            usage,
        });
        self.shared.metrics.responses.at(done.into()).inc();
        tracing::info!(response = r.id, status = label, audio_ms, "response done");
        let _ = r.trigger;
        // a failed turn did not happen as far as the conversation goes
        if let Some(user) = r.user.filter(|_| done != DoneStatus::Failed && r.remember) {
            self.history.push(r.id, user, r.text, r.calls, audio_ms);
        }
        self.answer_waiting_results(r.id, done == DoneStatus::Failed);
        if self.closing && self.live_responses() == 0 {
            self.end(false, Some((1001, "server shutting down")));
        }
    }

    pub(super) fn on_engine(&mut self, response_id: u32, event: EngineEvent) {
        let Some(r) = self.resp_mut(response_id) else {
            return;
        };
        match event {
            EngineEvent::HistoryTrimmed { turns } => {
                // (the history this response was given, less its oldest turns: later prompts
                // start where this one did)
                self.history.drop_oldest(turns);
                self.send_event(ServerEvent::ConversationTrimmed { seq: 0, response_id, turns });
            }
            EngineEvent::TextDelta(t) => {
                r.text.push_str(&t);
                self.send_event(ServerEvent::ResponseTextDelta { seq: 0, response_id, text: t });
            }
            EngineEvent::Audio { samples, last, .. } => {
                r.audio_samples += samples.len() as u64;
                r.chunks += 1;
                let encoded: anyhow::Result<Vec<Vec<u8>>> = (|| {
                    let mut packets = r.out.push(&samples)?;
                    if last {
                        packets.extend(r.out.finish()?);
                        if packets.is_empty() {
                            // nothing left to carry the flag: a frame of silence does
                            let frame = vec![0.0; r.out.frame_samples()];
                            packets.append(&mut r.out.push(&frame)?);
                        }
                    }
                    Ok(packets)
                })();
                let packets = match encoded {
                    Ok(p) => p,
                    Err(e) => {
                        return self.finish_response(
                            response_id,
                            Status::Failed(format!("encoding audio: {e}")),
                        )
                    }
                };
                let n = packets.len();
                r.packets += n as u64;
                let first = !r.first_packet && n > 0;
                if first {
                    r.first_packet = true;
                    let t = r.started.elapsed().as_secs_f64();
                    self.shared.metrics.ttfa.observe(t);
                }
                for (i, p) in packets.into_iter().enumerate() {
                    self.send_audio(response_id, p, last && i + 1 == n);
                }
                // (the reply's first audio is out: the turn's transcript may take the GPU now)
                let on = self.transcription;
                if let Some(clip) =
                    self.resp_mut(response_id).filter(|_| first).and_then(|r| r.transcript_due(on))
                {
                    self.transcribe(response_id, clip);
                }
            }
            EngineEvent::ToolCall(call) => self.on_tool_call(response_id, call),
            EngineEvent::ToolCallInvalid { text, reason, message } => {
                self.send_event(ServerEvent::ResponseToolCallInvalid {
                    seq: 0,
                    response_id,
                    text,
                    reason,
                    message,
                });
            }
            EngineEvent::Done { status, usage, .. } => {
                r.usage = usage;
                self.finish_response(response_id, status)
            }
        }
    }
}

/// The engine's view of a (validated) wire `generation`.
pub(super) fn params(g: &Generation) -> GenerationParams {
    GenerationParams {
        max_text_tokens: g.max_text_tokens,
        min_text_tokens: g.min_text_tokens,
        max_audio_tokens: g.max_audio_tokens,
        min_audio_tokens: g.min_audio_tokens,
        temperature: g.temperature,
        seed: g.seed,
        prefix: g.prefix.clone(),
    }
}

pub(super) fn merge(base: &Generation, over: Option<&Generation>) -> Generation {
    let Some(o) = over else { return base.clone() };
    Generation {
        max_text_tokens: o.max_text_tokens.or(base.max_text_tokens),
        min_text_tokens: o.min_text_tokens.or(base.min_text_tokens),
        max_audio_tokens: o.max_audio_tokens.or(base.max_audio_tokens),
        min_audio_tokens: o.min_audio_tokens.or(base.min_audio_tokens),
        temperature: o.temperature.or(base.temperature),
        seed: o.seed.or(base.seed),
        prefix: o.prefix.clone().or_else(|| base.prefix.clone()),
        tool_choice: o.tool_choice.clone().or_else(|| base.tool_choice.clone()),
        text_only: o.text_only.or(base.text_only),
        remember: o.remember.or(base.remember),
    }
}

/// A configured voice by id, uploaded audio (WAV, or raw PCM16 at `sample_rate`), or the default.
pub(super) fn resolve_voice(shared: &Shared, v: Option<&Voice>) -> Result<RefInput, WireError> {
    match v {
        None => Ok(shared.voices.default_input()),
        Some(Voice::Configured { id }) => shared.voices.get(id).ok_or_else(|| {
            WireError::new(ErrorCode::BadField, format!("field `voice.id`: no voice {id:?}"))
        }),
        Some(Voice::Uploaded { ref_audio_b64, sample_rate }) => {
            let bytes =
                base64::engine::general_purpose::STANDARD.decode(ref_audio_b64).map_err(|e| {
                    WireError::new(
                        ErrorCode::BadField,
                        format!("field `voice.ref_audio_b64`: not base64 ({e})"),
                    )
                })?;
            let (samples, rate) = if bytes.starts_with(b"RIFF") {
                antiphon_audio::decode_wav(&bytes).map_err(|e| {
                    WireError::new(ErrorCode::BadField, format!("field `voice.ref_audio_b64`: {e}"))
                })?
            } else {
                if bytes.len() % 2 != 0 {
                    return Err(WireError::new(
                        ErrorCode::BadField,
                        "field `voice.ref_audio_b64`: PCM16 of odd length",
                    ));
                }
                (
                    bytes
                        .chunks_exact(2)
                        .map(|b| antiphon_audio::i16_to_f32(i16::from_le_bytes([b[0], b[1]])))
                        .collect(),
                    *sample_rate,
                )
            };
            if !(8_000..=96_000).contains(&rate) {
                return Err(WireError::new(
                    ErrorCode::BadField,
                    "field `voice.ref_audio_b64`: audio at 8-96 kHz",
                ));
            }
            if samples.iter().any(|s| !s.is_finite()) {
                return Err(WireError::new(
                    ErrorCode::BadField,
                    "field `voice.ref_audio_b64`: non-finite samples",
                ));
            }
            if let Some(why) = antiphon_audio::voice_fault(&samples, rate) {
                return Err(WireError::new(
                    ErrorCode::BadField,
                    format!("field `voice.ref_audio_b64`: {why}"),
                ));
            }
            Ok(RefInput::new(samples, rate))
        }
    }
}
