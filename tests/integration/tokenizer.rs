//! Tokenizer, special tokens, the spoken-reply prompt, the hand-off slice and text deltas.

use antiphon_assets::synth::{tokenizer_json, Preset, REAL_SPECIAL_IDS, REAL_TOOL_IDS};
use antiphon_models::tokenizer::{
    handoff_range, voice_clone_system, Message, Part, Role, SpecialTokens, TextStream,
    TextTokenizer,
};

fn tiny() -> TextTokenizer {
    TextTokenizer::from_bytes(
        tokenizer_json(&Preset::Tiny.special_ids(), &Preset::Tiny.tool_ids())
            .to_string()
            .as_bytes(),
    )
    .unwrap()
}

#[test]
fn special_ids_are_looked_up_not_assumed() {
    let t = tiny();
    assert_eq!(t.special().im_start, 257);
    assert_eq!(t.special().tts_bos, 256 + 10);
    let full = TextTokenizer::from_bytes(
        tokenizer_json(&REAL_SPECIAL_IDS, &REAL_TOOL_IDS).to_string().as_bytes(),
    )
    .unwrap();
    let s = full.special();
    assert_eq!(
        (s.im_start, s.im_end, s.tts_bos, s.tts_eos, s.unk),
        (151644, 151645, 151703, 151704, 128244)
    );
    assert_eq!(
        (s.listen, s.speak, s.unit, s.turn_eos, s.chunk_eos, s.tts_pad),
        (151705, 151706, 151683, 151717, 151718, 151722)
    );
}

#[test]
fn a_missing_special_token_is_named() {
    let mut j = tokenizer_json(&Preset::Tiny.special_ids(), &Preset::Tiny.tool_ids());
    let added = j["added_tokens"].as_array_mut().unwrap();
    added.retain(|t| t["content"] != "<|tts_bos|>" && t["content"] != "<unit>");
    j["model"]["vocab"].as_object_mut().unwrap().remove("<|tts_bos|>");
    j["model"]["vocab"].as_object_mut().unwrap().remove("<unit>");
    let err = TextTokenizer::from_bytes(j.to_string().as_bytes()).unwrap_err().to_string();
    assert!(err.contains("<|tts_bos|>") && err.contains("<unit>"), "{err}");
}

#[test]
fn user_text_cannot_smuggle_special_tokens() {
    let t = tiny();
    let ids = t.encode("hi <|im_end|> there").unwrap();
    assert!(!ids.contains(&t.special().im_end));
    assert_eq!(t.decode(&ids).unwrap(), "hi <|im_end|> there");
    assert_eq!(SpecialTokens::NAMES.len(), 18);
}

#[test]
fn spoken_reply_prompt_follows_the_chat_template() {
    let t = tiny();
    let s = *t.special();
    let msgs = vec![
        voice_clone_system(3),
        Message { role: Role::User, parts: vec![Part::Audio(4), Part::Text("Hi".into())] },
    ];
    let ids = t.spoken_reply_prompt(&msgs).unwrap();
    let enc = |x: &str| t.encode(x).unwrap();
    let mut want = vec![s.im_start];
    want.extend(enc("system\nUse the voice in the audio prompt to synthesize new content.\n"));
    want.push(s.audio_start);
    want.extend([s.unk; 3]);
    want.push(s.audio_end);
    want.extend(enc("\nYou are a helpful assistant with the above voice style."));
    want.push(s.im_end);
    want.extend(enc("\n"));
    want.push(s.im_start);
    want.extend(enc("user\n"));
    want.push(s.audio_start);
    want.extend([s.unk; 4]);
    want.push(s.audio_end);
    want.extend(enc("Hi"));
    want.push(s.im_end);
    want.extend(enc("\n"));
    want.push(s.im_start);
    want.extend(enc("assistant\n"));
    want.push(s.think);
    want.extend(enc("\n\n"));
    want.push(s.think_end);
    want.extend(enc("\n\n"));
    want.push(s.tts_bos);
    assert_eq!(ids, want);
    // a written reply (the ASR task's template): the same without <|tts_bos|>
    assert_eq!(t.written_reply_prompt(&msgs).unwrap(), want[..want.len() - 1]);
    assert_eq!(
        t.decode(&ids).unwrap(),
        "system\nUse the voice in the audio prompt to synthesize \
        new content.\n\nYou are a helpful assistant with the above voice \
        style.\nuser\nHi\nassistant\n\n\n\n\n"
    );
}

#[test]
fn handoff_slice_runs_from_tts_bos_to_the_first_boundary() {
    let t = tiny();
    let s = *t.special();
    let prompt = t.spoken_reply_prompt(&[Message::text(Role::User, "x")]).unwrap();
    let p = prompt.len();
    let mut ids = prompt.clone();
    ids.extend([10, 11, 12, s.tts_eos, s.im_end]);
    assert_eq!(handoff_range(&ids, p, &s), p..p + 3);
    // no boundary yet: up to the end
    assert_eq!(handoff_range(&ids[..p + 2], p, &s), p..p + 2);
    // duplex-style segment ending at <|chunk_eos|>, after an earlier <|tts_bos|>
    let mut d = ids.clone();
    d.extend([s.tts_bos, 40, 41, s.chunk_eos, 42]);
    assert_eq!(handoff_range(&d, p, &s), ids.len() + 1..ids.len() + 3);
    // without <|tts_bos|>: the generated span
    let plain = [1, 2, 3, 50, 51, s.im_end];
    assert_eq!(handoff_range(&plain, 3, &s), 3..5);
}

#[test]
fn text_stream_emits_whole_characters() {
    let t = tiny();
    let ids = t.encode("héllo ✓").unwrap();
    let mut ts = TextStream::new();
    let mut out = Vec::new();
    for id in ids {
        let d = ts.push(&t, id).unwrap();
        assert!(!d.contains('\u{FFFD}'));
        out.push(d);
    }
    assert_eq!(out.concat(), "héllo ✓");
    assert!(out.iter().any(|d| d.is_empty()), "partial multi-byte characters wait");
}

/// A text seen before comes from the memo with the same ids, a text longer than 16 KiB is never
/// kept, clones share the memo, and the memo stays within its 8 MiB however many texts pass.
#[test]
fn the_encode_memo_gives_the_same_ids_and_stays_bounded() {
    let t = tiny();
    let fresh = tiny();
    let text = "user\nwhat did I say two turns ago?";
    let first = t.encode(text).unwrap();
    assert_eq!(t.memo_size().0, 1);
    assert_eq!(t.encode(text).unwrap(), first, "from the memo");
    assert_eq!(fresh.encode(text).unwrap(), first, "as a tokenizer that never saw it");
    let clone = t.clone();
    clone.encode("another turn").unwrap();
    assert_eq!(t.memo_size().0, 2, "clones share one memo");
    t.encode(&"x".repeat(17 << 10)).unwrap();
    assert_eq!(t.memo_size().0, 2, "a long text is not kept");
    // (~75 KB a text with its ids: the bound is passed after ~110)
    for i in 0..160 {
        let text = format!("turn {i:03} ").repeat(1600);
        let ids = t.encode(&text).unwrap();
        if i % 40 == 0 {
            assert_eq!(ids, fresh.encode(&text).unwrap());
        }
        assert!(t.memo_size().1 <= 8 << 20, "{:?} after {i} texts", t.memo_size());
    }
    assert!(t.memo_size().0 < 160, "it started over: {:?}", t.memo_size());
}

/// The tool template's four tags are looked up by name (the tiny preset after its special tokens,
/// the full one at Qwen3's ids); they are not special: they decode as text, and text that holds
/// them encodes to them (Hugging Face's way), unlike `<|im_end|>`. The Thinker may write a call's
/// two only in a reply that may call, the responses' never.
#[test]
fn the_tool_tags_are_text_tokens_looked_up_by_name() {
    let t = tiny();
    let tags = *t.tool_tokens().unwrap();
    assert_eq!(tags.all(), [274, 275, 276, 277]);
    let full = TextTokenizer::from_bytes(
        tokenizer_json(&REAL_SPECIAL_IDS, &REAL_TOOL_IDS).to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(full.tool_tokens().unwrap().all(), [151657, 151658, 151665, 151666]);
    let ids = t.encode("a<tool_call>b</tool_call>").unwrap();
    assert_eq!(ids, [b'a' as u32, tags.call, b'b' as u32, tags.call_end]);
    assert_eq!(t.decode(&ids).unwrap(), "a<tool_call>b</tool_call>");
    let f = t.forbidden();
    assert!(tags.all().iter().all(|id| f.reply.contains(id)
        && f.duplex_speech.contains(id)
        && f.duplex_decision.contains(id)));
    assert!(!f.reply_calling.contains(&tags.call) && !f.reply_calling.contains(&tags.call_end));
    assert!(
        f.reply_calling.contains(&tags.response) && f.reply_calling.contains(&tags.response_end)
    );
    // a tokenizer without them serves no tools, and forbids nothing more
    let mut j = tokenizer_json(&Preset::Tiny.special_ids(), &Preset::Tiny.tool_ids());
    j["added_tokens"].as_array_mut().unwrap().retain(|a| a["content"] != "</tool_response>");
    j["model"]["vocab"].as_object_mut().unwrap().remove("</tool_response>");
    let without = TextTokenizer::from_bytes(j.to_string().as_bytes()).unwrap();
    assert!(without.tool_tokens().is_none());
    assert_eq!(without.forbidden().reply, without.special().forbidden().reply);
}

/// The system turn's tools block, an assistant turn that spoke and called, and the user turn of
/// two tools' outputs, as Qwen3's template writes them (the strings below are the Jinja
/// template's output for these messages, written out by hand from its source).
#[test]
fn tools_calls_and_results_render_as_the_qwen3_template_does() {
    use antiphon_models::tools::{
        assistant_content, responses_content, FunctionTool, ToolCall, ToolSet,
    };
    let params = serde_json::json!({"type": "object", "properties": {"city": {"type": "string",
        "description": "Où"}}, "required": ["city"]});
    let set = ToolSet::new(vec![
        FunctionTool {
            name: "get_weather".into(),
            description: Some("The weather \"now\"".into()),
            parameters: Some(params),
        },
        FunctionTool { name: "hang_up".into(), description: None, parameters: None },
    ]);
    let want = "\n\n# Tools\n\nYou may call one or more functions to assist with the user \
    query.\n\nYou are provided with function signatures within <tools></tools> XML \
    tags:\n<tools>\n\
    {\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"The \
    weather \\\"now\\\"\", \"parameters\": {\"properties\": {\"city\": \
    {\"description\": \"Où\", \"type\": \"string\"}}, \"required\": \
    [\"city\"], \"type\": \"object\"}}}\n\
    {\"type\": \"function\", \"function\": {\"name\": \"hang_up\"}}\n</tools>\n\n\
    For each function call, return a json object with function name and arguments within \
    <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": \
    <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";
    assert_eq!(set.block(), want);
    let call = ToolCall::parse(
        " \n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n",
        &set,
    )
    .unwrap();
    assert_eq!(
        call,
        ToolCall { name: "get_weather".into(), arguments: "{\"city\": \"Paris\"}".into() }
    );
    let hang = ToolCall::parse("{\"name\": \"hang_up\"}", &set).unwrap();
    assert_eq!(hang.arguments, "{}");
    assert_eq!(
        assistant_content("Let me look.", &[call.clone(), hang.clone()]),
        "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
        {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"hang_up\", \
        \"arguments\": {}}\n</tool_call>"
    );
    assert_eq!(
        assistant_content("", std::slice::from_ref(&hang)),
        "<tool_call>\n{\"name\": \"hang_up\", \"arguments\": {}}\n</tool_call>"
    );
    assert_eq!(
        responses_content(&["18 °C".into(), "ok".into()]),
        "<tool_response>\n18 °C\n</tool_response>\n<tool_response>\nok\n</tool_response>"
    );
    // a string holding the arguments' object is taken as the object
    let s = ToolCall::parse(
        "{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}",
        &set,
    )
    .unwrap();
    assert_eq!(s.arguments, "{\"city\": \"Oslo\"}");
    for (span, says) in [
        ("{\"name\": \"get_time\"}", "`get_time`, which is not a declared tool"),
        ("not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ("{\"arguments\": {}}", "no `name`"),
        ("{\"name\": \"hang_up\", \"arguments\": 3}", "not an object"),
        ("{\"name\": \"hang_up\", \"arguments\": \"nope\"}", "string is not a JSON object"),
    ] {
        let e = ToolCall::parse(span, &set).unwrap_err().to_string();
        assert!(e.contains(says), "{span}: {e}");
    }
}
