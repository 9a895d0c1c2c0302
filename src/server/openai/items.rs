//! The conversation's items as the translator keeps them: what each holds, how client items
//! become them, their bounds, and truncation to what was heard.

use antiphon_protocol::openai::server::{ItemView, OaiServerEvent as S, PartView};
use antiphon_protocol::openai::{Item, ItemStatus, OaiError, OaiErrorCode, Part, Role};
use antiphon_protocol::ClientEvent;

use super::input::{check_text, decode_input};
use super::translate::{err, new_id, Translator};

/// The most items a conversation keeps, and the most text they hold together (the oldest give
/// way); an answered item keeps its text only.
pub const MAX_ITEMS: usize = 1024;
pub const MAX_ITEM_TEXT: usize = 1 << 20;

/// A conversation item and what the translator needs of it.
pub(super) struct ConvItem {
    pub view: ItemView,
    /// A user item not yet answered: its input (text, or 24 kHz audio).
    pub pending: Option<Pending>,
    /// An assistant item: the v1 response behind it and its audio length.
    pub v1_response: Option<u32>,
    pub audio_ms: u64,
    /// What the model remembers has it: a response's output, an input a response answered, or a
    /// turn given to v1 (`conversation.append`).
    pub in_v1: bool,
}

impl ConvItem {
    fn text_bytes(&self) -> usize {
        let v = &self.view;
        let parts: usize = v
            .content
            .iter()
            .flatten()
            .map(|p| {
                p.text.as_ref().map_or(0, String::len)
                    + p.transcript.as_ref().map_or(0, String::len)
            })
            .sum();
        let pending = match &self.pending {
            Some(Pending::Text(t) | Pending::Prefix(t)) => t.len(),
            _ => 0,
        };
        parts
            + pending
            + [&v.arguments, &v.output, &v.name, &v.call_id]
                .iter()
                .map(|s| s.as_ref().map_or(0, String::len))
                .sum::<usize>()
    }
}

#[derive(Clone)]
pub(super) enum Pending {
    Text(String),
    Audio(Vec<i16>),
    /// An assistant message created `incomplete`: the next response begins with its text.
    Prefix(String),
    /// A tool's output for a call.
    ToolResult {
        call_id: String,
        output: String,
    },
}

impl Translator {
    fn last_id(&self) -> Option<String> {
        self.items.last().map(|i| i.view.id.clone())
    }

    pub(super) fn find(&self, id: &str) -> Option<usize> {
        self.items.iter().position(|i| i.view.id == id)
    }

    pub(super) fn push_item(&mut self, item: ConvItem) {
        self.items.push(item);
        self.bound_items();
    }

    /// The oldest items give way beyond the bounds.
    fn bound_items(&mut self) {
        let mut text: usize = self.items.iter().map(ConvItem::text_bytes).sum();
        while self.items.len() > 1 && (self.items.len() > MAX_ITEMS || text > MAX_ITEM_TEXT) {
            text -= self.items.remove(0).text_bytes();
        }
    }

    /// User audio waiting for a response, in samples.
    fn pending_audio(&self) -> usize {
        self.items
            .iter()
            .map(|i| if let Some(Pending::Audio(a)) = &i.pending { a.len() } else { 0 })
            .sum()
    }

    /// Refuses `more` samples of user audio beyond what a turn may hold.
    fn check_pending_audio(&self, more: usize) -> Result<(), OaiError> {
        let max =
            self.shared.config.server.max_input_audio_s as usize * super::input::RATE as usize;
        if self.pending_audio() + more > max {
            return Err(err(
                OaiErrorCode::InputAudioBufferFull,
                format!(
                    "the user audio waiting for a response would be over the {} s a turn may hold",
                    max / 24_000
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn commit_audio(&mut self, id: String, audio: Vec<i16>) {
        if let Err(e) = self.check_pending_audio(audio.len()) {
            return self.error(None, e);
        }
        let previous = self.last_id();
        self.out.event(&S::Committed { previous_item_id: previous.clone(), item_id: id.clone() });
        let view = ItemView::message(
            &id,
            "user",
            ItemStatus::Completed,
            vec![PartView::of("input_audio", None, None)],
        );
        self.out.event(&S::ItemAdded { previous_item_id: previous.clone(), item: view.clone() });
        self.out.event(&S::ItemDone { previous_item_id: previous, item: view.clone() });
        self.push_item(ConvItem {
            view,
            pending: Some(Pending::Audio(audio)),
            v1_response: None,
            audio_ms: 0,
            in_v1: false,
        });
    }

    /// The item as the conversation holds it, and its input if it is a user's.
    pub(super) fn item_of(&self, item: Item) -> Result<(ItemView, Option<Pending>), OaiError> {
        let id = item.id().map(str::to_string).unwrap_or_else(|| new_id("item"));
        Ok(match item {
            Item::Message { role, content, incomplete, .. } => {
                let mut parts = Vec::new();
                let (mut text, mut audio) = (String::new(), Vec::new());
                for p in content {
                    match p {
                        Part::InputText(t) => {
                            text.push_str(&t);
                            parts.push(PartView::of("input_text", Some(t), None));
                        }
                        Part::InputAudio { audio: bytes, transcript } => {
                            audio.extend(decode_input(
                                self.session.input_format,
                                &bytes,
                                "item.content.audio",
                            )?);
                            parts.push(PartView::of("input_audio", None, transcript));
                        }
                        Part::Text(t) => {
                            text.push_str(&t);
                            parts.push(PartView::of("output_text", Some(t), None));
                        }
                        Part::Audio { transcript } => {
                            parts.push(PartView::of("output_audio", None, transcript))
                        }
                    }
                }
                let pending = match role {
                    Role::User if !audio.is_empty() => Some(Pending::Audio(audio)),
                    Role::User => Some(Pending::Text(text)),
                    Role::Assistant if incomplete => {
                        let n = text.chars().count();
                        if n > antiphon_protocol::MAX_PREFIX_CHARS {
                            let why = format!(
                                "an incomplete assistant message begins the next response: {n} \
                                characters, at most {}",
                                antiphon_protocol::MAX_PREFIX_CHARS
                            );
                            return Err(OaiError::param(
                                OaiErrorCode::InvalidValue,
                                "item.content",
                                why,
                            ));
                        }
                        Some(Pending::Prefix(text))
                    }
                    _ => None,
                };
                let status = if pending.as_ref().is_some_and(|p| matches!(p, Pending::Prefix(_))) {
                    ItemStatus::Incomplete
                } else {
                    ItemStatus::Completed
                };
                (ItemView::message(&id, role.as_str(), status, parts), pending)
            }
            Item::FunctionCall { call_id, name, arguments, .. } => {
                let mut v = ItemView::message(&id, "assistant", ItemStatus::Completed, Vec::new());
                (v.kind, v.role, v.content, v.call_id, v.name, v.arguments) =
                    ("function_call", None, None, call_id, Some(name), Some(arguments));
                (v, None)
            }
            Item::FunctionCallOutput { call_id, output, .. } => {
                let mut v = ItemView::message(&id, "user", ItemStatus::Completed, Vec::new());
                (v.kind, v.role, v.content, v.call_id, v.output) = (
                    "function_call_output",
                    None,
                    None,
                    Some(call_id.clone()),
                    Some(output.clone()),
                );
                (v, Some(Pending::ToolResult { call_id, output }))
            }
            Item::Reference { id } => {
                return Err(OaiError::param(
                    OaiErrorCode::InvalidValue,
                    "item.type",
                    format!("item_reference {id}: only in response.input"),
                ))
            }
        })
    }

    /// A client's item, after `previous` (`"root"`: first; none: last). One placed before items
    /// the model remembers has the conversation given again, in the new order, before the next
    /// response.
    pub(super) fn create_item(
        &mut self,
        item: Item,
        previous: Option<&str>,
    ) -> Result<(), OaiError> {
        if let Some(id) = item.id() {
            if self.find(id).is_some() {
                return Err(OaiError::param(
                    OaiErrorCode::InvalidValue,
                    "item.id",
                    format!("the conversation already has an item {id}"),
                ));
            }
        }
        let at = match previous {
            None => self.items.len(),
            Some("root") => 0,
            Some(p) => {
                let i = self.find(p).ok_or_else(|| {
                    OaiError::param(
                        OaiErrorCode::InvalidValue,
                        "previous_item_id",
                        format!("no item {p}"),
                    )
                })?;
                i + 1
            }
        };
        let (view, pending) = self.item_of(item)?;
        match &pending {
            Some(Pending::Audio(a)) => self.check_pending_audio(a.len())?,
            // the user text waiting for a response, with this, is answered as one input
            Some(Pending::Text(t)) => {
                let waiting = self.items.iter().filter_map(|i| {
                    if let Some(Pending::Text(w)) = &i.pending {
                        Some(w.as_str())
                    } else {
                        None
                    }
                });
                check_text(
                    &self.shared,
                    &waiting.chain([t.as_str()]).collect::<Vec<_>>().join("\n"),
                    "item.content",
                )?;
            }
            Some(Pending::ToolResult { output, .. }) => {
                let n = output.chars().count();
                if n > antiphon_protocol::MAX_TOOL_OUTPUT_CHARS {
                    let why = format!(
                        "a function's output of {n} characters; at most {}",
                        antiphon_protocol::MAX_TOOL_OUTPUT_CHARS
                    );
                    return Err(OaiError::param(OaiErrorCode::InvalidValue, "item.output", why));
                }
            }
            Some(Pending::Prefix(_)) | None => {}
        }
        if view.role == Some("system") {
            // a system item joins every response's instructions: checked now, not at the next
            // response
            let text: Vec<&str> =
                view.content.iter().flatten().map(|p| p.text.as_deref().unwrap_or("")).collect();
            let joined = self.joined_instructions(&self.session.instructions, &text);
            self.shared.check_instructions(Some(&joined)).map_err(|e| {
                OaiError::param(
                    OaiErrorCode::InvalidValue,
                    "item.content",
                    format!("with the session's instructions and system items: {}", e.message),
                )
            })?;
        }
        let previous = at.checked_sub(1).map(|i| self.items[i].view.id.clone());
        self.out.event(&S::ItemAdded { previous_item_id: previous.clone(), item: view.clone() });
        self.out.event(&S::ItemDone { previous_item_id: previous, item: view.clone() });
        self.forgotten |= self.items[at..].iter().any(|i| i.in_v1);
        self.items
            .insert(at, ConvItem { view, pending, v1_response: None, audio_ms: 0, in_v1: false });
        self.bound_items();
        Ok(())
    }

    pub(super) async fn truncate(
        &mut self,
        item_id: &str,
        content_index: u32,
        audio_end_ms: u64,
    ) -> Result<(), OaiError> {
        let bad = |m: String| OaiError::param(OaiErrorCode::InvalidValue, "audio_end_ms", m);
        if let Some(a) = self.active.as_mut().filter(|a| a.item_id == item_id) {
            // the response is still ending: the cut applies when it is done
            a.truncate_ms = Some(audio_end_ms);
        } else {
            let i = self.find(item_id).ok_or_else(|| {
                OaiError::param(
                    OaiErrorCode::ItemTruncateInvalidItemId,
                    "item_id",
                    format!("no item {item_id}"),
                )
            })?;
            let it = &mut self.items[i];
            let Some(rid) = it.v1_response else {
                return Err(OaiError::param(
                    OaiErrorCode::InvalidValue,
                    "item_id",
                    format!("item {item_id} is not an assistant's audio"),
                ));
            };
            if audio_end_ms > it.audio_ms {
                return Err(bad(format!(
                    "audio_end_ms {audio_end_ms} is beyond the item's {} ms of audio",
                    it.audio_ms
                )));
            }
            cut_transcript(&mut it.view, audio_end_ms, it.audio_ms);
            self.to_v1_event(ClientEvent::Playback { response_id: rid, played_ms: audio_end_ms })
                .await;
        }
        self.out.event(&S::ItemTruncated {
            item_id: item_id.to_string(),
            content_index,
            audio_end_ms,
        });
        Ok(())
    }
}

/// The transcript of an assistant item cut to what `played_ms` of `audio_ms` carried.
pub(super) fn cut_transcript(view: &mut ItemView, played_ms: u64, audio_ms: u64) {
    if audio_ms == 0 || played_ms >= audio_ms {
        return;
    }
    for part in view.content.iter_mut().flatten() {
        for t in [&mut part.transcript, &mut part.text].into_iter().flatten() {
            let chars: Vec<char> = t.chars().collect();
            let keep = (chars.len() as u64 * played_ms / audio_ms) as usize;
            *t = chars[..keep].iter().collect();
        }
    }
}
