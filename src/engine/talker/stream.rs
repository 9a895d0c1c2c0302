//! `TalkerStream`: one reply's life in the Talker as an explicit state machine. Every step of the
//! stage reads a stream's `Phase` to know what it feeds (condition rows or its last code) and
//! whether it samples a code; the phase changes only through the methods here.

use std::collections::VecDeque;

use candle_core::Tensor;

use super::chunks::TextChunks;
use crate::chunker::Chunker;
use crate::{Mode, RefInput};
use antiphon_models::decoder::PooledCache;
use antiphon_models::sampling::{LengthPolicy, Sampler};

/// Where a Talker stream is.
///
/// ```text
///   whole reply:  Conditioning --End--> Opening --first code--> Speaking --end code--> (gone)
///   duplex unit / text chunk:  Between --segment--> Opening --> Speaking --segment over--> Between
///   a duplex session's stream:  Conditioning --its first segment queued--> Between
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// A whole-reply turn while the Thinker writes: each step prefills the rows that came, and
    /// no code is sampled (the text is not complete).
    Conditioning,
    /// A condition is being prefilled (the text's end, a duplex unit, a text chunk's window; in
    /// one step, or a row a step when fed by rows): the step that takes its last row samples.
    Opening,
    /// One code a step from the last one (as far as pacing lets it).
    Speaking,
    /// Between segments: a duplex unit or a text chunk is awaited; the stream is not stepped.
    Between,
}

/// What one step feeds a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Feed {
    /// Its pending condition rows (all of them, or the first when fed by rows).
    Rows,
    /// Its last code.
    LastCode,
}

impl Phase {
    /// What a step feeds a stream in this phase: rows while it has any to prefill, its last
    /// code while speaking, nothing otherwise.
    pub(super) fn feed(self, rows_pending: bool, has_code: bool) -> Option<Feed> {
        match self {
            Phase::Conditioning | Phase::Opening if rows_pending => Some(Feed::Rows),
            Phase::Speaking if has_code => Some(Feed::LastCode),
            _ => None,
        }
    }

    /// The phase after a step's forward, and whether a code is sampled from it: an opening
    /// condition's last row gives the first code; rows still to come (fed by rows, or a whole
    /// reply's text still being written) give none.
    pub(super) fn after_forward(self, rows_left: bool) -> (Phase, bool) {
        match self {
            Phase::Opening if rows_left => (Phase::Opening, false),
            Phase::Opening | Phase::Speaking => (Phase::Speaking, true),
            other => (other, false),
        }
    }
}

/// A duplex turn's Talker side: one segment per spoken unit, each making a unit of codes; the
/// last one (`turn_end`) drains until the end code. Between segments the stream waits, its last
/// code not yet fed (it opens the next segment's prefill).
#[derive(Default)]
pub(super) struct DuplexTalk {
    /// Waiting segments: the condition (`None` when there is no new text) and `turn_end`.
    pub queue: VecDeque<(Option<Tensor>, bool)>,
    /// Codes left in the segment being decoded; `None` while draining the turn's end.
    pub left: Option<usize>,
}

pub(super) struct TalkerStream {
    pub mode: Mode,
    pub voice: RefInput,
    pub cache: PooledCache,
    phase: Phase,
    /// Condition rows waiting to be prefilled (`Conditioning` and `Opening` only).
    pub pending: Vec<Tensor>,
    pub last_code: Option<u32>,
    pub sampler: Sampler,
    pub length: LengthPolicy,
    pub chunker: Chunker,
    pub codes: usize,
    /// Duplex turns: segments by unit.
    pub duplex: Option<DuplexTalk>,
    /// Turn mode with text chunks: a segment per chunk.
    pub chunks: Option<TextChunks>,
    /// The small first chunk was given on an idle engine: with `talker.hold_first_chunk`, no
    /// codes beyond it until it is delivered (a small first chunk given on a busy engine keeps
    /// its lead: its next chunk is what it waits for).
    pub hold_first: bool,
}

/// What a new stream starts with.
pub(super) struct NewStream {
    pub mode: Mode,
    pub voice: RefInput,
    pub cache: PooledCache,
    pub sampler: Sampler,
    pub length: LengthPolicy,
    pub chunker: Chunker,
    pub chunks: Option<TextChunks>,
    pub hold_first: bool,
}

impl TalkerStream {
    /// A reply in text chunks waits for its first chunk; any other stream starts conditioning on
    /// the Thinker's rows (a duplex session's stream until its first segment comes).
    pub fn new(s: NewStream) -> Self {
        let duplex = (s.mode == Mode::Duplex).then(DuplexTalk::default);
        let phase = if s.chunks.is_some() { Phase::Between } else { Phase::Conditioning };
        Self {
            mode: s.mode,
            voice: s.voice,
            cache: s.cache,
            phase,
            pending: Vec::new(),
            last_code: None,
            sampler: s.sampler,
            length: s.length,
            chunker: s.chunker,
            codes: 0,
            duplex,
            chunks: s.chunks,
            hold_first: s.hold_first,
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// More of a whole reply's text (ignored once the text has ended).
    pub fn condition(&mut self, rows: Tensor) {
        if self.phase == Phase::Conditioning {
            self.pending.push(rows);
        }
    }

    /// A whole reply's text ended: its closing rows, and the step that prefills them samples.
    pub fn end_text(&mut self, tail: Tensor) {
        if self.phase == Phase::Conditioning {
            self.pending.push(tail);
            self.phase = Phase::Opening;
        }
    }

    /// A duplex unit's segment waits its turn (the condition, `None` without new text, and
    /// whether it ends the turn). A duplex session's stream takes its condition in segments
    /// only: at its first, it leaves conditioning for good. (Not a duplex stream: ignored.)
    pub fn queue_segment(&mut self, condition: Option<Tensor>, turn_end: bool) {
        let Some(dx) = self.duplex.as_mut() else { return };
        dx.queue.push_back((condition, turn_end));
        if self.phase == Phase::Conditioning && self.pending.is_empty() {
            self.phase = Phase::Between;
        }
    }

    /// A segment starts (a duplex unit, a text chunk's window): its rows, then codes.
    pub fn open_segment(&mut self, rows: Vec<Tensor>) {
        debug_assert_eq!(self.phase, Phase::Between);
        self.pending = rows;
        self.phase = Phase::Opening;
    }

    /// The step's forward took the pending rows (`rest` is what a segment fed by rows leaves for
    /// the next step): whether a code is sampled now.
    pub fn stepped(&mut self, rest: Option<Tensor>) -> bool {
        self.pending.clear();
        let rows_left = rest.is_some();
        self.pending.extend(rest);
        let (next, sample) = self.phase.after_forward(rows_left);
        self.phase = next;
        sample
    }

    /// The segment being decoded is over: the stream waits for the next one.
    pub fn segment_over(&mut self) {
        self.phase = Phase::Between;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use antiphon_models::decoder::KvCache;
    use antiphon_models::sampling::SamplingParams;
    use candle_core::{DType, Device};

    fn stream(mode: Mode, chunks: bool) -> TalkerStream {
        let cfg = crate::EngineConfig::default();
        TalkerStream::new(NewStream {
            mode,
            voice: RefInput::new(vec![0.1; 160], 16_000),
            cache: PooledCache::alone(KvCache::new(0)),
            sampler: Sampler::new(SamplingParams::talker(), 1),
            length: LengthPolicy::new(vec![0], 1, 10),
            chunker: Chunker::for_stream(&cfg, cfg.code2wav.chunk_codes, mode == Mode::Turn),
            chunks: chunks.then(|| TextChunks::new(None, 1, 10)),
            hold_first: false,
        })
    }

    fn rows(n: usize) -> Tensor {
        Tensor::zeros((n, 4), DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn a_whole_reply_conditions_until_its_text_ends_then_opens_and_speaks() {
        let mut s = stream(Mode::Turn, false);
        assert_eq!(s.phase(), Phase::Conditioning);
        s.condition(rows(3));
        assert!(!s.stepped(None), "no code while the text is being written");
        assert!(s.pending.is_empty(), "the step took the rows");
        s.end_text(rows(2));
        assert_eq!(s.phase(), Phase::Opening);
        s.condition(rows(1));
        assert_eq!(s.pending.len(), 1, "rows after the text's end are not taken");
        assert!(s.stepped(None), "the step that takes the closing rows samples");
        assert_eq!(s.phase(), Phase::Speaking);
        s.end_text(rows(2));
        assert_eq!(s.phase(), Phase::Speaking, "the text ends once");
    }

    #[test]
    fn a_duplex_session_stream_waits_between_units_once_its_first_segment_comes() {
        let mut s = stream(Mode::Duplex, false);
        assert_eq!(s.phase(), Phase::Conditioning, "a duplex request may take rows as a turn");
        s.queue_segment(Some(rows(2)), false);
        assert_eq!(s.phase(), Phase::Between);
        s.open_segment(vec![rows(2)]);
        assert!(!s.stepped(Some(rows(1))), "a segment fed by rows: no code before its last");
        assert_eq!(s.phase(), Phase::Opening);
        assert!(s.stepped(None));
        s.segment_over();
        assert_eq!(s.phase(), Phase::Between);
        let mut turn = stream(Mode::Turn, false);
        turn.queue_segment(Some(rows(2)), false);
        assert_eq!(turn.phase(), Phase::Conditioning, "a turn stream takes no segments");
        assert_eq!(stream(Mode::Turn, true).phase(), Phase::Between, "text chunks wait");
    }

    #[test]
    fn a_whole_reply_samples_only_once_its_text_has_ended() {
        let p = Phase::Conditioning;
        assert_eq!(p.feed(true, false), Some(Feed::Rows));
        assert_eq!(p.feed(false, false), None, "no rows yet: not stepped");
        assert_eq!(p.after_forward(false), (Phase::Conditioning, false), "no code mid-text");
        assert_eq!(Phase::Opening.after_forward(false), (Phase::Speaking, true));
        assert_eq!(Phase::Speaking.feed(false, true), Some(Feed::LastCode));
        assert_eq!(Phase::Speaking.after_forward(false), (Phase::Speaking, true));
    }

    #[test]
    fn a_segment_fed_by_rows_samples_after_its_last_row_and_a_waiting_stream_is_not_stepped() {
        assert_eq!(Phase::Opening.after_forward(true), (Phase::Opening, false));
        assert_eq!(Phase::Opening.after_forward(false), (Phase::Speaking, true));
        for (rows, code) in [(false, false), (true, true), (false, true), (true, false)] {
            assert_eq!(Phase::Between.feed(rows, code), None);
        }
        assert_eq!(Phase::Between.after_forward(false), (Phase::Between, false));
        assert_eq!(Phase::Speaking.feed(false, false), None, "no code to feed yet");
    }
}
