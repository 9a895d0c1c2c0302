//! The dialect's fields one by one: each checked and turned into its typed value, or refused
//! naming the field.

use super::*;

pub(super) fn bad(param: &str, message: impl Into<String>) -> OaiError {
    OaiError::param(OaiErrorCode::InvalidValue, param, message)
}

pub(super) fn string(v: &Value, param: &str) -> Result<String, OaiError> {
    v.as_str().map(str::to_string).ok_or_else(|| bad(param, format!("`{param}` must be a string")))
}

/// An optional string field: absent or null is `None`, a string is taken, anything else is refused
/// (naming `param`), never read as absent.
pub(super) fn opt_string(
    o: &Map<String, Value>,
    key: &str,
    param: &str,
) -> Result<Option<String>, OaiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => string(v, param).map(Some),
    }
}

/// `tool_choice`: "auto", "none", "required", or an object naming a tool.
pub(super) fn tool_choice(v: &Value, param: &str) -> Result<Value, OaiError> {
    match v {
        Value::String(s) if ["auto", "none", "required"].contains(&s.as_str()) => Ok(v.clone()),
        Value::Object(_) => Ok(v.clone()),
        _ => Err(bad(
            param,
            format!(
                "`{param}` must be \"auto\", \"none\", \"required\" or an object naming a tool"
            ),
        )),
    }
}

pub(super) fn id_field(v: &Value, param: &str) -> Result<String, OaiError> {
    let s = string(v, param)?;
    if s.is_empty() || s.chars().count() > MAX_ID_CHARS {
        return Err(bad(param, format!("`{param}` must be 1 to {MAX_ID_CHARS} characters")));
    }
    Ok(s)
}

pub(super) fn required<'a>(
    o: &'a Map<String, Value>,
    key: &str,
    param: &str,
) -> Result<&'a Value, OaiError> {
    o.get(key).filter(|v| !v.is_null()).ok_or_else(|| {
        OaiError::param(OaiErrorCode::MissingRequiredParameter, param, format!("missing `{param}`"))
    })
}

pub(super) fn object<'a>(v: &'a Value, param: &str) -> Result<&'a Map<String, Value>, OaiError> {
    v.as_object().ok_or_else(|| bad(param, format!("`{param}` must be an object")))
}

/// Base64 audio, decoded (`param` names the field in errors).
pub fn decode_audio(v: &Value, param: &str) -> Result<Vec<u8>, OaiError> {
    let s = string(v, param)?;
    base64::engine::general_purpose::STANDARD
        .decode(s.as_bytes())
        .map_err(|e| bad(param, format!("`{param}` is not base64: {e}")))
}

pub(super) fn format(v: &Value, param: &str) -> Result<AudioFormat, OaiError> {
    // GA: {"type": "audio/pcm", "rate": 24000}; beta: "pcm16" | "g711_ulaw" | "g711_alaw"
    let (ty, rate) = match v {
        Value::String(s) => (s.as_str(), None),
        Value::Object(o) => (o.get("type").and_then(Value::as_str).unwrap_or(""), o.get("rate")),
        _ => ("", None),
    };
    match (ty, rate.and_then(Value::as_u64)) {
        ("audio/pcm", None | Some(24_000)) | ("pcm16", _) => Ok(AudioFormat::Pcm24k),
        ("audio/pcm", Some(r)) => {
            Err(bad(param, format!("`{param}.rate` {r}: audio/pcm is 24000 Hz")))
        }
        ("audio/pcmu", _) | ("g711_ulaw", _) => Ok(AudioFormat::Pcmu),
        ("audio/pcma", _) | ("g711_alaw", _) => Ok(AudioFormat::Pcma),
        _ => Err(bad(
            param,
            format!(
                "`{param}`: expected audio/pcm (24000 Hz), audio/pcmu or \
                audio/pcma (or pcm16, g711_ulaw, g711_alaw)"
            ),
        )),
    }
}

pub(super) fn modalities(v: &Value, param: &str) -> Result<Modality, OaiError> {
    let list: Vec<&str> =
        v.as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    match () {
        _ if list.contains(&"audio") => Ok(Modality::Audio),
        _ if list == ["text"] => Ok(Modality::Text),
        _ => Err(bad(param, format!("`{param}` must be [\"audio\"] or [\"text\"]"))),
    }
}

pub(super) fn max_tokens(v: &Value, param: &str) -> Result<MaxTokens, OaiError> {
    match v {
        Value::String(s) if s == "inf" => Ok(MaxTokens::Inf),
        Value::Number(n) if n.as_u64().is_some_and(|n| n >= 1) => {
            Ok(MaxTokens::N(n.as_u64().unwrap_or(1)))
        }
        _ => Err(bad(param, format!("`{param}` must be a positive integer or \"inf\""))),
    }
}

pub(super) fn temperature(v: &Value, param: &str) -> Result<f32, OaiError> {
    v.as_f64()
        .filter(|t| t.is_finite() && (0.0..=2.0).contains(t))
        .map(|t| t as f32)
        .ok_or_else(|| bad(param, format!("`{param}` must be 0 to 2")))
}

pub(super) fn voice(v: &Value, param: &str) -> Result<String, OaiError> {
    match v {
        Value::Object(o) => {
            id_field(required(o, "id", &format!("{param}.id"))?, &format!("{param}.id"))
        }
        v => id_field(v, param),
    }
}

pub(super) fn turn_detection(v: &Value, param: &str) -> Result<Option<TurnDetection>, OaiError> {
    let o = match v {
        Value::Null | Value::Bool(false) => return Ok(None),
        v => object(v, param)?,
    };
    let mut t = TurnDetection::default();
    match o.get("type").and_then(Value::as_str) {
        None | Some("server_vad") => {}
        Some("semantic_vad") => t.semantic = true,
        Some(other) => {
            return Err(bad(
                &format!("{param}.type"),
                format!("turn detection `{other}`: expected server_vad or semantic_vad"),
            ))
        }
    }
    let num = |k: &str| o.get(k).filter(|v| !v.is_null());
    if let Some(x) = num("threshold") {
        t.threshold = x
            .as_f64()
            .filter(|x| (0.0..=1.0).contains(x))
            .ok_or_else(|| bad(&format!("{param}.threshold"), "threshold must be 0 to 1"))?
            as f32;
    }
    for (k, slot, max) in [
        ("prefix_padding_ms", &mut t.prefix_padding_ms, 5_000u64),
        ("silence_duration_ms", &mut t.silence_duration_ms, 10_000),
    ] {
        if let Some(x) = num(k) {
            *slot =
                x.as_u64().filter(|x| *x <= max).ok_or_else(|| {
                    bad(&format!("{param}.{k}"), format!("{k} must be 0 to {max}"))
                })? as u32;
        }
    }
    for (k, slot) in [
        ("create_response", &mut t.create_response),
        ("interrupt_response", &mut t.interrupt_response),
    ] {
        if let Some(x) = num(k) {
            *slot = x
                .as_bool()
                .ok_or_else(|| bad(&format!("{param}.{k}"), format!("{k} must be a boolean")))?;
        }
    }
    t.eagerness = match opt_string(o, "eagerness", &format!("{param}.eagerness"))? {
        Some(e) if ["low", "medium", "high", "auto"].contains(&e.as_str()) => Some(e),
        Some(_) => {
            return Err(bad(
                &format!("{param}.eagerness"),
                "eagerness must be low, medium, high or auto",
            ))
        }
        None => None,
    };
    Ok(Some(t))
}

/// `transcription`: null (off) or an object (`model`, `language`, `prompt`, … echoed; the Thinker
/// transcribes whatever model is named).
pub(super) fn transcription(v: &Value, param: &str) -> Result<Option<Value>, OaiError> {
    match v {
        Value::Null => Ok(None),
        Value::Object(o) if serde_json::to_string(o).map_or(0, |s| s.len()) <= 4096 => {
            Ok(Some(v.clone()))
        }
        _ => Err(bad(param, format!("`{param}` must be null or an object of at most 4 KiB"))),
    }
}

pub(super) fn tools(v: &Value, param: &str) -> Result<Vec<Value>, OaiError> {
    let a = v.as_array().ok_or_else(|| bad(param, format!("`{param}` must be an array")))?;
    if a.len() > MAX_TOOLS {
        return Err(bad(param, format!("at most {MAX_TOOLS} tools")));
    }
    Ok(a.clone())
}
