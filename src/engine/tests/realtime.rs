//! 8 duplex sessions on the tiny engine in real time. The engine crate's one integration-test
//! binary, so that no other test shares the 2 CPU cores with it (its timing must not).

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use antiphon_assets::synth::{models_in_memory, Preset};
use antiphon_engine::{
    DuplexEvent, DuplexPolicy, DuplexSpec, Engine, EngineConfig, EngineEvent, GenerationParams,
    RefInput, Status,
};
use candle_core::{DType, Device};

fn voice(f: f32) -> RefInput {
    RefInput::new(
        (0..16_000 * 3)
            .map(|i| 0.3 * (i as f32 * f / 16_000.0 * std::f32::consts::TAU).sin())
            .collect(),
        16_000,
    )
}

fn unit(n: u64) -> Vec<f32> {
    (0..16_000).map(|i| 0.2 * ((i as f32) * (0.03 + 0.002 * n as f32)).sin()).collect()
}

fn open(e: &Engine, session: &str) -> mpsc::Receiver<DuplexEvent> {
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let generation = GenerationParams {
        min_text_tokens: Some(4),
        max_text_tokens: Some(4),
        min_audio_tokens: Some(5),
        max_audio_tokens: Some(5),
        temperature: None,
        seed: Some(3),
        prefix: None,
    };
    let spec = DuplexSpec {
        session: session.into(),
        policy: DuplexPolicy::SpeakEvery(2),
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

/// 8 duplex sessions fed in real time (one unit per second each) keep up on 2 CPU cores: every
/// unit's decision comes well inside its second, and the speech of every turn is out before the
/// session's next turn starts.
#[test]
fn eight_sessions_in_real_time() {
    let e = Engine::start(
        models_in_memory(Preset::Tiny, 5, DType::F32, &Device::Cpu).unwrap(),
        EngineConfig::default(),
    )
    .unwrap();
    // units 1, 3, 5, 7 speak; unit 8 closes the last turn
    let units = 9u64;
    let rxs: Vec<_> = (0..8).map(|i| open(&e, &format!("rt{i}"))).collect();
    let t0 = Instant::now();
    for n in 0..units {
        // the sessions' units arrive spread over the second, as real clients' would
        for i in 0..8u64 {
            let due = t0 + Duration::from_millis(n * 1000 + i * 125);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            e.duplex_unit(&format!("rt{i}"), unit(n + i)).unwrap();
        }
    }
    let mut lags = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    for rx in &rxs {
        let (mut decisions, mut done) = (0, 0);
        while decisions < units || done < 4 {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left).expect("the sessions fell far behind") {
                DuplexEvent::Listen { lag_ms, .. } | DuplexEvent::Speak { lag_ms, .. } => {
                    decisions += 1;
                    lags.push(lag_ms);
                }
                DuplexEvent::Response { event: EngineEvent::Done { status, .. }, .. } => {
                    assert_eq!(status, Status::Completed);
                    done += 1;
                }
                _ => {}
            }
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    lags.sort_by(f64::total_cmp);
    let p50 = lags[lags.len() / 2];
    let p95 = lags[lags.len() * 95 / 100];
    let max = *lags.last().unwrap();
    println!(
        "8 duplex sessions × {units} units: decision lag p50 {p50:.0} ms, p95 {p95:.0} ms, \
        max {max:.0} ms; all turns done {:.1} s after the first unit",
        wall
    );
    assert!(p95 < 1000.0, "decisions fall behind real time: p95 {p95:.0} ms");
    // (the turns' speech follows the input by a few seconds; on the 2-core CI machine the last turn
    // has ended 12.2–14.4 s after the first unit across runs of the same build, and 16.4-19.4 s
    // in a slow hour of the same machine: 14 s of slack keeps this a test of keeping up, not of the
    // machine's load that hour; the decisions above are the real-time bound)
    assert!(
        wall < units as f64 + 14.0,
        "the speech fell behind: {wall:.1} s for {units} s of input"
    );
    for i in 0..8 {
        e.close_duplex(&format!("rt{i}"));
    }
}
