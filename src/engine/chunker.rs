//! Talker -> Code2Wav chunking: each payload is the previous payload's last `context` codes (the
//! silence code for the first) followed by new codes — `first` of them in the first payload (a
//! smaller first chunk cuts first-audio time), `size` in every later one; the final flush sends
//! whatever is pending, flagged last.
//!
//! A holding chunker ([`Chunker::holding`], turn mode) sends a complete chunk only when the next
//! code comes: when the stream ends instead, that chunk goes out as the last one. Without the
//! hold, a reply whose codes end on a chunk boundary needed one more chunk of no new codes (the
//! context alone, to flush the flow's look-ahead): a whole Code2Wav step for nothing, and one of
//! the slowest shapes it runs.

/// One hand-off to Code2Wav.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    pub seq: usize,
    pub codes: Vec<u32>,
    pub last: bool,
}

#[derive(Debug, Clone)]
pub struct Chunker {
    first: usize,
    size: usize,
    context: Vec<u32>,
    pending: Vec<u32>,
    seq: usize,
    flushed: bool,
    hold: bool,
}

impl Chunker {
    /// `first` outside `1..size` means "same as `size`".
    pub fn new(first: usize, size: usize, context: usize, silence: u32) -> Self {
        let first = if first > 0 && first < size { first } else { size };
        Self {
            first,
            size: size.max(1),
            context: vec![silence; context],
            pending: Vec::new(),
            seq: 0,
            flushed: false,
            hold: false,
        }
    }

    /// A stream's chunker as the Talker makes it: `first` new codes in the first payload, the
    /// configured size and context after; a turn's holds its chunks, a duplex turn's does not
    /// (its codes stop at each unit's end, so its chunks go out at once).
    pub fn for_stream(cfg: &crate::EngineConfig, first: usize, turn: bool) -> Self {
        let c = Self::new(
            first,
            cfg.code2wav.chunk_codes,
            cfg.code2wav.context_codes,
            antiphon_models::code2wav::SILENCE_CODE,
        );
        if turn {
            c.holding()
        } else {
            c
        }
    }

    /// Holds each complete chunk until the next code comes (see the module documentation).
    pub fn holding(mut self) -> Self {
        self.hold = true;
        self
    }

    /// Codes a stream makes beyond a chunk before that chunk goes out (1 when holding).
    pub fn held_codes(&self) -> usize {
        usize::from(self.hold)
    }

    /// Payloads made so far.
    pub fn sent(&self) -> usize {
        self.seq
    }

    /// New codes in the first payload.
    pub fn first(&self) -> usize {
        self.first
    }

    /// A full first payload after all, while no code has come yet (false once one has).
    pub fn widen_first(&mut self) -> bool {
        self.widen_first_to(self.size)
    }

    /// A first payload of `n` new codes after all (at most a full one, never fewer than it has),
    /// while no code has come yet (false once one has, or when nothing changes).
    pub fn widen_first_to(&mut self, n: usize) -> bool {
        let n = n.min(self.size);
        if self.seq > 0 || !self.pending.is_empty() || n <= self.first {
            return false;
        }
        self.first = n;
        true
    }

    fn want(&self) -> usize {
        if self.seq == 0 {
            self.first
        } else {
            self.size
        }
    }

    /// Adds a code; returns a payload when one is complete.
    pub fn push(&mut self, code: u32) -> Option<Payload> {
        if self.flushed {
            return None;
        }
        self.pending.push(code);
        let want = self.want();
        if self.pending.len() < want + self.held_codes() {
            return None;
        }
        // (holding: the code beyond the complete chunk starts the next one)
        let next = self.pending.split_off(want);
        let p = self.emit(false);
        self.pending = next;
        Some(p)
    }

    fn emit(&mut self, last: bool) -> Payload {
        let mut codes = self.context.clone();
        codes.append(&mut self.pending);
        let k = self.context.len();
        self.context = codes[codes.len() - k..].to_vec();
        let p = Payload { seq: self.seq, codes, last };
        self.seq += 1;
        p
    }

    /// The last payload: the context and everything pending.
    pub fn flush(&mut self) -> Option<Payload> {
        if self.flushed {
            return None;
        }
        self.flushed = true;
        Some(self.emit(true))
    }
}

/// The payloads (length in codes, context included; last or not) of the requests Code2Wav sees
/// most, made by the chunkers the Talker makes: a turn that found the engine idle (the small first
/// chunk), a turn that found it busy, and duplex turns of one and two units, each ending on a
/// whole chunk. Code2Wav's graph warm-up takes streams through these, so that their shapes are
/// captured before the first request (a last chunk of another length is captured as it comes).
pub fn warm_sequences(cfg: &crate::EngineConfig) -> Vec<Vec<(usize, bool)>> {
    let size = cfg.code2wav.chunk_codes.max(1);
    let run = |first: usize, turn: bool, codes: usize| -> Vec<(usize, bool)> {
        let mut c = Chunker::for_stream(cfg, first, turn);
        let mut out: Vec<(usize, bool)> =
            (0..codes as u32).filter_map(|i| c.push(i)).map(|p| (p.codes.len(), p.last)).collect();
        out.extend(c.flush().map(|p| (p.codes.len(), p.last)));
        out
    };
    let unit = cfg.duplex.codes_per_unit();
    let mut seqs = Vec::new();
    let small = Chunker::new(cfg.code2wav.first_chunk_codes, size, 0, 0).first();
    if small < size {
        seqs.push(run(small, true, small + 3 * size));
        if cfg.code2wav.small_first_chunk_slack {
            // (a busy engine's first chunk halfway to a full one, `pace.rs`)
            let mid = crate::pace::halfway(small, size);
            seqs.push(run(mid, true, mid + 3 * size));
        }
    }
    seqs.push(run(size, true, 4 * size));
    seqs.push(run(size, false, 2 * unit));
    seqs.push(run(size, false, unit));
    seqs.dedup();
    seqs
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_first_payload_widens_only_before_any_code() {
        let mut c = super::Chunker::new(2, 4, 1, 9);
        assert!(c.widen_first());
        assert_eq!(c.first(), 4);
        assert!((0..3).all(|i| c.push(i).is_none()), "a full first payload now");
        assert_eq!(c.push(3).map(|p| p.codes), Some(vec![9, 0, 1, 2, 3]));
        let mut c = super::Chunker::new(2, 4, 1, 9);
        assert!(c.push(0).is_none());
        assert!(!c.widen_first(), "a code has come");
        assert_eq!(c.push(1).map(|p| p.codes), Some(vec![9, 0, 1]));
        let mut c = super::Chunker::new(2, 8, 1, 9);
        assert!(c.widen_first_to(5));
        assert!(!c.widen_first_to(3), "never narrower");
        assert!(c.widen_first_to(20) && c.first() == 8, "at most a full payload");
    }

    use super::*;

    #[test]
    fn payloads_carry_three_codes_of_context() {
        let mut c = Chunker::new(25, 25, 3, 4218);
        let mut out = vec![];
        for i in 0..60 {
            if let Some(p) = c.push(i) {
                out.push(p);
            }
        }
        out.push(c.flush().unwrap());
        assert_eq!(out.len(), 3);
        assert_eq!(&out[0].codes[..3], &[4218, 4218, 4218]);
        assert_eq!(out[0].codes.len(), 28);
        assert_eq!(&out[1].codes[..3], &[22, 23, 24]);
        assert_eq!(out[1].codes.len(), 28);
        assert_eq!(out[2].codes, vec![47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]);
        assert!(out[2].last && !out[1].last);
        assert_eq!(out.iter().map(|p| p.seq).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert!(c.flush().is_none() && c.push(1).is_none());
    }

    #[test]
    fn a_smaller_first_chunk() {
        let mut c = Chunker::new(5, 25, 3, 4218);
        let first = (0..5).find_map(|i| c.push(i)).unwrap();
        assert_eq!(first.codes, vec![4218, 4218, 4218, 0, 1, 2, 3, 4]);
        assert!((5..29).all(|i| c.push(i).is_none()));
        let second = c.push(29).unwrap();
        assert_eq!(second.codes.len(), 28);
        assert_eq!(&second.codes[..3], &[2, 3, 4]);
    }

    /// Holding: the same payloads, each sent one code later, and a reply that ends on a chunk
    /// boundary ends with that chunk flagged last (no chunk of context alone).
    #[test]
    fn a_holding_chunker_sends_the_same_chunks_and_ends_on_the_boundary() {
        for (first, n) in [(25, 60), (8, 83), (25, 100), (8, 108), (25, 1)] {
            let (mut plain, mut held) =
                (Chunker::new(first, 25, 3, 4218), Chunker::new(first, 25, 3, 4218).holding());
            let mut a: Vec<Payload> = (0..n).filter_map(|i| plain.push(i)).collect();
            let mut b = Vec::new();
            for i in 0..n {
                let p = held.push(i);
                // a chunk goes out with the code after it, not with its own last code
                assert_eq!(
                    p.is_some(),
                    i > 0 && a.iter().any(|x| *x.codes.last().unwrap() == i - 1),
                    "first {first}, code {i}"
                );
                b.extend(p);
            }
            a.extend(plain.flush());
            b.extend(held.flush());
            let boundary = a.last().unwrap().codes.len() == 3;
            if boundary {
                // plain: the boundary chunk, then the context alone; holding: the chunk, last
                let tail = a.pop().unwrap();
                assert!(
                    tail.last
                        && tail.codes.len() == 3
                        && a.last().unwrap().codes.ends_with(&tail.codes)
                );
                a.last_mut().unwrap().last = true;
            }
            assert_eq!(a, b, "first {first}, {n} codes");
        }
    }

    #[test]
    fn an_exact_multiple_still_flushes_the_lookahead() {
        let mut c = Chunker::new(25, 25, 3, 4218);
        let n = (0..25).filter_map(|i| c.push(i)).count();
        assert_eq!(n, 1);
        let last = c.flush().unwrap();
        assert_eq!(last.codes, vec![22, 23, 24]);
        assert!(last.last);
    }
}
