//! Starting a response of the dialect: what it answers (the new user items, `response.input`, or
//! the outputs of the latest response's calls), the v1 session brought to the instructions,
//! voice and tools the response uses, and its input sent to v1.

use antiphon_protocol::openai::{
    Item, MaxTokens, Modality, OaiError, OaiErrorCode, ResponseParams,
};
use antiphon_protocol::{
    validate_tools, ClientEvent, Generation, SessionUpdate, ToolChoice, ToolDecl, ToolResult,
    Voice, KIND_AUDIO, MAX_TOOL_RESULTS,
};
use serde_json::Value;

use super::input::{check_text, Joined};
use super::items::Pending;
use super::respond::Active;
use super::translate::{err, update, Translator};
use crate::session::SessionMsg;

/// v1 audio messages are sent in pieces of at most this many bytes.
const AUDIO_PIECE: usize = 32 * 1024;

/// The session's function tools as v1 declares them (`{type: "function", name, description,
/// parameters}`; other kinds, such as MCP servers, are not called), checked against v1's bounds.
pub(super) fn v1_tools(tools: &[Value], param: &str) -> Result<Vec<ToolDecl>, OaiError> {
    let decls: Vec<ToolDecl> = tools
        .iter()
        .filter(|t| t.get("type").and_then(Value::as_str).is_none_or(|k| k == "function"))
        .map(|t| ToolDecl {
            name: t.get("name").and_then(Value::as_str).unwrap_or("").to_string(),
            description: t.get("description").and_then(Value::as_str).map(str::to_string),
            parameters: t.get("parameters").filter(|p| !p.is_null()).cloned(),
        })
        .collect();
    validate_tools(&decls)
        .map_err(|e| OaiError::param(OaiErrorCode::InvalidValue, param, e.message))?;
    Ok(decls)
}

/// The dialect's `tool_choice` (`"auto"`, `"none"`, `"required"`, `{type: "function", name}`) as
/// v1's, honourable by the declared tools.
pub(super) fn v1_tool_choice(
    choice: &Value,
    tools: &[ToolDecl],
    param: &str,
) -> Result<ToolChoice, OaiError> {
    let c = match choice {
        Value::String(s) if s == "none" => ToolChoice::None,
        Value::String(s) if s == "required" => ToolChoice::Required,
        Value::Object(o) => match o.get("name").and_then(Value::as_str) {
            Some(n) => ToolChoice::Function(n.to_string()),
            None => {
                return Err(OaiError::param(
                    OaiErrorCode::InvalidValue,
                    param,
                    "a tool_choice object names a function (`name`)",
                ))
            }
        },
        _ => ToolChoice::Auto,
    };
    antiphon_protocol::validate_tool_choice(&c, tools, param)
        .map_err(|e| OaiError::param(OaiErrorCode::InvalidValue, param, e.message))?;
    Ok(c)
}

impl Translator {
    /// Starts a response: the new user items (or `response.input`) go to v1 as its input (the
    /// outputs of the latest response's calls as a tool result), after the v1 session's
    /// instructions, voice and tools are brought to what this response uses.
    pub(super) async fn start_response(&mut self, p: ResponseParams) -> Result<(), OaiError> {
        if p.input.is_none() {
            self.append_client_turns().await;
        }
        let inputs: Vec<Pending> = match &p.input {
            Some(items) => {
                // counted before anything is copied: references repeat an item without growing the
                // frame, so what they join is bounded by what one turn may hold
                let mut joined =
                    Joined::new(self.shared.config.server.max_text_frame, self.max_audio_samples());
                let mut v = Vec::new();
                for it in items {
                    let add = match it {
                        Item::Reference { id } => {
                            let i = self.find(id).ok_or_else(|| {
                                OaiError::param(
                                    OaiErrorCode::InvalidValue,
                                    "response.input",
                                    format!("no item {id}"),
                                )
                            })?;
                            joined.count(self.items[i].pending.as_ref())?;
                            self.items[i].pending.clone()
                        }
                        it => {
                            let p = self.item_of(it.clone())?.1;
                            joined.count(p.as_ref())?;
                            p
                        }
                    };
                    v.extend(add);
                }
                v
            }
            None => self.items.iter().filter_map(|i| i.pending.clone()).collect(),
        };
        let instructions = self.joined_instructions(
            p.instructions.as_deref().unwrap_or(&self.session.instructions),
            &[],
        );
        // (checked whole before anything is sent: a refused update is never taken as applied)
        self.shared.check_instructions(Some(&instructions)).map_err(|e| {
            OaiError::param(OaiErrorCode::InvalidValue, "response.instructions", e.message)
        })?;
        if self.v1_instructions.as_deref() != Some(instructions.as_str()) {
            self.to_v1_event(ClientEvent::SessionUpdate(Box::new(SessionUpdate {
                instructions: Some(instructions.clone()),
                ..update()
            })))
            .await;
            self.v1_instructions = Some(instructions);
        }
        let voice_name = p.voice.clone().unwrap_or_else(|| self.session.voice.clone());
        // a voice this server has (configured or registered) by its id; OpenAI's names ("alloy",
        // "marin", ...) are spoken in the default voice
        let v1_voice = if self.shared.voices.get(&voice_name).is_some() {
            voice_name.clone()
        } else {
            self.shared.config.voices[0].id.clone()
        };
        if v1_voice != self.v1_voice {
            self.to_v1_event(ClientEvent::SessionUpdate(Box::new(SessionUpdate {
                voice: Some(Voice::Configured { id: v1_voice.clone() }),
                ..update()
            })))
            .await;
            self.v1_voice = v1_voice;
        }
        let transcription = self.session.transcription.is_some();
        if transcription != self.v1_transcription {
            self.to_v1_event(ClientEvent::SessionUpdate(Box::new(SessionUpdate {
                input_transcription: Some(transcription),
                ..update()
            })))
            .await;
            self.v1_transcription = transcription;
        }
        let tools = v1_tools(&self.session.tools, "session.tools")?;
        if tools != self.v1_tools {
            self.to_v1_event(ClientEvent::SessionUpdate(Box::new(SessionUpdate {
                tools: Some(tools.clone()),
                ..update()
            })))
            .await;
            self.v1_tools = tools;
        }
        let (choice, param) = match &p.tool_choice {
            Some(c) => (c, "response.tool_choice"),
            None => (&self.session.tool_choice, "session.tool_choice"),
        };
        let tool_choice = v1_tool_choice(choice, &self.v1_tools, param)?;
        let may_call = !self.v1_tools.is_empty() && tool_choice != ToolChoice::None;
        let modality = p.output_modalities.unwrap_or(self.session.output_modalities);
        let limits = self.shared.engine.generation_limits();
        let max = p.max_output_tokens.unwrap_or(self.session.max_output_tokens);
        let generation = Generation {
            max_text_tokens: match max {
                MaxTokens::N(n) => Some((n as usize).min(limits.max_text_tokens)),
                MaxTokens::Inf => None,
            },
            temperature: p.temperature.or(self.temperature),
            // an incomplete assistant message created last: the reply begins with it
            prefix: match inputs.last() {
                Some(Pending::Prefix(t)) => Some(t.clone()),
                _ => None,
            },
            tool_choice: Some(tool_choice),
            text_only: (modality == Modality::Text).then_some(true),
            remember: p.out_of_band.then_some(false),
            ..Generation::default()
        };
        let audio: Vec<i16> = inputs
            .iter()
            .flat_map(|i| if let Pending::Audio(a) = i { a.clone() } else { Vec::new() })
            .collect();
        let mut text: Vec<String> = inputs
            .iter()
            .filter_map(|i| if let Pending::Text(t) = i { Some(t.clone()) } else { None })
            .collect();
        let results: Vec<ToolResult> = inputs
            .iter()
            .filter_map(|i| match i {
                Pending::ToolResult { call_id, output } => {
                    Some(ToolResult { call_id: call_id.clone(), output: output.clone() })
                }
                _ => None,
            })
            .collect();
        // the outputs of the latest response's calls, and nothing else new, go to v1 as its tool
        // result; outputs for calls v1 did not make (a replayed conversation) are said as text
        let answers_calls = !results.is_empty()
            && audio.is_empty()
            && text.is_empty()
            && results.len() <= MAX_TOOL_RESULTS
            && results.iter().all(|r| self.v1_calls.contains(&r.call_id));
        if !answers_calls {
            text.extend(
                results
                    .iter()
                    .map(|r| format!("[the function call {} returned] {}", r.call_id, r.output)),
            );
        }
        let max_audio = self.max_audio_samples();
        if audio.len() > max_audio {
            return Err(err(
                OaiErrorCode::InputAudioBufferFull,
                format!("the new user audio is over the {} s a turn may hold", max_audio / 24_000),
            ));
        }
        check_text(&self.shared, &text.join("\n"), "response.input")?;
        // the spoken item this response answers, whose transcript v1 sends
        let heard = match &p.input {
            None => self.items.iter().rev().find_map(|i| match &i.pending {
                Some(Pending::Audio(a)) => {
                    Some((i.view.id.clone(), a.len() as f64 / super::input::RATE as f64))
                }
                _ => None,
            }),
            Some(_) => None,
        };
        // checked: the new user items are answered now
        if p.input.is_none() {
            for i in &mut self.items {
                if i.pending.take().is_some() {
                    i.in_v1 = true;
                }
            }
        }
        self.active = Some(Active::new(self, &p, voice_name, may_call));
        if let Some(a) = self.active.as_mut() {
            a.heard = heard;
        }
        if answers_calls {
            self.to_v1_event(ClientEvent::InputToolResult {
                results,
                generation: Some(generation),
            })
            .await;
        } else if audio.is_empty() {
            self.to_v1_event(ClientEvent::InputText {
                text: text.join("\n"),
                generation: Some(generation),
            })
            .await;
        } else {
            let bytes: Vec<u8> = audio.iter().flat_map(|s| s.to_le_bytes()).collect();
            for piece in bytes.chunks(AUDIO_PIECE) {
                self.to_v1(SessionMsg::Audio {
                    seq: None,
                    kind: KIND_AUDIO,
                    payload: piece.to_vec(),
                })
                .await;
            }
            self.to_v1_event(ClientEvent::InputCommit { generation: Some(generation) }).await;
        }
        Ok(())
    }
}
