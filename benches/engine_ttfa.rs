//! In-process first-audio time of the engine on the tiny synthetic models (CPU), closed loop:
//! C workers each send their next request as soon as the previous one ended; every request
//! carries a different reference voice (a cold reference cache: where reference prefetch shows).
//! Forced lengths: 32 text tokens, 100 codes (4 s of audio).
//!
//! `cargo bench --bench engine_ttfa` (env: REQUESTS per worker, default 8; SETS = comma list of
//! prefetch_on, prefetch_off, prefetch_ab, stream_prefill; LEVELS = comma list, default 1,4)

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use antiphon_assets::synth::{models_in_memory, Preset};
use antiphon_engine::metric_labels::PrefetchEvent;
use antiphon_engine::{
    Engine, EngineConfig, EngineEvent, GenerationParams, Mode, RefInput, RequestId, RequestSpec,
    Status, UserInput,
};
use candle_core::{DType, Device};

fn voice(n: usize) -> RefInput {
    let f = 120.0 + 7.0 * n as f32;
    RefInput::new(
        (0..16_000 * 6)
            .map(|i| 0.3 * (i as f32 * f / 16_000.0 * std::f32::consts::TAU).sin())
            .collect(),
        16_000,
    )
}

fn one(e: &Engine, id: String, n: usize) -> (f64, f64) {
    let spec = RequestSpec {
        id: RequestId(id),
        mode: Mode::Turn,
        input: UserInput::Text(format!("Please read sentence number {n} aloud.")),
        instructions: None,
        history: vec![],
        voice: voice(n),
        generation: GenerationParams {
            min_text_tokens: Some(32),
            max_text_tokens: Some(32),
            min_audio_tokens: Some(100),
            max_audio_tokens: Some(100),
            temperature: None,
            seed: Some(n as u64),
            prefix: None,
        },
        tools: Default::default(),
        text_only: false,
        task: Default::default(),
    };
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    e.submit(spec, Arc::new(move |ev| drop(tx.lock().unwrap().send(ev)))).unwrap();
    loop {
        if let EngineEvent::Done { status, timings, .. } =
            rx.recv_timeout(Duration::from_secs(300)).unwrap()
        {
            assert_eq!(status, Status::Completed);
            return (
                timings.first_audio_ms().unwrap(),
                timings.first_text_ms().unwrap_or(f64::NAN),
            );
        }
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

fn main() {
    let per = std::env::var("REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(8usize);
    let sets = std::env::var("SETS").unwrap_or_else(|_| "prefetch_on,prefetch_off".into());
    let levels: Vec<usize> = std::env::var("LEVELS")
        .unwrap_or_else(|_| "1,4".into())
        .split(',')
        .filter_map(|v| v.parse().ok())
        .collect();
    println!(
        "| config | C | requests | TTFA mean ms | p50 | p95 | TTFT p50 ms | prefetch phase A \
        runs | claims | inline |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for set in sets.split(',') {
        let cfg = match set {
            "prefetch_on" => EngineConfig::default(),
            "prefetch_off" => EngineConfig::default().with(|c| c.prefetch.enabled = false),
            "prefetch_ab" => EngineConfig::default().with(|c| c.prefetch.setup = true),
            "stream_prefill" => EngineConfig::default().with(|c| c.talker.streaming_prefill = true),
            other => panic!("unknown set {other}"),
        };
        for &c in &levels {
            let e = Arc::new(
                Engine::start(
                    models_in_memory(Preset::Tiny, 5, DType::F32, &Device::Cpu).unwrap(),
                    cfg.clone(),
                )
                .unwrap(),
            );
            // warm-up (excluded)
            one(&e, "warm".into(), 999);
            let t0 = Instant::now();
            let workers: Vec<_> = (0..c)
                .map(|w| {
                    let e = e.clone();
                    std::thread::spawn(move || {
                        (0..per)
                            .map(|k| one(&e, format!("w{w}-{k}"), w * 1000 + k))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            let res: Vec<(f64, f64)> =
                workers.into_iter().flat_map(|h| h.join().unwrap()).collect();
            let wall = t0.elapsed().as_secs_f64();
            let mut ttfa: Vec<f64> = res.iter().map(|r| r.0).collect();
            let mut ttft: Vec<f64> = res.iter().map(|r| r.1).collect();
            let m = e.metrics();
            println!(
                "| {set} | {c} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {} |",
                res.len(),
                ttfa.iter().sum::<f64>() / ttfa.len() as f64,
                pct(&mut ttfa, 0.5),
                pct(&mut ttfa, 0.95),
                pct(&mut ttft, 0.5),
                m.prefetch_count(PrefetchEvent::PhaseA),
                m.prefetch_count(PrefetchEvent::Claimed),
                m.prefetch_count(PrefetchEvent::Inline),
            );
            eprintln!("  ({set}, C{c}: {:.1} s wall)", wall);
        }
    }
}
