//! The input buffer's turn edges with `semantic_vad`: pauses asked about, answers applied, the
//! eagerness's longest wait, speech again after a pause. The turn model is not run here: the
//! tests answer for it (the real model's answers are `tests/integration/parity_turn.rs`'s and
//! `tests/integration/semantic_turns.rs`'s).

use super::*;

/// An espeak phrase of `assets/vad` at 24 kHz, as PCM16, from its first to its last sample above
/// -40 dBFS.
fn phrase(name: &str) -> Vec<i16> {
    let bytes =
        std::fs::read(format!("{}/../../assets/vad/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let (x, rate) = antiphon_audio::decode_wav(&bytes).unwrap();
    let x = antiphon_audio::resample(&x, rate, RATE as u32).unwrap();
    let first = x.iter().position(|v| v.abs() > 0.01).unwrap();
    let last = x.iter().rposition(|v| v.abs() > 0.01).unwrap();
    x[first..=last].iter().map(|&v| antiphon_audio::f32_to_i16(v)).collect()
}

fn silence(ms: u64) -> Vec<i16> {
    vec![0; (ms * PER_MS) as usize]
}

fn semantic(eagerness: &str) -> TurnDetection {
    TurnDetection { semantic: true, eagerness: Some(eagerness.into()), ..TurnDetection::default() }
}

/// Appends `x` in 20 ms packets, as a client streams; every event, in order.
fn feed(b: &mut InputBuffer, x: &[i16]) -> Vec<InputEvent> {
    x.chunks(480).flat_map(|p| b.push(p).unwrap()).collect()
}

fn kinds(events: &[InputEvent]) -> Vec<&'static str> {
    events
        .iter()
        .map(|e| match e {
            InputEvent::Started { .. } => "started",
            InputEvent::Stopped { .. } => "stopped",
            InputEvent::Paused { .. } => "paused",
        })
        .collect()
}

/// As [`feed`], with every pause answered at once as the translator does (`complete`: what the
/// model says about a pause at that stream sample); the pauses asked about stay in the events.
fn feed_answering(
    b: &mut InputBuffer,
    x: &[i16],
    complete: impl Fn(u64) -> bool,
) -> Vec<InputEvent> {
    let mut out = Vec::new();
    for e in feed(b, x) {
        let answer = if let InputEvent::Paused { at, .. } = &e {
            b.pause_decided(*at, complete(*at))
        } else {
            None
        };
        out.push(e);
        out.extend(answer);
    }
    out
}

/// The stream sample of the last pause asked about.
fn last_pause(events: &[InputEvent]) -> u64 {
    events
        .iter()
        .rev()
        .find_map(|e| if let InputEvent::Paused { at, .. } = e { Some(*at) } else { None })
        .expect("a pause")
}

fn without_pauses(events: &[InputEvent]) -> Vec<&'static str> {
    kinds(events).into_iter().filter(|k| *k != "paused").collect()
}

#[test]
fn a_pause_the_model_calls_complete_ends_the_turn_there() {
    let mut b = InputBuffer::new(60, true);
    b.set_turn_detection(Some(semantic("auto"))).unwrap();
    let p = phrase("phrase1.wav");
    // the model calls only the pause after the phrase complete (not its comma's)
    let end = (500 * PER_MS) + p.len() as u64;
    let at_end = move |at: u64| at + 100 * PER_MS >= end;
    let mut events = feed_answering(&mut b, &silence(500), at_end);
    events.extend(feed_answering(&mut b, &p, at_end));
    assert_eq!(without_pauses(&events), ["started"], "a pause inside the phrase does not end it");
    events.extend(feed_answering(&mut b, &silence(400), at_end));
    assert_eq!(without_pauses(&events), ["started", "stopped"]);
    assert_eq!(
        kinds(&events[events.len() - 2..]),
        ["paused", "stopped"],
        "the turn ends at the pause it was asked about"
    );
    let Some(InputEvent::Stopped { audio_end_ms, audio }) = events.last() else { unreachable!() };
    assert!(
        (audio_end_ms * PER_MS).abs_diff(end) <= 100 * PER_MS,
        "ended at {audio_end_ms} ms, the speech at {} ms",
        end / PER_MS
    );
    // the phrase and the prefix padding (300 ms), within the detector's 100 ms
    let want = p.len() + (300 * PER_MS) as usize;
    assert!(
        audio.len().abs_diff(want) <= (100 * PER_MS) as usize,
        "{} samples, the phrase and its padding {want}",
        audio.len()
    );
    assert!(feed_answering(&mut b, &silence(9000), at_end).is_empty(), "the turn ended once");
}

#[test]
fn an_incomplete_turn_ends_after_the_eagerness_longest_wait() {
    for (eagerness, wait) in [("high", 2000u64), ("medium", 4000), ("low", 8000)] {
        let mut b = InputBuffer::new(60, true);
        b.set_turn_detection(Some(semantic(eagerness))).unwrap();
        let p = phrase("phrase2.wav");
        let mut events = feed_answering(&mut b, &silence(500), |_| false);
        events.extend(feed_answering(&mut b, &p, |_| false));
        let before = feed_answering(&mut b, &silence(wait - 100), |_| false);
        assert_eq!(
            without_pauses(&before),
            Vec::<&str>::new(),
            "{eagerness}: ended before its wait"
        );
        let after = feed_answering(&mut b, &silence(300), |_| false);
        assert_eq!(kinds(&after), ["stopped"], "{eagerness}");
        let InputEvent::Stopped { audio_end_ms, audio } = &after[0] else { unreachable!() };
        let end = 500 + p.len() as u64 / PER_MS;
        assert!(
            audio_end_ms.abs_diff(end) <= 100,
            "{eagerness}: the turn ends where the speech did ({end} ms), not at {audio_end_ms}"
        );
        assert!(audio.len() >= p.len(), "{eagerness}: the whole phrase");
    }
}

#[test]
fn speech_after_an_incomplete_pause_continues_the_same_turn() {
    let mut b = InputBuffer::new(60, true);
    b.set_turn_detection(Some(semantic("auto"))).unwrap();
    let (p1, p2) = (phrase("phrase1.wav"), phrase("phrase2.wav"));
    // the model calls every pause incomplete until the second phrase has been said
    let end = (500 + 800) * PER_MS + (p1.len() + p2.len()) as u64;
    let at_end = move |at: u64| at + 100 * PER_MS >= end;
    let mut events = feed_answering(&mut b, &silence(500), at_end);
    events.extend(feed_answering(&mut b, &p1, at_end));
    events.extend(feed_answering(&mut b, &silence(800), at_end));
    assert!(kinds(&events).contains(&"paused"), "the 800 ms pause is asked about");
    let first = last_pause(&events);
    events.extend(feed_answering(&mut b, &p2, at_end));
    assert_eq!(without_pauses(&events), ["started"], "no second speech_started");
    events.extend(feed_answering(&mut b, &silence(400), at_end));
    assert_eq!(without_pauses(&events), ["started", "stopped"]);
    assert!(b.pause_decided(first, true).is_none(), "an answer about the first pause is stale");
    let Some(InputEvent::Stopped { audio, .. }) = events.last() else { unreachable!() };
    let both = p1.len() + p2.len() + (800 * PER_MS) as usize;
    assert!(
        audio.len() >= both,
        "one turn holds both phrases and the pause: {} < {both}",
        audio.len()
    );
}

#[test]
fn a_commit_during_a_pause_takes_the_turn_and_drops_the_question() {
    let mut b = InputBuffer::new(60, true);
    b.set_turn_detection(Some(semantic("high"))).unwrap();
    let mut events = feed(&mut b, &silence(500));
    events.extend(feed(&mut b, &phrase("phrase2.wav")));
    events.extend(feed(&mut b, &silence(300)));
    let at = last_pause(&events);
    assert!(b.commit().is_ok());
    assert!(b.pause_decided(at, true).is_none(), "the committed turn is not ended twice");
    assert!(feed(&mut b, &silence(3000)).is_empty(), "nor by the longest wait");
    let again = feed_answering(&mut b, &phrase("phrase2.wav"), |_| false);
    assert_eq!(without_pauses(&again), ["started"], "the next speech opens a new turn");
}

#[test]
fn without_a_turn_model_semantic_vad_is_the_silence_detector() {
    let mut b = InputBuffer::new(60, false);
    b.set_turn_detection(Some(semantic("low"))).unwrap();
    let mut events = feed(&mut b, &silence(500));
    events.extend(feed(&mut b, &phrase("phrase2.wav")));
    events.extend(feed(&mut b, &silence(700)));
    assert_eq!(kinds(&events), ["started", "stopped"], "server_vad's 500 ms of silence");
}

/// A clip of `assets/turns` (16 kHz) at 24 kHz.
fn turn_clip(name: &str) -> Vec<i16> {
    let bytes =
        std::fs::read(format!("{}/../../assets/turns/{name}.wav", env!("CARGO_MANIFEST_DIR")))
            .unwrap();
    let (x, rate) = antiphon_audio::decode_wav(&bytes).unwrap();
    antiphon_audio::resample(&x, rate, RATE as u32)
        .unwrap()
        .iter()
        .map(|&v| antiphon_audio::f32_to_i16(v))
        .collect()
}

/// Where each turn of `x` ended: (the speech's end in ms, the ms of audio appended when the
/// turn was ended), with every pause put to the real turn model as the translator does.
fn turn_ends(
    model: &crate::turn_model::TurnModel,
    rt: &tokio::runtime::Runtime,
    td: TurnDetection,
    x: &[i16],
) -> Vec<(u64, u64)> {
    let mut b = InputBuffer::new(60, true);
    b.set_turn_detection(Some(td)).unwrap();
    let mut ends = Vec::new();
    for (i, p) in x.chunks(480).enumerate() {
        let now_ms = (i as u64 + 1) * 20;
        for e in b.push(p).unwrap() {
            let stop = match e {
                InputEvent::Paused { at, audio } => {
                    b.pause_decided(at, rt.block_on(model.verdict(audio)).ends_turn())
                }
                other => Some(other),
            };
            if let Some(InputEvent::Stopped { audio_end_ms, .. }) = stop {
                ends.push((audio_end_ms, now_ms));
            }
        }
    }
    ends
}

/// Semantic turns against the truth of `assets/turns` (ANTIPHON_SMART_TURN_MODEL names Smart
/// Turn's file; without it this says so and passes): an incomplete phrase, a second's pause, then
/// a complete one is one turn; a complete phrase alone ends at its pause, or at the longest wait.
/// Prints what it measured.
#[test]
fn semantic_turns_against_the_truth_of_the_clips() {
    let Ok(path) = std::env::var("ANTIPHON_SMART_TURN_MODEL") else {
        eprintln!("ANTIPHON_SMART_TURN_MODEL is not set: semantic turns are not measured here");
        return;
    };
    let model = crate::turn_model::TurnModel::load(
        std::path::Path::new(&path),
        1,
        &prometheus::Registry::new(),
    )
    .unwrap();
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let medium = semantic("medium");
    let server_vad = TurnDetection::default();
    let (mut kept_whole, mut split_by_silence, mut ended_early) = (0, 0, 0);
    for i in 1..=6 {
        let (first, second) =
            (turn_clip(&format!("incomplete{i}")), turn_clip(&format!("complete{i}")));
        let mut x = silence(500);
        x.extend(&first);
        x.extend(silence(1000));
        x.extend(&second);
        x.extend(silence(4500));
        let semantic_turns = turn_ends(&model, &rt, medium.clone(), &x);
        let silence_turns = turn_ends(&model, &rt, server_vad.clone(), &x);
        eprintln!(
            "incomplete{i} + 1 s + complete{i}: semantic_vad {} turn(s) {semantic_turns:?}; \
            server_vad {} {silence_turns:?}",
            semantic_turns.len(),
            silence_turns.len()
        );
        assert!(!semantic_turns.is_empty(), "every stream's speech ends in a turn");
        kept_whole += usize::from(semantic_turns.len() == 1);
        split_by_silence += usize::from(silence_turns.len() == 2);
        let mut y = silence(500);
        y.extend(&second);
        y.extend(silence(4500));
        let ends = turn_ends(&model, &rt, medium.clone(), &y);
        assert_eq!(ends.len(), 1, "complete{i}: one turn {ends:?}");
        let (end, decided) = ends[0];
        let truth = 500 + second.len() as u64 / PER_MS;
        assert!(
            end.abs_diff(truth) <= 150,
            "complete{i}: the turn ends where the speech does ({truth} ms), not at {end}"
        );
        let after = decided - end;
        eprintln!("complete{i}: ended {after} ms after the speech");
        ended_early += usize::from(after < 1000);
    }
    eprintln!(
        "semantic_vad kept {kept_whole} of 6 paused sentences whole (server_vad split \
        {split_by_silence}); ended {ended_early} of 6 complete ones at their pause, the rest \
        after the 4 s wait"
    );
    assert_eq!(split_by_silence, 6, "the silence detector ends a turn at every second's pause");
    assert!(kept_whole >= 4, "the turn model kept {kept_whole} of 6 paused sentences whole");
    assert!(
        ended_early >= 2,
        "the turn model ended {ended_early} of 6 complete sentences at their pause"
    );
}
