//! The OpenAI Realtime dialect (docs/openai-realtime.md): its client events parsed into typed
//! values, accepting both API generations' shapes (GA: `session.type = "realtime"`,
//! `audio.input.format`; beta: the flat session with `input_audio_format`, `modalities`), and its
//! server events ([`server`]), always with the current (GA) names. Audio arrives as base64 PCM16
//! inside JSON; it is decoded here, so what leaves this module is bytes.

use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Map, Value};

mod fields;
pub mod server;
mod words;

pub use fields::decode_audio;
use fields::{
    bad, format, id_field, max_tokens, modalities, object, opt_string, required, string,
    temperature, tool_choice, tools, transcription, turn_detection, voice,
};
pub use words::{CancelReason, ItemStatus, OaiErrorCode, ResponseStatus};

/// A refused client event: OpenAI's error `code`, a message, the field at fault.
#[derive(Debug, Clone, PartialEq)]
pub struct OaiError {
    pub code: OaiErrorCode,
    pub message: String,
    pub param: Option<String>,
}

impl OaiError {
    pub fn new(code: OaiErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into(), param: None }
    }
    pub fn param(code: OaiErrorCode, param: &str, message: impl Into<String>) -> Self {
        Self { code, message: message.into(), param: Some(param.to_string()) }
    }
}

/// The audio formats of the dialect: PCM16 at 24 kHz, G.711 μ-law and A-law at 8 kHz.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AudioFormat {
    Pcm24k,
    Pcmu,
    Pcma,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Modality {
    Audio,
    Text,
}

/// `turn_detection`: server VAD, or `semantic_vad` (the server's turn model decides at each pause,
/// its eagerness sets the longest wait; without a turn model, the silence detector serves it).
#[derive(Debug, Clone, PartialEq)]
pub struct TurnDetection {
    pub semantic: bool,
    pub threshold: f32,
    pub prefix_padding_ms: u32,
    pub silence_duration_ms: u32,
    pub create_response: bool,
    pub interrupt_response: bool,
    pub eagerness: Option<String>,
}

impl Default for TurnDetection {
    fn default() -> Self {
        Self {
            semantic: false,
            threshold: 0.5,
            prefix_padding_ms: 300,
            silence_duration_ms: 500,
            create_response: true,
            interrupt_response: true,
            eagerness: None,
        }
    }
}

/// `max_output_tokens`: a count or `"inf"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxTokens {
    Inf,
    N(u64),
}

/// What a `session.update` changes (every field optional: only those present change).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SessionPatch {
    pub instructions: Option<String>,
    pub output_modalities: Option<Modality>,
    pub input_format: Option<AudioFormat>,
    pub output_format: Option<AudioFormat>,
    /// `Some(None)`: turn detection off.
    pub turn_detection: Option<Option<TurnDetection>>,
    pub voice: Option<String>,
    pub max_output_tokens: Option<MaxTokens>,
    pub temperature: Option<f32>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// `audio.input.transcription` (beta: `input_audio_transcription`): `Some(None)` turns
    /// transcripts off.
    pub transcription: Option<Option<Value>>,
}

/// One content part of an item.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// `input_text` (a user's or system's text).
    InputText(String),
    /// `input_audio`: the audio bytes in the session's input format.
    InputAudio { audio: Vec<u8>, transcript: Option<String> },
    /// `output_text` (GA) or `text` (beta): an assistant's text.
    Text(String),
    /// `output_audio` (GA) or `audio` (beta): an assistant's audio, by its transcript.
    Audio { transcript: Option<String> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    User,
    Assistant,
    System,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::System => "system",
        }
    }
}

/// A conversation item as a client sends it.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    Message {
        id: Option<String>,
        role: Role,
        content: Vec<Part>,
        /// `status: "incomplete"`: an assistant message the next response continues (an antiphon
        /// extension: the reply's given beginning).
        incomplete: bool,
    },
    FunctionCall {
        id: Option<String>,
        call_id: Option<String>,
        name: String,
        arguments: String,
    },
    FunctionCallOutput {
        id: Option<String>,
        call_id: String,
        output: String,
    },
    /// `item_reference` (only in `response.input`): an item already in the conversation.
    Reference {
        id: String,
    },
}

impl Item {
    pub fn id(&self) -> Option<&str> {
        match self {
            Item::Message { id, .. }
            | Item::FunctionCall { id, .. }
            | Item::FunctionCallOutput { id, .. } => id.as_deref(),
            Item::Reference { id } => Some(id),
        }
    }
}

/// `response.create`'s overrides.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResponseParams {
    pub instructions: Option<String>,
    pub output_modalities: Option<Modality>,
    pub voice: Option<String>,
    pub output_format: Option<AudioFormat>,
    pub max_output_tokens: Option<MaxTokens>,
    pub temperature: Option<f32>,
    /// Echoed in the response object (string → string).
    pub metadata: Option<Map<String, Value>>,
    /// `conversation: "none"`: an out-of-band response.
    pub out_of_band: bool,
    /// `input`: the items this response answers instead of the conversation's new ones.
    pub input: Option<Vec<Item>>,
    /// Which tools this response may call (overrides the session's).
    pub tool_choice: Option<Value>,
}

/// A client event of the dialect.
#[derive(Debug, Clone, PartialEq)]
pub enum OaiClientEvent {
    SessionUpdate(Box<SessionPatch>),
    /// `input_audio_buffer.append`: the decoded bytes.
    Append(Vec<u8>),
    Commit,
    Clear,
    ItemCreate {
        previous_item_id: Option<String>,
        item: Item,
    },
    ItemTruncate {
        item_id: String,
        content_index: u32,
        audio_end_ms: u64,
    },
    ItemDelete {
        item_id: String,
    },
    ItemRetrieve {
        item_id: String,
    },
    ResponseCreate(Box<ResponseParams>),
    ResponseCancel {
        response_id: Option<String>,
    },
    /// `output_audio_buffer.clear` (WebRTC/SIP in OpenAI's API; here: cancels the playing
    /// response).
    OutputAudioClear,
}

/// A parsed client event with the client's `event_id` (echoed in errors).
#[derive(Debug, Clone, PartialEq)]
pub struct OaiIncoming {
    pub event_id: Option<String>,
    pub event: OaiClientEvent,
}

/// The longest `event_id` or item id accepted (OpenAI's ids are at most 32 characters).
pub const MAX_ID_CHARS: usize = 64;
/// The most tools a session or response may declare (they are stored and echoed, never called).
pub const MAX_TOOLS: usize = 128;

/// The session object of `session.update`, GA or beta shape (both may be mixed).
pub fn session_patch(v: &Value) -> Result<SessionPatch, OaiError> {
    let o = object(v, "session")?;
    match o.get("type").and_then(Value::as_str) {
        None | Some("realtime") => {}
        Some(t) => {
            return Err(bad(
                "session.type",
                format!("session type `{t}`: this server runs realtime sessions only"),
            ))
        }
    }
    let mut p = SessionPatch::default();
    let get = |k: &str| o.get(k).filter(|v| !v.is_null());
    if let Some(i) = get("instructions") {
        p.instructions = Some(string(i, "session.instructions")?);
    }
    if let Some(m) = get("output_modalities").or_else(|| get("modalities")) {
        p.output_modalities = Some(modalities(m, "session.output_modalities")?);
    }
    if let Some(f) = get("input_audio_format") {
        p.input_format = Some(format(f, "session.input_audio_format")?);
    }
    if let Some(f) = get("output_audio_format") {
        p.output_format = Some(format(f, "session.output_audio_format")?);
    }
    if o.contains_key("turn_detection") {
        p.turn_detection = Some(turn_detection(&o["turn_detection"], "session.turn_detection")?);
    }
    if let Some(v) = get("voice") {
        p.voice = Some(voice(v, "session.voice")?);
    }
    if let Some(t) = o.get("input_audio_transcription") {
        p.transcription = Some(transcription(t, "session.input_audio_transcription")?);
    }
    if let Some(a) = get("audio") {
        let a = object(a, "session.audio")?;
        if let Some(i) = a.get("input").filter(|v| !v.is_null()) {
            let i = object(i, "session.audio.input")?;
            if let Some(f) = i.get("format").filter(|v| !v.is_null()) {
                p.input_format = Some(format(f, "session.audio.input.format")?);
            }
            if i.contains_key("turn_detection") {
                p.turn_detection = Some(turn_detection(
                    &i["turn_detection"],
                    "session.audio.input.turn_detection",
                )?);
            }
            if let Some(t) = i.get("transcription") {
                p.transcription = Some(transcription(t, "session.audio.input.transcription")?);
            }
        }
        if let Some(out) = a.get("output").filter(|v| !v.is_null()) {
            let out = object(out, "session.audio.output")?;
            if let Some(f) = out.get("format").filter(|v| !v.is_null()) {
                p.output_format = Some(format(f, "session.audio.output.format")?);
            }
            if let Some(v) = out.get("voice").filter(|v| !v.is_null()) {
                p.voice = Some(voice(v, "session.audio.output.voice")?);
            }
        }
    }
    if let Some(m) = get("max_output_tokens").or_else(|| get("max_response_output_tokens")) {
        p.max_output_tokens = Some(max_tokens(m, "session.max_output_tokens")?);
    }
    if let Some(t) = get("temperature") {
        p.temperature = Some(temperature(t, "session.temperature")?);
    }
    if let Some(t) = get("tools") {
        p.tools = Some(tools(t, "session.tools")?);
    }
    p.tool_choice =
        get("tool_choice").map(|t| tool_choice(t, "session.tool_choice")).transpose()?;
    Ok(p)
}

fn part(v: &Value, param: &str) -> Result<Part, OaiError> {
    let o = object(v, param)?;
    let text = |k: &str| {
        required(o, k, &format!("{param}.{k}")).and_then(|t| string(t, &format!("{param}.{k}")))
    };
    let transcript = opt_string(o, "transcript", &format!("{param}.transcript"))?;
    match o.get("type").and_then(Value::as_str).unwrap_or("") {
        "input_text" => Ok(Part::InputText(text("text")?)),
        "input_audio" => Ok(Part::InputAudio {
            audio: decode_audio(
                required(o, "audio", &format!("{param}.audio"))?,
                &format!("{param}.audio"),
            )?,
            transcript,
        }),
        "output_text" | "text" => Ok(Part::Text(text("text")?)),
        "output_audio" | "audio" => Ok(Part::Audio { transcript }),
        other => Err(bad(
            &format!("{param}.type"),
            format!(
                "content part `{other}`: expected \
                input_text, input_audio, output_text or output_audio"
            ),
        )),
    }
}

/// One conversation item (`param` names it in errors).
pub fn item(v: &Value, param: &str) -> Result<Item, OaiError> {
    let o = object(v, param)?;
    let id = match o.get("id").filter(|v| !v.is_null()) {
        Some(i) => Some(id_field(i, &format!("{param}.id"))?),
        None => None,
    };
    let s = |k: &str| {
        required(o, k, &format!("{param}.{k}")).and_then(|t| string(t, &format!("{param}.{k}")))
    };
    let ty = opt_string(o, "type", &format!("{param}.type"))?;
    match ty.as_deref().unwrap_or("message") {
        "message" => {
            let role = match o.get("role").and_then(Value::as_str) {
                Some("user") => Role::User,
                Some("assistant") => Role::Assistant,
                Some("system") => Role::System,
                _ => {
                    return Err(bad(
                        &format!("{param}.role"),
                        "a message's role must be user, assistant or system",
                    ))
                }
            };
            let parts = required(o, "content", &format!("{param}.content"))?
                .as_array()
                .ok_or_else(|| bad(&format!("{param}.content"), "content must be an array"))?;
            let content = parts
                .iter()
                .enumerate()
                .map(|(i, p)| part(p, &format!("{param}.content[{i}]")))
                .collect::<Result<Vec<_>, _>>()?;
            let incomplete = o.get("status").and_then(Value::as_str) == Some("incomplete");
            Ok(Item::Message { id, role, content, incomplete })
        }
        "function_call" => Ok(Item::FunctionCall {
            id,
            call_id: opt_string(o, "call_id", &format!("{param}.call_id"))?,
            name: s("name")?,
            // (a JSON text, as the SDK's types say: an object is refused, not serialized for it)
            arguments: opt_string(o, "arguments", &format!("{param}.arguments"))?
                .unwrap_or_else(|| "{}".to_string()),
        }),
        "function_call_output" => {
            Ok(Item::FunctionCallOutput { id, call_id: s("call_id")?, output: s("output")? })
        }
        "item_reference" => Ok(Item::Reference {
            id: id.ok_or_else(|| {
                OaiError::param(
                    OaiErrorCode::MissingRequiredParameter,
                    &format!("{param}.id"),
                    "an item_reference needs `id`",
                )
            })?,
        }),
        other => Err(bad(
            &format!("{param}.type"),
            format!("item type `{other}`: expected message, function_call or function_call_output"),
        )),
    }
}

fn response_params(v: Option<&Value>) -> Result<ResponseParams, OaiError> {
    let mut r = ResponseParams::default();
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(r) };
    let o = object(v, "response")?;
    let get = |k: &str| o.get(k).filter(|v| !v.is_null());
    if let Some(i) = get("instructions") {
        r.instructions = Some(string(i, "response.instructions")?);
    }
    if let Some(m) = get("output_modalities").or_else(|| get("modalities")) {
        r.output_modalities = Some(modalities(m, "response.output_modalities")?);
    }
    if let Some(v) = get("voice") {
        r.voice = Some(voice(v, "response.voice")?);
    }
    if let Some(f) = get("output_audio_format") {
        r.output_format = Some(format(f, "response.output_audio_format")?);
    }
    if let Some(out) = get("audio")
        .map(|a| object(a, "response.audio"))
        .transpose()?
        .and_then(|a| a.get("output"))
        .filter(|v| !v.is_null())
    {
        let out = object(out, "response.audio.output")?;
        if let Some(f) = out.get("format").filter(|v| !v.is_null()) {
            r.output_format = Some(format(f, "response.audio.output.format")?);
        }
        if let Some(v) = out.get("voice").filter(|v| !v.is_null()) {
            r.voice = Some(voice(v, "response.audio.output.voice")?);
        }
    }
    if let Some(m) = get("max_output_tokens").or_else(|| get("max_response_output_tokens")) {
        r.max_output_tokens = Some(max_tokens(m, "response.max_output_tokens")?);
    }
    if let Some(t) = get("temperature") {
        r.temperature = Some(temperature(t, "response.temperature")?);
    }
    r.tool_choice =
        get("tool_choice").map(|t| tool_choice(t, "response.tool_choice")).transpose()?;
    if let Some(m) = get("metadata") {
        let m = object(m, "response.metadata")?;
        if m.len() > 16
            || m.iter().any(|(k, v)| {
                k.chars().count() > 64 || v.as_str().is_none_or(|s| s.chars().count() > 512)
            })
        {
            return Err(bad(
                "response.metadata",
                "metadata holds at most 16 string pairs (keys up \
                to 64, values up to 512 characters)",
            ));
        }
        r.metadata = Some(m.clone());
    }
    match get("conversation").map(|c| c.as_str()) {
        None | Some(Some("auto")) => {}
        Some(Some("none")) => r.out_of_band = true,
        Some(_) => {
            return Err(bad("response.conversation", "conversation must be \"auto\" or \"none\""))
        }
    }
    if let Some(i) = get("input") {
        let a =
            i.as_array().ok_or_else(|| bad("response.input", "input must be an array of items"))?;
        r.input = Some(
            a.iter()
                .enumerate()
                .map(|(n, it)| item(it, &format!("response.input[{n}]")))
                .collect::<Result<_, _>>()?,
        );
    }
    Ok(r)
}

#[derive(Deserialize)]
struct Truncate {
    item_id: String,
    #[serde(default)]
    content_index: u32,
    audio_end_ms: u64,
}

/// Parses one text frame of the dialect.
pub fn parse_client(text: &str) -> Result<OaiIncoming, (Option<String>, OaiError)> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| (None, OaiError::new(OaiErrorCode::InvalidJson, format!("not JSON: {e}"))))?;
    let Value::Object(o) = &v else {
        return Err((
            None,
            OaiError::new(OaiErrorCode::InvalidJson, "a text frame must hold one JSON object"),
        ));
    };
    let event_id = o
        .get("event_id")
        .and_then(Value::as_str)
        .map(|s| s.chars().take(MAX_ID_CHARS).collect::<String>());
    let fail = |e: OaiError| (event_id.clone(), e);
    let ty = o.get("type").and_then(Value::as_str).ok_or_else(|| {
        fail(OaiError::param(OaiErrorCode::MissingRequiredParameter, "type", "missing `type`"))
    })?;
    let event = match ty {
        "session.update" => OaiClientEvent::SessionUpdate(Box::new(
            session_patch(required(o, "session", "session").map_err(fail)?).map_err(fail)?,
        )),
        "input_audio_buffer.append" => OaiClientEvent::Append(
            decode_audio(required(o, "audio", "audio").map_err(fail)?, "audio").map_err(fail)?,
        ),
        "input_audio_buffer.commit" => OaiClientEvent::Commit,
        "input_audio_buffer.clear" => OaiClientEvent::Clear,
        "conversation.item.create" => OaiClientEvent::ItemCreate {
            previous_item_id: opt_string(o, "previous_item_id", "previous_item_id")
                .map_err(fail)?,
            item: item(required(o, "item", "item").map_err(fail)?, "item").map_err(fail)?,
        },
        "conversation.item.truncate" => {
            let t: Truncate = serde_json::from_value(v.clone())
                .map_err(|e| fail(bad("item_id", format!("conversation.item.truncate: {e}"))))?;
            OaiClientEvent::ItemTruncate {
                item_id: t.item_id,
                content_index: t.content_index,
                audio_end_ms: t.audio_end_ms,
            }
        }
        "conversation.item.delete" | "conversation.item.retrieve" => {
            let item_id = id_field(required(o, "item_id", "item_id").map_err(fail)?, "item_id")
                .map_err(fail)?;
            if ty.ends_with("delete") {
                OaiClientEvent::ItemDelete { item_id }
            } else {
                OaiClientEvent::ItemRetrieve { item_id }
            }
        }
        "response.create" => OaiClientEvent::ResponseCreate(Box::new(
            response_params(o.get("response")).map_err(fail)?,
        )),
        "response.cancel" => OaiClientEvent::ResponseCancel {
            response_id: opt_string(o, "response_id", "response_id").map_err(fail)?,
        },
        "output_audio_buffer.clear" => OaiClientEvent::OutputAudioClear,
        other => {
            let shown: String = other.chars().take(64).collect();
            return Err(fail(OaiError::param(
                OaiErrorCode::InvalidEvent,
                "type",
                format!("unknown or unsupported event type `{shown}`"),
            )));
        }
    };
    Ok(OaiIncoming { event_id, event })
}

#[cfg(test)]
mod tests;
