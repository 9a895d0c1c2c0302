//! The replay journal: every server message of a session (events and audio alike) that the client
//! has not acknowledged, bounded by bytes and by audio duration. A resume replays what the client
//! lacks, in order.

use std::collections::VecDeque;

/// One wire message as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireMsg {
    Text(String),
    Binary(Vec<u8>),
}

impl WireMsg {
    pub fn len(&self) -> usize {
        match self {
            WireMsg::Text(t) => t.len(),
            WireMsg::Binary(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug)]
pub struct Journal {
    entries: VecDeque<(u64, WireMsg, u64)>,
    bytes: usize,
    audio_ms: u64,
    max_bytes: usize,
    max_audio_ms: u64,
}

/// The journal would exceed a bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow;

impl Journal {
    pub fn new(max_bytes: usize, max_audio_ms: u64) -> Self {
        Self { entries: VecDeque::new(), bytes: 0, audio_ms: 0, max_bytes, max_audio_ms }
    }

    /// Keeps message `seq` (`audio_ms` of audio in it) until acknowledged.
    pub fn push(&mut self, seq: u64, msg: WireMsg, audio_ms: u64) -> Result<(), Overflow> {
        let n = msg.len();
        if self.bytes + n > self.max_bytes || self.audio_ms + audio_ms > self.max_audio_ms {
            return Err(Overflow);
        }
        self.bytes += n;
        self.audio_ms += audio_ms;
        self.entries.push_back((seq, msg, audio_ms));
        Ok(())
    }

    /// The client holds everything up to `seq`.
    pub fn ack(&mut self, seq: u64) {
        while self.entries.front().is_some_and(|(s, _, _)| *s <= seq) {
            let (_, m, a) = self.entries.pop_front().expect("checked");
            self.bytes -= m.len();
            self.audio_ms -= a;
        }
    }

    /// Messages after `seq`, in order, each with its seq.
    pub fn after(&self, seq: u64) -> impl Iterator<Item = (u64, &WireMsg)> {
        self.entries.iter().filter(move |(s, _, _)| *s > seq).map(|(s, m, _)| (*s, m))
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_trim_and_bounds_hold() {
        let mut j = Journal::new(100, 1000);
        for s in 1..=5 {
            j.push(s, WireMsg::Text("x".repeat(10)), 100).unwrap();
        }
        assert_eq!(j.bytes(), 50);
        j.ack(3);
        assert_eq!(j.len(), 2);
        assert_eq!(j.after(0).count(), 2);
        assert_eq!(j.after(4).collect::<Vec<_>>(), vec![(5, &WireMsg::Text("x".repeat(10)))]);
        assert_eq!(j.push(6, WireMsg::Binary(vec![0; 90]), 0), Err(Overflow));
        assert_eq!(j.push(6, WireMsg::Binary(vec![0; 10]), 900), Err(Overflow), "audio bound");
        j.push(6, WireMsg::Binary(vec![0; 10]), 700).unwrap();
    }
}
