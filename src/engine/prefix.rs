//! The Thinker's prompt-prefix store: KV of prompts seen before, found by the longest run of ids a
//! new prompt shares with one of them.
//!
//! Two kinds of entries go in: the system turn (with the voice) once it is prefilled, shared by
//! every session with that voice and instructions; and a whole finished turn (prompt + reply),
//! whose conversation's next prompt starts with it. A session's tenth turn then prefills its new
//! user message and the reply's re-rendering, not the nine turns before them.
//!
//! An entry is valid for a prompt only as far as each position's embedding is fixed by its id: the
//! reference voice's audio sits in the system turn and is keyed by `voice`; a user's audio clip's
//! placeholder ids say nothing of its content, so the caller keys those positions by the clip's
//! content (ids above the vocabulary, see `thinker/turn.rs`), and a match crosses a clip only into
//! an entry built from the same clip. Before the voice's audio every position is fixed by its id,
//! so an entry of any voice serves a prompt up to where its voice's rows begin: a new voice's
//! system turn takes its head (the template and the text before the audio) from another voice's.

use std::collections::VecDeque;

#[derive(Debug)]
pub struct Entry<V> {
    /// The reference voice heard in the system turn (0: none).
    pub voice: u64,
    /// The ids the value holds, from position 0.
    pub ids: Vec<u32>,
    pub value: V,
    /// What the value holds in memory.
    pub bytes: usize,
}

/// Least recently used first out, at most `cap` entries holding at most `max_bytes` together.
#[derive(Debug)]
pub struct PrefixStore<V> {
    entries: VecDeque<Entry<V>>,
    cap: usize,
    max_bytes: usize,
}

/// Positions `a` and `b` share from the start.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<V> PrefixStore<V> {
    pub fn new(cap: usize, max_bytes: usize) -> Self {
        Self { entries: VecDeque::new(), cap, max_bytes }
    }

    /// Bytes the entries hold.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry that shares the most leading ids with `ids`, counting at most `limit` of them,
    /// and, for an entry of another voice than `voice`, at most `voice_free` (the positions before
    /// the prompt's voice audio begins); `None` when the best shares fewer than `min`. The entry
    /// becomes the most recent. Returns it and the positions to take from it.
    pub fn lookup(
        &mut self,
        voice: u64,
        ids: &[u32],
        limit: usize,
        voice_free: usize,
        min: usize,
    ) -> Option<(&V, usize)> {
        let (i, n) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let n = common_prefix(&e.ids, ids).min(limit);
                (i, if e.voice == voice { n } else { n.min(voice_free) })
            })
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))?;
        if n < min.max(1) {
            return None;
        }
        let e = self.entries.remove(i).expect("found");
        self.entries.push_front(e);
        self.entries.front().map(|e| (&e.value, n))
    }

    /// Whether an entry with `voice` holds all of `ids`.
    pub fn covers(&self, voice: u64, ids: &[u32]) -> bool {
        self.entries.iter().any(|e| {
            e.voice == voice && e.ids.len() >= ids.len() && common_prefix(&e.ids, ids) == ids.len()
        })
    }

    /// Adds an entry of `bytes` as the most recent. Entries it holds entirely are dropped (it
    /// answers every lookup they would), then the least recent beyond the capacity or the byte
    /// budget (an entry larger than the whole budget is not kept).
    pub fn insert(&mut self, voice: u64, ids: Vec<u32>, value: V, bytes: usize) {
        if self.cap == 0 || bytes > self.max_bytes {
            return;
        }
        self.entries.retain(|e| {
            !(e.voice == voice
                && e.ids.len() <= ids.len()
                && common_prefix(&e.ids, &ids) == e.ids.len())
        });
        self.entries.push_front(Entry { voice, ids, value, bytes });
        self.entries.truncate(self.cap);
        while self.bytes() > self.max_bytes {
            self.entries.pop_back();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_shared_run_wins_within_the_limit_and_voice() {
        let mut s = PrefixStore::new(4, usize::MAX);
        s.insert(1, vec![1, 2, 3], "system", 1);
        s.insert(1, vec![1, 2, 3, 4, 5, 6, 7], "turn 1", 1);
        s.insert(2, vec![1, 2, 3, 4, 5, 6, 7, 8], "other voice", 1);
        // "system" is held entirely by "turn 1": dropped
        assert_eq!(s.len(), 2);
        assert!(s.covers(1, &[1, 2, 3]));
        let next = [1, 2, 3, 4, 5, 6, 9, 9];
        assert_eq!(s.lookup(1, &next, 100, 0, 2), Some((&"turn 1", 6)));
        assert_eq!(
            s.lookup(1, &next, 4, 0, 2),
            Some((&"turn 1", 4)),
            "a user audio clip at 4 stops the match"
        );
        assert_eq!(s.lookup(1, &next, 100, 0, 7), None, "fewer than min shared");
        assert_eq!(
            s.lookup(3, &next, 100, 0, 1),
            None,
            "another voice's entries only before the voice"
        );
        assert_eq!(s.lookup(2, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 8, 0, 1), Some((&"other voice", 8)));
    }

    /// A prompt with a new voice takes another voice's entry up to where its own voice's rows
    /// begin, and no further; an entry of its own voice goes further when it shares more.
    #[test]
    fn another_voices_entry_serves_the_head_before_the_voice() {
        let mut s = PrefixStore::new(4, usize::MAX);
        // (ids 9 mark the voice's rows, from position 3)
        s.insert(1, vec![1, 2, 3, 9, 9, 5, 6], "voice 1", 1);
        let new_voice = [1, 2, 3, 9, 9, 5, 7];
        assert_eq!(s.lookup(2, &new_voice, 100, 3, 1), Some((&"voice 1", 3)));
        assert_eq!(s.lookup(2, &new_voice, 100, 3, 4), None, "fewer than min before the voice");
        assert_eq!(
            s.lookup(1, &new_voice, 100, 3, 1),
            Some((&"voice 1", 6)),
            "its own voice: the whole shared run"
        );
        s.insert(2, vec![1, 2, 3, 9, 9, 5], "voice 2", 1);
        assert_eq!(s.lookup(2, &new_voice, 100, 3, 1), Some((&"voice 2", 6)));
    }

    #[test]
    fn least_recently_used_goes_first() {
        let mut s = PrefixStore::new(2, usize::MAX);
        s.insert(0, vec![1, 1], 'a', 1);
        s.insert(0, vec![2, 2], 'b', 1);
        assert!(s.lookup(0, &[1, 1, 5], 10, 0, 1).is_some()); // 'a' is now the most recent
        s.insert(0, vec![3, 3], 'c', 1);
        assert!(s.covers(0, &[1, 1]) && s.covers(0, &[3, 3]) && !s.covers(0, &[2, 2]));
        let mut off = PrefixStore::new(0, usize::MAX);
        off.insert(0, vec![1], 'x', 1);
        assert!(off.is_empty());
    }

    /// The entries together stay within the byte budget: the least recent go first, and an entry
    /// larger than the whole budget is not kept.
    #[test]
    fn entries_stay_within_the_byte_budget() {
        let mut s = PrefixStore::new(10, 100);
        s.insert(0, vec![1], 'a', 40);
        s.insert(0, vec![2], 'b', 40);
        s.insert(0, vec![3], 'c', 40);
        assert_eq!(s.bytes(), 80);
        assert!(!s.covers(0, &[1]) && s.covers(0, &[2]) && s.covers(0, &[3]));
        s.insert(0, vec![4], 'd', 101);
        assert!(!s.covers(0, &[4]) && s.bytes() == 80);
    }
}
