//! Spoken turns' transcripts and what the model remembers: turns not remembered, replayed
//! conversations, deleted and placed items.

use super::*;

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
