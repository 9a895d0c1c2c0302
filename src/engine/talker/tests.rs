//! The Talker's first-chunk choice on a busy engine, with the paces set by the test
//! (`code2wav.small_first_chunk_slack`, `pace.rs`): deterministic where the engine's own paces are
//! not.

use std::time::Duration;

use super::*;
use crate::pace::StagePace;
use crate::RefInput;

fn talker_stage(pace: &StagePace, slack: bool) -> TalkerStage {
    let models = antiphon_assets::synth::models_in_memory(
        antiphon_assets::synth::Preset::Tiny,
        5,
        DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    // (no stream is ever "few": every one finds the engine busy)
    let cfg = EngineConfig::default().with(|c| {
        c.code2wav.first_chunk_codes = 5;
        c.code2wav.small_first_chunk_streams = Some(0);
        c.code2wav.small_first_chunk_slack = slack;
    });
    let (tx, _rx) = std::sync::mpsc::sync_channel(16);
    // (the receiver goes: nothing is sent before a code is made)
    TalkerStage::new(
        models.talker,
        Arc::new(cfg),
        Registry::default(),
        EngineMetrics::new(),
        tx,
        PrefillGate::new(false),
    )
    .unwrap()
    .with_pace(pace.clone())
}

fn begin(s: &mut TalkerStage, id: &str) -> usize {
    let voice = RefInput::new(vec![0.1; 16_000], 16_000);
    let id = RequestId(id.into());
    s.on_message(TalkerMsg::Begin {
        id: id.clone(),
        mode: Mode::Turn,
        voice,
        min_codes: 100,
        max_codes: 100,
        text_tokens: None,
        text_chunk: 0,
        seed: 1,
    });
    s.reqs[&id].chunker.first()
}

const MS: fn(u64) -> Duration = Duration::from_millis;

#[test]
fn a_busy_engine_sizes_a_first_chunk_by_the_paces() {
    let pace = StagePace::default();
    let mut s = talker_stage(&pace, true);
    assert_eq!(begin(&mut s, "unmeasured"), 25, "no pace measured yet: a full chunk");
    pace.record_talker_step(MS(2));
    pace.record_code2wav(MS(40), Some(MS(2000)));
    assert_eq!(begin(&mut s, "quick"), 5, "25 × 2 ms + 2 × 40 ms within 5 codes' 200 ms");
    assert!(
        !s.reqs[&RequestId("quick".into())].hold_first,
        "a busy engine's small chunk keeps its Talker lead"
    );
    pace.record_code2wav(MS(100), Some(MS(2000)));
    assert_eq!(begin(&mut s, "slower"), 15, "25 × 2 ms + 2 × 100 ms: the halfway chunk");
    pace.record_code2wav(MS(100), Some(MS(150)));
    assert_eq!(begin(&mut s, "short"), 25, "a speaking stream with less than two steps buffered");
    let mut off = talker_stage(&pace, false);
    pace.record_code2wav(MS(40), Some(MS(2000)));
    assert_eq!(begin(&mut off, "off"), 25, "without slack a busy engine's first chunk is full");
}

#[test]
fn a_first_text_chunks_hold_lasts_until_the_talkers_next_step() {
    let models = antiphon_assets::synth::models_in_memory(
        antiphon_assets::synth::Preset::Tiny,
        5,
        DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let llm_dim = models.thinker.llm.decoder().config().hidden_size;
    let cfg = EngineConfig::default().with(|c| c.talker.text_chunk = 10);
    let (tx, _rx) = std::sync::mpsc::sync_channel(64);
    let gate = PrefillGate::new(true);
    let mut s = TalkerStage::new(
        models.talker,
        Arc::new(cfg),
        Registry::default(),
        EngineMetrics::new(),
        tx,
        gate.clone(),
    )
    .unwrap();
    let id = RequestId("held".into());
    let voice = RefInput::new(vec![0.1; 16_000], 16_000);
    assert!(s.registry.insert(id.clone(), Arc::new(|_| {})));
    s.on_message(TalkerMsg::Begin {
        id: id.clone(),
        mode: Mode::Turn,
        voice,
        min_codes: 30,
        max_codes: 30,
        text_tokens: Some(20),
        text_chunk: 10,
        seed: 1,
    });
    let hidden = Tensor::zeros((10, llm_dim), DType::F32, &candle_core::Device::Cpu).unwrap();
    let hold = Some(gate.hold());
    s.on_message(TalkerMsg::TextChunk {
        id: id.clone(),
        ids: vec![5; 10],
        hidden,
        last: false,
        hold,
    });
    assert!(gate.is_held(), "the Thinker waits while the Talker makes the chunk's condition");
    assert!(s.step(), "the chunk's prefill is a step");
    assert!(!gate.is_held(), "after the Talker's step the Thinker goes on");
    assert!(s.reqs[&id].codes > 0, "the step made the reply's first code");
}
