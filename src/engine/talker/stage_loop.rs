//! The Talker as a stage loop: the messages it takes (requests, hand-offs, cancels) and its step.

use super::*;
use crate::metric_labels::StageName;

impl StageLoop for TalkerStage {
    type Msg = TalkerMsg;

    fn fail_all(&mut self, why: &str) {
        for id in self.order.clone() {
            self.fail(&id, why.to_string());
        }
    }

    fn on_message(&mut self, m: TalkerMsg) {
        match m {
            TalkerMsg::Begin {
                id,
                mode,
                voice,
                min_codes,
                max_codes,
                text_tokens,
                text_chunk,
                seed,
            } => {
                // room for the longest text, its two closing embeddings and every code: the cache
                // never grows (a growth would need a new decode graph); with text chunks, room for
                // two chunks' conditions and every code (a window holds at most that)
                let chunk = (mode == Mode::Turn && text_chunk > 0).then_some(text_chunk);
                let need =
                    crate::fit::talker_rows(self.cfg.default_max_text_tokens, max_codes, chunk);
                let context = self.talker.decoder().config().max_positions;
                if need > context {
                    let why = format!(
                        "field `generation.max_audio_tokens`: {max_codes}; the codes and the text \
                        do not fit the Talker's context ({context})"
                    );
                    self.registry.finish_counted(&id, Status::Refused(why), &self.metrics.requests);
                    return;
                }
                // a small first chunk while few requests are in the engine (first audio sooner);
                // under load a full one (its audio covers the next chunk's wait). Requests still in
                // the Thinker count: a wave of them reaches the Talker together, and the first of
                // them to come would find it idle, then wait for its next chunk behind the others'
                // first ones. A duplex turn's first chunk is always a full one: its codes come a
                // unit at a time, and a small chunk's audio would end long before the next unit's
                // codes fill the next chunk.
                let busy = self.busy(1);
                let first = match (mode, busy) {
                    (Mode::Duplex, _) => self.cfg.code2wav.chunk_codes,
                    (Mode::Turn, true) => self.busy_first_chunk(),
                    (Mode::Turn, false) => self.cfg.code2wav.first_chunk_codes,
                };
                let cache = match self.caches.take(self.talker.decoder(), need) {
                    Ok(c) => c,
                    Err(e) => {
                        self.registry.finish_counted(
                            &id,
                            Status::Failed(format!("talker cache: {e:#}")),
                            &self.metrics.requests,
                        );
                        return;
                    }
                };
                let r = TalkerStream::new(NewStream {
                    mode,
                    voice,
                    cache,
                    sampler: Sampler::new(self.cfg.talker.sampling.clone(), seed),
                    length: LengthPolicy::new(vec![self.talker.eos_code()], min_codes, max_codes),
                    chunker: Chunker::for_stream(&self.cfg, first, mode == Mode::Turn),
                    chunks: chunk
                        .is_some()
                        .then(|| TextChunks::new(text_tokens, min_codes, max_codes)),
                    hold_first: !busy,
                });
                self.remove(&id);
                self.order.push(id.clone());
                self.reqs.insert(id, r);
            }
            TalkerMsg::Rows { id, ids, hidden } => {
                let Some(r) = self.reqs.get_mut(&id) else {
                    return;
                };
                match self.talker.condition_rows(&ids, &hidden) {
                    Ok(c) => r.condition(c),
                    Err(e) => self.fail(&id, format!("talker condition: {e:#}")),
                }
            }
            TalkerMsg::End { id } => {
                // (Begin comes when the Thinker takes a request: requests submitted while it
                // thought count too, so the first of a wave keeps a full first chunk)
                let busy = self.busy(0);
                let busy_first = self.busy_first_chunk();
                let Some(r) = self.reqs.get_mut(&id) else {
                    return;
                };
                if busy
                    && r.mode == Mode::Turn
                    && r.chunker.first() < busy_first
                    && r.chunker.widen_first_to(busy_first)
                {
                    r.hold_first = false;
                }
                let mode = match r.mode {
                    Mode::Turn => ConditionMode::Turn,
                    Mode::Duplex => ConditionMode::Duplex,
                };
                match self.talker.condition_tail(mode) {
                    Ok(t) => r.end_text(t),
                    Err(e) => self.fail(&id, format!("talker condition: {e:#}")),
                }
            }
            TalkerMsg::Segment { id, ids, hidden, turn_end } => {
                let Some(r) = self.reqs.get(&id) else {
                    return;
                };
                if r.duplex.is_none() {
                    return;
                }
                let cond = match (&hidden, ids.is_empty()) {
                    (Some(h), false) => self
                        .talker
                        .condition_rows(&ids, h)
                        .and_then(|rows| {
                            Tensor::cat(
                                &[rows, self.talker.condition_tail(ConditionMode::Duplex)?],
                                0,
                            )
                        })
                        .map(Some),
                    // a spoken unit without text still opens a unit of speech
                    _ if !turn_end => self.talker.condition_tail(ConditionMode::Duplex).map(Some),
                    _ => Ok(None),
                };
                match cond {
                    Ok(c) => {
                        let r = self.reqs.get_mut(&id).expect("looked up");
                        r.queue_segment(c, turn_end);
                    }
                    Err(e) => self.fail(&id, format!("talker condition: {e:#}")),
                }
            }
            TalkerMsg::TextChunk { id, ids, hidden, last, hold } => {
                self.on_text_chunk(&id, &ids, &hidden, last);
                self.bridge.extend(hold);
            }
            TalkerMsg::Cancel(id) => self.remove(&id),
            // (the step after it finds what was delivered)
            TalkerMsg::Delivered => {}
        }
    }

    fn step(&mut self) -> bool {
        let registry = self.registry.clone();
        let gone: Vec<RequestId> =
            self.reqs.keys().filter(|id| !registry.is_live(id)).cloned().collect();
        for id in gone {
            self.remove(&id);
        }
        self.metrics.queue_depth.at(StageName::Talker).set(self.reqs.len() as i64);
        match self.run() {
            Ok(worked) => worked,
            Err(e) => {
                let msg = format!("talker step: {e:#}");
                for id in self.order.clone() {
                    self.fail(&id, msg.clone());
                }
                true
            }
        }
    }
}
