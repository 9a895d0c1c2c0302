//! What the stages send each other: each stage's thread owns its state and takes these from a
//! bounded channel between its steps (`run_stage` in lib.rs).

use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};

use anyhow::Result;
use candle_core::Tensor;

use crate::{gate, voices, DuplexSink, DuplexSpec, Mode, RefInput, RequestId, RequestSpec};

/// Messages to the Thinker.
pub enum ThinkerMsg {
    Admit(RequestSpec),
    Cancel(RequestId),
    DuplexOpen(DuplexSpec, DuplexSink),
    DuplexUnit {
        session: String,
        samples: Vec<f32>,
        arrived: std::time::Instant,
    },
    DuplexClose(String),
    /// A place was freed (admission): queued requests may start.
    Wake,
}

/// What the Thinker hands the Talker.
pub enum TalkerMsg {
    /// Start of a request (the Talker's parameters).
    Begin {
        id: RequestId,
        mode: Mode,
        voice: RefInput,
        min_codes: usize,
        max_codes: usize,
        /// The reply's text length when the request forces it (`min_text_tokens` =
        /// `max_text_tokens`): with text chunks, forced codes are spread over the chunks by it.
        text_tokens: Option<usize>,
        /// Turn mode: the reply comes in text chunks of this many tokens (`TextChunk`); 0: the
        /// whole reply (`Rows`, then `End`). The Thinker decides it for the reply
        /// (`talker.text_chunk_streams`).
        text_chunk: usize,
        seed: u64,
    },
    /// Thinker tokens after `<|tts_bos|>` and their last-layer hidden rows `[n, llm_dim]`.
    Rows {
        id: RequestId,
        ids: Vec<u32>,
        hidden: Tensor,
    },
    /// The text is complete: prefill the text end / audio start and decode.
    End {
        id: RequestId,
    },
    /// Turn mode with `talker.text_chunk`: the next chunk of the reply's text (its tokens and their
    /// hidden rows, `[n, llm_dim]`); `last` when the text ends with it.
    TextChunk {
        id: RequestId,
        ids: Vec<u32>,
        hidden: Tensor,
        last: bool,
        /// A reply's first chunk from a lightly loaded Thinker: the gate, held from the send until
        /// the Talker's next step has taken its own hold, so that the Thinker launches nothing
        /// while the Talker builds the condition and prefills (`gate.rs`).
        hold: Option<gate::Held>,
    },
    /// Duplex: one spoken unit's text (`hidden`: its rows, `None` when there is no text, as when a
    /// listening unit closes the turn). The Talker makes one unit of codes for it, or drains the
    /// turn when `turn_end`.
    Segment {
        id: RequestId,
        ids: Vec<u32>,
        hidden: Option<Tensor>,
        turn_end: bool,
    },
    Cancel(RequestId),
    /// From Code2Wav, after a step that delivered audio (or ended streams): a stream the Talker
    /// holds back until its audio is delivered (`talker.lead_chunks`) may go on. The Talker waits
    /// for this, not for a timer; one lost because the inbox is full is not needed (the Talker
    /// steps again after the messages it holds).
    Delivered,
}

/// What reaches Code2Wav.
pub enum Code2WavMsg {
    /// At admission: the request exists; `prefetch` carries its reference when it may be prefetched
    /// (never for duplex).
    Placeholder {
        id: RequestId,
        prefetch: Option<RefInput>,
    },
    /// Codes for Code2Wav; chunk 0 carries the reference to use.
    Chunk {
        id: RequestId,
        seq: usize,
        codes: Vec<u32>,
        last: bool,
        reference: Option<RefInput>,
    },
    Cancel(RequestId),
    /// Prepare a voice now (when no chunk is due) and keep its features while it is registered.
    Prepare {
        voice: RefInput,
        reply: SyncSender<Result<voices::PreparedVoice, voices::PrepareRefused>>,
    },
    /// Keep features prepared earlier (saved by a previous run) for the voice they name.
    Install(voices::PreparedVoice),
    /// A voice is no longer registered: its kept features go (by reference key).
    Forget(String),
    /// A duplex session is live: while any is, no prefetch runs (the busy gate).
    DuplexOpen(String),
    DuplexClose(String),
}

/// The Talker's inbox as Code2Wav holds it, to say that audio went out (`TalkerMsg::Delivered`).
/// The engine takes the sender back when it stops: the Talker holds Code2Wav's inbox open, so
/// with Code2Wav holding the Talker's neither stage would ever see its inbox close.
#[derive(Clone, Default)]
pub struct TalkerWake(Arc<Mutex<Option<SyncSender<TalkerMsg>>>>);

impl TalkerWake {
    pub fn new(to_talker: SyncSender<TalkerMsg>) -> Self {
        Self(Arc::new(Mutex::new(Some(to_talker))))
    }

    /// Tells the Talker, without waiting: a full inbox already wakes it, a closed one is an
    /// engine stopping.
    pub fn delivered(&self) {
        if let Some(t) = self.0.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = t.try_send(TalkerMsg::Delivered);
        }
    }

    /// Lets the sender go (the engine stopping).
    pub fn close(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}
