//! A session's tools: the functions it declares (checked once, rendered once for every prompt),
//! the calls its responses make (each given a `call_id`), and the results a client gives back,
//! which start the response that answers from them once the calling response is done.

use std::sync::Arc;

use antiphon_engine::{
    FunctionTool, ToolCall, ToolChoice as EngineChoice, ToolSet, Tools, UserInput,
};
use antiphon_protocol::{validate_tool_choice, validate_tools, ToolChoice, ToolDecl, ToolResult};

use super::history::IdentifiedCall;
use super::*;

/// What a session declared, and results waiting for their response to finish.
#[derive(Default)]
pub(super) struct SessionTools {
    decls: Vec<ToolDecl>,
    set: Option<Arc<ToolSet>>,
    /// Results given while the calling response still ran (its speech before the call): the
    /// response that answers them starts when it is done.
    waiting: Option<(Vec<String>, Option<Generation>)>,
}

impl SessionTools {
    /// The declared tools, replaced (`[]`: none). Checked against the bounds, and refused when the
    /// model's tokenizer has no tool tokens.
    pub(super) fn declare(
        &mut self,
        decls: Vec<ToolDecl>,
        model_serves_tools: bool,
    ) -> Result<(), WireError> {
        validate_tools(&decls)?;
        if !decls.is_empty() && !model_serves_tools {
            return Err(WireError::new(
                ErrorCode::BadField,
                "field `tools`: this model's tokenizer has no tool tokens",
            ));
        }
        let tools = decls.iter().map(|d| FunctionTool {
            name: d.name.clone(),
            description: d.description.clone(),
            parameters: d.parameters.clone(),
        });
        self.set = (!decls.is_empty()).then(|| Arc::new(ToolSet::new(tools.collect())));
        self.decls = decls;
        Ok(())
    }

    /// A `generation` whose `tool_choice` the declared tools can honour.
    pub(super) fn check_choice(&self, g: &Generation) -> Result<(), WireError> {
        match &g.tool_choice {
            Some(c) => validate_tool_choice(c, &self.decls, "generation.tool_choice"),
            None => Ok(()),
        }
    }

    /// What a reply with `g` may call.
    pub(super) fn for_reply(&self, g: &Generation) -> Tools {
        let choice = match g.tool_choice.clone().unwrap_or(ToolChoice::Auto) {
            ToolChoice::Auto => EngineChoice::Auto,
            ToolChoice::None => EngineChoice::None,
            ToolChoice::Required => EngineChoice::Required,
            ToolChoice::Function(f) => EngineChoice::Function(f),
        };
        Tools { set: self.set.clone(), choice }
    }

    /// A new turn comes: results still waiting are not answered by it.
    pub(super) fn forget_waiting(&mut self) {
        self.waiting = None;
    }
}

impl Session {
    /// `input.tool_result`: the outputs of calls of the latest response, put in the order of its
    /// calls (Qwen's template matches outputs to calls by position), answered now, or when the
    /// calling response is done if it still runs.
    pub(super) fn on_tool_result(
        &mut self,
        results: Vec<ToolResult>,
        generation: Option<Generation>,
    ) {
        if self.duplex.is_some() {
            return self.send_error(WireError::new(
                ErrorCode::BadField,
                "input.tool_result: a duplex session has no tools",
            ));
        }
        let open: Vec<IdentifiedCall> = match &self.current {
            Some(r) => r.calls.clone(),
            None => self.history.open_calls().to_vec(),
        };
        if let Some((k, r)) =
            results.iter().enumerate().find(|(_, r)| !open.iter().any(|(id, _)| id == &r.call_id))
        {
            let why = format!(
                "field `results[{k}].call_id`: `{}` is not a call of the latest response",
                r.call_id
            );
            return self.send_error(WireError::new(ErrorCode::BadField, why));
        }
        let outputs: Vec<String> = open
            .iter()
            .filter_map(|(id, _)| {
                results.iter().find(|r| &r.call_id == id).map(|r| r.output.clone())
            })
            .collect();
        if self.current.is_some() {
            self.tools.waiting = Some((outputs, generation));
            return;
        }
        self.start_response(Trigger::ToolResult, UserInput::ToolResults(outputs), generation);
    }

    /// The response that called is done: results given meanwhile are answered now (its calls are
    /// in the conversation unless it failed).
    pub(super) fn answer_waiting_results(&mut self, calling: u32, failed: bool) {
        let Some((outputs, generation)) = self.tools.waiting.take() else { return };
        if failed {
            let why = format!(
                "input.tool_result: response {calling} failed, so its calls are not \
                in the conversation"
            );
            return self.send_error(WireError::new(ErrorCode::BadField, why));
        }
        self.start_response(Trigger::ToolResult, UserInput::ToolResults(outputs), generation);
    }

    /// `conversation.append`: earlier turns, as text, after those the conversation holds (a
    /// client that owns its conversation replays it, or adds what it created). A call's
    /// arguments must be a JSON object; a response still running keeps its place after them.
    pub(super) fn on_append(&mut self, turns: Vec<antiphon_protocol::PastTurn>) {
        if self.duplex.is_some() {
            return self.send_error(WireError::new(
                ErrorCode::BadField,
                "conversation.append: a duplex session's conversation is its stream",
            ));
        }
        let mut checked = Vec::with_capacity(turns.len());
        for (k, t) in turns.into_iter().enumerate() {
            let mut calls = Vec::with_capacity(t.calls.len());
            for (j, c) in t.calls.iter().enumerate() {
                match ToolCall::given(&c.name, &c.arguments) {
                    Ok(call) => calls.push((c.call_id.clone(), call)),
                    Err(e) => {
                        return self.send_error(WireError::new(
                            ErrorCode::BadField,
                            format!("field `turns[{k}].calls[{j}].arguments`: {e:#}"),
                        ))
                    }
                }
            }
            let user = if t.tool_outputs.is_empty() {
                UserInput::Text(t.user)
            } else {
                UserInput::ToolResults(t.tool_outputs)
            };
            checked.push((user, t.assistant, calls));
        }
        for (user, assistant, calls) in checked {
            self.history.push(0, user, assistant, calls, 0);
        }
    }

    /// The engine reports a call: it gets its id and goes to the client at once (the tool can run
    /// while the speech before it still plays).
    pub(super) fn on_tool_call(&mut self, response_id: u32, call: ToolCall) {
        let call_id = format!("call_{}", random_token(15));
        if let Some(r) = self.resp_mut(response_id) {
            r.calls.push((call_id.clone(), call.clone()));
        }
        self.send_event(ServerEvent::ResponseToolCall {
            seq: 0,
            response_id,
            call_id,
            name: call.name,
            arguments: call.arguments,
        });
    }
}
