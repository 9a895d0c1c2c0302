//! A session's conversation as the next turn's prompt hears it: each turn as it was (a typed turn
//! as its text, a spoken turn as its audio, never a transcript or a stand-in), the assistant's
//! replies cut to what the caller heard (`playback`), bounded by what a prompt could ever hold.

use antiphon_engine::{ToolCall, Turn, UserInput};

/// A call a reply made, with the id the session gave it (`response.tool_call`'s `call_id`).
pub(super) type IdentifiedCall = (String, ToolCall);

/// The most turns kept (a client that appends turns without asking for replies gives way here;
/// the engine lets the oldest go long before, by the context).
const MAX_TURNS: usize = 4096;

/// One 16 kHz sample per sample; the Thinker hears 10 embeddings a second of audio, one per 1600.
const SAMPLES_PER_POSITION: usize = 1600;

struct HistoryTurn {
    response_id: u32,
    user: UserInput,
    assistant: String,
    /// The tools the reply called (they stay when `playback` cuts what was said).
    calls: Vec<IdentifiedCall>,
    /// The reply's length as audio (what `playback.played_ms` is a part of).
    audio_ms: u64,
}

/// The conversation of a turn-mode session (a duplex session's stream holds its own).
pub(super) struct History {
    turns: Vec<HistoryTurn>,
    /// Samples of spoken audio the turns hold.
    spoken: usize,
    /// The most spoken audio kept: what would take the whole of the Thinker's context. The engine
    /// lets the oldest turns give way long before (half its context goes to the conversation), so
    /// nothing dropped here could have been heard.
    max_spoken: usize,
}

fn spoken_samples(u: &UserInput) -> usize {
    match u {
        UserInput::Audio(clip) => clip.samples().len(),
        UserInput::Text(_) | UserInput::ToolResults(_) => 0,
    }
}

impl History {
    /// A history for a Thinker with a context of `context` positions.
    pub(super) fn new(context: usize) -> Self {
        Self {
            turns: Vec::new(),
            spoken: 0,
            max_spoken: context.saturating_mul(SAMPLES_PER_POSITION),
        }
    }

    /// A turn that happened (a failed one did not, as far as the conversation goes); the oldest
    /// turns go while the spoken audio held is beyond the bound.
    pub(super) fn push(
        &mut self,
        response_id: u32,
        user: UserInput,
        assistant: String,
        calls: Vec<IdentifiedCall>,
        audio_ms: u64,
    ) {
        self.spoken += spoken_samples(&user);
        self.turns.push(HistoryTurn { response_id, user, assistant, calls, audio_ms });
        let mut drop = self.turns.len().saturating_sub(MAX_TURNS);
        for t in &self.turns[..drop] {
            self.spoken -= spoken_samples(&t.user);
        }
        while self.spoken > self.max_spoken && drop < self.turns.len() {
            self.spoken -= spoken_samples(&self.turns[drop].user);
            drop += 1;
        }
        self.turns.drain(..drop);
    }

    /// Every turn goes (the client's `conversation.clear`).
    pub(super) fn clear(&mut self) {
        self.turns.clear();
        self.spoken = 0;
    }

    /// The `n` oldest turns go (the engine left them out of a prompt: the context is full).
    pub(super) fn drop_oldest(&mut self, n: usize) {
        let n = n.min(self.turns.len());
        for t in self.turns.drain(..n) {
            self.spoken -= spoken_samples(&t.user);
        }
    }

    /// The caller heard `played_ms` of a reply: the reply is remembered as far as it was heard.
    pub(super) fn played(&mut self, response_id: u32, played_ms: u64) {
        if let Some(t) = self.turns.iter_mut().find(|t| t.response_id == response_id) {
            if t.audio_ms > 0 && played_ms < t.audio_ms {
                let chars: Vec<char> = t.assistant.chars().collect();
                let keep = (chars.len() as u64 * played_ms / t.audio_ms) as usize;
                t.assistant = chars[..keep].iter().collect();
            }
        }
    }

    /// The calls of the latest turn, which a tool result may answer (none once a later turn came).
    pub(super) fn open_calls(&self) -> &[IdentifiedCall] {
        self.turns.last().map_or(&[], |t| &t.calls)
    }

    /// The turns for a request's prompt (a spoken turn's clip is shared, not copied).
    pub(super) fn turns(&self) -> Vec<Turn> {
        self.turns
            .iter()
            .map(|t| Turn {
                user: t.user.clone(),
                assistant: t.assistant.clone(),
                calls: t.calls.iter().map(|(_, c)| c.clone()).collect(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use antiphon_engine::SpokenClip;

    fn spoken(seconds: usize) -> UserInput {
        UserInput::Audio(SpokenClip::new(vec![0.1; 16_000 * seconds]).unwrap())
    }

    #[test]
    fn spoken_turns_are_kept_as_audio_until_the_bound() {
        // a context of 100 positions: 10 s of speech
        let mut h = History::new(100);
        h.push(1, UserInput::Text("hello".into()), "hi".into(), vec![], 500);
        h.push(2, spoken(4), "a".into(), vec![], 500);
        h.push(3, spoken(4), "b".into(), vec![], 500);
        let t = h.turns();
        assert_eq!(t.len(), 3);
        assert!(matches!(&t[1].user, UserInput::Audio(c) if c.samples().len() == 64_000));
        // 12 s: the oldest turns go until what is left is within 10 s
        h.push(4, spoken(4), "c".into(), vec![], 500);
        let t = h.turns();
        assert_eq!(t.iter().map(|t| t.assistant.as_str()).collect::<Vec<_>>(), ["b", "c"]);
        assert_eq!(h.spoken, 128_000);
    }

    #[test]
    fn a_reply_is_remembered_as_far_as_it_was_heard() {
        let mut h = History::new(100);
        h.push(7, UserInput::Text("q".into()), "abcdefghij".into(), vec![], 1000);
        h.played(7, 300);
        h.played(8, 0);
        assert_eq!(h.turns()[0].assistant, "abc");
    }

    #[test]
    fn turns_the_engine_left_out_go() {
        let mut h = History::new(100);
        h.push(1, spoken(2), "a".into(), vec![], 500);
        h.push(2, UserInput::Text("b".into()), "b".into(), vec![], 500);
        h.push(3, spoken(1), "c".into(), vec![], 500);
        h.drop_oldest(2);
        assert_eq!(h.turns().iter().map(|t| t.assistant.as_str()).collect::<Vec<_>>(), ["c"]);
        assert_eq!(h.spoken, 16_000);
        h.drop_oldest(5);
        assert!(h.turns().is_empty() && h.spoken == 0);
    }
}
