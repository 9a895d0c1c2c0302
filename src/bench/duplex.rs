//! The `duplex` workload: C sessions streaming audio in real time, one record per spoken turn.

use std::sync::Arc;
use std::time::{Duration, Instant};

use antiphon_protocol::DoneStatus;
use anyhow::{anyhow, bail, Context, Result};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

use super::{stalls, BenchConfig, Client, Msg, RequestRecord, Shared};

/// Codes drained at the end of a duplex turn: the turn's speech fits its k-unit cycle.
pub(super) fn duplex_drain(cfg: &BenchConfig) -> usize {
    cfg.audio_tokens.saturating_sub(25).min(25 * (cfg.speak_every.max(1) as usize - 1))
}

/// Spoken turns per duplex session: every k-th unit that has a unit after it (which closes it).
pub(super) fn duplex_turns(cfg: &BenchConfig) -> usize {
    let k = cfg.speak_every.max(1) as usize;
    (0..cfg.duplex_units).filter(|u| (u + 1) % k == 0 && u + 1 < cfg.duplex_units).count()
}

/// One duplex session of the `duplex` workload: streams `duplex_units` seconds of the voice WAV
/// (looped) in real time as 20 ms Opus packets while it receives; one record per spoken turn,
/// its TTFA measured from the end of the unit in which the model decided to speak.
async fn duplex_session(
    sh: Arc<Shared>,
    level: usize,
    worker: usize,
    level_start: Instant,
) -> Result<Vec<RequestRecord>> {
    use tokio::sync::Mutex;
    let cfg = &sh.cfg;
    let mut c = Client::connect(cfg).await?;
    let k = cfg.speak_every;
    let text = cfg.text_tokens.min(antiphon_protocol::DUPLEX_UNIT_MAX_TEXT_TOKENS);
    let drain = duplex_drain(cfg);
    c.send(json!({"type": "session.create", "mode": "duplex",
        "input_audio": {"codec": "opus", "sample_rate": 48000},
        "output_audio": {"codec": "opus", "frame_ms": 20},
        "duplex": {"policy": "speak_every", "k": k},
        "generation": {"min_text_tokens": text, "max_text_tokens": text, "min_audio_tokens": drain,
            "max_audio_tokens": drain, "seed": worker as u64}}))
        .await?;
    loop {
        match c.recv(cfg.timeout).await? {
            Msg::Event(v) if v["type"] == "session.created" => break,
            Msg::Event(v) if v["type"] == "error" => {
                bail!("session.create: {} ({})", v["code"], v["message"])
            }
            _ => {}
        }
    }
    let packets = sh.voice.clone().ok_or_else(|| anyhow!("no input packets"))?;
    let Client { ws, input_seq, frame_ms, .. } = c;
    let (sink, mut stream) = ws.split();
    let sink = Arc::new(Mutex::new(sink));
    let sent_at: Arc<std::sync::Mutex<Vec<Instant>>> = Arc::default();
    let total = cfg.duplex_units * 50;
    let sender = {
        let (sink, sent_at) = (sink.clone(), sent_at.clone());
        tokio::spawn(async move {
            let t0 = Instant::now();
            for n in 0..total {
                tokio::time::sleep_until((t0 + Duration::from_millis(20 * n as u64)).into()).await;
                let mut f = vec![1u8, 0, 0, 0];
                f.extend_from_slice(&((input_seq + 1 + n as u64) as u32).to_le_bytes());
                f.extend_from_slice(&0u32.to_le_bytes());
                f.extend_from_slice(&packets[n % packets.len()]);
                sink.lock().await.send(Message::Binary(f.into())).await?;
                sent_at.lock().expect("sent_at").push(Instant::now());
            }
            Ok::<_, anyhow::Error>(())
        })
    };
    let expected = duplex_turns(cfg);
    let warm = cfg.warmup.min(expected.saturating_sub(1));
    let mut records: Vec<RequestRecord> = Vec::new();
    // response id → (record index, unit, durations)
    let mut open: std::collections::HashMap<u64, (usize, u64, Vec<f64>)> = Default::default();
    let mut last_speak = 0u64;
    let mut done = 0usize;
    let mut last_seq = 0u64;
    let mut last_ack = Instant::now();
    let unit_end = |u: u64| -> Option<Instant> {
        sent_at.lock().expect("sent_at").get(((u + 1) * 50 - 1) as usize).copied()
    };
    while done < expected {
        let m = tokio::time::timeout(cfg.timeout, stream.next())
            .await
            .map_err(|_| anyhow!("timed out waiting for the server"))?;
        let now = Instant::now();
        match m {
            Some(Ok(Message::Text(t))) => {
                let v: Value = serde_json::from_str(&t)?;
                last_seq = last_seq.max(v["seq"].as_u64().unwrap_or(0));
                match v["type"].as_str().unwrap_or("") {
                    "duplex.speak" => last_speak = v["unit"].as_u64().unwrap_or(0),
                    // a turn opened in the last unit never ends inside the stream: not measured
                    "response.created" if last_speak as usize + 1 >= cfg.duplex_units => {}
                    "response.created" => {
                        let index = records.len();
                        let start_s = unit_end(last_speak)
                            .map_or(0.0, |t| t.duration_since(level_start).as_secs_f64());
                        records.push(RequestRecord::new(
                            level,
                            worker,
                            index,
                            index < warm,
                            last_speak as usize,
                            start_s,
                        ));
                        open.insert(
                            v["response_id"].as_u64().unwrap_or(0),
                            (index, last_speak, vec![]),
                        );
                    }
                    "response.text.delta" => {
                        if let Some((i, u, _)) = open.get(&v["response_id"].as_u64().unwrap_or(0)) {
                            if let Some(end) = unit_end(*u) {
                                records[*i].ttft_ms.get_or_insert(
                                    now.saturating_duration_since(end).as_secs_f64() * 1000.0,
                                );
                            }
                        }
                    }
                    "response.done" => {
                        if let Some((i, _, durations)) =
                            open.remove(&v["response_id"].as_u64().unwrap_or(0))
                        {
                            let r = &mut records[i];
                            r.status = crate::done_status(&v);
                            r.chunks = v["chunks"].as_u64();
                            r.ok = r.status == Some(DoneStatus::Completed)
                                && !r.arrivals_ms.is_empty();
                            if r.status != Some(DoneStatus::Completed) {
                                r.error = Some(format!("response {}", v["status"]));
                            }
                            r.audio_ms = durations.iter().sum();
                            if let (Some(&first), Some(&last)) =
                                (r.arrivals_ms.first(), r.arrivals_ms.last())
                            {
                                r.last_audio_ms = Some(last);
                                r.rtf = Some(last / r.audio_ms.max(1e-9));
                                r.rtf_compute = Some((last - first) / r.audio_ms.max(1e-9));
                            }
                            r.stalls = cfg
                                .prebuffers_ms
                                .iter()
                                .map(|&p| {
                                    let (e, t) = stalls(&r.arrivals_ms, &durations, p as f64);
                                    (p, e, t)
                                })
                                .collect();
                            done += 1;
                            if let Some(p) = &sh.progress {
                                if !r.warmup {
                                    p.inc(1);
                                }
                            }
                        }
                    }
                    "error" if v["fatal"] == true => bail!("error {}: {}", v["code"], v["message"]),
                    "session.closing" => bail!("the server closed the session: {}", v["reason"]),
                    _ => {}
                }
            }
            Some(Ok(Message::Binary(b))) => {
                if b.len() >= 12 && b[0] == 1 {
                    last_seq = last_seq.max(u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as u64);
                    let rid = u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as u64;
                    if let Some((i, u, durations)) = open.get_mut(&rid) {
                        let r = &mut records[*i];
                        if let Some(end) = unit_end(*u) {
                            let ms = now.saturating_duration_since(end).as_secs_f64() * 1000.0;
                            r.ttfa_ms.get_or_insert(ms);
                            r.arrivals_ms.push(ms);
                        }
                        r.packets += 1;
                        durations.push(frame_ms);
                    }
                }
            }
            Some(Ok(Message::Close(c))) => bail!("closed by the server: {c:?}"),
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e.into()),
            None => bail!("the connection ended"),
        }
        if last_ack.elapsed() >= Duration::from_millis(250) {
            sink.lock()
                .await
                .send(Message::Text(json!({"type": "ack", "seq": last_seq}).to_string().into()))
                .await?;
            last_ack = Instant::now();
        }
    }
    sender.await.context("duplex sender")??;
    let _ = sink
        .lock()
        .await
        .send(Message::Text(
            json!({"type": "session.close", "seq": input_seq + 1 + total as u64})
                .to_string()
                .into(),
        ))
        .await;
    // read until the server closes: dropping a socket with unread data resets it, and the reset
    // can overtake the close
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(_)) = stream.next().await {}
    })
    .await;
    Ok(records)
}

/// A duplex level: `level` sessions streaming at once.
pub(super) async fn run_duplex_level(
    sh: Arc<Shared>,
    level: usize,
) -> Result<(Vec<RequestRecord>, f64)> {
    let start = Instant::now();
    let tasks: Vec<_> =
        (0..level).map(|w| tokio::spawn(duplex_session(sh.clone(), level, w, start))).collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.context("duplex worker")??);
    }
    let measured: Vec<&RequestRecord> = all.iter().filter(|r| !r.warmup).collect();
    let begin = measured.iter().map(|r| r.start_s).fold(f64::INFINITY, f64::min);
    let wall = start.elapsed().as_secs_f64() - if begin.is_finite() { begin } else { 0.0 };
    Ok((all, wall))
}
