//! The conversation as the client built it. Items the client created that the model does not
//! remember yet (assistant messages, calls and their outputs, and the user items they answered:
//! a conversation replayed on a new socket, or turns a client made up) become earlier turns of
//! the v1 conversation (`conversation.append`, text only) before a response starts; the user
//! items after the last of them are the response's input, as before.

use antiphon_protocol::{
    valid_tool_name, ClientEvent, PastCall, PastTurn, MAX_APPEND_TURNS, MAX_TOOL_OUTPUT_CHARS,
    MAX_TOOL_RESULTS,
};

use super::items::{ConvItem, Pending};
use super::translate::{new_id, Translator};

/// An item the assistant said or did (a message, or a call), unless it is the beginning the
/// client gave the next response.
fn assistant_side(item: &ConvItem, last: bool) -> bool {
    let v = &item.view;
    let beginning = last && matches!(item.pending, Some(Pending::Prefix(_)));
    v.kind == "function_call" || (v.kind == "message" && v.role == Some("assistant") && !beginning)
}

/// A message's words: its text parts, or its audio parts' transcripts.
fn words(item: &ConvItem) -> String {
    let parts = item.view.content.iter().flatten();
    parts.filter_map(|p| p.text.as_deref().or(p.transcript.as_deref())).collect::<Vec<_>>().join("")
}

/// A `function_call` item as v1 takes it (a call without a usable name is left out: v1 would
/// refuse the whole turn; arguments that are not an object are taken as none).
fn past_call(item: &ConvItem) -> Option<PastCall> {
    let v = &item.view;
    let name = v.name.clone().filter(|n| valid_tool_name(n))?;
    let arguments = v
        .arguments
        .clone()
        .filter(|a| serde_json::from_str::<serde_json::Value>(a).is_ok_and(|j| j.is_object()))
        .unwrap_or_else(|| "{}".into());
    let call_id = v
        .call_id
        .clone()
        .filter(|c| !c.is_empty() && c.len() <= 64)
        .unwrap_or_else(|| new_id("call"));
    Some(PastCall { call_id, name, arguments })
}

#[derive(Default)]
struct Gathered {
    said: Vec<String>,
    outputs: Vec<String>,
    answer: Vec<String>,
    calls: Vec<PastCall>,
}

impl Gathered {
    fn is_empty(&self) -> bool {
        self.said.is_empty()
            && self.outputs.is_empty()
            && self.answer.is_empty()
            && self.calls.is_empty()
    }

    /// As a v1 turn: the caller's words, or the tools' outputs (with words too, the outputs are
    /// said as text after them).
    fn turn(self) -> PastTurn {
        let (user, tool_outputs) =
            match (self.said.is_empty() && self.outputs.len() <= MAX_TOOL_RESULTS, self.outputs) {
                (true, outputs) => (String::new(), outputs),
                (false, outputs) => {
                    let mut said = self.said;
                    said.extend(outputs.iter().map(|o| format!("[a function returned] {o}")));
                    (said.join("\n"), Vec::new())
                }
            };
        PastTurn { user, tool_outputs, assistant: self.answer.join("\n"), calls: self.calls }
    }
}

impl Translator {
    /// Gives v1 the items the model does not remember yet, up to the last thing the assistant
    /// said or did, as earlier turns (one user side and one assistant side each), and marks them
    /// remembered; the user items after them stay the response's input.
    pub(super) async fn append_client_turns(&mut self) {
        if std::mem::take(&mut self.forgotten) {
            // an item the model remembered was deleted: it is told the whole item list again
            // (as text: a spoken turn is heard as its transcript from here on)
            self.to_v1_event(ClientEvent::ConversationClear).await;
            for i in &mut self.items {
                i.in_v1 = false;
            }
        }
        let new: Vec<usize> = (0..self.items.len())
            .filter(|&i| !self.items[i].in_v1 && self.items[i].view.role != Some("system"))
            .collect();
        let Some(cut) = new
            .iter()
            .enumerate()
            .rposition(|(k, &i)| assistant_side(&self.items[i], k + 1 == new.len()))
        else {
            return;
        };
        let mut turns = Vec::new();
        let mut g = Gathered::default();
        let mut answered = false;
        for &i in &new[..=cut] {
            let item = &self.items[i];
            if assistant_side(item, false) {
                answered = true;
                match item.view.kind {
                    "function_call" => g.calls.extend(past_call(item)),
                    _ => g.answer.push(words(item)),
                }
            } else {
                if answered {
                    turns.push(std::mem::take(&mut g).turn());
                    answered = false;
                }
                match item.view.kind {
                    "function_call_output" => g.outputs.push(
                        item.view
                            .output
                            .clone()
                            .unwrap_or_default()
                            .chars()
                            .take(MAX_TOOL_OUTPUT_CHARS)
                            .collect(),
                    ),
                    _ => g.said.push(words(item)),
                }
            }
        }
        if !g.is_empty() {
            turns.push(g.turn());
        }
        for &i in &new[..=cut] {
            self.items[i].pending = None;
            self.items[i].in_v1 = true;
        }
        for part in turns.chunks(MAX_APPEND_TURNS) {
            self.to_v1_event(ClientEvent::ConversationAppend { turns: part.to_vec() }).await;
        }
    }
}
