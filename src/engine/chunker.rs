//! Talker -> Code2Wav chunking: each payload is the previous payload's last `context` codes (the
//! silence code for the first) followed by new codes — `first` of them in the first payload (a
//! smaller first chunk cuts first-audio time), `size` in every later one; the final flush sends
//! whatever is pending, flagged last.

/// One hand-off to Stage 2.
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
}

impl Chunker {
    /// `first` outside `1..size` means "same as `size`".
    pub fn new(first: usize, size: usize, context: usize, silence: u32) -> Self {
        let first = if first > 0 && first < size { first } else { size };
        Self { first, size: size.max(1), context: vec![silence; context], pending: Vec::new(), seq: 0, flushed: false }
    }

    /// New codes in the first payload.
    pub fn first(&self) -> usize {
        self.first
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
        if self.pending.len() < self.want() {
            return None;
        }
        Some(self.emit(false))
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

#[cfg(test)]
mod tests {
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
