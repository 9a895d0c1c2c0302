//! The threaded engine on the tiny synthetic models, as the engine tests drive it: a request with
//! forced lengths, its events collected until `Done`.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use antiphon_assets::synth::{models_in_memory, Preset};
use antiphon_engine::{
    Engine, EngineConfig, EngineEvent, GenerationParams, Mode, RefInput, RequestId, RequestSpec,
    Status, UserInput,
};
use candle_core::{DType, Device};

pub fn engine(cfg: EngineConfig) -> Engine {
    Engine::start(models_in_memory(Preset::Tiny, 5, DType::F32, &Device::Cpu).unwrap(), cfg)
        .unwrap()
}

pub fn voice() -> RefInput {
    RefInput::new(
        (0..16_000 * 3)
            .map(|i| 0.3 * (i as f32 * 0.07).sin() * (i as f32 * 0.0004).cos())
            .collect(),
        16_000,
    )
}

pub fn spec(id: &str, text: &str, text_tokens: usize, codes: usize, seed: u64) -> RequestSpec {
    RequestSpec {
        id: RequestId(id.into()),
        mode: Mode::Turn,
        input: UserInput::Text(text.into()),
        instructions: None,
        history: vec![],
        voice: voice(),
        generation: GenerationParams {
            min_text_tokens: Some(text_tokens),
            max_text_tokens: Some(text_tokens),
            min_audio_tokens: Some(codes),
            max_audio_tokens: Some(codes),
            temperature: None,
            seed: Some(seed),
            prefix: None,
        },
        tools: Default::default(),
        text_only: false,
        task: Default::default(),
    }
}

pub struct Outcome {
    pub text: String,
    pub audio: Vec<Vec<f32>>,
    pub status: Status,
    pub codes: usize,
    pub first_audio_ms: f64,
    pub events: Vec<EngineEvent>,
}

pub fn submit(e: &Engine, s: RequestSpec) -> mpsc::Receiver<EngineEvent> {
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    e.submit(
        s,
        Arc::new(move |ev| {
            let _ = tx.lock().unwrap().send(ev);
        }),
    )
    .unwrap();
    rx
}

pub fn collect(rx: mpsc::Receiver<EngineEvent>) -> Outcome {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut events = vec![];
    loop {
        let ev = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("the request finishes");
        let done = matches!(ev, EngineEvent::Done { .. });
        events.push(ev);
        if done {
            break;
        }
    }
    // nothing after Done: the engine lets go of the request's sink, so the channel ends
    match rx.recv_timeout(Duration::from_secs(60)) {
        Err(mpsc::RecvTimeoutError::Disconnected) => {}
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("the engine still holds the sink of a finished request")
        }
        Ok(ev) => panic!("an event came after Done: {ev:?}"),
    }
    let mut text = String::new();
    let mut audio = vec![];
    let mut out = None;
    for ev in &events {
        match ev {
            EngineEvent::HistoryTrimmed { .. }
            | EngineEvent::ToolCall(_)
            | EngineEvent::ToolCallInvalid { .. } => {}
            EngineEvent::TextDelta(t) => text.push_str(t),
            EngineEvent::Audio { samples, .. } => audio.push(samples.clone()),
            EngineEvent::Done { status, codes, timings, text: t, .. } => {
                assert_eq!(t, &text, "Done carries the whole text");
                out = Some((status.clone(), *codes, timings.first_audio_ms().unwrap_or(f64::NAN)));
            }
        }
    }
    let (status, codes, first_audio_ms) = out.unwrap();
    Outcome { text, audio, status, codes, first_audio_ms, events }
}
