//! The threaded engine on the tiny synthetic models: whole requests, forced lengths, chunking,
//! cancellation, batching, streaming prefill, duplex requests and metrics.

use crate::common;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use antiphon_assets::synth::{models_in_memory, Preset};
use antiphon_engine::metric_labels::{PrefetchEvent, StepKind};
use antiphon_engine::{
    Engine, EngineConfig, EngineEvent, GenerationParams, Mode, RefInput, RequestId, SpokenClip,
    Status, UserInput,
};
use candle_core::{DType, Device};
use common::engine::{collect, engine, spec, submit, voice, Outcome};

mod captured_prefill;
mod first_chunk;
mod history;
mod inbox;

#[test]
fn a_turn_request_gives_text_then_audio_of_the_forced_length() {
    let e = engine(EngineConfig::default());
    let o = collect(submit(&e, spec("r1", "Read this sentence.", 12, 60, 1)));
    assert_eq!(o.status, Status::Completed);
    assert_eq!(o.codes, 60);
    // 60 codes in chunks of 25 + 25 + 10 (each with 3 codes of context)
    assert_eq!(o.audio.len(), 3);
    let total: usize = o.audio.iter().map(|a| a.len()).sum();
    assert_eq!(
        total,
        (3 + 60) * 2 * 480 + 3840,
        "(codes + 3 look-ahead) × 40 ms, plus the vocoder delay"
    );
    assert!(o.first_audio_ms > 0.0);
    assert!(o.audio.iter().flatten().all(|s| s.is_finite()));
    // audio events come after the text is complete (turn mode hands off at <|tts_eos|>)
    let first_audio = o.events.iter().position(|e| matches!(e, EngineEvent::Audio { .. })).unwrap();
    assert!(o.events[first_audio..].iter().all(|e| !matches!(e, EngineEvent::TextDelta(_))));
    assert_eq!(e.active(), 0);
    let m = e.metrics().render();
    assert!(m.contains("antiphon_stage_step_seconds_count{stage=\"thinker\"}"), "{m}");
    assert!(m.contains("antiphon_engine_requests_total{status=\"completed\"} 1"));
    // every milestone of the reply, once, in the order the stages reach them
    let at = |phase: &str| -> f64 {
        let key = format!("antiphon_engine_phase_seconds_sum{{phase=\"{phase}\"}} ");
        let line =
            m.lines().find(|l| l.starts_with(&key)).unwrap_or_else(|| panic!("no {phase} in {m}"));
        line[key.len()..].parse().unwrap()
    };
    let order =
        ["first_token", "handoff", "first_code", "chunk0_codes", "first_chunk", "first_audio"];
    let times: Vec<f64> = order.iter().map(|p| at(p)).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{order:?}: {times:?}");
}

#[test]
fn the_same_seed_gives_the_same_response() {
    let e = engine(EngineConfig::default());
    let a = collect(submit(&e, spec("a", "hello", 10, 30, 7)));
    let b = collect(submit(&e, spec("b", "hello", 10, 30, 7)));
    let c = collect(submit(&e, spec("c", "hello", 10, 30, 8)));
    assert_eq!(a.text, b.text);
    assert_eq!(a.audio, b.audio);
    assert_ne!(a.audio, c.audio, "another seed samples other codes");
}

#[test]
fn requests_batched_together_match_requests_alone() {
    batched_requests_match_requests_alone(EngineConfig::default());
}

/// With mixed steps a Code2Wav step holds the three replies' chunks at once, whatever their
/// lengths (their last chunks: 5, 10 and 15 new codes) and flags: each still gets its audio alone.
#[test]
fn requests_in_mixed_code2wav_steps_match_requests_alone() {
    batched_requests_match_requests_alone(
        EngineConfig::default().with(|c| c.code2wav.mixed_steps = true),
    );
}

/// One batch a Code2Wav step: the replies' chunks of other lengths and flags (their last chunks:
/// 5, 10 and 15 new codes) wait for later steps, and each still gets its audio alone.
#[test]
fn requests_in_one_batch_code2wav_steps_match_requests_alone() {
    batched_requests_match_requests_alone(
        EngineConfig::default().with(|c| c.code2wav.one_batch_per_step = true),
    );
}

/// Text chunks of 3 tokens (so every reply has several): replies batched together get what each
/// gets alone, though every chunk starts its stream's Talker cache over with a window.
#[test]
fn requests_with_text_chunks_batched_together_match_requests_alone() {
    batched_requests_match_requests_alone(
        EngineConfig::default().with(|c| c.talker.text_chunk = 3),
    );
}

/// A later chunk's window fed a row a step through the decode step (the GPU config's way) gives the
/// codes and audio its prefill gives, alone and batched with other replies.
#[test]
fn text_chunk_windows_fed_by_rows_give_what_their_prefill_gives() {
    let chunked = EngineConfig::default().with(|c| c.talker.text_chunk = 3);
    let talker_steps = |e: &Engine| e.metrics().step_count(StepKind::Talker);
    let e = engine(chunked.clone());
    let prefilled = collect(submit(&e, spec("a", "say it", 12, 80, 5)));
    let prefill_steps = talker_steps(&e);
    let by_rows = chunked.with(|c| c.talker.segment_rows = true);
    let e = engine(by_rows.clone());
    let rows = collect(submit(&e, spec("a", "say it", 12, 80, 5)));
    assert!(
        talker_steps(&e) > prefill_steps + 20,
        "windows fed by rows: {} steps, {prefill_steps} with prefills",
        talker_steps(&e)
    );
    assert_eq!(rows.status, Status::Completed);
    assert_eq!(rows.codes, 80);
    assert_eq!(rows.audio.len(), prefilled.audio.len());
    for (x, y) in rows.audio.iter().zip(&prefilled.audio) {
        assert_eq!(x.len(), y.len());
        let err = common::max_abs_diff(x, y);
        assert!(err < 1e-4, "audio differs by {err}");
    }
    batched_requests_match_requests_alone(by_rows);
}

/// With text chunks the Talker makes a reply's forced codes over its chunks, the text is the
/// Thinker's as without chunks, and the audio is made from another condition; with free lengths
/// the codes end where the Talker ends its chunks, within the reply's bounds.
#[test]
fn text_chunks_give_the_forced_codes_and_the_same_text() {
    let whole = collect(submit(&engine(EngineConfig::default()), spec("a", "say it", 32, 100, 5)));
    let e = engine(EngineConfig::default().with(|c| c.talker.text_chunk = 10));
    let chunked = collect(submit(&e, spec("a", "say it", 32, 100, 5)));
    assert_eq!(chunked.status, Status::Completed);
    assert_eq!(chunked.text, whole.text);
    assert_eq!(chunked.codes, 100);
    let total: usize = chunked.audio.iter().map(|a| a.len()).sum();
    assert_eq!(
        total,
        (3 + 100) * 2 * 480 + 3840,
        "(codes + 3 look-ahead) × 40 ms, plus the vocoder delay"
    );
    assert!(chunked.audio.iter().flatten().all(|s| s.is_finite()));
    assert_ne!(chunked.audio.concat(), whole.audio.concat(), "the Talker's condition is another");
    let mut free = spec("b", "say it", 25, 0, 6);
    free.generation.min_audio_tokens = Some(10);
    free.generation.max_audio_tokens = Some(300);
    let o = collect(submit(&e, free));
    assert_eq!(o.status, Status::Completed);
    assert!((10..=300).contains(&o.codes), "{} codes", o.codes);
    let total: usize = o.audio.iter().map(|a| a.len()).sum();
    assert_eq!(total, (3 + o.codes) * 2 * 480 + 3840);
    assert_eq!(e.active(), 0);
}

/// `talker.text_chunk_streams`: a reply that finds more requests in the engine than that (itself
/// included) is handed off whole, and its audio is the whole reply's; one that finds no more gets
/// text chunks, and the chunked audio.
#[test]
fn text_chunks_only_for_a_reply_that_finds_the_engine_light() {
    let run = |cfg: EngineConfig| collect(submit(&engine(cfg), spec("a", "say it", 32, 100, 5)));
    let chunks = |streams: Option<usize>| {
        EngineConfig::default().with(|c| {
            c.talker.text_chunk = 10;
            c.talker.text_chunk_streams = streams;
        })
    };
    let whole = run(EngineConfig::default());
    let chunked = run(chunks(None));
    assert_ne!(chunked.audio.concat(), whole.audio.concat(), "text chunks condition otherwise");
    for (name, got, want) in
        [("busy", run(chunks(Some(0))), &whole), ("light", run(chunks(Some(1))), &chunked)]
    {
        assert_eq!(got.status, Status::Completed, "{name}");
        assert_eq!(got.text, want.text, "{name}");
        let err = common::max_abs_diff(&got.audio.concat(), &want.audio.concat());
        assert!(err < 1e-6, "{name}: the audio differs by {err}");
    }
}

fn batched_requests_match_requests_alone(cfg: EngineConfig) {
    let e = engine(cfg);
    let alone: Vec<Outcome> = (0..3)
        .map(|i| {
            collect(submit(
                &e,
                spec(&format!("alone{i}"), &format!("prompt {i}"), 8 + i, 30 + 5 * i, i as u64),
            ))
        })
        .collect();
    let rxs: Vec<_> = (0..3)
        .map(|i| {
            submit(
                &e,
                spec(&format!("together{i}"), &format!("prompt {i}"), 8 + i, 30 + 5 * i, i as u64),
            )
        })
        .collect();
    let together: Vec<Outcome> = rxs.into_iter().map(collect).collect();
    assert!(e
        .metrics()
        .render()
        .contains("antiphon_stage_batch_size_bucket{stage=\"talker\",le=\"1\"}"));
    for (a, t) in alone.iter().zip(&together) {
        assert_eq!(a.text, t.text);
        assert_eq!(a.codes, t.codes);
        assert_eq!(a.audio.len(), t.audio.len());
        for (x, y) in a.audio.iter().zip(&t.audio) {
            assert_eq!(x.len(), y.len());
            let err = common::max_abs_diff(x, y);
            assert!(err < 1e-4, "batched audio differs by {err}");
        }
    }
}

/// New callers with new voices at once (the Thinker hears a burst's references together, Code2Wav
/// prefetches them together): each gets what it gets alone, on an engine that has heard none.
#[test]
fn a_burst_of_new_voices_gives_what_each_gives_alone() {
    let voiced = |i: usize| {
        let mut s = spec(&format!("v{i}"), "Say it in my voice.", 8, 30, 3);
        s.voice = RefInput::new(
            (0..16_000 * 2).map(|k| 0.3 * (k as f32 * (0.05 + 0.01 * i as f32)).sin()).collect(),
            16_000,
        );
        s
    };
    let alone: Vec<Outcome> =
        (0..3).map(|i| collect(submit(&engine(EngineConfig::default()), voiced(i)))).collect();
    let e = engine(EngineConfig::default().with(|c| c.prefetch.setup = true));
    let rxs: Vec<_> = (0..3).map(|i| submit(&e, voiced(i))).collect();
    let together: Vec<Outcome> = rxs.into_iter().map(collect).collect();
    assert_ne!(alone[0].audio, alone[1].audio, "two voices, two sounds");
    for (a, t) in alone.iter().zip(&together) {
        assert_eq!(a.status, Status::Completed);
        assert_eq!((&a.status, &a.text, a.codes), (&t.status, &t.text, t.codes));
        assert_eq!(a.audio.len(), t.audio.len());
        for (x, y) in a.audio.iter().zip(&t.audio) {
            assert_eq!(x.len(), y.len());
            let err = common::max_abs_diff(x, y);
            assert!(err < 1e-4, "audio in a burst differs from alone by {err}");
        }
    }
}

#[test]
fn cancel_stops_output_and_frees_every_stage() {
    let e = engine(EngineConfig::default());
    let rx = submit(&e, spec("long", "talk a lot", 8, 400, 3));
    // wait for the first audio, then cancel
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).unwrap() {
            EngineEvent::Audio { .. } => break,
            EngineEvent::Done { .. } => panic!("finished before the cancel"),
            _ => {}
        }
    }
    let t = Instant::now();
    assert!(e.cancel(&RequestId("long".into())));
    let mut after = vec![];
    while let Ok(ev) = rx.recv_timeout(Duration::from_millis(500)) {
        after.push(ev);
    }
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(after.last(), Some(EngineEvent::Done { status: Status::Cancelled, .. })),
        "{after:?}"
    );
    assert!(
        after.iter().filter(|e| matches!(e, EngineEvent::Audio { .. })).count() == 0,
        "no audio after the cancel"
    );
    assert_eq!(e.active(), 0);
    assert!(!e.cancel(&RequestId("long".into())), "a second cancel does nothing");
    // the engine keeps serving
    let o = collect(submit(&e, spec("next", "again", 6, 20, 4)));
    assert_eq!(o.status, Status::Completed);
}

#[test]
fn cancel_before_any_output() {
    let e = engine(EngineConfig::default());
    let rx = submit(&e, spec("early", "x", 50, 200, 3));
    assert!(e.cancel(&RequestId("early".into())));
    let o = collect(rx);
    assert_eq!(o.status, Status::Cancelled);
    assert!(o.audio.is_empty());
}

#[test]
fn streaming_prefill_gives_the_same_response() {
    let a = collect(submit(&engine(EngineConfig::default()), spec("a", "same input", 16, 30, 11)));
    let b = collect(submit(
        &engine(EngineConfig::default().with(|c| c.talker.streaming_prefill = true)),
        spec("a", "same input", 16, 30, 11),
    ));
    assert_eq!(a.text, b.text);
    assert_eq!(a.codes, b.codes);
    let (x, y): (Vec<f32>, Vec<f32>) = (a.audio.concat(), b.audio.concat());
    assert_eq!(x.len(), y.len());
    let err = common::max_abs_diff(&x, &y);
    assert!(err < 1e-4, "streaming prefill changed the audio by {err}");
}

#[test]
fn spoken_input_and_history_are_accepted() {
    let e = engine(EngineConfig::default());
    let mut s = spec("voice", "", 6, 20, 1);
    s.input = UserInput::Audio(
        SpokenClip::new((0..16_000 * 2).map(|i| 0.2 * (i as f32 * 0.05).sin()).collect()).unwrap(),
    );
    s.history = vec![antiphon_engine::Turn::text("hi", "hello there")];
    s.instructions = Some("Be brief.".into());
    let o = collect(submit(&e, s));
    assert_eq!(o.status, Status::Completed);
    assert_eq!(o.codes, 20);
}

#[test]
fn a_duplex_request_is_never_prefetched() {
    let e = engine(EngineConfig::default());
    let mut s = spec("d", "duplex segment", 6, 25, 1);
    s.mode = Mode::Duplex;
    let o = collect(submit(&e, s));
    assert_eq!(o.status, Status::Completed);
    let m = e.metrics();
    assert_eq!(m.prefetch_count(PrefetchEvent::PhaseA), 0);
    assert_eq!(
        m.prefetch_count(PrefetchEvent::Inline) + m.prefetch_count(PrefetchEvent::CacheHit),
        1
    );
}

#[test]
fn a_bad_reference_is_refused_and_the_engine_keeps_serving() {
    let e = engine(EngineConfig::default());
    let sink = || -> antiphon_engine::EventSink { Arc::new(|_| {}) };
    let mut s = spec("bad", "x", 4, 10, 1);
    s.voice = RefInput::new(vec![], 16_000);
    assert!(e.submit(s, sink()).is_err());
    let mut s = spec("nan", "x", 4, 10, 1);
    s.voice = RefInput::new(vec![f32::NAN; 100], 16_000);
    assert!(e.submit(s, sink()).is_err());
    // audio shorter than one mel hop is accepted (it just gives no embeddings)
    let mut s = spec("tiny-audio", "", 4, 10, 1);
    s.input = UserInput::Audio(SpokenClip::new(vec![0.1; 50]).unwrap());
    assert_eq!(collect(submit(&e, s)).status, Status::Completed);
    assert_eq!(collect(submit(&e, spec("ok", "x", 4, 10, 1))).status, Status::Completed);
}

/// Counts no model holds are refused with a clear reason naming the field (no allocation is
/// attempted), and the engine keeps serving.
#[test]
fn counts_beyond_the_contexts_fail_the_request_not_the_engine() {
    let e = engine(EngineConfig::default());
    for (id, text, codes, what) in [
        ("huge-text", 4_294_967_296usize, 10usize, "max_text_tokens"),
        ("huge-codes", 4, 1usize << 40, "max_audio_tokens"),
    ] {
        let mut s = spec(id, "x", 4, 10, 1);
        s.generation.max_text_tokens = Some(text);
        s.generation.max_audio_tokens = Some(codes);
        s.generation.min_audio_tokens = Some(codes.min(10));
        match collect(submit(&e, s)).status {
            Status::Refused(why) => assert!(why.contains(&format!("generation.{what}")), "{why}"),
            other => panic!("{id}: {other:?}"),
        }
    }
    let limits = e.generation_limits();
    assert!(limits.max_text_tokens > 0 && limits.max_audio_tokens > 0, "{limits:?}");
    assert_eq!(collect(submit(&e, spec("ok", "x", 4, 10, 1))).status, Status::Completed);
}

#[test]
fn duplicate_live_ids_are_refused() {
    let e = engine(EngineConfig::default());
    let rx = submit(&e, spec("dup", "x", 30, 100, 1));
    let (tx, _rx2) = mpsc::channel::<EngineEvent>();
    let tx = std::sync::Mutex::new(tx);
    assert!(e
        .submit(spec("dup", "x", 3, 10, 1), Arc::new(move |ev| drop(tx.lock().unwrap().send(ev))))
        .is_err());
    e.cancel(&RequestId("dup".into()));
    let _ = collect(rx);
}

/// The GPU runs bf16 weights: the same pipeline in bf16 on the CPU finds dtype mismatches without a
/// GPU (the S3 tokenizer and the vocoder run in f32 by design; everything else in the weights'
/// dtype).
#[test]
fn bf16_weights_run_end_to_end() {
    let e = Engine::start(
        models_in_memory(Preset::Tiny, 5, DType::BF16, &Device::Cpu).unwrap(),
        EngineConfig::default(),
    )
    .unwrap();
    let o = collect(submit(&e, spec("bf", "Read this sentence.", 6, 30, 1)));
    assert_eq!(o.status, Status::Completed, "{:?}", o.events.last());
    assert_eq!(o.codes, 30);
    let samples: usize = o.audio.iter().map(|a| a.len()).sum();
    assert!(samples > 30 * 960, "{samples} samples");
    assert!(o.audio.iter().flatten().all(|s| s.is_finite()));
    // a spoken turn too (audio input through the Whisper encoder in bf16)
    let mut s = spec("bf2", "", 4, 10, 2);
    s.input = UserInput::Audio(
        SpokenClip::new((0..16_000).map(|i| 0.2 * (i as f32 * 0.05).sin()).collect()).unwrap(),
    );
    assert_eq!(collect(submit(&e, s)).status, Status::Completed);
    // and a duplex session's streaming units
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let g = GenerationParams {
        min_text_tokens: Some(3),
        max_text_tokens: Some(3),
        min_audio_tokens: Some(4),
        max_audio_tokens: Some(4),
        ..Default::default()
    };
    let d = antiphon_engine::DuplexSpec {
        session: "bfd".into(),
        policy: antiphon_engine::DuplexPolicy::SpeakEvery(2),
        instructions: None,
        voice: voice(),
        generation: g,
    };
    e.open_duplex(d, Arc::new(move |ev| drop(tx.lock().unwrap().send(ev)))).unwrap();
    for n in 0..3 {
        e.duplex_unit(
            "bfd",
            (0..16_000).map(|i| 0.2 * (i as f32 * (0.03 + 0.01 * n as f32)).sin()).collect(),
        )
        .unwrap();
    }
    loop {
        match rx.recv_timeout(Duration::from_secs(60)).expect("duplex events") {
            antiphon_engine::DuplexEvent::Response {
                event: EngineEvent::Done { status, .. },
                ..
            } => {
                assert_eq!(status, Status::Completed);
                break;
            }
            antiphon_engine::DuplexEvent::Closed { reason } => panic!("closed: {reason}"),
            _ => {}
        }
    }
}

/// Admission by load: with two stream places and a queue of two, the third and fourth requests
/// wait, each starting only once a running one has ended, and a fifth is refused at once
/// (`Busy`, with a time to retry); every admitted request completes.
#[test]
fn requests_beyond_the_places_wait_and_beyond_the_queue_are_refused() {
    use antiphon_engine::SubmitError;
    // (the limit stays at the places: the CPU's tiny engine is no real-time measure)
    let e = engine(EngineConfig::default().with(|c| {
        c.max_streams = Some(2);
        c.max_queued = 2;
        c.adaptive_stream_limit = false;
    }));
    let (tx, rx) = mpsc::channel::<(usize, Instant, EngineEvent)>();
    let tx = Arc::new(std::sync::Mutex::new(tx));
    for i in 0..4 {
        let tx = tx.clone();
        let sink = Arc::new(move |ev| drop(tx.lock().unwrap().send((i, Instant::now(), ev))));
        e.submit(spec(&format!("r{i}"), "hello", 6, 60, i as u64), sink).unwrap();
    }
    match e.submit(spec("r4", "hello", 6, 60, 4), Arc::new(|_| {})) {
        Err(SubmitError::Busy(b)) => assert!(b.retry_after_ms > 0),
        other => panic!("a fifth request beyond two places and a queue of two: {other:?}"),
    }
    // (the first and the last output of each: a place is freed after a request's last audio)
    let (mut first, mut last): ([Option<Instant>; 4], [Option<Instant>; 4]) = Default::default();
    let mut done = [false; 4];
    while done.iter().any(|d| !d) {
        let (i, t, ev) =
            rx.recv_timeout(Duration::from_secs(120)).expect("every admitted request finishes");
        match ev {
            EngineEvent::Done { status, .. } => {
                assert_eq!(status, Status::Completed, "request {i}");
                done[i] = true;
            }
            _ => {
                first[i].get_or_insert(t);
                last[i] = Some(t);
            }
        }
    }
    let first_end = last[0].unwrap().min(last[1].unwrap());
    for (i, t) in first.iter().enumerate().skip(2) {
        assert!(t.unwrap() >= first_end, "request {i} produced output before a place was free");
    }
    // (a place comes back before its request's Done goes out)
    assert_eq!(e.admission().counts(), (0, 0, 2), "every place is back");
}

/// `engine.first_audio_target_ms`: a reply whose first audio comes later than the target after it
/// took its place lowers the stream limit (the adaptive limit's sign of load, as a late chunk);
/// without the target the limit stays at the places.
#[test]
fn a_first_audio_past_its_target_lowers_the_stream_limit() {
    for (target_ms, lowered) in [(1, true), (0, false)] {
        let e = engine(EngineConfig::default().with(|c| {
            c.max_streams = Some(4);
            c.adaptive_stream_limit = true;
            c.first_audio_target_ms = target_ms;
        }));
        assert_eq!(e.admission().counts().2, 4);
        // (the tiny engine's first audio takes more than a millisecond: a prefill, decode steps
        // and a Code2Wav chunk)
        let o = collect(submit(&e, spec("slow", "hello", 6, 60, 1)));
        assert_eq!(o.status, Status::Completed);
        let limit = e.admission().counts().2;
        assert_eq!(limit < 4, lowered, "target {target_ms} ms: the limit is {limit}");
    }
}
