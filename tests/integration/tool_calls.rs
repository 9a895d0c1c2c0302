//! What agents ask of a turn on the tiny synthetic models: tool calls and text-only replies.
//! Synthetic weights write noise, so each call test begins the reply with the client's prefix
//! (`generation.prefix`), which the model continues as if it had written it: a call, speech then a
//! call, calls that are not one, `tool_choice`, a tool's output as the next turn.

use crate::common;

use std::sync::Arc;

use antiphon_engine::metric_labels::{PromptSource, StepKind, ToolCallOutcome};
use antiphon_engine::{
    Engine, EngineConfig, EngineEvent, FunctionTool, RequestSpec, Status, ToolCall, ToolChoice,
    ToolSet, Tools, Turn, UserInput,
};
use antiphon_protocol::ToolCallProblem;
use common::engine::{collect, engine, spec, submit, Outcome};

fn tools(choice: ToolChoice) -> Tools {
    let weather = FunctionTool {
        name: "get_weather".into(),
        description: Some("The weather in a city now".into()),
        parameters: Some(
            serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}}),
        ),
    };
    let hang_up = FunctionTool { name: "hang_up".into(), description: None, parameters: None };
    Tools { set: Some(Arc::new(ToolSet::new(vec![weather, hang_up]))), choice }
}

const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

/// A reply begun with `prefix`, up to `max_text` tokens of text, 30 codes if it speaks.
fn reply(id: &str, prefix: &str, max_text: usize, choice: ToolChoice) -> RequestSpec {
    let mut s = spec(id, "What is the weather in Paris?", max_text, 30, 5);
    s.generation.min_text_tokens = None;
    s.generation.prefix = (!prefix.is_empty()).then(|| prefix.to_string());
    s.tools = tools(choice);
    s
}

fn calls(o: &Outcome) -> Vec<&ToolCall> {
    o.events
        .iter()
        .filter_map(|e| if let EngineEvent::ToolCall(c) = e { Some(c) } else { None })
        .collect()
}

fn invalid(o: &Outcome) -> Vec<(&str, ToolCallProblem, &str)> {
    o.events
        .iter()
        .filter_map(|e| {
            if let EngineEvent::ToolCallInvalid { text, reason, message } = e {
                Some((text.as_str(), *reason, message.as_str()))
            } else {
                None
            }
        })
        .collect()
}

fn tool_calls_counted(e: &Engine, outcome: ToolCallOutcome) -> u64 {
    e.metrics().tool_calls.at(outcome).get()
}

#[test]
fn a_reply_that_only_calls_makes_no_audio() {
    let e = engine(EngineConfig::default());
    let o = collect(submit(&e, reply("call", CALL, 200, ToolChoice::Auto)));
    assert_eq!(o.status, Status::Completed);
    assert_eq!(
        calls(&o),
        [&ToolCall { name: "get_weather".into(), arguments: "{\"city\": \"Paris\"}".into() }]
    );
    assert_eq!(o.text, "", "a call is written, not said");
    assert!(o.audio.is_empty() && o.codes == 0, "{} chunks, {} codes", o.audio.len(), o.codes);
    assert_eq!(tool_calls_counted(&e, ToolCallOutcome::Valid), 1);
    assert_eq!(e.active(), 0);
    // the engine goes on serving: a spoken reply after it
    let next = collect(submit(&e, spec("after", "And tomorrow?", 6, 30, 2)));
    assert_eq!((next.status, next.codes), (Status::Completed, 30));
}

/// What the reply says before its call is spoken, and only that: the Talker gets the same rows as
/// a reply that ends where the call begins (same prompt, same seed), so the audio is identical.
#[test]
fn speech_then_a_call_speaks_only_what_comes_before_the_call() {
    let e = engine(EngineConfig::default());
    let said = "Let me check.\n";
    let o = collect(submit(&e, reply("both", &format!("{said}{CALL}"), 200, ToolChoice::Auto)));
    assert_eq!(o.status, Status::Completed);
    assert_eq!(o.text, said);
    assert_eq!(calls(&o).len(), 1);
    let call_at = o.events.iter().position(|e| matches!(e, EngineEvent::ToolCall(_))).unwrap();
    assert!(
        o.events[call_at..].iter().all(|e| !matches!(e, EngineEvent::TextDelta(_))),
        "no text after the call"
    );
    assert_eq!(o.codes, 30);
    // the same words as a whole reply, with the tools declared but not callable (the same prompt)
    let n = said.len();
    let mut plain = reply("plain", said, n, ToolChoice::None);
    plain.generation.min_text_tokens = Some(n);
    let p = collect(submit(&e, plain));
    assert_eq!(p.text, said);
    assert!(calls(&p).is_empty());
    assert!(!o.audio.is_empty() && o.audio.iter().flatten().all(|s| s.is_finite()));
    assert_eq!(o.audio, p.audio, "the Talker heard only the speech before the call");
}

#[test]
fn a_call_that_is_not_one_says_why_and_ends_the_reply() {
    let e = engine(EngineConfig::default());
    for (k, (span, reason, says)) in [
        (
            "\n{\"name\": \"get_time\", \"arguments\": {}}\n",
            ToolCallProblem::UndeclaredTool,
            "`get_time`, which is not a declared tool",
        ),
        ("\nthe weather please\n", ToolCallProblem::NotJson, "not JSON"),
    ]
    .into_iter()
    .enumerate()
    {
        let o = collect(submit(
            &e,
            reply(
                &format!("bad{k}"),
                &format!("<tool_call>{span}</tool_call>"),
                200,
                ToolChoice::Auto,
            ),
        ));
        assert_eq!(o.status, Status::Completed);
        assert!(calls(&o).is_empty());
        let bad = invalid(&o);
        assert_eq!(bad.len(), 1, "{:?}", o.events);
        assert_eq!(bad[0].0, span);
        assert_eq!(bad[0].1, reason);
        assert!(bad[0].2.contains(says), "{}", bad[0].2);
        assert!(o.audio.is_empty());
    }
    assert_eq!(tool_calls_counted(&e, ToolCallOutcome::Invalid), 2);
    // a reply that ends inside its call (here: at its most tokens, right after the prefix; the
    // tag is one token, every other byte one)
    let open = "<tool_call>\n{\"name\": \"get_weather\", \"arg";
    let o = collect(submit(
        &e,
        reply("open", open, open.len() - "<tool_call>".len() + 1, ToolChoice::Auto),
    ));
    assert_eq!(o.status, Status::Completed);
    let bad = invalid(&o);
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0].0, "\n{\"name\": \"get_weather\", \"arg");
    assert_eq!(bad[0].1, ToolCallProblem::Unclosed);
    assert!(bad[0].2.contains("no `</tool_call>`"), "{}", bad[0].2);
    assert_eq!(tool_calls_counted(&e, ToolCallOutcome::Unterminated), 1);
}

/// `tool_choice` naming a function begins the reply with that call, whatever the model would
/// have said; `none` keeps the tools in the prompt but a call's tags are text.
#[test]
fn tool_choice_begins_the_call_or_forbids_it() {
    let e = engine(EngineConfig::default());
    let o = collect(submit(&e, reply("named", "", 40, ToolChoice::Function("hang_up".into()))));
    assert_eq!(o.status, Status::Completed);
    assert_eq!(o.text, "", "nothing said before a required call");
    assert!(o.audio.is_empty());
    // (synthetic weights write noise for the arguments: the call is whatever they make of them)
    let written: Vec<&str> = invalid(&o).iter().map(|(t, ..)| *t).collect();
    match calls(&o).as_slice() {
        [c] => assert_eq!(c.name, "hang_up"),
        [] => assert!(
            written.len() == 1
                && written[0].starts_with("\n{\"name\": \"hang_up\", \"arguments\": "),
            "{written:?}"
        ),
        more => panic!("{more:?}"),
    }
    let none = collect(submit(&e, reply("none", CALL, CALL.len(), ToolChoice::None)));
    assert!(calls(&none).is_empty() && invalid(&none).is_empty());
    assert!(none.text.starts_with("<tool_call>\n{\"name\""), "{}", none.text);
    assert_eq!(none.codes, 30, "spoken like any text");
}

/// A tool loop as a client runs it: the user asks, the reply calls, the tool's output comes back
/// as the next turn and the model answers from it; the second prompt starts with the first (its
/// KV is reused from the prefix store).
#[test]
fn a_tools_output_comes_back_as_the_next_turn() {
    let e = engine(EngineConfig::default());
    let reused = |e: &Engine| e.metrics().prompt_positions.at(PromptSource::Reused).get();
    let first = collect(submit(&e, reply("ask", CALL, 200, ToolChoice::Auto)));
    let call = calls(&first)[0].clone();
    let before = reused(&e);
    let mut answer = spec("answer", "", 8, 30, 6);
    answer.input = UserInput::ToolResults(vec!["{\"temperature_c\": 18}".into()]);
    answer.history = vec![Turn {
        user: UserInput::Text("What is the weather in Paris?".into()),
        assistant: String::new(),
        calls: vec![call],
    }];
    answer.tools = tools(ToolChoice::Auto);
    let o = collect(submit(&e, answer));
    assert_eq!(o.status, Status::Completed);
    assert_eq!(o.codes, 30);
    assert!(calls(&o).is_empty());
    // (the system turn with the tools block, and the first turn up to its reply)
    assert!(reused(&e) - before > 400, "reused {} positions", reused(&e) - before);
}

/// A text-only reply is written as a spoken one would be (the same prompt, the same text), but
/// nothing goes to the Talker or Code2Wav.
#[test]
fn a_text_only_reply_is_written_not_spoken() {
    let e = engine(EngineConfig::default());
    let spoken = collect(submit(&e, spec("spoken", "Tell me a story.", 12, 30, 9)));
    let talker_steps = e.metrics().step_count(StepKind::Talker);
    assert!(talker_steps > 0);
    let mut s = spec("written", "Tell me a story.", 12, 30, 9);
    s.text_only = true;
    let written = collect(submit(&e, s));
    assert_eq!(written.status, Status::Completed);
    assert_eq!(written.text, spoken.text);
    assert!(!written.text.is_empty());
    assert!(written.audio.is_empty() && written.codes == 0);
    assert_eq!(
        e.metrics().step_count(StepKind::Talker),
        talker_steps,
        "the Talker stepped for the spoken reply only"
    );
    assert_eq!(e.active(), 0);
}

/// What the caller said, written down by the Thinker from the same audio (a transcript request):
/// text deltas of the forced length, nothing spoken, the Talker never stepped; a typed input has
/// nothing to transcribe.
#[test]
fn a_spoken_input_is_transcribed_by_the_thinker_without_speech() {
    let e = engine(EngineConfig::default());
    let said: Vec<f32> =
        (0..16_000 * 2).map(|i| 0.2 * (i as f32 * 0.05).sin() * (i as f32 * 0.001).cos()).collect();
    let clip = antiphon_engine::SpokenClip::new(said).unwrap();
    let mut s = spec("heard", "", 8, 30, 4);
    s.input = UserInput::Audio(clip.clone());
    s.task = antiphon_engine::Task::Transcribe;
    let t = collect(submit(&e, s.clone()));
    assert_eq!(t.status, Status::Completed);
    assert!(!t.text.is_empty());
    assert!(t.audio.is_empty() && t.codes == 0);
    assert_eq!(e.metrics().step_count(StepKind::Talker), 0, "nothing went to the Talker");
    // the same request gives the same transcript (seeded), and a reply to the same input is spoken
    s.id = antiphon_engine::RequestId("heard-again".into());
    assert_eq!(collect(submit(&e, s)).text, t.text);
    let mut reply = spec("reply", "", 8, 30, 4);
    reply.input = UserInput::Audio(clip);
    let r = collect(submit(&e, reply));
    assert_eq!((r.status, r.codes), (Status::Completed, 30));
    let mut typed = spec("typed", "hello", 8, 30, 4);
    typed.task = antiphon_engine::Task::Transcribe;
    let o = collect(submit(&e, typed));
    assert!(matches!(&o.status, Status::Failed(why) if why.contains("spoken")), "{:?}", o.status);
}

/// A reply's usage: its prompt's positions (those of audio among them, and those reused from the
/// prefix store) and the text tokens it wrote.
#[test]
fn usage_counts_the_prompt_what_was_reused_and_what_was_written() {
    let e = engine(EngineConfig::default());
    let usage = |o: &Outcome| match o.events.last() {
        Some(EngineEvent::Done { usage, .. }) => *usage,
        other => panic!("{other:?}"),
    };
    let first = collect(submit(&e, spec("u1", "Hello there.", 6, 30, 1)));
    let u1 = usage(&first);
    assert_eq!(u1.output_text, 6);
    assert!(u1.input > 20 && u1.cached <= u1.input, "{u1:?}");
    let mut next = spec("u2", "And then?", 6, 30, 2);
    next.history = vec![Turn::text("Hello there.", first.text.clone())];
    let u2 = usage(&collect(submit(&e, next)));
    assert!(u2.input > u1.input, "the conversation is in the prompt: {u2:?} after {u1:?}");
    assert!(u2.cached > u1.cached, "the first turn's KV is reused: {u2:?} after {u1:?}");
    // a spoken input's positions are audio: 2 s more than the typed one holds
    let mut spoken = spec("u3", "", 6, 30, 3);
    spoken.input = UserInput::Audio(antiphon_engine::SpokenClip::new(vec![0.1; 32_000]).unwrap());
    let u3 = usage(&collect(submit(&e, spoken)));
    assert!(u3.input_audio >= u1.input_audio + 20, "{u3:?} vs {u1:?}");
}
