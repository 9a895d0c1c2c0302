use super::server::{ItemView, OaiServerEvent, PartView, SessionView};
use super::*;

fn parse(v: serde_json::Value) -> Result<OaiIncoming, (Option<String>, OaiError)> {
    parse_client(&v.to_string())
}

#[test]
fn ga_and_beta_session_updates_mean_the_same() {
    let ga = parse(serde_json::json!({"type": "session.update", "event_id": "e1", "session": {
        "type": "realtime", "instructions": "be brief", "output_modalities": ["text"],
        "audio": {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": null},
                  "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "marin"}},
        "max_output_tokens": 200, "tracing": "auto", "tools": []}}))
    .unwrap();
    assert_eq!(ga.event_id.as_deref(), Some("e1"));
    let beta = parse(serde_json::json!({"type": "session.update", "session": {
        "instructions": "be brief", "modalities": ["text"], "input_audio_format": "g711_ulaw",
        "output_audio_format": "pcm16", "turn_detection": null, "voice": "marin",
        "max_response_output_tokens": 200, "tools": []}}))
    .unwrap();
    assert_eq!(ga.event, beta.event);
    let OaiClientEvent::SessionUpdate(p) = ga.event else { panic!("{:?}", ga.event) };
    assert_eq!(p.output_modalities, Some(Modality::Text));
    assert_eq!(p.input_format, Some(AudioFormat::Pcmu));
    assert_eq!(p.turn_detection, Some(None));
    assert_eq!(p.max_output_tokens, Some(MaxTokens::N(200)));
}

#[test]
fn semantic_vad_is_served_and_bad_knobs_are_named() {
    let e = parse(serde_json::json!({"type": "session.update", "session": {"type": "realtime",
        "audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "medium"}}}}}))
    .unwrap();
    let OaiClientEvent::SessionUpdate(p) = e.event else { panic!() };
    let t = p.turn_detection.unwrap().unwrap();
    assert!(t.semantic && t.create_response && t.interrupt_response);
    for (session, param) in [
        (
            serde_json::json!({"turn_detection": {"type": "server_vad", "threshold": 1.5}}),
            "session.turn_detection.threshold",
        ),
        (
            serde_json::json!({"audio": {"input": {"format": {"type": "audio/pcm",
                "rate": 16000}}}}),
            "session.audio.input.format",
        ),
        (serde_json::json!({"type": "transcription"}), "session.type"),
        (serde_json::json!({"output_modalities": ["video"]}), "session.output_modalities"),
    ] {
        let (id, err) = parse(
            serde_json::json!({"type": "session.update", "event_id": "x", "session": session}),
        )
        .unwrap_err();
        assert_eq!(id.as_deref(), Some("x"));
        assert_eq!(err.param.as_deref(), Some(param), "{err:?}");
    }
}

#[test]
fn audio_and_items_decode() {
    let e =
        parse(serde_json::json!({"type": "input_audio_buffer.append", "audio": "AAEC"})).unwrap();
    assert_eq!(e.event, OaiClientEvent::Append(vec![0, 1, 2]));
    let (_, err) =
        parse(serde_json::json!({"type": "input_audio_buffer.append", "audio": "not base64!"}))
            .unwrap_err();
    assert_eq!(err.param.as_deref(), Some("audio"));
    let (_, err) = parse(serde_json::json!({"type": "input_audio_buffer.append"})).unwrap_err();
    assert_eq!(err.code, OaiErrorCode::MissingRequiredParameter);
    let e = parse(serde_json::json!({"type": "conversation.item.create", "item": {"id": "abc",
        "type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "hi"}]}}))
    .unwrap();
    let OaiClientEvent::ItemCreate { item, .. } = e.event else { panic!() };
    assert_eq!(
        item,
        Item::Message {
            id: Some("abc".into()),
            role: Role::User,
            content: vec![Part::InputText("hi".into())],
            incomplete: false
        }
    );
    let e = parse(serde_json::json!({"type": "conversation.item.create",
        "item": {"type": "function_call_output", "call_id": "c1", "output": "42"}}))
    .unwrap();
    assert!(matches!(
        e.event,
        OaiClientEvent::ItemCreate { item: Item::FunctionCallOutput { .. }, .. }
    ));
    let (_, err) =
        parse(serde_json::json!({"type": "conversation.item.create", "item": {"type": "message",
            "role": "robot", "content": []}}))
        .unwrap_err();
    assert_eq!(err.param.as_deref(), Some("item.role"));
}

#[test]
fn response_create_overrides_and_unknown_events() {
    let e = parse(serde_json::json!({"type": "response.create",
        "response": {"instructions": "shout", "metadata": {"client_event_id": "q"},
        "conversation": "none", "output_modalities": ["audio"], "input": [{"type": "item_reference",
            "id": "abc"}]}}))
    .unwrap();
    let OaiClientEvent::ResponseCreate(p) = e.event else { panic!() };
    assert!(p.out_of_band);
    assert_eq!(p.metadata.unwrap()["client_event_id"], "q");
    assert_eq!(p.input, Some(vec![Item::Reference { id: "abc".into() }]));
    assert_eq!(
        parse(serde_json::json!({"type": "response.create"})).unwrap().event,
        OaiClientEvent::ResponseCreate(Box::default())
    );
    let (_, err) = parse(serde_json::json!({"type": "transcription_session.update"})).unwrap_err();
    assert_eq!(err.code, OaiErrorCode::InvalidEvent);
    let (id, err) = parse_client("{not json").unwrap_err();
    assert!(id.is_none() && err.code == OaiErrorCode::InvalidJson);
}

#[test]
fn server_events_carry_event_id_and_the_ga_names() {
    let s = SessionView {
        id: "sess_1".into(),
        model: "m".into(),
        instructions: "i".into(),
        output_modalities: Modality::Audio,
        input_format: AudioFormat::Pcm24k,
        output_format: AudioFormat::Pcm24k,
        turn_detection: Some(TurnDetection::default()),
        voice: "alloy".into(),
        max_output_tokens: MaxTokens::Inf,
        tools: vec![],
        tool_choice: "auto".into(),
        transcription: None,
    };
    let v: serde_json::Value =
        serde_json::from_str(&OaiServerEvent::SessionCreated(s).to_json("event_1")).unwrap();
    assert_eq!(v["type"], "session.created");
    assert_eq!(v["event_id"], "event_1");
    assert_eq!(v["session"]["type"], "realtime");
    assert_eq!(
        v["session"]["audio"]["output"]["format"],
        serde_json::json!({"type": "audio/pcm", "rate": 24000})
    );
    assert_eq!(v["session"]["audio"]["input"]["turn_detection"]["type"], "server_vad");
    assert_eq!(v["session"]["tool_choice"], "auto");
    let item = ItemView::message(
        "item_1",
        "assistant",
        ItemStatus::Completed,
        vec![PartView::of("output_audio", None, Some("hi".into()))],
    );
    let v: serde_json::Value = serde_json::from_str(
        &OaiServerEvent::ItemAdded { previous_item_id: None, item }.to_json("e"),
    )
    .unwrap();
    assert_eq!(v["type"], "conversation.item.added");
    assert_eq!(v["item"]["object"], "realtime.item");
    assert_eq!(
        v["item"]["content"][0],
        serde_json::json!({"type": "output_audio", "transcript": "hi"})
    );
}

/// A field of the wrong type is refused naming its param, never read as absent or defaulted (issue
/// 38: each of these was accepted; `response.cancel` with `response_id: 5` cancelled the running
/// response as if no id had been given).
#[test]
fn wrong_types_are_refused_naming_the_param() {
    use serde_json::json;
    let cases = [
        (json!({"type": "session.update", "session": {"tool_choice": 5}}), "session.tool_choice"),
        (
            json!({"type": "session.update", "session": {"tool_choice": "sometimes"}}),
            "session.tool_choice",
        ),
        (
            json!({"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad",
                "eagerness": 7}}}),
            "session.turn_detection.eagerness",
        ),
        (
            json!({"type": "conversation.item.create", "item": {"type": 5, "role": "user",
                "content": []}}),
            "item.type",
        ),
        (
            json!({"type": "conversation.item.create", "item": {"type": "function_call",
                "name": "f", "arguments": {"a": 1}}}),
            "item.arguments",
        ),
        (
            json!({"type": "conversation.item.create", "item": {"type": "function_call",
                "name": "f", "call_id": 3}}),
            "item.call_id",
        ),
        (
            json!({"type": "conversation.item.create", "previous_item_id": 5,
                "item": {"role": "user", "content": [{"type": "input_text", "text": "x"}]}}),
            "previous_item_id",
        ),
        (
            json!({"type": "conversation.item.create", "item": {"role": "assistant",
                "content": [{"type": "output_audio", "transcript": 5}]}}),
            "item.content[0].transcript",
        ),
        (json!({"type": "response.create", "response": {"audio": "x"}}), "response.audio"),
        (json!({"type": "response.cancel", "response_id": 5}), "response_id"),
    ];
    for (v, param) in cases {
        let (_, e) = parse(v.clone()).expect_err(&format!("{v} was accepted"));
        assert_eq!(e.param.as_deref(), Some(param), "{v}: {e:?}");
        assert_eq!(e.code, OaiErrorCode::InvalidValue, "{v}");
    }
    // the right types still pass, absent and null alike
    for v in [
        json!({"type": "session.update", "session": {"tool_choice": "auto"}}),
        json!({"type": "session.update", "session": {"tool_choice": {"type": "function",
            "name": "f"}}}),
        json!({"type": "response.cancel"}),
        json!({"type": "response.cancel", "response_id": null}),
        json!({"type": "conversation.item.create", "item": {"type": "function_call", "name": "f",
            "arguments": "{\"a\":1}"}}),
    ] {
        assert!(parse(v.clone()).is_ok(), "{v}");
    }
}
