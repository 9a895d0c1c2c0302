//! Turns a client gives the conversation (`conversation.append`): what was said before, as text,
//! so that a client that owns its conversation (one it replays on a new socket, or items it
//! created) has the model remember it. Bounded here before the session sees it.

use serde::{Deserialize, Serialize};

use crate::{
    valid_tool_name, ErrorCode, WireError, MAX_TOOL_NAME, MAX_TOOL_OUTPUT_CHARS, MAX_TOOL_RESULTS,
};

/// Turns one `conversation.append` may give.
pub const MAX_APPEND_TURNS: usize = 256;

/// A call an earlier reply made.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct PastCall {
    pub call_id: String,
    pub name: String,
    /// A JSON object, as text.
    pub arguments: String,
}

/// An earlier turn: what the caller said (or the outputs of the previous turn's calls, in their
/// order), and what the assistant said and called.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
pub struct PastTurn {
    #[serde(default)]
    pub user: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_outputs: Vec<String>,
    #[serde(default)]
    pub assistant: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub calls: Vec<PastCall>,
}

/// Turns within the bounds (`bad_field` naming the field).
pub fn validate_turns(turns: &[PastTurn]) -> Result<(), WireError> {
    let bad = |m: String| Err(WireError::new(ErrorCode::BadField, m));
    if turns.is_empty() || turns.len() > MAX_APPEND_TURNS {
        return bad(format!("field `turns`: {} turns; give 1 to {MAX_APPEND_TURNS}", turns.len()));
    }
    for (k, t) in turns.iter().enumerate() {
        if !t.user.is_empty() && !t.tool_outputs.is_empty() {
            return bad(format!("field `turns[{k}]`: `user` or `tool_outputs`, not both"));
        }
        if t.tool_outputs.len() > MAX_TOOL_RESULTS
            || t.tool_outputs.iter().any(|o| o.chars().count() > MAX_TOOL_OUTPUT_CHARS)
        {
            return bad(format!(
                "field `turns[{k}].tool_outputs`: at most {MAX_TOOL_RESULTS} of at \
                most {MAX_TOOL_OUTPUT_CHARS} characters"
            ));
        }
        for (j, c) in t.calls.iter().enumerate() {
            if !valid_tool_name(&c.name) || c.call_id.is_empty() || c.call_id.len() > 64 {
                return bad(format!(
                    "field `turns[{k}].calls[{j}]`: a name of 1-{MAX_TOOL_NAME} of \
                    A-Z a-z 0-9 _ - and a call_id of 1-64 bytes"
                ));
            }
        }
    }
    Ok(())
}
