//! Code2Wav hot paths at the tiny preset on the CPU: one steady chunk (3 context + 25 new codes,
//! then the vocoder) and reference preparation + setup.
//!
//! `cargo bench --bench code2wav`

use antiphon_assets::synth::{code2wav_in_memory, Preset};
use antiphon_models::code2wav::prompt::Reference;
use antiphon_models::code2wav::SILENCE_CODE;
use candle_core::{DType, Device};
use criterion::{criterion_group, criterion_main, Criterion};

fn reference() -> Reference {
    let x: Vec<f32> = (0..48_000).map(|i| 0.3 * (i as f32 * 0.05).sin()).collect();
    Reference::materialize(&x, 16_000).unwrap()
}

fn bench(c: &mut Criterion) {
    let c2w = code2wav_in_memory(Preset::Tiny, 1, DType::F32, &Device::Cpu).unwrap();
    let r = reference();
    let f = c2w.prepare(&r).unwrap();
    let setup = c2w.setup(&f).unwrap();
    let mut g = c.benchmark_group("code2wav_tiny_cpu");
    g.sample_size(10);
    g.bench_function("prepare_and_setup", |b| {
        b.iter(|| {
            let f = c2w.prepare(&r).unwrap();
            c2w.setup(&f).unwrap()
        })
    });
    let first: Vec<u32> =
        std::iter::repeat_n(SILENCE_CODE, 3).chain((0..25).map(|i| (i * 97) % 6561)).collect();
    let steady: Vec<u32> = (0..28).map(|i| (i * 131 + 7) % 6561).collect();
    g.bench_function("steady_chunk_25_plus_3", |b| {
        b.iter_batched(
            || {
                let mut st = c2w.start(&f, &setup).unwrap();
                c2w.chunk(&mut st, &first, false).unwrap();
                st
            },
            |mut st| c2w.chunk(&mut st, &steady, false).unwrap(),
            criterion::BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
