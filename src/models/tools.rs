//! Tool (function) calls in Qwen3's chat template, as MiniCPM-o 4.5 ships it: the tools block of
//! the system turn, the calls of an assistant turn, the user turn of tool responses, and reading a
//! call the model wrote. docs/design/tool-calls.md quotes the template these follow.
//!
//! The four tags are added tokens that are not special: they decode as text, and text that holds
//! them encodes to them (as Hugging Face's tokenizer does), so the template is rendered as text.

use anyhow::{anyhow, Result};
use serde_json::Value;

/// The ids of the template's tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolTokens {
    pub call: u32,
    pub call_end: u32,
    pub response: u32,
    pub response_end: u32,
}

impl ToolTokens {
    /// The tags' texts, in field order (the generator of synthetic tokenizers uses it too).
    pub const NAMES: [&'static str; 4] =
        ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"];

    /// All four, or `None` when the tokenizer lacks any (it then serves no tools).
    pub fn lookup(find: impl Fn(&str) -> Option<u32>) -> Option<Self> {
        let [call, call_end, response, response_end] = Self::NAMES.map(&find);
        Some(Self {
            call: call?,
            call_end: call_end?,
            response: response?,
            response_end: response_end?,
        })
    }

    pub fn all(&self) -> [u32; 4] {
        [self.call, self.call_end, self.response, self.response_end]
    }
}

/// A function the model may call, as a client declared it.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionTool {
    pub name: String,
    pub description: Option<String>,
    /// Its parameters' JSON Schema.
    pub parameters: Option<Value>,
}

/// Which calls a reply may make.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides.
    #[default]
    Auto,
    /// No call (the tools stay in the prompt, so its cached KV still serves).
    None,
    /// The reply is a call, to a function the model picks.
    Required,
    /// The reply is a call to this function.
    Function(String),
}

/// A session's tools, with the system turn's block rendered once.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSet {
    tools: Vec<FunctionTool>,
    block: String,
}

impl ToolSet {
    pub fn new(tools: Vec<FunctionTool>) -> Self {
        let mut block = String::from(
            "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
            You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        );
        for t in &tools {
            // (the shape Chat Completions servers hand the template, in its order: `type`, then
            // the function's `name`, `description`, `parameters`)
            block.push_str("\n{\"type\": \"function\", \"function\": {\"name\": ");
            block.push_str(&python_json(&Value::String(t.name.clone())));
            if let Some(d) = &t.description {
                block.push_str(", \"description\": ");
                block.push_str(&python_json(&Value::String(d.clone())));
            }
            if let Some(p) = &t.parameters {
                block.push_str(", \"parameters\": ");
                block.push_str(&python_json(p));
            }
            block.push_str("}}");
        }
        block.push_str(
            "\n</tools>\n\nFor each function call, return a json object with function name and \
            arguments within \
            <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": \
            <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        Self { tools, block }
    }

    pub fn tools(&self) -> &[FunctionTool] {
        &self.tools
    }

    pub fn declares(&self, name: &str) -> bool {
        self.tools.iter().any(|t| t.name == name)
    }

    /// What follows the instructions in the system turn (from the blank line on).
    pub fn block(&self) -> &str {
        &self.block
    }
}

/// `v` as Python's `json.dumps(v, ensure_ascii=False)` writes it (the template's `tojson`): `", "`
/// between items, `": "` after keys, non-ASCII as it is.
pub fn python_json(v: &Value) -> String {
    let mut out = String::new();
    write_python_json(v, &mut out);
    out
}

fn write_python_json(v: &Value, out: &mut String) {
    match v {
        Value::Array(items) => {
            out.push('[');
            for (k, item) in items.iter().enumerate() {
                if k > 0 {
                    out.push_str(", ");
                }
                write_python_json(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (k, (key, item)) in map.iter().enumerate() {
                if k > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push_str(": ");
                write_python_json(item, out);
            }
            out.push('}');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// A call the model wrote: a declared function, and its arguments as a JSON object's text.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

impl ToolCall {
    /// The call as an assistant turn of the template holds it.
    pub fn template_text(&self) -> String {
        format!(
            "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
            Value::String(self.name.clone()),
            self.arguments
        )
    }

    /// A call a client says was made (a conversation it replays): `arguments` must be a JSON
    /// object's text; it is kept as the template writes it.
    pub fn given(name: &str, arguments: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(arguments)
            .map_err(|e| anyhow!("`arguments` is not JSON ({e})"))?;
        if !v.is_object() {
            return Err(anyhow!("`arguments` is not a JSON object"));
        }
        Ok(Self { name: name.to_string(), arguments: python_json(&v) })
    }

    /// Reads the text between `<tool_call>` and `</tool_call>`: a JSON object with a declared
    /// `name` and `arguments` that are an object or a string holding one (models write both; none
    /// is `{}`). The error says what is wrong, for the client.
    pub fn parse(span: &str, tools: &ToolSet) -> std::result::Result<Self, CallError> {
        let v: Value =
            serde_json::from_str(span.trim()).map_err(|e| CallError::NotJson(e.to_string()))?;
        let Value::Object(call) = v else { return Err(CallError::NotAnObject) };
        let name = match call.get("name") {
            Some(Value::String(n)) if tools.declares(n) => n.clone(),
            Some(Value::String(n)) => return Err(CallError::Undeclared(n.clone())),
            _ => return Err(CallError::NoName),
        };
        let arguments = match call.get("arguments") {
            None | Some(Value::Null) => Value::Object(Default::default()),
            Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                .ok()
                .filter(Value::is_object)
                .ok_or(CallError::ArgumentsStringNotAnObject)?,
            Some(a @ Value::Object(_)) => a.clone(),
            Some(_) => return Err(CallError::ArgumentsNotAnObject),
        };
        Ok(Self { name, arguments: python_json(&arguments) })
    }
}

/// What is wrong with a call the model wrote; its text is the message for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// The JSON parser's complaint.
    NotJson(String),
    NotAnObject,
    NoName,
    /// The name the call gives.
    Undeclared(String),
    ArgumentsNotAnObject,
    ArgumentsStringNotAnObject,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::NotJson(e) => write!(f, "the call is not JSON ({e})"),
            CallError::NotAnObject => f.write_str("the call is not a JSON object"),
            CallError::NoName => f.write_str("the call has no `name` string"),
            CallError::Undeclared(n) => {
                write!(f, "the call names `{n}`, which is not a declared tool")
            }
            CallError::ArgumentsNotAnObject => {
                f.write_str("the call's `arguments` is not an object")
            }
            CallError::ArgumentsStringNotAnObject => {
                f.write_str("the call's `arguments` string is not a JSON object")
            }
        }
    }
}

impl std::error::Error for CallError {}

/// An assistant turn's content: what it said, then its calls, each after a newline (none before
/// the first when nothing was said).
pub fn assistant_content(said: &str, calls: &[ToolCall]) -> String {
    let mut out = said.to_string();
    for (k, c) in calls.iter().enumerate() {
        if k > 0 || !said.is_empty() {
            out.push('\n');
        }
        out.push_str(&c.template_text());
    }
    out
}

/// The user turn that gives tools' outputs back, in the order of the calls (the template matches
/// them by position).
pub fn responses_content(outputs: &[String]) -> String {
    outputs
        .iter()
        .map(|o| format!("<tool_response>\n{o}\n</tool_response>"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The start of a reply that must call: `<tool_call>` and the call's JSON up to the function's
/// name (a named function: up to its arguments).
pub fn call_opening(function: Option<&str>) -> String {
    match function {
        None => "<tool_call>\n{\"name\": \"".into(),
        Some(f) => format!("<tool_call>\n{{\"name\": {}, \"arguments\": ", Value::String(f.into())),
    }
}
