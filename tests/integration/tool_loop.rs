//! Tool calls over protocol v1 and the OpenAI dialect against raw WebSocket clients, on the tiny
//! engine: a session declares tools, a response speaks and calls (begun by the client, since
//! synthetic weights write noise), the client gives the tool's output back while the speech
//! still plays, and the answer starts when the calling response is done; bad tool input is
//! refused naming the field, and the session goes on.

use serde_json::{json, Value};

// (shared with tests/integration/server.rs, which uses all of it)
#[allow(dead_code)]
use crate::wire;
use wire::{is_done, server, Client, In};

const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

fn tools() -> Value {
    json!([{"name": "get_weather", "description": "The weather in a city now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}},
           {"name": "hang_up"}])
}

fn events(ms: &[In]) -> Vec<Value> {
    ms.iter().filter_map(|m| if let In::Event(v) = m { Some(v.clone()) } else { None }).collect()
}

fn audio_packets(ms: &[In], response_id: u32) -> usize {
    ms.iter().filter(|m| matches!(m, In::Audio(f) if f.response_id == response_id)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_loop_over_the_wire() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    c.create(json!({"tools": tools()})).await;
    let ask = json!({"prefix": format!("Let me check.\n{CALL}"), "max_text_tokens": 200,
        "min_audio_tokens": 20, "max_audio_tokens": 20,
            "seed": 1});
    c.send(json!({"type": "input.text", "text": "What is the weather in Paris?", "seq": 1,
        "generation": ask}))
        .await;
    let before_call = c.until(|m| m.ty() == "response.tool_call").await;
    let said: String = events(&before_call)
        .iter()
        .filter(|e| e["type"] == "response.text.delta")
        .map(|e| e["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(said, "Let me check.\n");
    let call = events(&before_call).pop().unwrap();
    assert_eq!(
        (call["response_id"].as_u64(), call["name"].as_str()),
        (Some(1), Some("get_weather"))
    );
    assert_eq!(call["arguments"], "{\"city\": \"Paris\"}");
    let call_id = call["call_id"].as_str().unwrap().to_string();
    assert!(call_id.starts_with("call_") && call_id.len() <= 32, "{call_id}");
    // the output comes back at once; the answer waits for the calling response to be done
    let answer = json!({"min_text_tokens": 4, "max_text_tokens": 4, "min_audio_tokens": 20,
        "max_audio_tokens": 20, "seed": 2});
    c.send(json!({"type": "input.tool_result", "seq": 2, "results": [{"call_id": call_id,
            "output": "{\"temperature_c\": 18}"}], "generation": answer}))
        .await;
    let rest = c
        .until(
            |m| matches!(m, In::Event(v) if v["type"] == "response.done" && v["response_id"] == 2),
        )
        .await;
    let ev = events(&rest);
    let done1 = ev
        .iter()
        .position(|e| e["type"] == "response.done" && e["response_id"] == 1)
        .expect("the calling response ends");
    let created2 = ev
        .iter()
        .position(|e| e["type"] == "response.created" && e["response_id"] == 2)
        .expect("the answer starts");
    assert!(done1 < created2, "{ev:?}");
    assert_eq!(ev[done1]["status"], "completed");
    assert!(ev[done1]["audio_ms"].as_u64().unwrap() > 0, "the speech before the call was spoken");
    assert_eq!(ev[created2]["trigger"], "tool_result");
    assert!(!ev.iter().any(|e| e["type"] == "error"), "{ev:?}");
    let done2 = ev.last().unwrap();
    assert_eq!(done2["status"], "completed");
    let u = &done2["usage"];
    assert_eq!(u["output_text_tokens"], 4);
    assert_eq!(u["output_audio_tokens"], done2["audio_ms"].as_u64().unwrap() * 25 / 1000);
    assert!(
        u["input_tokens"].as_u64().unwrap() > u["cached_tokens"].as_u64().unwrap()
            && u["cached_tokens"].as_u64().unwrap() > 0,
        "{u}"
    );
    assert!(audio_packets(&rest, 2) > 0);

    // a response that only calls: no audio at all
    let only = json!({"prefix": CALL, "max_text_tokens": 200, "seed": 3});
    c.send(json!({"type": "input.text", "text": "And in Oslo?", "seq": 3, "generation": only}))
        .await;
    let ms = c.until(is_done).await;
    assert_eq!(events(&ms).iter().filter(|e| e["type"] == "response.tool_call").count(), 1);
    assert_eq!(audio_packets(&ms, 3), 0);
    let done = events(&ms).pop().unwrap();
    assert_eq!(
        (done["status"].as_str(), done["audio_ms"].as_u64(), done["packets"].as_u64()),
        (Some("completed"), Some(0), Some(0))
    );

    // a call that is not one says why, and the response ends
    let bad = json!({"prefix": "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>",
        "max_text_tokens": 200, "seed": 4});
    c.send(json!({"type": "input.text", "text": "What time is it?", "seq": 4, "generation": bad}))
        .await;
    let ms = c.until(is_done).await;
    let invalid = events(&ms)
        .into_iter()
        .find(|e| e["type"] == "response.tool_call.invalid")
        .expect("an invalid call is reported");
    assert_eq!(invalid["reason"], "undeclared_tool", "{invalid}");
    assert!(invalid["message"].as_str().unwrap().contains("get_time"), "{invalid}");
    assert_eq!(invalid["text"], "\n{\"name\": \"get_time\"}\n");
    s.shutdown().await.unwrap();
}

/// Each is refused with `bad_field` naming what is wrong, and the session goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tool_input_is_refused_naming_the_field() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    c.create(json!({"tools": tools()})).await;
    let cases = [
        (
            json!({"type": "input.tool_result", "results": [{"call_id": "call_nope",
                "output": "x"}]}),
            "results[0].call_id",
        ),
        (json!({"type": "input.tool_result", "results": []}), "results"),
        (
            json!({"type": "input.text", "text": "hi",
                "generation": {"tool_choice": {"name": "get_time"}}}),
            "generation.tool_choice",
        ),
        (
            json!({"type": "input.text", "text": "hi", "generation": {"tool_choice": "sometimes"}}),
            "generation.tool_choice",
        ),
        (
            json!({"type": "input.text", "text": "hi", "generation": {"prefix": "x".repeat(2049)}}),
            "generation.prefix",
        ),
        (json!({"type": "session.update", "tools": [{"name": "a b"}]}), "tools[0].name"),
        (
            json!({"type": "session.update", "tools": [],
                "generation": {"tool_choice": "required"}}),
            "generation.tool_choice",
        ),
    ];
    for (msg, field) in cases {
        c.send(msg.clone()).await;
        let e = c.event("error").await;
        assert_eq!(e["code"], "bad_field", "{msg}: {e}");
        assert!(e["message"].as_str().unwrap().contains(&format!("`{field}`")), "{msg}: {e}");
    }
    // the refused update changed nothing: the tools are still declared
    let g = json!({"prefix": CALL, "max_text_tokens": 200, "seed": 3});
    c.send(json!({"type": "input.text", "text": "Weather?", "generation": g})).await;
    let ms = c.until(is_done).await;
    assert!(events(&ms).iter().any(|e| e["type"] == "response.tool_call"), "{:?}", events(&ms));
    // tools are for turns: a duplex session refuses them
    let mut d = Client::connect(&s).await;
    d.send(json!({"type": "session.create", "mode": "duplex", "tools": tools(),
        "input_audio": {"codec": "pcm16", "sample_rate": 16000},
            "output_audio": {"codec": "opus"}}))
        .await;
    let e = d.event("error").await;
    assert!(e["message"].as_str().unwrap().contains("`tools`"), "{e}");
    s.shutdown().await.unwrap();
}

async fn oai_connect(s: &antiphon_server::Server) -> Client {
    let mut c =
        Client::connect_to(&format!("ws://{}/openai/v1/realtime?model=gpt-realtime", s.addr))
            .await
            .unwrap();
    assert_eq!(c.recv().await.ty(), "session.created");
    c
}

async fn oai_until(c: &mut Client, ty: &str) -> Vec<Value> {
    let mut out = vec![];
    loop {
        match c.recv().await {
            In::Event(v) => {
                let done = v["type"] == ty;
                out.push(v);
                if done {
                    return out;
                }
            }
            other => panic!("expected an event, got {other:?} after {out:?}"),
        }
    }
}

fn types(evs: &[Value]) -> Vec<&str> {
    evs.iter()
        .map(|v| v["type"].as_str().unwrap())
        .filter(|t| !t.ends_with("audio.delta") && !t.ends_with("transcript.delta"))
        .collect()
}

/// The OpenAI Realtime dialect: tools in `session.update`, a call made by a reply the client
/// began (an `incomplete` assistant message created last, antiphon's extension), the call as the
/// SDK's types define it (a `function_call` item and its argument events), its output answered
/// by the next response, speech and a call in one response, and a text-only response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_loop_in_the_openai_dialect() {
    let s = server(|c| c.engine.default_max_audio_tokens = 30).await;
    let mut c = oai_connect(&s).await;
    let weather = json!({"type": "function", "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}});
    c.send(json!({"type": "session.update", "session": {"type": "realtime", "tools": [weather],
        "tool_choice": "auto",
        "audio": {"input": {"turn_detection": null}}}}))
        .await;
    let u = oai_until(&mut c, "session.updated").await.pop().unwrap();
    assert_eq!(
        (u["session"]["tools"][0]["name"].as_str(), u["session"]["tool_choice"].as_str()),
        (Some("get_weather"), Some("auto"))
    );
    let user = |text: &str| {
        json!({"type": "conversation.item.create", "item": {"type": "message",
        "role": "user", "content": [{"type": "input_text", "text": text}]}})
    };
    let begun = |text: &str| {
        json!({"type": "conversation.item.create", "item": {"type": "message",
        "role": "assistant", "status": "incomplete", "content": [{"type": "output_text",
        "text": text}]}})
    };
    c.send(user("What is the weather in Paris?")).await;
    oai_until(&mut c, "conversation.item.done").await;
    c.send(begun(CALL)).await;
    let added = oai_until(&mut c, "conversation.item.done").await;
    assert_eq!(added[0]["item"]["status"], "incomplete");
    c.send(json!({"type": "response.create"})).await;
    let evs = oai_until(&mut c, "response.done").await;
    assert_eq!(
        types(&evs),
        [
            "response.created",
            "response.output_item.added",
            "conversation.item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "conversation.item.done",
            "response.output_item.done",
            "response.done"
        ],
        "a call alone: no message item, no audio"
    );
    let args = &evs[4];
    assert_eq!(
        (args["name"].as_str(), args["arguments"].as_str()),
        (Some("get_weather"), Some("{\"city\": \"Paris\"}"))
    );
    let call_id = args["call_id"].as_str().unwrap().to_string();
    assert!(call_id.len() <= 32);
    let done = &evs.last().unwrap()["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(done["output"].as_array().unwrap().len(), 1);
    let item = &done["output"][0];
    assert_eq!(
        (item["type"].as_str(), item["call_id"].as_str(), item["status"].as_str()),
        (Some("function_call"), Some(call_id.as_str()), Some("completed"))
    );
    assert_eq!(evs[1]["item"]["arguments"], "", "the call opens with no arguments");
    // the output goes back, and the next response answers with speech
    c.send(json!({"type": "conversation.item.create", "item": {"type": "function_call_output",
        "call_id": call_id, "output": "{\"temperature_c\": 18}"}}))
        .await;
    oai_until(&mut c, "conversation.item.done").await;
    c.send(json!({"type": "response.create", "response": {"max_output_tokens": 6}})).await;
    let evs = oai_until(&mut c, "response.done").await;
    let done = &evs.last().unwrap()["response"];
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["output"][0]["type"], "message");
    let u = &done["usage"];
    assert!(
        u["input_tokens"].as_u64().unwrap() > 0
            && u["input_token_details"]["cached_tokens"].as_u64().unwrap() > 0,
        "{u}"
    );
    assert!(evs.iter().any(|v| v["type"] == "response.output_audio.delta"));
    assert!(!evs.iter().any(|v| v["type"] == "error"), "{evs:?}");
    // speech, then a call, in one response: the message first, the call after it
    c.send(user("And in Oslo?")).await;
    oai_until(&mut c, "conversation.item.done").await;
    c.send(begun(&format!("Let me check.\n{}", CALL.replace("Paris", "Oslo")))).await;
    oai_until(&mut c, "conversation.item.done").await;
    // (a call's text counts in the reply's tokens: the embedded default's 64 would cut this one)
    c.send(json!({"type": "response.create", "response": {"max_output_tokens": 200}})).await;
    let evs = oai_until(&mut c, "response.done").await;
    let done = &evs.last().unwrap()["response"];
    let kinds: Vec<&str> =
        done["output"].as_array().unwrap().iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["message", "function_call"]);
    assert_eq!(done["output"][0]["content"][0]["transcript"], "Let me check.\n");
    assert_eq!(done["output"][1]["arguments"], "{\"city\": \"Oslo\"}");
    assert!(evs.iter().any(|v| v["type"] == "response.output_audio.delta"));
    let call_at =
        evs.iter().position(|v| v["type"] == "response.function_call_arguments.done").unwrap();
    assert_eq!(evs[call_at]["output_index"], 1);
    // a text-only response is written, not spoken
    c.send(user("Say it in writing.")).await;
    oai_until(&mut c, "conversation.item.done").await;
    c.send(json!({"type": "response.create", "response": {"output_modalities": ["text"],
        "tool_choice": "none", "max_output_tokens": 6}}))
        .await;
    let evs = oai_until(&mut c, "response.done").await;
    let done = &evs.last().unwrap()["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(done["output"][0]["content"][0]["type"], "output_text");
    assert!(!evs.iter().any(|v| v["type"] == "response.output_audio.delta"));
    assert_eq!(done["usage"]["output_token_details"]["audio_tokens"], 0, "no audio was made");
    // tool_choice naming an undeclared function is refused, naming the param
    c.send(json!({"type": "response.create", "response": {"tool_choice": {"type": "function",
        "name": "get_time"}}}))
        .await;
    let e = oai_until(&mut c, "error").await.pop().unwrap();
    assert_eq!(e["error"]["param"], "response.tool_choice", "{e}");
    s.shutdown().await.unwrap();
}

/// PCM16 frames of `seconds` of a tone at 16 kHz, as v1 audio input.
async fn speak(c: &mut Client, seconds: usize, first_seq: u32) -> u32 {
    use tokio_tungstenite::tungstenite::Message;
    let samples: Vec<i16> = (0..16_000 * seconds)
        .map(|i| (6000.0 * ((i as f32) * 0.05).sin() * ((i as f32) * 0.002).cos()) as i16)
        .collect();
    let mut seq = first_seq;
    for chunk in samples.chunks(3200) {
        let payload: Vec<u8> = chunk.iter().flat_map(|s| s.to_le_bytes()).collect();
        let frame =
            antiphon_protocol::AudioFrame { kind: 1, last: false, seq, response_id: 0, payload };
        c.send_raw(Message::Binary(frame.encode().into())).await;
        seq += 1;
    }
    seq
}

/// With `input_transcription`, a spoken turn's transcript (the Thinker's own, from the same
/// audio) follows the reply's first audio as `input.transcript.delta`s and `.done`; a typed turn
/// has none, and a session without the option gets none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoken_turns_are_transcribed_after_the_replys_first_audio() {
    let s = server(|_| {}).await;
    let mut c = Client::connect(&s).await;
    c.create(json!({"input_transcription": true})).await;
    let seq = speak(&mut c, 1, 1).await;
    let g = json!({"min_text_tokens": 4, "max_text_tokens": 4, "min_audio_tokens": 20,
        "max_audio_tokens": 20, "seed": 1});
    c.send(json!({"type": "input.commit", "seq": seq, "generation": g})).await;
    let ms = c.until(|m| m.ty() == "input.transcript.done").await;
    let first_audio = ms
        .iter()
        .position(|m| matches!(m, In::Audio(f) if f.response_id == 1))
        .expect("the reply's audio");
    let first_delta =
        ms.iter().position(|m| m.ty() == "input.transcript.delta").expect("transcript deltas");
    assert!(first_audio < first_delta, "the transcript waits for the reply's first audio");
    let ev = events(&ms);
    let deltas: String = ev
        .iter()
        .filter(|e| e["type"] == "input.transcript.delta")
        .map(|e| e["delta"].as_str().unwrap().to_string())
        .collect();
    let done = ev.last().unwrap();
    assert_eq!(done["response_id"], 1);
    assert_eq!(done["transcript"].as_str().unwrap(), deltas);
    assert!(!deltas.is_empty());
    // a typed turn: nothing to transcribe
    c.send(json!({"type": "input.text", "seq": seq + 1, "text": "hello", "generation": g})).await;
    let ms = c
        .until(
            |m| matches!(m, In::Event(v) if v["type"] == "response.done" && v["response_id"] == 2),
        )
        .await;
    assert!(!ms.iter().any(|m| m.ty().starts_with("input.transcript")));
    // turned off: a spoken turn gets no transcript
    c.send(json!({"type": "session.update", "input_transcription": false})).await;
    let seq = speak(&mut c, 1, seq + 2).await;
    c.send(json!({"type": "input.commit", "seq": seq, "generation": g})).await;
    let ms = c
        .until(
            |m| matches!(m, In::Event(v) if v["type"] == "response.done" && v["response_id"] == 3),
        )
        .await;
    assert!(!ms.iter().any(|m| m.ty().starts_with("input.transcript")));
    s.shutdown().await.unwrap();
}

/// The dialect: `audio.input.transcription` set, a committed audio turn gets
/// `conversation.item.input_audio_transcription.delta`s and `.completed` for its item (with the
/// audio's duration as usage), and the item's audio part carries the transcript.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dialect_transcribes_a_committed_turn() {
    let s = server(|c| c.engine.default_max_audio_tokens = 30).await;
    let mut c = oai_connect(&s).await;
    c.send(json!({"type": "session.update", "session": {"type": "realtime",
        "audio": {"input": {"turn_detection": null,
            "transcription": {"model": "gpt-4o-transcribe"}}}}}))
        .await;
    let u = oai_until(&mut c, "session.updated").await.pop().unwrap();
    assert_eq!(u["session"]["audio"]["input"]["transcription"]["model"], "gpt-4o-transcribe");
    use base64::Engine as _;
    let pcm: Vec<u8> = (0..24_000)
        .flat_map(|i| ((6000.0 * ((i as f32) * 0.04).sin()) as i16).to_le_bytes())
        .collect();
    c.send(json!({"type": "input_audio_buffer.append",
        "audio": base64::engine::general_purpose::STANDARD.encode(&pcm)}))
        .await;
    c.send(json!({"type": "input_audio_buffer.commit"})).await;
    let item = oai_until(&mut c, "input_audio_buffer.committed").await.pop().unwrap()["item_id"]
        .as_str()
        .unwrap()
        .to_string();
    c.send(json!({"type": "response.create"})).await;
    let evs = oai_until(&mut c, "conversation.item.input_audio_transcription.completed").await;
    let done = evs.last().unwrap();
    assert_eq!(
        (done["item_id"].as_str(), done["content_index"].as_u64()),
        (Some(item.as_str()), Some(0))
    );
    let deltas: String = evs
        .iter()
        .filter(|v| v["type"] == "conversation.item.input_audio_transcription.delta")
        .map(|v| v["delta"].as_str().unwrap().to_string())
        .collect();
    assert!(!deltas.is_empty());
    assert_eq!(done["transcript"].as_str().unwrap(), deltas);
    assert_eq!(done["usage"], json!({"type": "duration", "seconds": 1.0}));
    if !evs.iter().any(|v| v["type"] == "response.done") {
        oai_until(&mut c, "response.done").await;
    }
    c.send(json!({"type": "conversation.item.retrieve", "item_id": item})).await;
    let r = oai_until(&mut c, "conversation.item.retrieved").await.pop().unwrap();
    assert_eq!(r["item"]["content"][0]["transcript"].as_str().unwrap(), deltas);
    s.shutdown().await.unwrap();
}

/// `generation.remember: false` (the dialect's `conversation: "none"`): the turn leaves no trace,
/// so the next prompt is what it would be without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_not_remembered_leaves_no_trace() {
    let s = server(|_| {}).await;
    let g = |remember: bool| {
        json!({"min_text_tokens": 4, "max_text_tokens": 4,
        "min_audio_tokens": 20, "max_audio_tokens": 20, "seed": 1, "remember": remember})
    };
    let input_tokens =
        |ms: &[In]| events(ms).last().unwrap()["usage"]["input_tokens"].as_u64().unwrap();
    let mut a = Client::connect(&s).await;
    a.create(json!({})).await;
    a.send(
        json!({"type": "input.text", "text": "An aside that is not kept.", "generation": g(false)}),
    )
    .await;
    a.until(is_done).await;
    a.send(json!({"type": "input.text", "text": "What did I say?", "generation": g(true)})).await;
    let after_aside = input_tokens(&a.until(is_done).await);
    let mut b = Client::connect(&s).await;
    b.create(json!({})).await;
    b.send(json!({"type": "input.text", "text": "What did I say?", "generation": g(true)})).await;
    let alone = input_tokens(&b.until(is_done).await);
    assert_eq!(after_aside, alone, "the aside is not in the prompt");
    // and a remembered turn is
    b.send(json!({"type": "input.text", "text": "What did I say?", "generation": g(true)})).await;
    assert!(input_tokens(&b.until(is_done).await) > alone);
    s.shutdown().await.unwrap();
}

/// The client owns its conversation: items it created (a conversation replayed on a new socket:
/// user and assistant messages, a call and its output) are in what the model remembers, as
/// earlier turns, and the user item after them is the input; the same input on a socket
/// without them has a shorter prompt. Over v1, `conversation.append` does it directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_conversation_is_what_the_model_remembers() {
    let s = server(|c| c.engine.default_max_audio_tokens = 30).await;
    let create = |item: Value| json!({"type": "conversation.item.create", "item": item});
    let user = |t: &str| {
        create(json!({"type": "message", "role": "user", "content": [{"type": "input_text",
                "text": t}]}))
    };
    let said = |t: &str| {
        create(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text",
                "text": t}]}))
    };
    let ask = |c: Client| async move {
        let mut c = c;
        c.send(user("And tomorrow?")).await;
        oai_until(&mut c, "conversation.item.done").await;
        c.send(json!({"type": "response.create", "response": {"max_output_tokens": 4}})).await;
        let evs = oai_until(&mut c, "response.done").await;
        assert!(!evs.iter().any(|v| v["type"] == "error"), "{evs:?}");
        let done = evs.last().unwrap()["response"].clone();
        assert_eq!(done["status"], "completed", "{done}");
        (c, done["usage"]["input_tokens"].as_u64().unwrap())
    };
    let (_, alone) = ask(oai_connect(&s).await).await;
    let replayed = |answer: &'static str| {
        let s = &s;
        async move {
            let mut c = oai_connect(s).await;
            c.send(json!({"type": "session.update", "session": {"type": "realtime",
                "audio": {"input": {"turn_detection": null}}}}))
                .await;
            oai_until(&mut c, "session.updated").await;
            let replay = [
                user("What is the weather in Paris?"),
                said("Let me check."),
                create(json!({"type": "function_call", "call_id": "call_1", "name": "get_weather",
                        "arguments": "{\"city\": \"Paris\"}"})),
                create(json!({"type": "function_call_output", "call_id": "call_1",
                        "output": "{\"temperature_c\": 18}"})),
                said(answer),
            ];
            for item in replay {
                c.send(item).await;
                oai_until(&mut c, "conversation.item.done").await;
            }
            ask(c).await.1
        }
    };
    let (short, long) =
        ("It is 18 degrees.", "It is 18 degrees in Paris, and sunny, with a light breeze.");
    let (a, b) = (replayed(short).await, replayed(long).await);
    assert!(a > alone + 60, "{a} input tokens after the replay, {alone} without it");
    // what the assistant said is in the prompt, word for word (the tiny tokenizer: a token a byte)
    assert_eq!(
        b - a,
        (long.len() - short.len()) as u64,
        "the replayed answer is what the model remembers"
    );

    // over v1: the same turns appended, then the same question
    let g = json!({"min_text_tokens": 4, "max_text_tokens": 4, "min_audio_tokens": 20,
        "max_audio_tokens": 20, "seed": 1});
    let input_tokens =
        |ms: &[In]| events(ms).last().unwrap()["usage"]["input_tokens"].as_u64().unwrap();
    let mut v = Client::connect(&s).await;
    v.create(json!({})).await;
    v.send(json!({"type": "conversation.append", "turns": [
        {"user": "What is the weather in Paris?", "assistant": "Let me check.",
         "calls": [{"call_id": "call_1", "name": "get_weather",
             "arguments": "{\"city\": \"Paris\"}"}]},
        {"tool_outputs": ["{\"temperature_c\": 18}"],
            "assistant": "It is eighteen degrees in Paris."}]}))
        .await;
    v.send(json!({"type": "input.text", "text": "And tomorrow?", "generation": g})).await;
    let appended = input_tokens(&v.until(is_done).await);
    let mut w = Client::connect(&s).await;
    w.create(json!({})).await;
    w.send(json!({"type": "input.text", "text": "And tomorrow?", "generation": g})).await;
    let fresh = input_tokens(&w.until(is_done).await);
    assert!(appended > fresh + 60, "{appended} vs {fresh}");
    // a call whose arguments are not an object is refused, naming it, and nothing is appended
    v.send(
        json!({"type": "conversation.append", "turns": [{"user": "x", "calls": [{"call_id": "c",
        "name": "f", "arguments": "[1]"}]}]}),
    )
    .await;
    let e = v.event("error").await;
    assert!(e["message"].as_str().unwrap().contains("`turns[0].calls[0].arguments`"), "{e}");
    s.shutdown().await.unwrap();
}

/// Deleting an item the model remembers takes it out of what the model remembers (the dialect
/// gives the conversation again, without it; v1's `conversation.clear` forgets all of it).
/// Out-of-band responses measure the prompt without changing it.
async fn measure(c: &mut Client) -> u64 {
    measure_both(c).await.0
}

/// The prompt's input tokens and those reused from the prefix store.
async fn measure_both(c: &mut Client) -> (u64, u64) {
    c.send(json!({"type": "response.create", "response": {"conversation": "none",
        "max_output_tokens": 2, "output_modalities": ["text"]}}))
        .await;
    let done = oai_until(c, "response.done").await.pop().unwrap();
    let u = &done["response"]["usage"];
    (
        u["input_tokens"].as_u64().unwrap(),
        u["input_token_details"]["cached_tokens"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_item_is_forgotten() {
    let s = server(|c| c.engine.default_max_audio_tokens = 30).await;
    let create = |item: Value| json!({"type": "conversation.item.create", "item": item});
    let user = |t: &str| {
        create(json!({"type": "message", "role": "user", "content": [{"type": "input_text",
                "text": t}]}))
    };
    let said = |id: &str, t: &str| {
        create(json!({"id": id, "type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": t}]}))
    };
    let session = |answer: &'static str| {
        let s = &s;
        async move {
            let mut c = oai_connect(s).await;
            for item in [
                user("What is the weather in Paris?"),
                said("a1", answer),
                user("And in Oslo?"),
                said("a2", "Cold."),
            ] {
                c.send(item).await;
                oai_until(&mut c, "conversation.item.done").await;
            }
            let before = measure(&mut c).await;
            c.send(json!({"type": "conversation.item.delete", "item_id": "a1"})).await;
            oai_until(&mut c, "conversation.item.deleted").await;
            (before, measure(&mut c).await)
        }
    };
    let (short, long) = ("Mild.", "Mild, with sun in the morning and rain after noon.");
    let (s1, s2) = session(short).await;
    let (l1, l2) = session(long).await;
    assert_eq!(l1 - s1, (long.len() - short.len()) as u64, "both answers are remembered at first");
    assert_eq!(l2, s2, "the deleted answer is not in the prompt");
    assert!(l2 < l1);
    // v1: conversation.clear forgets every turn
    let g = json!({"min_text_tokens": 4, "max_text_tokens": 4, "min_audio_tokens": 20,
        "max_audio_tokens": 20, "seed": 1});
    let input_tokens =
        |ms: &[In]| events(ms).last().unwrap()["usage"]["input_tokens"].as_u64().unwrap();
    let mut v = Client::connect(&s).await;
    v.create(json!({})).await;
    v.send(json!({"type": "input.text", "text": "Remember this.", "generation": g})).await;
    let first = input_tokens(&v.until(is_done).await);
    v.send(json!({"type": "conversation.clear"})).await;
    v.send(json!({"type": "input.text", "text": "Remember this.", "generation": g})).await;
    assert_eq!(
        input_tokens(&v.until(is_done).await),
        first,
        "after the clear the prompt is a first turn's"
    );
    s.shutdown().await.unwrap();
}

/// `previous_item_id` places an item: `"root"` first, an item's id after it, unknown ones are
/// refused; an item placed before what the model remembers is remembered in its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_item_id_places_an_item() {
    let s = server(|c| c.engine.default_max_audio_tokens = 30).await;
    let mut c = oai_connect(&s).await;
    let item = |id: &str, role: &str, kind: &str, t: &str| {
        json!({"id": id, "type": "message",
        "role": role, "content": [{"type": kind, "text": t}]})
    };
    for it in [
        item("q", "user", "input_text", "What is the weather in Paris?"),
        item("a1", "assistant", "output_text", "Mild."),
    ] {
        c.send(json!({"type": "conversation.item.create", "item": it})).await;
        oai_until(&mut c, "conversation.item.done").await;
    }
    measure(&mut c).await;
    // (measured twice: the second prompt is the first's, held by the prefix store)
    let (before, held) = measure_both(&mut c).await;
    let greeting = "Hello, I can tell you the weather anywhere.";
    c.send(
        json!({"type": "conversation.item.create", "previous_item_id": "root", "item": item("a0",
        "assistant", "output_text", greeting)}),
    )
    .await;
    let added = oai_until(&mut c, "conversation.item.added").await.pop().unwrap();
    assert!(added["previous_item_id"].is_null(), "{added}");
    oai_until(&mut c, "conversation.item.done").await;
    let (after, reused) = measure_both(&mut c).await;
    // first in the conversation: the prompt differs from the greeting on (no longer the held one)
    assert!(reused + 40 < held, "{reused} positions reused after the insert, {held} before");
    // (the greeting and a turn's template around it: an empty user message, the assistant's)
    let grew = after - before;
    assert!(
        grew >= greeting.len() as u64 && grew <= greeting.len() as u64 + 32,
        "the greeting is remembered: {before} -> {after}"
    );
    c.send(json!({"type": "conversation.item.create", "previous_item_id": "q", "item": item("n",
        "user", "input_text", "Note.")}))
        .await;
    let added = oai_until(&mut c, "conversation.item.added").await.pop().unwrap();
    assert_eq!(added["previous_item_id"], "q");
    oai_until(&mut c, "conversation.item.done").await;
    c.send(
        json!({"type": "conversation.item.create", "previous_item_id": "nope", "item": item("m",
        "user", "input_text", "x")}),
    )
    .await;
    let e = oai_until(&mut c, "error").await.pop().unwrap();
    assert_eq!(e["error"]["param"], "previous_item_id", "{e}");
    s.shutdown().await.unwrap();
}
