//! Full duplex in the threaded engine on the tiny synthetic models: unit cadence and the per-unit
//! token budget, speak_every, consecutive speaking units as one turn, the model's own decisions,
//! the context limit, and no prefetch while a duplex session is live (8 sessions in real time:
//! `src/engine/tests/realtime.rs`, the engine crate's own test binary, so that no other test
//! shares its cores).

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use antiphon_assets::synth::{models_in_memory, Preset};
use antiphon_engine::metric_labels::{PrefetchEvent, PrefetchSkip, StepKind};
use antiphon_engine::{
    DuplexEnd, DuplexEvent, DuplexPolicy, DuplexSpec, Engine, EngineConfig, EngineEvent,
    GenerationParams, Mode, RefInput, RequestId, RequestSpec, Status, UserInput,
};
use candle_core::{DType, Device};

fn engine(cfg: EngineConfig) -> Engine {
    Engine::start(models_in_memory(Preset::Tiny, 5, DType::F32, &Device::Cpu).unwrap(), cfg)
        .unwrap()
}

fn voice(f: f32) -> RefInput {
    RefInput::new(
        (0..16_000 * 3)
            .map(|i| 0.3 * (i as f32 * f / 16_000.0 * std::f32::consts::TAU).sin())
            .collect(),
        16_000,
    )
}

/// One second of "speech" (a gliding tone), different per unit.
fn unit(n: u64) -> Vec<f32> {
    (0..16_000).map(|i| 0.2 * ((i as f32) * (0.03 + 0.002 * n as f32)).sin()).collect()
}

fn forced(text: usize, drain: usize) -> GenerationParams {
    GenerationParams {
        min_text_tokens: Some(text),
        max_text_tokens: Some(text),
        min_audio_tokens: Some(drain),
        max_audio_tokens: Some(drain),
        temperature: None,
        seed: Some(3),
        prefix: None,
    }
}

fn open(
    e: &Engine,
    session: &str,
    policy: DuplexPolicy,
    generation: GenerationParams,
) -> mpsc::Receiver<DuplexEvent> {
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let spec = DuplexSpec {
        session: session.into(),
        policy,
        instructions: None,
        voice: voice(180.0),
        generation,
    };
    e.open_duplex(
        spec,
        Arc::new(move |ev| {
            let _ = tx.lock().unwrap().send(ev);
        }),
    )
    .unwrap();
    rx
}

/// Events until `stop` says so (or a timeout fails the test).
fn collect(
    rx: &mpsc::Receiver<DuplexEvent>,
    mut stop: impl FnMut(&[DuplexEvent]) -> bool,
) -> Vec<DuplexEvent> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut out = Vec::new();
    while !stop(&out) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "timed out; events so far: {}", summary(&out));
        if let Ok(e) = rx.recv_timeout(left.min(Duration::from_millis(200))) {
            out.push(e);
        }
    }
    out
}

/// Events until the session's `Closed` (the last of them).
fn until_closed(rx: &mpsc::Receiver<DuplexEvent>) -> Vec<DuplexEvent> {
    collect(rx, |ev| ev.iter().any(|e| matches!(e, DuplexEvent::Closed { .. })))
}

/// Why the session closed (its events end with `Closed`).
fn closed_reason(ev: &[DuplexEvent]) -> &DuplexEnd {
    match ev.last() {
        Some(DuplexEvent::Closed { reason }) => reason,
        other => panic!("no Closed at the end: {other:?} after {}", summary(ev)),
    }
}

fn summary(ev: &[DuplexEvent]) -> String {
    ev.iter()
        .map(|e| match e {
            DuplexEvent::Listen { unit, .. } => format!("L{unit}"),
            DuplexEvent::Speak { unit, new_turn, .. } => {
                format!("S{unit}{}", if *new_turn { "+" } else { "" })
            }
            DuplexEvent::Response { turn, event: EngineEvent::Done { status, .. } } => {
                format!("done({turn},{status:?})")
            }
            DuplexEvent::Response { .. } => String::new(),
            DuplexEvent::Closed { reason } => format!("closed({reason})"),
        })
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// (unit, speak, context) of every decision, in order.
fn decisions(ev: &[DuplexEvent]) -> Vec<(u64, bool, usize)> {
    ev.iter()
        .filter_map(|e| match e {
            DuplexEvent::Listen { unit, context, .. } => Some((*unit, false, *context)),
            DuplexEvent::Speak { unit, context, .. } => Some((*unit, true, *context)),
            _ => None,
        })
        .collect()
}

fn dones(ev: &[DuplexEvent]) -> Vec<(RequestId, Status, usize, String)> {
    ev.iter()
        .filter_map(|e| match e {
            DuplexEvent::Response {
                turn,
                event: EngineEvent::Done { status, codes, text, .. },
            } => Some((turn.clone(), status.clone(), *codes, text.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn speak_every_cadence_and_the_per_unit_token_budget() {
    let e = engine(EngineConfig::default());
    let rx = open(&e, "s", DuplexPolicy::SpeakEvery(2), forced(5, 10));
    for n in 0..7 {
        e.duplex_unit("s", unit(n)).unwrap();
    }
    // units 1, 3, 5 speak; unit 6 listens and closes the third turn
    let ev = collect(&rx, |ev| dones(ev).len() == 3);
    let d = decisions(&ev);
    assert_eq!(
        d.iter().map(|x| (x.0, x.1)).collect::<Vec<_>>(),
        (0..7).map(|u| (u, u % 2 == 1)).collect::<Vec<_>>(),
        "{}",
        summary(&ev)
    );
    // Thinker positions per unit: `</unit>` `<unit>` + 10 audio embeddings, plus what the
    // previous unit fed back: `<|listen|>` (1), or `<|speak|>` + 5 text tokens + `<|chunk_eos|>`
    // (7)
    for w in d.windows(2) {
        let fed = if w[0].1 { 1 + 5 + 1 } else { 1 };
        assert_eq!(w[1].2 - w[0].2, 12 + fed, "unit {} → {}", w[0].0, w[1].0);
    }
    // every speaking unit opened its own turn: a unit of codes (25) plus the forced drain (10)
    let turns: Vec<_> = ev
        .iter()
        .filter_map(|e| {
            if let DuplexEvent::Speak { turn, new_turn, .. } = e {
                Some((turn.clone(), *new_turn))
            } else {
                None
            }
        })
        .collect();
    assert!(turns.iter().all(|t| t.1));
    let done = dones(&ev);
    for (turn, status, codes, text) in &done {
        assert_eq!(*status, Status::Completed, "{turn}");
        assert_eq!(*codes, 35, "{turn}");
        assert!(!text.is_empty());
    }
    assert_eq!(
        done.iter().map(|d| d.0 .0.clone()).collect::<Vec<_>>(),
        vec!["s/t1", "s/t2", "s/t3"]
    );
    // audio of each turn: chunks in order, the last flagged, ≈ 35 codes × 40 ms
    for t in ["s/t1", "s/t2", "s/t3"] {
        let chunks: Vec<(usize, bool, usize)> = ev
            .iter()
            .filter_map(|e| match e {
                DuplexEvent::Response {
                    turn,
                    event: EngineEvent::Audio { chunk, last, samples },
                } if turn.0 == t => Some((*chunk, *last, samples.len())),
                _ => None,
            })
            .collect();
        assert_eq!(
            chunks.iter().map(|c| c.0).collect::<Vec<_>>(),
            (0..chunks.len()).collect::<Vec<_>>()
        );
        assert!(chunks.last().unwrap().1 && chunks.iter().filter(|c| c.1).count() == 1);
        let ms = chunks.iter().map(|c| c.2).sum::<usize>() as f64 / 24.0;
        assert!((35.0 * 40.0..=35.0 * 40.0 + 400.0).contains(&ms), "{t}: {ms} ms");
    }
    e.close_duplex("s");
    let end = until_closed(&rx);
    assert_eq!(closed_reason(&end), &DuplexEnd::Closed);
}

#[test]
fn consecutive_speaking_units_are_one_turn_and_closing_cancels_it() {
    let e = engine(EngineConfig::default());
    let rx = open(&e, "s", DuplexPolicy::SpeakEvery(1), forced(3, 10));
    for n in 0..3 {
        e.duplex_unit("s", unit(n)).unwrap();
    }
    // three segments of 25 codes: the first two chunks are out before the third unit's codes end
    let ev = collect(&rx, |ev| {
        ev.iter()
            .filter(|e| matches!(e, DuplexEvent::Response { event: EngineEvent::Audio { .. }, .. }))
            .count()
            >= 2
    });
    let speaks: Vec<bool> = ev
        .iter()
        .filter_map(|e| {
            if let DuplexEvent::Speak { new_turn, .. } = e {
                Some(*new_turn)
            } else {
                None
            }
        })
        .collect();
    assert_eq!(speaks.first(), Some(&true));
    assert!(speaks[1..].iter().all(|n| !n), "one turn: {}", summary(&ev));
    e.close_duplex("s");
    let ev = until_closed(&rx);
    let done = dones(&ev);
    assert_eq!(done.len(), 1, "{}", summary(&ev));
    assert_eq!(done[0].1, Status::Cancelled);
    assert!(matches!(ev.last(), Some(DuplexEvent::Closed { .. })));
}

/// A speaking turn's later units fed to the Talker a row a step (`talker.segment_rows`, the way a
/// GPU keeps them on its priority graph) give the audio their prefills give.
#[test]
fn later_units_fed_by_rows_give_what_their_prefills_give() {
    let run = |cfg: EngineConfig| {
        let e = engine(cfg);
        let rx = open(&e, "r", DuplexPolicy::SpeakEvery(1), forced(3, 10));
        for n in 0..5 {
            e.duplex_unit("r", unit(n)).unwrap();
        }
        let audio = |ev: &[DuplexEvent]| -> Vec<Vec<f32>> {
            ev.iter()
                .filter_map(|e| match e {
                    DuplexEvent::Response { event: EngineEvent::Audio { samples, .. }, .. } => {
                        Some(samples.clone())
                    }
                    _ => None,
                })
                .collect()
        };
        let ev = collect(&rx, |ev| audio(ev).len() >= 4);
        e.close_duplex("r");
        let end = until_closed(&rx);
        let codes = dones(&end).iter().map(|d| d.2).sum::<usize>() as u64;
        let steps = e.metrics().step_count(StepKind::Talker);
        // (every step samples a code but a row's that is not its segment's last: 4 units made
        // their conditions' rows by then)
        (audio(&ev)[..4].to_vec(), steps.saturating_sub(codes))
    };
    let (prefilled, prefill_rows) = run(EngineConfig::default());
    let (rows, row_steps) = run(EngineConfig::default().with(|c| c.talker.segment_rows = true));
    assert!(
        prefill_rows <= 3 && row_steps >= 10,
        "Talker steps without a code: {row_steps} by rows, {prefill_rows} with prefills"
    );
    for (k, (x, y)) in rows.iter().zip(&prefilled).enumerate() {
        assert_eq!(x.len(), y.len(), "chunk {k}");
        let err = x
            .iter()
            .zip(y)
            .map(
                |(a, b)| if a.is_finite() && b.is_finite() { (a - b).abs() } else { f32::INFINITY },
            )
            .fold(0f32, f32::max);
        assert!(err < 1e-4, "chunk {k}: audio differs by {err}");
    }
}

#[test]
fn the_model_decides_within_the_unit_budget() {
    let e = engine(EngineConfig::default());
    let g = GenerationParams { temperature: Some(1.0), seed: Some(11), ..Default::default() };
    let rx = open(&e, "m", DuplexPolicy::Model, g);
    for n in 0..6 {
        e.duplex_unit("m", unit(n)).unwrap();
    }
    let ev = collect(&rx, |ev| decisions(ev).len() == 6);
    let d = decisions(&ev);
    assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>());
    for w in d.windows(2) {
        // listen: 1 token fed; speaking: at most 20 text tokens + speak/terminator
        let fed = w[1].2 - w[0].2 - 12;
        assert!((1..=22).contains(&fed), "unit {}: {fed} tokens", w[0].0);
        if !w[0].1 {
            assert_eq!(fed, 1);
        }
    }
    e.close_duplex("m");
}

#[test]
fn a_full_context_closes_the_session_with_its_reason() {
    let e = engine(EngineConfig::default().with(|c| c.duplex.max_context = Some(200)));
    let rx = open(&e, "c", DuplexPolicy::SpeakEvery(1000), GenerationParams::default());
    for n in 0..30 {
        e.duplex_unit("c", unit(n)).unwrap();
    }
    let ev = until_closed(&rx);
    assert_eq!(closed_reason(&ev), &DuplexEnd::ContextFull, "{}", summary(&ev));
    let d = decisions(&ev);
    assert!(!d.is_empty() && d.len() < 30);
    // the next unit would not have fit: its markers, audio and a whole spoken unit
    let last = d.last().unwrap().2 + 1;
    assert!(last + 12 + 22 > 200 && d.last().unwrap().2 <= 200, "{d:?}");
    // nothing after Closed
    std::thread::sleep(Duration::from_millis(300));
    assert!(rx.try_recv().is_err());
}

/// The engine's own bound on a stream's queued input (the server paces its clients well before
/// it): a session whose units run more than 30 s ahead of the decisions fails, saying why, and
/// nothing follows its `Closed`.
#[test]
fn a_stream_whose_input_runs_far_ahead_of_the_model_fails_saying_why() {
    let e = engine(EngineConfig::default());
    let rx = open(&e, "f", DuplexPolicy::SpeakEvery(1000), GenerationParams::default());
    let units: Vec<Vec<f32>> = (0..45).map(unit).collect();
    // (45 s offered at once: the tiny Thinker decides a unit in milliseconds, not microseconds)
    for u in units {
        e.duplex_unit("f", u).unwrap();
    }
    let ev = until_closed(&rx);
    match closed_reason(&ev) {
        DuplexEnd::Failed(why) => assert!(why.contains("30 s ahead"), "{why}"),
        other => panic!("not failed for running ahead: {other} after {}", summary(&ev)),
    }
    assert!(decisions(&ev).len() < 45, "{}", summary(&ev));
    e.close_duplex("f");
}

/// A closed session's stream goes even when its close message is lost (an inbox full): its place
/// is the authority, and the Thinker's step forgets a stream whose session holds none.
#[test]
fn a_duplex_stream_goes_with_its_place() {
    let e = engine(EngineConfig::default());
    let rx = open(&e, "p", DuplexPolicy::SpeakEvery(1000), GenerationParams::default());
    e.duplex_unit("p", unit(0)).unwrap();
    collect(&rx, |ev| !decisions(ev).is_empty());
    // the place alone, as a close whose messages found the inboxes full leaves it
    e.admission().release(&antiphon_engine::admission::Holder::Duplex("p".into()));
    e.duplex_unit("p", unit(1)).unwrap();
    let ev = until_closed(&rx);
    assert_eq!(closed_reason(&ev), &DuplexEnd::Closed, "{}", summary(&ev));
    assert_eq!(e.admission().counts().0, 0, "no place held");
}

#[test]
fn no_prefetch_while_a_duplex_session_is_live() {
    let e = engine(EngineConfig::default());
    let rx = open(&e, "d", DuplexPolicy::SpeakEvery(2), forced(3, 5));
    for n in 0..3 {
        e.duplex_unit("d", unit(n)).unwrap();
    }
    collect(&rx, |ev| !dones(ev).is_empty());
    let m = e.metrics();
    // the duplex turn carried no reference to prefetch: nothing was claimed, retired or evicted
    for ev in [
        PrefetchEvent::PhaseA,
        PrefetchEvent::Claimed,
        PrefetchEvent::Retired,
        PrefetchEvent::Evicted,
    ] {
        assert_eq!(m.prefetch_count(ev), 0, "{ev:?}");
    }
    // a turn-mode request admitted while the duplex session is live: no prefetch (busy gate)
    let turn = |id: &str, f: f32| {
        let (tx, trx) = mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        let spec = RequestSpec {
            id: RequestId(id.into()),
            mode: Mode::Turn,
            input: UserInput::Text("Hello there.".into()),
            instructions: None,
            history: vec![],
            voice: voice(f),
            generation: forced(24, 30),
            tools: Default::default(),
            text_only: false,
            task: Default::default(),
        };
        e.submit(
            spec,
            Arc::new(move |ev| {
                let _ = tx.lock().unwrap().send(ev);
            }),
        )
        .unwrap();
        loop {
            if let EngineEvent::Done { status, .. } =
                trx.recv_timeout(Duration::from_secs(60)).unwrap()
            {
                assert_eq!(status, Status::Completed);
                break;
            }
        }
    };
    turn("t1", 300.0);
    assert_eq!(m.prefetch_count(PrefetchEvent::PhaseA), 0);
    assert!(m.skip_count(PrefetchSkip::Busy) > 0, "the busy gate said no");
    // once the duplex session closes, prefetch runs again
    e.close_duplex("d");
    until_closed(&rx);
    turn("t2", 410.0);
    assert_eq!(m.prefetch_count(PrefetchEvent::PhaseA), 1);
    assert_eq!(m.prefetch_count(PrefetchEvent::Claimed), 1);
}

/// A session in a KV slot that outgrows it moves to a cache of its own and goes on: the same
/// decisions, contexts and turn texts as a session that never had a slot.
#[test]
fn a_session_that_outgrows_its_slot_goes_on_unchanged() {
    let run = |cfg: EngineConfig| {
        let e = engine(cfg);
        let rx = open(&e, "g", DuplexPolicy::SpeakEvery(2), forced(3, 5));
        for n in 0..8 {
            e.duplex_unit("g", unit(n)).unwrap();
        }
        let ev = collect(&rx, |ev| decisions(ev).len() == 8 && dones(ev).len() >= 3);
        e.close_duplex("g");
        (decisions(&ev), dones(&ev))
    };
    let (slot_d, slot_t) = run(EngineConfig::default().with(|c| {
        c.thinker.slots = 2;
        c.thinker.slot_context = 96;
    }));
    let (own_d, own_t) = run(EngineConfig::default().with(|c| c.thinker.slots = 0));
    assert!(
        slot_d.first().unwrap().2 < 96 && slot_d.last().unwrap().2 > 96,
        "the session outgrew its 96-position slot: {slot_d:?}"
    );
    assert_eq!(slot_d, own_d);
    assert_eq!(slot_t, own_t);
}
