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

mod conversation;

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
