//! CPU hot paths outside Code2Wav (that one is `benches/code2wav.rs`): the Opus edge (20 ms
//! encode / decode at 48 kHz), resampling, Whisper's log-mel, the Kaldi fbank of a reference voice,
//! the flow's mel of a reference, one decode step of the Thinker and of the Talker at the tiny
//! preset after a 64-position prefix, and the prompt of a long conversation's next turn.
//!
//! `cargo bench --bench hot_paths`

use antiphon_assets::synth::{models_in_memory, Preset};
use antiphon_models::decoder::{KvCache, StreamStep};
use antiphon_models::mel::{kaldi_fbank, FlowMel, WhisperLogMel};
use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};

fn tone(n: usize, rate: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            0.3 * (i as f32 * 220.0 / rate * std::f32::consts::TAU).sin()
                + 0.05 * (i as f32 * 0.37).sin()
        })
        .collect()
}

fn audio(c: &mut Criterion) {
    let mut g = c.benchmark_group("audio_cpu");
    let frame = tone(960, 48_000.0);
    let mut enc =
        opus::Encoder::new(48_000, opus::Channels::Mono, opus::Application::Voip).unwrap();
    g.bench_function("opus_encode_20ms_48k", |b| {
        b.iter(|| enc.encode_vec_float(&frame, 4000).unwrap())
    });
    let packet = enc.encode_vec_float(&frame, 4000).unwrap();
    let mut dec = opus::Decoder::new(48_000, opus::Channels::Mono).unwrap();
    let mut out = vec![0f32; 5760];
    g.bench_function("opus_decode_20ms_48k", |b| {
        b.iter(|| dec.decode_float(&packet, &mut out, false).unwrap())
    });
    let second = tone(48_000, 48_000.0);
    g.bench_function("resample_1s_48k_to_16k", |b| {
        b.iter(|| antiphon_audio::resample(&second, 48_000, 16_000).unwrap())
    });
    let out24 = tone(24_000, 24_000.0);
    g.bench_function("resample_1s_24k_to_48k", |b| {
        b.iter(|| antiphon_audio::resample(&out24, 24_000, 48_000).unwrap())
    });
    let whisper = WhisperLogMel::new(80);
    let unit = tone(16_000, 16_000.0);
    g.bench_function("whisper_log_mel_1s", |b| b.iter(|| whisper.compute(&unit)));
    let reference = tone(6 * 16_000, 16_000.0);
    g.bench_function("kaldi_fbank_6s_reference", |b| {
        b.iter(|| kaldi_fbank(&reference, 16_000, 80))
    });
    let flow_mel = FlowMel::standard();
    let reference24 = tone(6 * 24_000, 24_000.0);
    g.bench_function("flow_mel_6s_reference", |b| b.iter(|| flow_mel.compute(&reference24)));
    g.finish();
}

fn decode_steps(c: &mut Criterion) {
    let m = models_in_memory(Preset::Tiny, 0, DType::F32, &Device::Cpu).unwrap();
    let mut g = c.benchmark_group("stage_steps_tiny_cpu");
    let prefix: Vec<u32> = (0..64).map(|i| (i * 7) % 200).collect();

    // Thinker: one Thinker token after a 64-token prefix
    let llm = &m.thinker.llm;
    let prefilled = || -> KvCache {
        let mut cache = llm.new_cache();
        let e = llm.embed(&prefix).unwrap();
        llm.forward(&mut [StreamStep { cache: &mut cache, embeds: e }]).unwrap();
        cache
    };
    let tok = llm.embed(&[42]).unwrap();
    g.bench_function("thinker_decode_step", |b| {
        b.iter_batched(
            prefilled,
            |mut cache| {
                let h = llm
                    .forward(&mut [StreamStep { cache: &mut cache, embeds: tok.clone() }])
                    .unwrap();
                llm.logits(&h[0]).unwrap()
            },
            BatchSize::LargeInput,
        )
    });

    // Talker: one Talker code after a 64-position condition
    let talker = &m.talker;
    let hidden = talker.config().hidden_size;
    let cond = Tensor::randn(0f32, 1.0, (64, hidden), &Device::Cpu).unwrap();
    let talker_prefilled = || -> KvCache {
        let mut cache = talker.new_cache();
        talker.forward(&mut [StreamStep { cache: &mut cache, embeds: cond.clone() }]).unwrap();
        cache
    };
    let code = talker.embed_codes(&[17]).unwrap();
    g.bench_function("talker_decode_step", |b| {
        b.iter_batched(
            talker_prefilled,
            |mut cache| {
                let h = talker
                    .forward(&mut [StreamStep { cache: &mut cache, embeds: code.clone() }])
                    .unwrap();
                talker.logits(&h[0]).unwrap()
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

/// Host-side sampling per step: the Talker's 6562 codes (top-k 25, top-p 0.85, penalty over 16)
/// and the Thinker's greedy pick over Qwen3's 151,936 ids (presence penalty over a 1000-id
/// history).
fn sampling(c: &mut Criterion) {
    use antiphon_models::sampling::{Sampler, SamplingParams};
    let mut g = c.benchmark_group("sampling");
    let noise = |n: usize| -> Vec<f32> {
        (0..n).map(|i| ((i as u64 * 2_654_435_761) % 10_007) as f32 / 1000.0 - 5.0).collect()
    };
    let codes = noise(6562);
    let mut talker = Sampler::new(SamplingParams::talker(), 1);
    talker.observe(&(0..16).collect::<Vec<u32>>());
    // (a fresh clone per call: sampling appends to the history the penalty reads)
    g.bench_function("talker_sample_6562", |b| {
        b.iter_batched(|| talker.clone(), |mut s| s.sample(&codes, &[]), BatchSize::SmallInput)
    });
    let text = noise(151_936);
    let mut thinker = Sampler::new(SamplingParams::thinker_greedy(), 1);
    thinker.observe(&(0..1000).map(|i| i * 131 % 151_936).collect::<Vec<u32>>());
    g.bench_function("thinker_greedy_151936", |b| {
        b.iter_batched(
            || thinker.clone(),
            |mut s| s.sample(&text, &[151_643, 151_645]),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// The prompt of a 120-turn conversation's next turn (every turn's messages, as a turn's prompt is
/// built): by a tokenizer that has seen none of them, and by one whose encode memo holds the
/// earlier turns (the conversation's previous prompt).
fn long_conversation_prompt(c: &mut Criterion) {
    use antiphon_assets::synth::tokenizer_json;
    use antiphon_models::tokenizer::{Message, Role, TextTokenizer};
    let json = tokenizer_json(&Preset::Tiny.special_ids(), &Preset::Tiny.tool_ids()).to_string();
    let fresh = || TextTokenizer::from_bytes(json.as_bytes()).unwrap();
    let mut messages = vec![Message::text(
        Role::System,
        "You are a helpful assistant with the above voice style.",
    )];
    for i in 0..120 {
        messages.push(Message::text(Role::User, format!("question {i}: ").repeat(16)));
        messages.push(Message::text(Role::Assistant, format!("answer {i} ").repeat(30)));
    }
    messages.push(Message::text(Role::User, "and now?"));
    let mut g = c.benchmark_group("prompt");
    g.bench_function("conversation_120_turns_cold", |b| {
        b.iter_batched(fresh, |t| t.spoken_reply_prompt(&messages).unwrap(), BatchSize::SmallInput)
    });
    let warm = fresh();
    warm.spoken_reply_prompt(&messages[..messages.len() - 1]).unwrap();
    g.bench_function("conversation_120_turns_memo", |b| {
        b.iter(|| warm.spoken_reply_prompt(&messages).unwrap())
    });
    g.finish();
}

criterion_group!(benches, audio, decode_steps, sampling, long_conversation_prompt);
criterion_main!(benches);
