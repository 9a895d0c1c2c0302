use super::*;

/// Counts beyond what the wire can mean are refused, naming the field (issue 38).
#[test]
fn counts_beyond_the_wire_are_a_bad_field() {
    let refused = |text: &str, field: &str| {
        let e = parse_client(text).expect_err(text);
        assert_eq!(e.code, ErrorCode::BadField, "{text}");
        assert!(e.message.contains(field), "{text}: {}", e.message);
    };
    refused(r#"{"type": "input.clear", "seq": 9007199254740993}"#, "`seq`");
    refused(r#"{"type": "input.clear", "seq": 4294967296}"#, "`seq`");
    refused(
        r#"{"type": "playback", "response_id": 1, "played_ms": 9007199254740992}"#,
        "`played_ms`",
    );
    assert_eq!(
        parse_client(r#"{"type": "input.clear", "seq": 4294967295}"#).unwrap().seq,
        Some(4_294_967_295)
    );
    assert!(parse_client(
        r#"{"type": "playback", "response_id": 1, "played_ms": 9007199254740991}"#
    )
    .is_ok());
}

#[test]
fn generation_beyond_the_limits_is_a_bad_field_naming_it() {
    let limits = GenerationLimits { max_text_tokens: 100, max_audio_tokens: 500 };
    let g = |f: &dyn Fn(&mut Generation)| {
        let mut g = Generation::default();
        f(&mut g);
        g.validate(&limits)
    };
    assert!(g(&|_| {}).is_ok());
    assert!(g(&|g| g.max_text_tokens = Some(100)).is_ok());
    for (field, set) in [
        (
            "max_text_tokens",
            &(|g: &mut Generation| g.max_text_tokens = Some(4_294_967_296))
                as &dyn Fn(&mut Generation),
        ),
        ("min_text_tokens", &|g| g.min_text_tokens = Some(101)),
        ("max_audio_tokens", &|g| g.max_audio_tokens = Some(501)),
        ("min_audio_tokens", &|g| {
            g.min_audio_tokens = Some(50);
            g.max_audio_tokens = Some(10)
        }),
        ("temperature", &|g| g.temperature = Some(-0.5)),
        ("temperature", &|g| g.temperature = Some(f32::NAN)),
    ] {
        let e = g(set).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadField);
        assert!(e.message.contains(field), "{field}: {}", e.message);
    }
}

#[test]
fn frames_round_trip() {
    let f = AudioFrame { kind: 1, last: true, seq: 77, response_id: 3, payload: vec![9, 8, 7] };
    let b = f.encode();
    assert_eq!(&b[..4], &[1, 1, 0, 0]);
    assert_eq!(AudioFrame::decode(&b).unwrap(), f);
    assert!(AudioFrame::decode(&b[..11]).is_none());
}

#[test]
fn parse_errors_name_what_is_wrong() {
    assert_eq!(parse_client("{nope").unwrap_err().code, ErrorCode::BadJson);
    assert_eq!(parse_client("[1]").unwrap_err().code, ErrorCode::BadJson);
    assert_eq!(parse_client(r#"{"type":"dance"}"#).unwrap_err().code, ErrorCode::UnknownEvent);
    let e = parse_client(concat!(
        r#"{"type":"session.create","input_audio":{"codec":"pcm16","sample_rate":16000},"#,
        r#""output_audio":{"codec":"opus"}}"#
    ))
    .unwrap_err();
    assert_eq!(e.code, ErrorCode::BadField);
    assert!(e.message.contains("mode"), "{}", e.message);
    let e = parse_client(concat!(
        r#"{"type":"session.create","mode":"turn","#,
        r#""input_audio":{"codec":"mp3","sample_rate":16000},"output_audio":{"codec":"opus"}}"#,
    ))
    .unwrap_err();
    assert!(e.message.contains("input_audio.codec"), "{}", e.message);
    let e = parse_client(r#"{"type":"playback","response_id":"x","played_ms":3}"#).unwrap_err();
    assert!(e.message.contains("response_id"), "{}", e.message);
    let e = parse_client(r#"{"type":"session.update","mode":"duplex"}"#).unwrap_err();
    assert!(e.message.contains("mode"));
}

#[test]
fn client_events_parse() {
    let i = parse_client(r#"{"type":"input.text","text":"hi","seq":4}"#).unwrap();
    assert_eq!(i.seq, Some(4));
    assert_eq!(i.event, ClientEvent::InputText { text: "hi".into(), generation: None });
    let i = parse_client(r#"{"type":"ack","seq":9}"#).unwrap();
    assert_eq!(i.seq, None, "an ack's seq is the server seq it acknowledges");
    assert_eq!(i.event, ClientEvent::Ack { seq: 9 });
    let i = parse_client(concat!(
        r#"{"type":"session.create","mode":"duplex","#,
        r#""input_audio":{"codec":"opus","sample_rate":48000},"#,
        r#""output_audio":{"codec":"pcm16","frame_ms":40},"voice":{"id":"default"},"#,
        r#""duplex":{"policy":"speak_every","k":2}}"#,
    ))
    .unwrap();
    let ClientEvent::SessionCreate(c) = i.event else { panic!() };
    assert_eq!(c.duplex, Some(DuplexPolicy::SpeakEvery { k: 2 }));
    assert_eq!(c.voice, Some(Voice::Configured { id: "default".into() }));
}

#[test]
fn server_events_carry_seq_except_connection_level() {
    let e =
        ServerEvent::ResponseCreated { seq: 0, response_id: 1, trigger: Trigger::Text }.with_seq(5);
    assert!(
        e.to_json().contains("\"seq\":5") && e.to_json().contains("\"type\":\"response.created\"")
    );
    assert!(e.to_json().contains("\"trigger\":\"text\""));
    // the words on the wire, and what a client makes of them (a reason it does not know too)
    let done = ServerEvent::ResponseDone {
        seq: 0,
        response_id: 1,
        status: DoneStatus::Cancelled,
        audio_ms: 0,
        packets: 0,
        chunks: 0,
        usage: Usage::default(),
    };
    assert!(done.to_json().contains("\"status\":\"cancelled\""));
    let closing = ServerEvent::SessionClosing {
        seq: 0,
        reason: ClosingReason::MaxDuration,
        retry_after_ms: None,
    };
    assert!(closing.to_json().contains("\"reason\":\"max_duration\""));
    assert!(matches!(
        parse_server(&closing.to_json()),
        Some(Received::SessionClosing { reason: ClosingReason::MaxDuration, .. })
    ));
    let newer = r#"{"type":"session.closing","seq":4,"reason":"moved_to_mars"}"#;
    assert!(matches!(
        parse_server(newer),
        Some(Received::SessionClosing { reason: ClosingReason::Other, .. })
    ));
    assert!(ServerEvent::Ack { input_seq: 3 }.is_connection_level());
    assert!(!ServerEvent::error(&WireError::new(ErrorCode::BadAudio, "x"))
        .with_seq(2)
        .is_connection_level());
    assert!(ServerEvent::error(&WireError::new(ErrorCode::BadJson, "x")).is_connection_level());
}

#[test]
fn error_codes_are_their_words_both_ways() {
    for code in ErrorCode::ALL {
        let json = ServerEvent::error(&WireError::new(code, "x").retry_after(7)).to_json();
        assert!(json.contains(&format!("\"code\":\"{}\"", code.as_str())), "{json}");
        assert!(
            matches!(parse_server(&json), Some(Received::Error { code: c,
                retry_after_ms: Some(7), .. }) if c == code),
            "{json}"
        );
    }
    assert!(!ErrorCode::ALL.contains(&ErrorCode::Other), "the server never sends `other`");
    let newer = r#"{"type":"error","code":"moon_unreachable","message":"x","fatal":false}"#;
    assert!(matches!(parse_server(newer), Some(Received::Error { code: ErrorCode::Other, .. })));
}

#[test]
fn why_a_call_or_a_transcript_failed_is_a_word_and_a_message() {
    let invalid = ServerEvent::ResponseToolCallInvalid {
        seq: 3,
        response_id: 1,
        text: "{".into(),
        reason: ToolCallProblem::UndeclaredTool,
        message: "the call names `x`".into(),
    };
    let json = invalid.to_json();
    assert!(json.contains(r#""reason":"undeclared_tool""#), "{json}");
    let back = parse_server(&json);
    assert!(
        matches!(
            &back,
            Some(Received::ToolCallInvalid {
                reason: ToolCallProblem::UndeclaredTool,
                message,
                ..
            }) if message == "the call names `x`"
        ),
        "{back:?}"
    );
    let failed = ServerEvent::InputTranscriptFailed {
        seq: 4,
        response_id: 1,
        reason: TranscriptFailure::Capacity,
        message: "busy".into(),
    };
    let json = failed.to_json();
    assert!(json.contains(r#""reason":"capacity""#), "{json}");
    assert!(matches!(
        parse_server(&json),
        Some(Received::TranscriptFailed { reason: TranscriptFailure::Capacity, .. })
    ));
    // a newer server's word is `other`, and an older server's event without a message still
    // reads
    let newer = r#"{"type":"input.transcript.failed","seq":5,"response_id":1,"reason":"moon"}"#;
    assert!(matches!(
        parse_server(newer),
        Some(Received::TranscriptFailed { reason: TranscriptFailure::Other, .. })
    ));
}
