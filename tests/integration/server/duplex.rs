//! A duplex session over the wire.

use super::*;

/// Duplex over the wire: a decision per unit (cut from 24 kHz input), a response per spoken turn,
/// the duplex-only rules, and a drop mid-speech resumed with the unapplied input resent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplex_session_over_the_wire() {
    let s = server(|_| {}).await;
    // `duplex` belongs to duplex sessions only
    let mut t = Client::connect(&s).await;
    t.send(json!({"type": "session.create", "mode": "turn", "input_audio": {"codec": "pcm16",
        "sample_rate": 16000},
        "output_audio": {"codec": "opus"}, "duplex": {"policy": "speak_every", "k": 2}}))
        .await;
    assert_eq!(t.event("error").await["code"], "bad_field");

    let mut c = Client::connect(&s).await;
    let created = c
        .create(json!({"mode": "duplex", "input_audio": {"codec": "pcm16", "sample_rate": 24000},
            "duplex": {"policy": "speak_every", "k": 2}, "generation": short(10)}))
        .await;
    assert_eq!(created["mode"], "duplex");
    let (sid, tok) = (
        created["session_id"].as_str().unwrap().to_string(),
        created["resume_token"].as_str().unwrap().to_string(),
    );
    c.send(json!({"type": "input.text", "text": "hi", "seq": 1})).await;
    let e = c.event("error").await;
    assert_eq!((e["code"].as_str(), e["fatal"].as_bool()), (Some("bad_field"), Some(false)));
    c.send(json!({"type": "session.update", "voice": {"id": "default"}, "seq": 2})).await;
    assert_eq!(c.event("error").await["code"], "bad_field");
    // 5 s of 24 kHz PCM16 in 100 ms frames (seq 3..52): units 1 and 3 speak, unit 4 closes turn 2
    let frames: Vec<Vec<u8>> = (0..50)
        .map(|f| {
            (0..2400)
                .map(|i| (((f * 2400 + i) as f32 * 0.05).sin() * 8000.0) as i16)
                .flat_map(|v| v.to_le_bytes())
                .collect()
        })
        .collect();
    let frame = |k: usize| {
        Message::Binary(
            AudioFrame {
                kind: 1,
                last: false,
                seq: (k + 3) as u32,
                response_id: 0,
                payload: frames[k].clone(),
            }
            .encode()
            .into(),
        )
    };
    for k in 0..50 {
        c.send_raw(frame(k)).await;
    }
    let mut held: Vec<u64> = vec![1, 2, 3];
    let mut got = vec![];
    // drop after the third audio packet of the second response
    loop {
        let m = c.recv().await;
        if let Some(q) = m.seq() {
            held.push(q);
        }
        let cut = matches!(&m, In::Audio(a) if a.response_id == 2)
            && got.iter().filter(|x| matches!(x, In::Audio(a) if a.response_id == 2)).count() == 2;
        got.push(m);
        if cut {
            break;
        }
    }
    drop(c);
    let mut c = Client::connect(&s).await;
    let last = *held.iter().max().unwrap();
    c.send(
        json!({"type": "session.resume", "session_id": sid, "resume_token": tok, "last_seq": last}),
    )
    .await;
    let r = c.event("session.resumed").await;
    let applied = r["input_seq"].as_u64().unwrap();
    for k in (applied as usize).saturating_sub(2)..50 {
        // resend everything after what the server applied (a few before it too: deduplicated)
        c.send_raw(frame(k)).await;
    }
    let mut done = got.iter().filter(|m| is_done(m)).count();
    while done < 2 {
        let m = c.recv().await;
        assert!(!matches!(m, In::Closed(_)), "closed: {got:?}");
        if let Some(q) = m.seq() {
            assert!(!held.contains(&q), "seq {q} twice");
            held.push(q);
        }
        done += is_done(&m) as usize;
        got.push(m);
    }
    held.sort_unstable();
    // error events carry seqs too; everything from 1 to the last arrived exactly once
    assert_eq!(held, (1..=*held.last().unwrap()).collect::<Vec<_>>());
    let ev: Vec<&Value> =
        got.iter().filter_map(|m| if let In::Event(v) = m { Some(v) } else { None }).collect();
    let decisions: Vec<(u64, bool)> = ev
        .iter()
        .filter(|v| v["type"].as_str().unwrap().starts_with("duplex."))
        .map(|v| (v["unit"].as_u64().unwrap(), v["type"] == "duplex.speak"))
        .collect();
    assert_eq!(decisions, (0..5).map(|u| (u, u % 2 == 1)).collect::<Vec<_>>());
    let created: Vec<&&Value> = ev.iter().filter(|v| v["type"] == "response.created").collect();
    assert_eq!(created.len(), 2);
    assert!(created.iter().all(|v| v["trigger"] == "duplex"));
    for v in ev.iter().filter(|v| v["type"] == "response.done") {
        assert_eq!(v["status"], "completed");
        let rid = v["response_id"].as_u64().unwrap() as u32;
        let audio: Vec<&AudioFrame> = got
            .iter()
            .filter_map(|m| {
                if let In::Audio(a) = m {
                    (a.response_id == rid).then_some(a)
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(audio.len() as u64, v["packets"].as_u64().unwrap());
        assert!(audio.last().unwrap().last && audio.iter().filter(|a| a.last).count() == 1);
    }
    s.shutdown().await.unwrap();
}

/// A duplex client that sends faster than real time is paced by the model: the session takes its
/// audio only as far as 3 s (three 1 s units) ahead of the units decided (its `ack`s show what it
/// took), and nothing is dropped: every unit is decided, in order, with no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplex_client_faster_than_real_time_is_paced_by_the_model() {
    let s = server(|c| c.engine.duplex.unit_ms = 1000).await;
    let mut c = Client::connect(&s).await;
    c.create(json!({"mode": "duplex", "duplex": {"policy": "speak_every", "k": 1000}})).await;
    // 90 s of 16 kHz PCM16 in 100 ms frames (seq 1..=900), sent at once (the tiny model decides a
    // unit in tens of milliseconds: an unpaced session would have taken it all by its first ack)
    let frames = 900u32;
    for k in 0..frames {
        let payload: Vec<u8> = (0..1600)
            .map(|i| (((k * 1600 + i) as f32 * 0.03).sin() * 6000.0) as i16)
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let f = AudioFrame { kind: 1, last: false, seq: k + 1, response_id: 0, payload };
        c.send_raw(Message::Binary(f.encode().into())).await;
    }
    let (mut decided, mut taken) = (0u64, 0u64);
    while decided < 90 || taken < frames as u64 {
        match c.recv().await {
            In::Event(v) if v["type"] == "duplex.listen" || v["type"] == "duplex.speak" => {
                assert_eq!(v["unit"], decided, "units decided in order: {v}");
                decided += 1;
            }
            In::Event(v) if v["type"] == "ack" => {
                taken = v["input_seq"].as_u64().unwrap();
                // what the session took: the units decided, three more in flight, the unit being
                // cut and the frame that completed it
                assert!(
                    taken <= (decided + 3 + 1) * 10 + 1,
                    "took {taken} frames of 100 ms with {decided} units decided"
                );
            }
            In::Event(v) if v["type"] == "error" => panic!("{v}"),
            In::Closed(c) => panic!("closed: {c:?}"),
            _ => {}
        }
    }
    assert_eq!(decided, 90);
}
