use super::*;

/// Two espeak-ng phrases (assets/vad/README.md says how they were made) laid out as
/// silence, speech, silence, speech, silence at `rate`, with faint noise under it all, and the
/// four true edges in ms.
fn speech_silence_speech(rate: u32) -> (Vec<f32>, [u64; 4]) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/vad");
    let phrase = |name: &str| {
        let bytes = std::fs::read(format!("{dir}/{name}")).unwrap();
        let (x, r) = crate::decode_wav(&bytes).unwrap();
        let x = crate::resample(&x, r, rate).unwrap();
        // the phrase's true extent: from its first to its last sample above -40 dBFS
        let first = x.iter().position(|v| v.abs() > 0.01).unwrap();
        let last = x.iter().rposition(|v| v.abs() > 0.01).unwrap();
        x[first..=last].to_vec()
    };
    let (a, b) = (phrase("phrase1.wav"), phrase("phrase2.wav"));
    let ms = |n: usize| (n as u64 * 1000) / rate as u64;
    let gap = |s: f32| vec![0.0f32; (s * rate as f32) as usize];
    let mut x = gap(0.8);
    let s1 = ms(x.len());
    x.extend_from_slice(&a);
    let e1 = ms(x.len());
    x.extend(gap(1.2));
    let s2 = ms(x.len());
    x.extend_from_slice(&b);
    let e2 = ms(x.len());
    x.extend(gap(1.0));
    // faint white noise (-70 dBFS) from a fixed LCG, so silence is not digital zero
    let mut seed = 0x2545_f491_u32;
    for v in x.iter_mut() {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        *v += ((seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 6e-4;
    }
    (x, [s1, e1, s2, e2])
}

fn run(x: &[f32], rate: u32, piece: usize) -> Vec<VadEvent> {
    run_at(x, rate, piece, VadConfig::default())
}

fn run_at(x: &[f32], rate: u32, piece: usize, config: VadConfig) -> Vec<VadEvent> {
    let mut d = TurnDetector::new(rate, config).unwrap();
    x.chunks(piece).flat_map(|p| d.push(p)).collect()
}

fn check_edges(events: &[VadEvent], truth: [u64; 4]) {
    assert_eq!(events.len(), 4, "expected start, stop, start, stop: {events:?}");
    for (i, (e, t)) in events.iter().zip(truth).enumerate() {
        let at = match (i % 2, e) {
            (0, VadEvent::SpeechStarted { at_ms }) | (1, VadEvent::SpeechStopped { at_ms }) => {
                *at_ms
            }
            _ => panic!("event {i} is {e:?}: {events:?}"),
        };
        assert!(at.abs_diff(t) <= 100, "event {i} at {at} ms, the true edge at {t} ms: {events:?}");
    }
}

#[test]
fn speech_edges_are_found_within_100_ms_at_24_khz() {
    let (x, truth) = speech_silence_speech(24000);
    // pieces of 20 ms, as clients append them
    check_edges(&run(&x, 24000, 480), truth);
    // every aggressiveness mode the threshold can pick
    for threshold in [0.1, 0.3, 0.6, 0.9] {
        check_edges(
            &run_at(&x, 24000, 480, VadConfig { threshold, silence_duration_ms: 500 }),
            truth,
        );
    }
}

#[test]
fn speech_edges_are_found_within_100_ms_at_16_khz() {
    let (x, truth) = speech_silence_speech(16000);
    check_edges(&run(&x, 16000, 320), truth);
}

#[test]
fn the_edges_do_not_depend_on_how_the_audio_is_cut() {
    let (x, _) = speech_silence_speech(24000);
    let whole = run(&x, 24000, x.len());
    assert_eq!(whole.len(), 4);
    for piece in [1, 7, 480, 4801] {
        assert_eq!(run(&x, 24000, piece), whole, "pieces of {piece}");
    }
}

#[test]
fn silence_and_noise_give_no_edges() {
    let mut seed = 7u32;
    let x: Vec<f32> = (0..24000 * 3)
        .map(|_| {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            ((seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 6e-4
        })
        .collect();
    assert_eq!(run(&x, 24000, 480), vec![]);
    assert_eq!(run(&vec![0.0; 48000], 24000, 480), vec![]);
}

#[test]
fn a_longer_silence_setting_keeps_a_short_pause_inside_the_turn() {
    let (mut x, truth) = speech_silence_speech(24000);
    // (the trailing 1 s is shorter than the silence asked for: another second of it)
    x.extend(std::iter::repeat_n(0.0, 24000));
    let mut d =
        TurnDetector::new(24000, VadConfig { threshold: 0.5, silence_duration_ms: 1500 }).unwrap();
    let ev: Vec<_> = x.chunks(480).flat_map(|p| d.push(p)).collect();
    // the 1.2 s gap is shorter than 1.5 s: one turn from the first start to the last stop
    assert_eq!(ev.len(), 2, "{ev:?}");
    let (VadEvent::SpeechStarted { at_ms: s }, VadEvent::SpeechStopped { at_ms: e }) =
        (ev[0], ev[1])
    else {
        panic!("{ev:?}")
    };
    assert!(s.abs_diff(truth[0]) <= 100 && e.abs_diff(truth[3]) <= 100, "{ev:?} against {truth:?}");
}

#[test]
fn bad_settings_are_refused() {
    assert!(
        TurnDetector::new(24000, VadConfig { threshold: 1.5, silence_duration_ms: 500 }).is_err()
    );
    assert!(TurnDetector::new(24000, VadConfig { threshold: f32::NAN, silence_duration_ms: 500 })
        .is_err());
    assert!(TurnDetector::new(44100, VadConfig::default()).is_err());
}
