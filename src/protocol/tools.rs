//! Tools on the wire (docs/protocol.md, "Tool calls"): the functions a session declares, which
//! calls a response may make, and the results a client gives back, each bounded here before the
//! session sees it.

use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;

use crate::{ErrorCode, WireError};

/// Tools a session may declare.
pub const MAX_TOOLS: usize = 128;
/// A tool's name: 1 to 64 of `A-Z a-z 0-9 _ -` (OpenAI's rule).
pub const MAX_TOOL_NAME: usize = 64;
/// The declared tools together, as JSON: they go into every prompt's system turn.
pub const MAX_TOOLS_BYTES: usize = 32 << 10;
/// Results one `input.tool_result` gives back.
pub const MAX_TOOL_RESULTS: usize = 16;
/// One tool's output, in characters.
pub const MAX_TOOL_OUTPUT_CHARS: usize = 16 << 10;

/// A function a session declares.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct ToolDecl {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Its parameters' JSON Schema (an object).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
}

/// Which calls a response may make: `"auto"` (the model decides), `"none"`, `"required"`, or
/// `{"name": …}` (that function; `{"type": "function", "name": …}` is read the same).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Function(String),
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match Value::deserialize(d)? {
            Value::String(s) => match s.as_str() {
                "auto" => Ok(ToolChoice::Auto),
                "none" => Ok(ToolChoice::None),
                "required" => Ok(ToolChoice::Required),
                other => Err(D::Error::custom(format!(
                    "`{other}` is not \"auto\", \"none\", \"required\" or {{\"name\": …}}"
                ))),
            },
            Value::Object(o) => match (o.get("name"), o.get("type")) {
                (Some(Value::String(n)), None) => Ok(ToolChoice::Function(n.clone())),
                (Some(Value::String(n)), Some(Value::String(t))) if t == "function" => {
                    Ok(ToolChoice::Function(n.clone()))
                }
                _ => Err(D::Error::custom("an object must be {\"name\": \"<a declared tool>\"}")),
            },
            _ => Err(D::Error::custom(
                "must be \"auto\", \"none\", \"required\" or \
                {\"name\": …}",
            )),
        }
    }
}

impl Serialize for ToolChoice {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ToolChoice::Auto => s.serialize_str("auto"),
            ToolChoice::None => s.serialize_str("none"),
            ToolChoice::Required => s.serialize_str("required"),
            ToolChoice::Function(name) => serde_json::json!({ "name": name }).serialize(s),
        }
    }
}

/// A tool's output for one call.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct ToolResult {
    pub call_id: String,
    pub output: String,
}

/// A function's name as OpenAI allows it: 1 to [`MAX_TOOL_NAME`] of `A-Z a-z 0-9 _ -`.
pub fn valid_tool_name(name: &str) -> bool {
    (1..=MAX_TOOL_NAME).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn bad(m: String) -> WireError {
    WireError::new(ErrorCode::BadField, m)
}

/// Declared tools within the bounds: at most [`MAX_TOOLS`], names unique and well formed,
/// parameters an object, [`MAX_TOOLS_BYTES`] in all.
pub fn validate_tools(tools: &[ToolDecl]) -> Result<(), WireError> {
    if tools.len() > MAX_TOOLS {
        return Err(bad(format!(
            "field `tools`: {} tools, more than this server takes (at most {MAX_TOOLS})",
            tools.len()
        )));
    }
    for (k, t) in tools.iter().enumerate() {
        if !valid_tool_name(&t.name) {
            return Err(bad(format!(
                "field `tools[{k}].name`: {:?} is not 1-{MAX_TOOL_NAME} of A-Z a-z 0-9 _ -",
                t.name
            )));
        }
        if tools[..k].iter().any(|o| o.name == t.name) {
            return Err(bad(format!("field `tools[{k}].name`: `{}` is declared twice", t.name)));
        }
        if t.parameters.as_ref().is_some_and(|p| !p.is_object()) {
            return Err(bad(format!(
                "field `tools[{k}].parameters`: must be a JSON Schema object"
            )));
        }
    }
    let bytes = serde_json::to_string(tools).map(|s| s.len()).unwrap_or(usize::MAX);
    if bytes > MAX_TOOLS_BYTES {
        return Err(bad(format!(
            "field `tools`: {bytes} bytes of JSON, more than this server takes \
            (at most {MAX_TOOLS_BYTES})"
        )));
    }
    Ok(())
}

/// A `tool_choice` the declared tools can honour (`field` names where it came from).
pub fn validate_tool_choice(
    choice: &ToolChoice,
    tools: &[ToolDecl],
    field: &str,
) -> Result<(), WireError> {
    match choice {
        ToolChoice::Required if tools.is_empty() => {
            Err(bad(format!("field `{field}`: \"required\", but the session declares no tools")))
        }
        ToolChoice::Function(n) if !tools.iter().any(|t| &t.name == n) => {
            Err(bad(format!("field `{field}`: `{n}` is not a declared tool")))
        }
        _ => Ok(()),
    }
}

/// Results within the bounds: 1 to [`MAX_TOOL_RESULTS`], each output at most
/// [`MAX_TOOL_OUTPUT_CHARS`], no call answered twice.
pub fn validate_results(results: &[ToolResult]) -> Result<(), WireError> {
    if results.is_empty() || results.len() > MAX_TOOL_RESULTS {
        return Err(bad(format!(
            "field `results`: {} results; give 1 to {MAX_TOOL_RESULTS}",
            results.len()
        )));
    }
    for (k, r) in results.iter().enumerate() {
        let n = r.output.chars().count();
        if n > MAX_TOOL_OUTPUT_CHARS {
            return Err(bad(format!(
                "field `results[{k}].output`: {n} characters, more than this \
                server takes (at most {MAX_TOOL_OUTPUT_CHARS})"
            )));
        }
        if results[..k].iter().any(|o| o.call_id == r.call_id) {
            return Err(bad(format!(
                "field `results[{k}].call_id`: `{}` is answered twice",
                r.call_id
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decl(name: &str) -> ToolDecl {
        ToolDecl { name: name.into(), description: None, parameters: None }
    }

    #[test]
    fn tool_choice_reads_every_form_and_names_what_is_wrong() {
        let read = |s: &str| serde_json::from_str::<ToolChoice>(s);
        assert_eq!(read("\"auto\"").unwrap(), ToolChoice::Auto);
        assert_eq!(read("\"none\"").unwrap(), ToolChoice::None);
        assert_eq!(read("\"required\"").unwrap(), ToolChoice::Required);
        assert_eq!(read(r#"{"name": "f"}"#).unwrap(), ToolChoice::Function("f".into()));
        assert_eq!(
            read(r#"{"type": "function", "name": "f"}"#).unwrap(),
            ToolChoice::Function("f".into())
        );
        assert!(read("\"sometimes\"").unwrap_err().to_string().contains("sometimes"));
        assert!(read(r#"{"type": "mcp", "name": "f"}"#).is_err());
        assert!(read("3").is_err());
        assert_eq!(
            serde_json::to_string(&ToolChoice::Function("f".into())).unwrap(),
            r#"{"name":"f"}"#
        );
    }

    #[test]
    fn tools_and_results_beyond_the_bounds_are_refused_naming_the_field() {
        assert!(validate_tools(&[decl("get_weather"), decl("hang-up")]).is_ok());
        let field = |r: Result<(), WireError>| {
            r.unwrap_err().message.split('`').nth(1).unwrap().to_string()
        };
        assert_eq!(field(validate_tools(&[decl("a"), decl("bad name")])), "tools[1].name");
        assert_eq!(field(validate_tools(&[decl("")])), "tools[0].name");
        assert_eq!(field(validate_tools(&[decl(&"x".repeat(65))])), "tools[0].name");
        assert_eq!(field(validate_tools(&[decl("a"), decl("a")])), "tools[1].name");
        let mut p = decl("p");
        p.parameters = Some(serde_json::json!([1]));
        assert_eq!(field(validate_tools(&[p])), "tools[0].parameters");
        let many: Vec<ToolDecl> = (0..=MAX_TOOLS).map(|k| decl(&format!("f{k}"))).collect();
        assert_eq!(field(validate_tools(&many)), "tools");
        let mut big = decl("big");
        big.description = Some("x".repeat(MAX_TOOLS_BYTES));
        assert_eq!(field(validate_tools(&[big])), "tools");
        assert_eq!(
            field(validate_tool_choice(&ToolChoice::Required, &[], "generation.tool_choice")),
            "generation.tool_choice"
        );
        assert_eq!(
            field(validate_tool_choice(&ToolChoice::Function("g".into()), &[decl("f")], "x")),
            "x"
        );
        assert!(validate_tool_choice(&ToolChoice::Function("f".into()), &[decl("f")], "x").is_ok());
        let r = |id: &str, n: usize| ToolResult { call_id: id.into(), output: "é".repeat(n) };
        assert!(validate_results(&[r("a", MAX_TOOL_OUTPUT_CHARS)]).is_ok());
        assert_eq!(field(validate_results(&[])), "results");
        assert_eq!(
            field(validate_results(&[r("a", 1), r("b", MAX_TOOL_OUTPUT_CHARS + 1)])),
            "results[1].output"
        );
        assert_eq!(field(validate_results(&[r("a", 1), r("a", 1)])), "results[1].call_id");
    }
}
