//! Tool calls over protocol v1 against a raw WebSocket client, on the tiny engine: a session
//! declares tools, a response speaks and calls (begun by `generation.prefix`, since synthetic
//! weights write noise), the client gives the tool's output back while the speech still plays,
//! and the answer starts when the calling response is done; bad tool input is refused naming the
//! field, and the session goes on.

use serde_json::{json, Value};

// (shared with tests/server.rs, which uses all of it)
#[allow(dead_code)]
mod wire;
use wire::{is_done, server, Client, In};

const CALL: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

fn tools() -> Value {
    json!([{"name": "get_weather", "description": "The weather in a city now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
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
    let ask = json!({"prefix": format!("Let me check.\n{CALL}"), "max_text_tokens": 200, "min_audio_tokens": 20, "max_audio_tokens": 20, "seed": 1});
    c.send(json!({"type": "input.text", "text": "What is the weather in Paris?", "seq": 1, "generation": ask})).await;
    let before_call = c.until(|m| m.ty() == "response.tool_call").await;
    let said: String =
        events(&before_call).iter().filter(|e| e["type"] == "response.text.delta").map(|e| e["text"].as_str().unwrap().to_string()).collect();
    assert_eq!(said, "Let me check.\n");
    let call = events(&before_call).pop().unwrap();
    assert_eq!((call["response_id"].as_u64(), call["name"].as_str()), (Some(1), Some("get_weather")));
    assert_eq!(call["arguments"], "{\"city\": \"Paris\"}");
    let call_id = call["call_id"].as_str().unwrap().to_string();
    assert!(call_id.starts_with("call_") && call_id.len() <= 32, "{call_id}");
    // the output comes back at once; the answer waits for the calling response to be done
    let answer = json!({"min_text_tokens": 4, "max_text_tokens": 4, "min_audio_tokens": 20, "max_audio_tokens": 20, "seed": 2});
    c.send(
        json!({"type": "input.tool_result", "seq": 2, "results": [{"call_id": call_id, "output": "{\"temperature_c\": 18}"}], "generation": answer}),
    )
    .await;
    let rest = c.until(|m| matches!(m, In::Event(v) if v["type"] == "response.done" && v["response_id"] == 2)).await;
    let ev = events(&rest);
    let done1 = ev.iter().position(|e| e["type"] == "response.done" && e["response_id"] == 1).expect("the calling response ends");
    let created2 = ev.iter().position(|e| e["type"] == "response.created" && e["response_id"] == 2).expect("the answer starts");
    assert!(done1 < created2, "{ev:?}");
    assert_eq!(ev[done1]["status"], "completed");
    assert!(ev[done1]["audio_ms"].as_u64().unwrap() > 0, "the speech before the call was spoken");
    assert_eq!(ev[created2]["trigger"], "tool_result");
    assert!(!ev.iter().any(|e| e["type"] == "error"), "{ev:?}");
    let done2 = ev.last().unwrap();
    assert_eq!(done2["status"], "completed");
    assert!(audio_packets(&rest, 2) > 0);

    // a response that only calls: no audio at all
    let only = json!({"prefix": CALL, "max_text_tokens": 200, "seed": 3});
    c.send(json!({"type": "input.text", "text": "And in Oslo?", "seq": 3, "generation": only})).await;
    let ms = c.until(is_done).await;
    assert_eq!(events(&ms).iter().filter(|e| e["type"] == "response.tool_call").count(), 1);
    assert_eq!(audio_packets(&ms, 3), 0);
    let done = events(&ms).pop().unwrap();
    assert_eq!((done["status"].as_str(), done["audio_ms"].as_u64(), done["packets"].as_u64()), (Some("completed"), Some(0), Some(0)));

    // a call that is not one says why, and the response ends
    let bad = json!({"prefix": "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>", "max_text_tokens": 200, "seed": 4});
    c.send(json!({"type": "input.text", "text": "What time is it?", "seq": 4, "generation": bad})).await;
    let ms = c.until(is_done).await;
    let invalid = events(&ms).into_iter().find(|e| e["type"] == "response.tool_call.invalid").expect("an invalid call is reported");
    assert!(invalid["reason"].as_str().unwrap().contains("get_time"), "{invalid}");
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
        (json!({"type": "input.tool_result", "results": [{"call_id": "call_nope", "output": "x"}]}), "results[0].call_id"),
        (json!({"type": "input.tool_result", "results": []}), "results"),
        (json!({"type": "input.text", "text": "hi", "generation": {"tool_choice": {"name": "get_time"}}}), "generation.tool_choice"),
        (json!({"type": "input.text", "text": "hi", "generation": {"tool_choice": "sometimes"}}), "generation.tool_choice"),
        (json!({"type": "input.text", "text": "hi", "generation": {"prefix": "x".repeat(2049)}}), "generation.prefix"),
        (json!({"type": "session.update", "tools": [{"name": "a b"}]}), "tools[0].name"),
        (json!({"type": "session.update", "tools": [], "generation": {"tool_choice": "required"}}), "generation.tool_choice"),
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
        "input_audio": {"codec": "pcm16", "sample_rate": 16000}, "output_audio": {"codec": "opus"}}))
        .await;
    let e = d.event("error").await;
    assert!(e["message"].as_str().unwrap().contains("`tools`"), "{e}");
    s.shutdown().await.unwrap();
}
