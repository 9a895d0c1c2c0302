//! The Thinker's tokenizer (`tokenizer.json`, Qwen byte-level BPE via the `tokenizers` crate),
//! the special tokens the pipeline needs (looked up by name, never hard-coded), the chat template
//! of a spoken reply, the hand-off slice to the Talker, and incremental detokenization for text
//! deltas.
//!
//! Prompts are assembled piece by piece: special tokens go in by id, text is encoded with special
//! token parsing off, so a user who types `<|im_end|>` gets those characters, not the token.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Result};

use crate::tools::ToolTokens;

/// Ids of the special tokens the pipeline uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialTokens {
    pub endoftext: u32,
    pub im_start: u32,
    pub im_end: u32,
    pub think: u32,
    pub think_end: u32,
    pub audio_start: u32,
    pub audio_end: u32,
    /// The multimodal placeholder `<unk>`.
    pub unk: u32,
    pub unit: u32,
    pub unit_end: u32,
    pub tts_bos: u32,
    pub tts_eos: u32,
    pub listen: u32,
    pub speak: u32,
    pub turn_eos: u32,
    pub chunk_eos: u32,
    pub chunk_tts_eos: u32,
    pub tts_pad: u32,
}

impl SpecialTokens {
    /// Every token by its text, in one place (the generator of synthetic tokenizers uses it too).
    pub const NAMES: [&'static str; 18] = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<|audio_start|>",
        "<|audio_end|>",
        "<unk>",
        "<unit>",
        "</unit>",
        "<|tts_bos|>",
        "<|tts_eos|>",
        "<|listen|>",
        "<|speak|>",
        "<|turn_eos|>",
        "<|chunk_eos|>",
        "<|chunk_tts_eos|>",
        "<|tts_pad|>",
    ];

    /// Looks every token up; names all the missing ones if any is.
    pub fn lookup(find: impl Fn(&str) -> Option<u32>) -> Result<Self> {
        let mut ids = [0u32; 18];
        let mut missing = Vec::new();
        for (slot, name) in ids.iter_mut().zip(Self::NAMES) {
            match find(name) {
                Some(id) => *slot = id,
                None => missing.push(name),
            }
        }
        if !missing.is_empty() {
            return Err(anyhow!("tokenizer lacks special token(s) {}", missing.join(", ")));
        }
        let [
            // in the order of `NAMES`
            endoftext, im_start, im_end, think, think_end, audio_start, audio_end, unk, unit,
            unit_end, tts_bos, tts_eos, listen, speak, turn_eos, chunk_eos, chunk_tts_eos, tts_pad,
        ] = ids;
        Ok(Self {
            endoftext,
            im_start,
            im_end,
            think,
            think_end,
            audio_start,
            audio_end,
            unk,
            unit,
            unit_end,
            tts_bos,
            tts_eos,
            listen,
            speak,
            turn_eos,
            chunk_eos,
            chunk_tts_eos,
            tts_pad,
        })
    }

    pub fn audio_markers(&self) -> crate::thinker::AudioMarkers {
        crate::thinker::AudioMarkers {
            start: self.audio_start,
            end: self.audio_end,
            placeholder: self.unk,
        }
    }

    /// Every special id (none of them is text).
    pub fn all(&self) -> [u32; 18] {
        [
            self.endoftext,
            self.im_start,
            self.im_end,
            self.think,
            self.think_end,
            self.audio_start,
            self.audio_end,
            self.unk,
            self.unit,
            self.unit_end,
            self.tts_bos,
            self.tts_eos,
            self.listen,
            self.speak,
            self.turn_eos,
            self.chunk_eos,
            self.chunk_tts_eos,
            self.tts_pad,
        ]
    }

    /// The tokens the Thinker may not write, per context, built once.
    pub fn forbidden(&self) -> Forbidden {
        // markup that never appears inside written text
        let never = [
            self.tts_pad,
            self.tts_bos,
            self.unit,
            self.unit_end,
            self.audio_start,
            self.audio_end,
            self.im_start,
            self.think,
            self.think_end,
            self.unk,
        ];
        let with = |extra: &[u32]| never.iter().chain(extra).copied().collect::<Vec<u32>>();
        let speech = with(&[self.listen, self.speak, self.tts_eos, self.endoftext]);
        let mut speech_forced = speech.clone();
        speech_forced.extend([self.turn_eos, self.chunk_tts_eos, self.im_end]);
        let reply =
            with(&[self.listen, self.speak, self.chunk_eos, self.chunk_tts_eos, self.turn_eos]);
        Forbidden {
            reply_calling: reply.clone(),
            reply,
            duplex_decision: with(&[
                self.tts_eos,
                self.im_end,
                self.endoftext,
                self.chunk_eos,
                self.chunk_tts_eos,
                self.turn_eos,
            ]),
            duplex_speech: speech,
            duplex_speech_forced: speech_forced,
        }
    }

    /// Tokens that end the text handed to the Talker.
    pub fn handoff_boundaries(&self) -> [u32; 8] {
        [
            self.tts_eos,
            self.tts_pad,
            self.listen,
            self.chunk_eos,
            self.chunk_tts_eos,
            self.unit,
            self.unit_end,
            self.im_end,
        ]
    }
}

/// The special tokens the Thinker's sampler may not pick, for each thing it writes (synthetic
/// weights would otherwise emit them; real weights do not want them there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forbidden {
    /// A turn-mode spoken reply (it ends with `<|tts_eos|>` or `<|im_end|>`).
    pub reply: Vec<u32>,
    /// ... that may call a tool (`<tool_call>`, `</tool_call>` allowed).
    pub reply_calling: Vec<u32>,
    /// A duplex unit's first token: the listen / speak decision (or the first word).
    pub duplex_decision: Vec<u32>,
    /// The text of a spoken duplex unit, which ends with a chunk or turn end.
    pub duplex_speech: Vec<u32>,
    /// ... under `speak_every`, where the schedule, not the model, ends turns.
    pub duplex_speech_forced: Vec<u32>,
}

/// Who speaks a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// A piece of message content: text, or an audio clip given as its number of embeddings.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Text(String),
    Audio(usize),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: Role,
    pub parts: Vec<Part>,
}

impl Message {
    pub fn text(role: Role, text: impl Into<String>) -> Self {
        Self { role, parts: vec![Part::Text(text.into())] }
    }
}

/// The system prompt of voice cloning (`get_sys_prompt(mode="audio_assistant")`), the reference
/// clip given as its number of audio embeddings.
pub fn voice_clone_system(ref_audio_embeds: usize) -> Message {
    Message {
        role: Role::System,
        parts: vec![
            Part::Text("Use the voice in the audio prompt to synthesize new content.\n".into()),
            Part::Audio(ref_audio_embeds),
            Part::Text("\nYou are a helpful assistant with the above voice style.".into()),
        ],
    }
}

enum Piece {
    Special(u32),
    Text(String),
}

/// The tokenizer with the pipeline's special tokens resolved.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialTokens,
    /// The tool template's tags, when the tokenizer has them.
    tools: Option<ToolTokens>,
    /// Shared by every clone (the engine's and its Thinker's).
    memo: Arc<Mutex<EncodeMemo>>,
}

/// Texts longer than this are tokenized every time (a one-off input, not a conversation's turn).
const MEMO_TEXT_MAX: usize = 16 << 10;
/// What the memo holds at most, texts and ids together; beyond it, it starts over.
const MEMO_BYTES: usize = 8 << 20;
/// What an entry costs beside its text and ids (the key's and the slice's headers, the table slot).
const MEMO_ENTRY_BYTES: usize = 96;

/// Encodings of texts seen before. A conversation's prompt is built again every turn from the same
/// messages, and each message would be tokenized again: a cost that grows with the square of the
/// call's length, on the Thinker's thread.
#[derive(Default)]
struct EncodeMemo {
    ids: HashMap<String, Arc<[u32]>>,
    bytes: usize,
}

impl EncodeMemo {
    fn get(&self, text: &str) -> Option<Vec<u32>> {
        self.ids.get(text).map(|v| v.to_vec())
    }

    fn put(&mut self, text: &str, ids: &[u32]) {
        if self.ids.contains_key(text) {
            return;
        }
        // (the text, its ids, and the entry's own keep: the key, the shared slice, its slot)
        let size = text.len() + 4 * ids.len() + MEMO_ENTRY_BYTES;
        if self.bytes + size > MEMO_BYTES {
            self.ids = HashMap::new();
            self.bytes = 0;
        }
        self.ids.insert(text.to_string(), ids.into());
        self.bytes += size;
    }
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer").field("special", &self.special).finish_non_exhaustive()
    }
}

impl TextTokenizer {
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let mut inner =
            tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| anyhow!("tokenizer.json: {e}"))?;
        let special = SpecialTokens::lookup(|t| inner.token_to_id(t))?;
        let tools = ToolTokens::lookup(|t| inner.token_to_id(t));
        inner.set_encode_special_tokens(true);
        Ok(Self { inner, special, tools, memo: Arc::default() })
    }

    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }

    /// The tool template's tags (`None`: this tokenizer serves no tools).
    pub fn tool_tokens(&self) -> Option<&ToolTokens> {
        self.tools.as_ref()
    }

    /// The tokens the Thinker may not write, per context: [`SpecialTokens::forbidden`], and the
    /// tool tags everywhere except a call's two in a reply that may call.
    pub fn forbidden(&self) -> Forbidden {
        let mut f = self.special.forbidden();
        if let Some(t) = &self.tools {
            for list in [
                &mut f.reply,
                &mut f.duplex_decision,
                &mut f.duplex_speech,
                &mut f.duplex_speech_forced,
            ] {
                list.extend(t.all());
            }
            f.reply_calling.extend([t.response, t.response_end]);
        }
        f
    }

    /// Plain text to ids; special-token text is not recognized. Texts of up to 16 KiB are kept
    /// with their ids (8 MiB at most, then the memo starts over) and not tokenized again.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let memo = text.len() <= MEMO_TEXT_MAX;
        if memo {
            if let Some(ids) = self.memo.lock().expect("memo").get(text) {
                return Ok(ids);
            }
        }
        let ids = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenize: {e}"))?
            .get_ids()
            .to_vec();
        if memo {
            self.memo.lock().expect("memo").put(text, &ids);
        }
        Ok(ids)
    }

    /// Texts the encode memo holds now, and their bytes with their ids.
    pub fn memo_size(&self) -> (usize, usize) {
        let m = self.memo.lock().expect("memo");
        (m.ids.len(), m.bytes)
    }

    /// Ids to text, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| anyhow!("detokenize: {e}"))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn render(&self, pieces: Vec<Piece>) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut text = String::new();
        for p in pieces {
            match p {
                Piece::Text(t) => text.push_str(&t),
                Piece::Special(id) => {
                    if !text.is_empty() {
                        ids.extend(self.encode(&text)?);
                        text.clear();
                    }
                    ids.push(id);
                }
            }
        }
        if !text.is_empty() {
            ids.extend(self.encode(&text)?);
        }
        Ok(ids)
    }

    fn message_pieces(&self, m: &Message, out: &mut Vec<Piece>) {
        let s = &self.special;
        out.push(Piece::Special(s.im_start));
        out.push(Piece::Text(format!("{}\n", m.role.as_str())));
        for part in &m.parts {
            match part {
                Part::Text(t) => out.push(Piece::Text(t.clone())),
                Part::Audio(n) => {
                    out.push(Piece::Special(s.audio_start));
                    out.extend(std::iter::repeat_n(s.unk, *n).map(Piece::Special));
                    out.push(Piece::Special(s.audio_end));
                }
            }
        }
        out.push(Piece::Special(s.im_end));
        out.push(Piece::Text("\n".into()));
    }

    /// The chat template with the generation prompt of a spoken reply: every message as
    /// `<|im_start|>{role}\n{content}<|im_end|>\n` (content parts joined with nothing, audio as
    /// `<|audio_start|><unk>…<|audio_end|>`), then
    /// `<|im_start|>assistant\n<think>\n\n</think>\n\n<|tts_bos|>`.
    pub fn spoken_reply_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        self.reply_prompt(messages, true)
    }

    /// The chat template with the generation prompt of a written reply (the authors' text mode,
    /// as their ASR task prompts it): as [`TextTokenizer::spoken_reply_prompt`] without
    /// `<|tts_bos|>`.
    pub fn written_reply_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        self.reply_prompt(messages, false)
    }

    fn reply_prompt(&self, messages: &[Message], spoken: bool) -> Result<Vec<u32>> {
        let s = &self.special;
        let mut pieces = Vec::new();
        for m in messages {
            self.message_pieces(m, &mut pieces);
        }
        pieces.push(Piece::Special(s.im_start));
        pieces.push(Piece::Text("assistant\n".into()));
        pieces.push(Piece::Special(s.think));
        pieces.push(Piece::Text("\n\n".into()));
        pieces.push(Piece::Special(s.think_end));
        pieces.push(Piece::Text("\n\n".into()));
        if spoken {
            pieces.push(Piece::Special(s.tts_bos));
        }
        self.render(pieces)
    }

    /// Ids of a sequence of pieces given as text and special ids (duplex units and the like).
    pub fn render_parts(&self, parts: &[Result<&str, u32>]) -> Result<Vec<u32>> {
        self.render(
            parts
                .iter()
                .map(|p| match p {
                    Ok(t) => Piece::Text((*t).to_string()),
                    Err(id) => Piece::Special(*id),
                })
                .collect(),
        )
    }
}

/// The rows handed to the Talker: after the last `<|tts_bos|>` up to (excluding) the first
/// boundary token; without a `<|tts_bos|>`, the whole generated span from `prompt_len`.
pub fn handoff_range(
    ids: &[u32],
    prompt_len: usize,
    special: &SpecialTokens,
) -> std::ops::Range<usize> {
    let start = match ids.iter().rposition(|&t| t == special.tts_bos) {
        Some(i) => i + 1,
        None => prompt_len.min(ids.len()),
    };
    let bounds = special.handoff_boundaries();
    let end = ids[start..].iter().position(|t| bounds.contains(t)).map_or(ids.len(), |p| start + p);
    start..end
}

/// Incremental detokenization: feed ids one by one, get the new text once it is whole UTF-8.
#[derive(Debug, Default, Clone)]
pub struct TextStream {
    ids: Vec<u32>,
    emitted: usize,
}

impl TextStream {
    pub fn new() -> Self {
        Self::default()
    }

    /// The text `id` completes, if any (empty while a multi-byte character is still partial).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = tok.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let Some(delta) = text.get(self.emitted..).map(str::to_string) else {
            return Ok(String::new());
        };
        self.emitted = text.len();
        Ok(delta)
    }
}
