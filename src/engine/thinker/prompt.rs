//! A turn's prompt: the voice-cloning system turn (with the session's tools), the conversation's
//! turns as they were (a spoken turn as its audio, a reply with its calls, tools' outputs as their
//! user turn), and the input, laid out before anything is encoded; the ids the prefix store knows
//! it by; and the tokens a reply is made to begin with.

use std::collections::VecDeque;

use anyhow::Result;
use candle_core::Tensor;

use super::Ctx;
use crate::{RequestSpec, SpokenClip, Task, ToolChoice, Turn, UserInput};
use antiphon_models::thinker::audio_spans;
use antiphon_models::tokenizer::{Message, Part, Role};
use antiphon_models::tools::{assistant_content, call_opening, responses_content};

/// An audio run of a prompt: the reference voice (its embeddings, kept per voice) or a clip the
/// caller spoke (encoded only when its positions are not held already).
enum PromptAudio {
    Voice(Tensor),
    Clip(SpokenClip),
}

/// A request's prompt laid out, before anything of it is encoded.
pub(super) struct Prompt {
    pub(super) ids: Vec<u32>,
    /// The ids the prefix store knows the prompt by: `ids` with each spoken clip's placeholders
    /// replaced by ids made from the clip's content ([`clip_key_id`]), so a stored prefix holds
    /// a clip's KV only for that same clip (the voice's run is keyed by the entry's voice).
    pub(super) key: Vec<u32>,
    /// The audio runs, in the order of their placeholder runs in `ids`.
    audio: Vec<PromptAudio>,
    /// The conversation's oldest turns left out (it outgrew the context).
    pub(super) dropped: usize,
}

/// The prefix-store id of position `at` of a clip with content key `clip`: above every vocabulary
/// id (they are below 2^31), so it matches only the same position of the same clip.
fn clip_key_id(clip: u64, at: usize) -> u32 {
    let mut x = clip ^ (at as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    0x8000_0000 | ((x ^ (x >> 31)) >> 33) as u32
}

/// Token counts of each earlier turn (what the caller said, what the assistant said, and the
/// template around them), each counted once.
fn turn_sizes(ctx: &Ctx, history: &[Turn]) -> Vec<usize> {
    history
        .iter()
        .map(|t| {
            input_size(ctx, &t.user)
                + count_tokens(ctx, &assistant_content(&t.assistant, &t.calls))
                + 10
        })
        .collect()
}

fn count_tokens(ctx: &Ctx, text: &str) -> usize {
    ctx.tok.encode(text).map(|v| v.len()).unwrap_or(0)
}

/// Positions a user's input takes in a prompt, its message's markers aside.
fn input_size(ctx: &Ctx, input: &UserInput) -> usize {
    match input {
        UserInput::Text(text) => count_tokens(ctx, text),
        UserInput::Audio(clip) => ctx.thinker.clip_embeddings_for(clip.samples().len()) + 2,
        UserInput::ToolResults(outputs) => count_tokens(ctx, &responses_content(outputs)),
    }
}

/// The user message of an input: its text, or its clip as an audio run.
fn user_message(ctx: &Ctx, input: &UserInput, audio: &mut Vec<PromptAudio>) -> Message {
    match input {
        UserInput::Text(t) => Message::text(Role::User, t.clone()),
        UserInput::ToolResults(outputs) => Message::text(Role::User, responses_content(outputs)),
        UserInput::Audio(clip) => {
            audio.push(PromptAudio::Clip(clip.clone()));
            Message {
                role: Role::User,
                parts: vec![Part::Audio(ctx.thinker.clip_embeddings_for(clip.samples().len()))],
            }
        }
    }
}

/// What the authors' ASR task asks the model before the audio (MiniCPM-o's cookbook).
const TRANSCRIBE_PROMPT: &str =
    "Please listen to the audio snippet carefully and transcribe the content.\n";

/// A request's prompt: for a reply, the voice-cloning system turn, the conversation's turns as
/// they were (a spoken turn as its audio), and the input; for a transcript, the input alone
/// after the ASR task's words, in the written-reply template.
pub(super) fn build_prompt(ctx: &mut Ctx, spec: &RequestSpec) -> Result<Prompt> {
    if spec.task == Task::Transcribe {
        let mut audio = Vec::new();
        let mut user = user_message(ctx, &spec.input, &mut audio);
        if audio.is_empty() {
            anyhow::bail!("a transcript is of spoken input");
        }
        user.parts.insert(0, Part::Text(TRANSCRIBE_PROMPT.into()));
        let ids = ctx.tok.written_reply_prompt(&[user])?;
        return keyed(ctx, ids, audio, 0);
    }
    let mut audio = Vec::new();
    let mut messages = Vec::new();
    let mut instructions =
        spec.instructions.clone().unwrap_or_else(|| crate::DEFAULT_INSTRUCTIONS.into());
    if let Some(tools) = &spec.tools.set {
        instructions.push_str(tools.block());
    }
    let mut voice_rows = 0;
    if ctx.cfg.thinker.hears_reference {
        let emb = ctx.reference_embeddings(&spec.voice)?;
        voice_rows = emb.dim(0)?;
        messages.push(Message {
            role: Role::System,
            parts: vec![
                Part::Text("Use the voice in the audio prompt to synthesize new content.\n".into()),
                Part::Audio(emb.dim(0)?),
                Part::Text(format!("\n{instructions}")),
            ],
        });
        audio.push(PromptAudio::Voice(emb));
    } else {
        messages.push(Message::text(Role::System, instructions.clone()));
    }
    // the oldest turns give way when the conversation outgrows the context (fit.rs: at most half
    // of what the reply leaves, in steps of half that, so that the next prompts reuse this one's)
    let budget = crate::fit::prompt_budget(
        ctx.context(),
        spec.generation.max_text_tokens.unwrap_or(ctx.cfg.default_max_text_tokens),
    );
    let fixed = count_tokens(ctx, &instructions)
        + voice_rows
        + crate::SYSTEM_TURN_TOKENS
        + input_size(ctx, &spec.input);
    let room = crate::fit::history_room(budget, fixed);
    let first = crate::fit::oldest_turns_left_out(&turn_sizes(ctx, &spec.history), room);
    for t in &spec.history[first..] {
        messages.push(user_message(ctx, &t.user, &mut audio));
        messages.push(Message::text(Role::Assistant, assistant_content(&t.assistant, &t.calls)));
    }
    messages.push(user_message(ctx, &spec.input, &mut audio));
    let ids = ctx.tok.spoken_reply_prompt(&messages)?;
    keyed(ctx, ids, audio, first)
}

/// A prompt's ids with the key the prefix store knows it by.
fn keyed(ctx: &Ctx, ids: Vec<u32>, audio: Vec<PromptAudio>, dropped: usize) -> Result<Prompt> {
    let mut key = ids.clone();
    let spans = audio_spans(&ids, &ctx.tok.special().audio_markers())?;
    if spans.len() != audio.len() {
        anyhow::bail!("the prompt has {} audio runs for {} audio inputs", spans.len(), audio.len());
    }
    for ((s, n), a) in spans.into_iter().zip(&audio) {
        if let PromptAudio::Clip(clip) = a {
            for (at, k) in key[s..s + n].iter_mut().enumerate() {
                *k = clip_key_id(clip.content_key(), at);
            }
        }
    }
    Ok(Prompt { ids, key, audio, dropped })
}

/// The tokens a reply begins with: the client's `generation.prefix`, then, when `tool_choice`
/// requires a call, the call's opening (on a line of its own after a prefix).
pub(super) fn reply_opening(ctx: &Ctx, spec: &RequestSpec) -> Result<VecDeque<u32>> {
    let prefix = spec.generation.prefix.as_deref().unwrap_or("");
    let opening = match (&spec.tools.set, &spec.tools.choice) {
        (Some(_), ToolChoice::Required) => Some(call_opening(None)),
        (Some(_), ToolChoice::Function(f)) => Some(call_opening(Some(f))),
        _ => None,
    };
    if opening.is_some() && ctx.tok.tool_tokens().is_none() {
        anyhow::bail!("field `tool_choice`: this model's tokenizer has no tool tokens");
    }
    let mut ids = ctx.tok.encode(prefix)?;
    if let Some(o) = opening {
        let sep = if prefix.is_empty() || prefix.ends_with('\n') { "" } else { "\n" };
        ids.extend(ctx.tok.encode(&format!("{sep}{o}"))?);
    }
    Ok(ids.into())
}

/// The prompt's embeddings from `from` on: only the clips that reach past it are encoded.
pub(super) fn embed_prompt(ctx: &Ctx, prompt: &Prompt, from: usize) -> Result<Tensor> {
    let markers = ctx.tok.special().audio_markers();
    let mut audio = |k: usize| match &prompt.audio[k] {
        PromptAudio::Voice(emb) => Ok(emb.clone()),
        PromptAudio::Clip(clip) => ctx.thinker.encode_clip(clip.samples()),
    };
    Ok(ctx.thinker.embed_with_audio_from(&prompt.ids, &markers, from, &mut audio)?)
}
