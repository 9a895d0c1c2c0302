//! Turn mode with the reply's text in chunks (`engine.talker.text_chunk`), conditioned as the
//! model's own streaming mode conditions its Talker (docs/design/turn-streaming.md): every text
//! chunk is a segment of codes, decoded until the end code; a segment's prefill starts the cache
//! over with a window of the previous segment (its condition and its codes) followed by this
//! chunk's condition (`sliding_recompute`, one chunk back).

use std::collections::VecDeque;

use anyhow::Result;
use candle_core::Tensor;

use super::stream::Phase;
use super::TalkerStage;
use crate::RequestId;
use antiphon_models::sampling::LengthPolicy;
use antiphon_models::talker::{ConditionMode, Talker};

/// A text chunk's condition: its rows (`ids` and their Thinker hidden rows), then the text end
/// when the text ends with it, then the audio start.
pub fn chunk_condition(
    talker: &Talker,
    ids: &[u32],
    hidden: &Tensor,
    last: bool,
) -> candle_core::Result<Tensor> {
    talker.condition(ids, hidden, if last { ConditionMode::Turn } else { ConditionMode::Duplex })
}

/// What a segment prefills, from position 0 of a cache started over: the previous chunk's
/// condition and the codes it made, then this chunk's condition (`sliding_recompute` with one chunk
/// of history, as the checkpoint's `tts_config` sets it).
pub fn segment_window(
    talker: &Talker,
    previous: Option<(&Tensor, &[u32])>,
    condition: &Tensor,
) -> candle_core::Result<Tensor> {
    let mut parts = Vec::with_capacity(3);
    if let Some((c, codes)) = previous {
        parts.push(c.clone());
        if !codes.is_empty() {
            parts.push(talker.embed_codes(codes)?);
        }
    }
    parts.push(condition.clone());
    Tensor::cat(&parts, 0)
}

/// The most codes one text chunk may make (the reference's bound per chunk).
pub const MAX_CHUNK_CODES: usize = 500;

/// With forced lengths, a text chunk makes at least this many codes (a second of speech, ~2.5
/// codes per text token, as real speech does) while the forced total lasts: a forced reply of
/// long text and few codes would otherwise give its first chunk fewer codes than the first audio
/// chunk needs, and hold first audio back for text no real reply would wait for.
pub const FORCED_CODES_PER_CHUNK: usize = 25;

/// One text chunk's condition: its rows, the text end (last chunk only), the audio start.
pub struct TextChunk {
    pub condition: Tensor,
    /// Text rows in the chunk.
    pub rows: usize,
    pub last: bool,
}

/// A segment being decoded, or the last one decoded (the next one's window starts with it).
struct Segment {
    condition: Tensor,
    codes: Vec<u32>,
    last: bool,
}

/// What a starting segment prefills and how many codes it makes.
pub struct SegmentStart {
    /// The window's head: the previous chunk's condition and codes (none at the first chunk)...
    pub previous: Option<(Tensor, Vec<u32>)>,
    /// ...then this chunk's condition.
    pub condition: Tensor,
    /// At least and at most this many codes before the segment's end.
    pub min_codes: usize,
    pub max_codes: usize,
}

/// A turn stream's text chunks on the Talker side.
pub struct TextChunks {
    /// Chunks not yet started, in order.
    queue: VecDeque<TextChunk>,
    segment: Option<Segment>,
    /// A segment is being decoded.
    pub active: bool,
    /// Text rows in the chunks started so far...
    rows: usize,
    /// ...and the chunks.
    chunks: usize,
    /// The reply's text length when the request forces it...
    text_tokens: Option<usize>,
    /// ...and the reply's bounds on codes (equal when forced).
    min_codes: usize,
    max_codes: usize,
    /// The first chunk has come (the first-chunk size is settled then).
    pub started: bool,
}

impl TextChunks {
    pub fn new(text_tokens: Option<usize>, min_codes: usize, max_codes: usize) -> Self {
        Self {
            queue: VecDeque::new(),
            segment: None,
            active: false,
            rows: 0,
            chunks: 0,
            text_tokens,
            min_codes,
            max_codes,
            started: false,
        }
    }

    pub fn push(&mut self, chunk: TextChunk) {
        self.started = true;
        self.queue.push_back(chunk);
    }

    /// The codes the reply should have made by the end of its `chunks`th chunk, which brings its
    /// text to `rows` rows: all of them after the last chunk; with forced lengths, a share of the
    /// forced codes in proportion to the text so far (at least [`FORCED_CODES_PER_CHUNK`] a chunk).
    fn target(&self, rows: usize, chunks: usize, last: bool) -> Option<usize> {
        let forced = self.min_codes == self.max_codes;
        match (forced, self.text_tokens, last) {
            (true, _, true) => Some(self.max_codes),
            (true, Some(t), false) if t > 0 => Some(
                (self.max_codes * rows / t)
                    .max(FORCED_CODES_PER_CHUNK * chunks)
                    .min(self.max_codes),
            ),
            _ => None,
        }
    }

    /// The next segment to decode, when none is and a chunk waits, given `made` codes so far.
    /// A chunk that may make no codes is passed over (its condition still opens the next window).
    /// `None` also when nothing waits; [`TextChunks::finished`] says whether the reply is over.
    pub fn start(&mut self, made: usize) -> Option<SegmentStart> {
        while !self.active {
            let chunk = self.queue.pop_front()?;
            self.rows += chunk.rows;
            self.chunks += 1;
            let (min, max) = match self.target(self.rows, self.chunks, chunk.last) {
                Some(t) => (t.saturating_sub(made), t.saturating_sub(made)),
                None => {
                    let room = self.max_codes.saturating_sub(made);
                    let min = if chunk.last { self.min_codes.saturating_sub(made) } else { 0 };
                    (min.min(room), room.min(MAX_CHUNK_CODES))
                }
            };
            let previous = self.segment.take().map(|p| (p.condition, p.codes));
            self.segment = Some(Segment {
                condition: chunk.condition.clone(),
                codes: Vec::new(),
                last: chunk.last,
            });
            if max == 0 {
                continue;
            }
            self.active = true;
            return Some(SegmentStart {
                previous,
                condition: chunk.condition,
                min_codes: min,
                max_codes: max,
            });
        }
        None
    }

    /// A code the active segment made.
    pub fn made(&mut self, code: u32) {
        if let Some(s) = self.segment.as_mut() {
            s.codes.push(code);
        }
    }

    /// The active segment ended (its end code, or its last code).
    pub fn end_segment(&mut self) {
        self.active = false;
    }

    /// The reply is over: its last chunk's segment has ended (or had nothing to make), or the
    /// reply made all the codes it may.
    pub fn finished(&self, made: usize) -> bool {
        let last_done =
            !self.active && self.queue.is_empty() && self.segment.as_ref().is_some_and(|s| s.last);
        last_done || made >= self.max_codes
    }
}

impl TalkerStage {
    /// The next text chunk of a turn stream: its condition joins the stream's queue. The first
    /// one settles the first Code2Wav chunk's size (as the whole text's end does without chunks).
    pub(super) fn on_text_chunk(
        &mut self,
        id: &RequestId,
        ids: &[u32],
        hidden: &Tensor,
        last: bool,
    ) {
        let busy = self.busy(0);
        let Some(r) = self.reqs.get_mut(id) else {
            return;
        };
        let Some(chunks) = r.chunks.as_mut() else {
            return self.fail(id, "a text chunk for a stream that takes its text whole".into());
        };
        if !chunks.started && busy && r.chunker.first() < self.cfg.code2wav.chunk_codes {
            r.chunker.widen_first();
        }
        match chunk_condition(&self.talker, ids, hidden, last) {
            Ok(condition) => chunks.push(TextChunk { condition, rows: ids.len(), last }),
            Err(e) => self.fail(id, format!("talker condition: {e:#}")),
        }
    }

    /// Starts the next segment of every turn stream whose text chunk waits: the cache starts over
    /// with the window. A reply whose last chunk leaves nothing to make ends here.
    pub(super) fn start_text_segments(&mut self) -> Result<()> {
        let mut over = Vec::new();
        for id in &self.order {
            let r = self.reqs.get_mut(id).expect("listed");
            if r.phase() != Phase::Between {
                continue;
            }
            let Some(chunks) = r.chunks.as_mut() else {
                continue;
            };
            let Some(start) = chunks.start(r.codes) else {
                if chunks.finished(r.codes) {
                    over.push(id.clone());
                }
                continue;
            };
            let previous = start.previous.as_ref().map(|(c, codes)| (c, codes.as_slice()));
            let window = segment_window(&self.talker, previous, &start.condition)?;
            r.cache.truncate(0);
            r.open_segment(vec![window]);
            r.length =
                LengthPolicy::new(vec![self.talker.eos_code()], start.min_codes, start.max_codes);
        }
        for id in over {
            self.end_stream(&id);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn chunk(rows: usize, last: bool) -> TextChunk {
        TextChunk {
            condition: Tensor::zeros(
                (rows + 1 + usize::from(last), 4),
                candle_core::DType::F32,
                &Device::Cpu,
            )
            .unwrap(),
            rows,
            last,
        }
    }

    fn run(chunks: &mut TextChunks, made: &mut usize, codes: usize) {
        for _ in 0..codes {
            chunks.made(7);
            *made += 1;
        }
        chunks.end_segment();
    }

    #[test]
    fn forced_codes_are_spread_over_the_chunks_by_their_text() {
        // 32 text tokens and 100 codes, forced: chunks of 10, 10, 10 and 2 rows
        let mut c = TextChunks::new(Some(32), 100, 100);
        let mut made = 0;
        let mut got = Vec::new();
        for (rows, last) in [(10, false), (10, false), (10, false), (2, true)] {
            c.push(chunk(rows, last));
            let s = c.start(made).expect("a segment");
            assert_eq!(s.min_codes, s.max_codes, "forced");
            assert_eq!(
                s.previous.as_ref().map(|(c, codes)| (c.dim(0).unwrap(), codes.len())),
                got.last().map(|&n| (11, n)),
                "the window holds the chunk before"
            );
            got.push(s.max_codes);
            run(&mut c, &mut made, s.max_codes);
            assert!(c.start(made).is_none(), "nothing waits");
        }
        assert_eq!(got, [31, 31, 31, 7]);
        assert!(c.finished(made));
    }

    #[test]
    fn forced_codes_of_long_text_give_each_chunk_a_second_of_speech_while_they_last() {
        // 128 text tokens and 100 codes, forced: 25 codes a chunk until the 100 are made
        let mut c = TextChunks::new(Some(128), 100, 100);
        let mut made = 0;
        let mut got = Vec::new();
        for k in 0..13 {
            let last = k == 12;
            c.push(chunk(if last { 8 } else { 10 }, last));
            if let Some(s) = c.start(made) {
                got.push(s.max_codes);
                run(&mut c, &mut made, s.max_codes);
            }
        }
        assert_eq!(got, [25, 25, 25, 25], "the chunks after the forced total make nothing");
        assert!(c.finished(made));
    }

    #[test]
    fn free_lengths_end_on_the_end_code_and_keep_the_reply_minimum_for_the_last_chunk() {
        let mut c = TextChunks::new(None, 50, 2048);
        let mut made = 0;
        c.push(chunk(10, false));
        let s = c.start(made).unwrap();
        assert_eq!((s.min_codes, s.max_codes), (0, MAX_CHUNK_CODES));
        run(&mut c, &mut made, 20);
        assert!(!c.finished(made));
        c.push(chunk(3, true));
        let s = c.start(made).unwrap();
        assert_eq!((s.min_codes, s.max_codes), (30, MAX_CHUNK_CODES));
        run(&mut c, &mut made, 30);
        assert!(c.finished(made));
    }

    #[test]
    fn a_chunk_with_no_room_left_is_passed_over_and_the_reply_ends() {
        let mut c = TextChunks::new(None, 0, 12);
        let mut made = 0;
        c.push(chunk(10, false));
        let s = c.start(made).unwrap();
        assert_eq!(s.max_codes, 12);
        run(&mut c, &mut made, 12);
        assert!(c.finished(made), "every code the reply may make is made");
        c.push(chunk(10, false));
        assert!(c.start(made).is_none(), "no room: no segment");
    }
}
