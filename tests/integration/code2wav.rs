//! Code2Wav end to end on synthetic assets: the generator writes the real formats, the loaders read
//! them back, and a reference voice streams through prepare -> setup -> chunks -> audio.

use crate::common;

use common::streams::{codes, due, payloads, reference, samples};

use antiphon_assets::synth::{self, Preset};
use antiphon_models::code2wav::prompt::{PromptFeatures, Reference};
use antiphon_models::code2wav::{BufferSeeds, Code2Wav};
use candle_core::{DType, Device, Tensor};

#[test]
fn synthetic_assets_round_trip_and_stream() {
    let dir = tempfile::tempdir().unwrap();
    synth::write_token2wav(dir.path(), Preset::Tiny, 3).unwrap();
    for f in [
        "flow.pt",
        "flow.yaml",
        "hift.pt",
        "config.yaml",
        "hift_original.pt",
        "campplus.onnx",
        "speech_tokenizer_v2_25hz.onnx",
    ] {
        assert!(dir.path().join(f).is_file(), "{f} written");
    }
    let seeds = BufferSeeds { seed: 3, ..BufferSeeds::default() };
    let from_files =
        antiphon_assets::token2wav::load_dir(dir.path(), DType::F32, &Device::Cpu, seeds).unwrap();
    let in_memory = synth::code2wav_in_memory(Preset::Tiny, 3, DType::F32, &Device::Cpu).unwrap();
    let r = reference();
    let fa = from_files.prepare(&r).unwrap();
    let fb = in_memory.prepare(&r).unwrap();
    assert_eq!(fa.codes.len(), 150, "6 s of reference -> 150 speech codes");
    assert_eq!(fa.codes, fb.codes, "the same weights from the files and from memory");
    assert_eq!(fa.mel.dims(), &[300, 80]);
    let all = codes(60, 7);
    let chunks = payloads(&all, &[25, 25, 10]);
    let run = |c2w: &Code2Wav, f: &antiphon_models::code2wav::prompt::PromptFeatures| {
        let setup = c2w.setup(f).unwrap();
        let mut st = c2w.start(f, &setup).unwrap();
        chunks
            .iter()
            .enumerate()
            .map(|(i, p)| samples(&c2w.chunk(&mut st, p, i == chunks.len() - 1).unwrap()))
            .collect::<Vec<_>>()
    };
    let a = run(&from_files, &fa);
    let b = run(&in_memory, &fb);
    assert_eq!(a, b);
    // 3 silence positions + 60 codes, 2 mel frames each, 480 samples per frame, plus the
    // vocoder's 8-frame delay emitted as silence before the first audio
    let total: usize = a.iter().map(|c| c.len()).sum();
    assert_eq!(total, (3 + 60) * 2 * 480 + 3840);
    assert_eq!(a[0].len(), 25 * 2 * 480, "a steady chunk: 25 positions = 1 s");
    assert!(a.iter().flatten().all(|s| s.is_finite() && s.abs() <= 0.99));
    assert!(a[1].iter().any(|&s| s.abs() > 1e-4), "synthetic weights still make sound");
}

#[test]
fn chunk0_is_identical_whether_setup_is_fresh_or_reused() {
    // The basis of reference prefetch: setup caches computed ahead of time (and shared) give
    // bit-identical chunk-0 audio.
    let c2w = synth::code2wav_in_memory(Preset::Tiny, 9, DType::F32, &Device::Cpu).unwrap();
    let f = c2w.prepare(&reference()).unwrap();
    let early = c2w.setup(&f).unwrap();
    let p = payloads(&codes(25, 1), &[25]);
    let mut s1 = c2w.start(&f, &early).unwrap();
    let first = samples(&c2w.chunk(&mut s1, &p[0], false).unwrap());
    // a second stream from the same (shared) setup caches
    let mut s2 = c2w.start(&f, &early).unwrap();
    let second = samples(&c2w.chunk(&mut s2, &p[0], false).unwrap());
    // and one from a setup made inline, after other work
    let f_again = c2w.prepare(&reference()).unwrap();
    let inline = c2w.setup(&f_again).unwrap();
    let mut s3 = c2w.start(&f_again, &inline).unwrap();
    let third = samples(&c2w.chunk(&mut s3, &p[0], false).unwrap());
    assert_eq!(first, second);
    assert_eq!(first, third);
}

#[test]
fn batched_streams_match_single_streams() {
    let c2w = synth::code2wav_in_memory(Preset::Tiny, 5, DType::F32, &Device::Cpu).unwrap();
    let f = c2w.prepare(&reference()).unwrap();
    let setup = c2w.setup(&f).unwrap();
    let pa = payloads(&codes(50, 1), &[25, 25]);
    let pb = payloads(&codes(50, 2), &[25, 25]);
    let (mut a1, mut b1) = (c2w.start(&f, &setup).unwrap(), c2w.start(&f, &setup).unwrap());
    let (mut a2, mut b2) = (c2w.start(&f, &setup).unwrap(), c2w.start(&f, &setup).unwrap());
    for i in 0..2 {
        let together = c2w.chunk_batch(&mut [&mut a1, &mut b1], &[&pa[i], &pb[i]], false).unwrap();
        let ya = samples(&c2w.chunk(&mut a2, &pa[i], false).unwrap());
        let yb = samples(&c2w.chunk(&mut b2, &pb[i], false).unwrap());
        assert!(common::max_abs_diff(&samples(&together[0]), &ya) < 1e-5);
        assert!(common::max_abs_diff(&samples(&together[1]), &yb) < 1e-5);
    }
}

/// A tiny Code2Wav and two voices: the reference, and its first 2 s (padded to the same 6 s).
fn two_voices() -> (Code2Wav, PromptFeatures, PromptFeatures) {
    let c2w = synth::code2wav_in_memory(Preset::Tiny, 5, DType::F32, &Device::Cpu).unwrap();
    let f = c2w.prepare(&reference()).unwrap();
    let short: Vec<f32> = reference().samples[..24_000 * 2].to_vec();
    let g = c2w.prepare(&Reference::materialize(&short, 24_000).unwrap()).unwrap();
    (c2w, f, g)
}

/// Streams at different points of their histories (so caches of different lengths: the flow pads
/// them and masks the padding) and with different voices share every chunk, through to the last,
/// and each gets what it gets alone.
#[test]
fn streams_with_different_histories_and_voices_share_a_batch() {
    let (c2w, f, g) = two_voices();
    // (every reference is padded to the same 6 s: the voices differ in content, not length)
    assert_ne!(samples(&f.speaker), samples(&g.speaker), "two voices");
    let (sf, sg) = (c2w.setup(&f).unwrap(), c2w.setup(&g).unwrap());
    // stream 0 and 2 start together (voices f, g), stream 1 (voice f) one chunk later
    let feats = [(&f, &sf), (&f, &sf), (&g, &sg)];
    let lag = [0usize, 1, 0];
    let sizes = [25, 25, 25, 10];
    let pay: Vec<Vec<Vec<u32>>> =
        (0..3).map(|s| payloads(&codes(85, s as u32 + 1), &sizes)).collect();
    let mut together: Vec<_> = feats.iter().map(|(f, s)| c2w.start(f, s).unwrap()).collect();
    let mut alone: Vec<_> = feats.iter().map(|(f, s)| c2w.start(f, s).unwrap()).collect();
    let mut ragged = 0;
    for round in 0..sizes.len() + 1 {
        for last in [false, true] {
            let members = due(round, last, &lag, sizes.len());
            if members.is_empty() {
                continue;
            }
            let mut refs: Vec<&mut _> = together
                .iter_mut()
                .enumerate()
                .filter(|(s, _)| members.iter().any(|m| m.0 == *s))
                .map(|(_, t)| t)
                .collect();
            let codes: Vec<&[u32]> = members.iter().map(|&(s, i)| pay[s][i].as_slice()).collect();
            let lens: Vec<usize> = refs.iter().map(|r| r.flow.estimator.len()).collect();
            ragged += usize::from(lens.iter().any(|&l| l != lens[0]));
            let out = c2w.chunk_batch(&mut refs, &codes, last).unwrap();
            for (&(s, i), y) in members.iter().zip(&out) {
                let want = samples(&c2w.chunk(&mut alone[s], &pay[s][i], last).unwrap());
                let got = samples(y);
                assert_eq!(got.len(), want.len(), "stream {s}, chunk {i}");
                let d = common::max_abs_diff(&got, &want);
                assert!(
                    d < 1e-4,
                    "stream {s}, chunk {i} (cache lengths in the batch {lens:?}): max diff {d}"
                );
            }
        }
    }
    assert!(ragged >= 2, "batches mixed cache lengths {ragged} times");
}

/// Voices set up together (one encoder pass and one solve over all their prompts, as Code2Wav sets
/// up the new voices of a step) give each the state it gets alone: the same first chunk.
#[test]
fn voices_set_up_in_one_batch_match_voices_set_up_alone() {
    let (c2w, f, g) = two_voices();
    let together = c2w.setup_batch(&[&f, &g, &f]).unwrap();
    assert_eq!(together.len(), 3);
    let first = codes(28, 3);
    for (i, (v, st)) in [&f, &g, &f].into_iter().zip(&together).enumerate() {
        let alone = c2w.setup(v).unwrap();
        assert_eq!(st.estimator.att.dims(), alone.estimator.att.dims(), "voice {i}");
        let want = samples(&c2w.chunk(&mut c2w.start(v, &alone).unwrap(), &first, false).unwrap());
        let got = samples(&c2w.chunk(&mut c2w.start(v, st).unwrap(), &first, false).unwrap());
        assert_eq!(got.len(), want.len(), "voice {i}");
        let d = common::max_abs_diff(&got, &want);
        assert!(d < 1e-4, "voice {i}: max diff {d}");
    }
    assert!(c2w.setup_batch(&[]).unwrap().is_empty());
    // as the server runs it: over fixed buffers (CUDA graphs on a GPU), padded to a power of two,
    // the same state from every run
    let mut g2w = c2w.clone();
    g2w.set_graphs(Some(antiphon_models::code2wav::dit::GraphPolicy::default()), Some(4));
    let want =
        samples(&c2w.chunk(&mut c2w.start(&g, &together[1]).unwrap(), &first, false).unwrap());
    for run in 0..3 {
        let set = g2w.setup_batch(&[&f, &g, &f]).unwrap();
        let got = samples(&g2w.chunk(&mut g2w.start(&g, &set[1]).unwrap(), &first, false).unwrap());
        let d = common::max_abs_diff(&got, &want);
        assert!(d < 1e-4, "fixed-buffer run {run}: max diff {d}");
    }
}

#[test]
fn missing_assets_are_named() {
    let dir = tempfile::tempdir().unwrap();
    synth::write_token2wav(dir.path(), Preset::Tiny, 1).unwrap();
    std::fs::remove_file(dir.path().join("campplus.onnx")).unwrap();
    let err = antiphon_assets::token2wav::load_dir(
        dir.path(),
        DType::F32,
        &Device::Cpu,
        BufferSeeds::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("campplus.onnx"), "{err}");
}

#[test]
fn a_chunk_after_the_last_is_refused() {
    let c2w = synth::code2wav_in_memory(Preset::Tiny, 2, DType::F32, &Device::Cpu).unwrap();
    let f = c2w.prepare(&reference()).unwrap();
    let setup = c2w.setup(&f).unwrap();
    let mut st = c2w.start(&f, &setup).unwrap();
    let p = payloads(&codes(5, 1), &[5]);
    c2w.chunk(&mut st, &p[0], true).unwrap();
    assert!(c2w.chunk(&mut st, &p[0], true).is_err());
}

/// Counts what a loader asks for without allocating (every tensor is one value broadcast).
struct Counting(std::sync::Mutex<Vec<(String, usize)>>);

impl candle_nn::var_builder::SimpleBackend for Counting {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        d: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.0.lock().unwrap().push((name.to_string(), s.elem_count()));
        Tensor::ones(1, d, dev)?.broadcast_as(s)
    }
    fn get_unchecked(&self, n: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("no {n}")
    }
    fn contains_tensor(&self, n: &str) -> bool {
        !(n.ends_with("weight_g") || n.ends_with("weight_v"))
    }
}

fn count<T>(build: impl FnOnce(candle_nn::VarBuilder<'static>) -> T) -> (usize, usize) {
    let c = std::sync::Arc::new(Counting(Default::default()));
    let vb = candle_nn::VarBuilder::from_backend(
        Box::new(antiphon_assets::checkpoint::SharedBackend(c.clone())),
        DType::F32,
        Device::Cpu,
    );
    let _ = build(vb);
    let v = c.0.lock().unwrap();
    (v.len(), v.iter().map(|(_, n)| n).sum())
}

#[test]
fn full_code2wav_preset_has_the_real_sizes() {
    use antiphon_models::code2wav::flow::Flow;
    use antiphon_models::code2wav::hift::{HiftConfig, HiftGenerator};
    let d = Preset::Full.code2wav();
    let noise = Tensor::zeros((80, 1), DType::F32, &Device::Cpu).unwrap();
    let (tensors, params) = count(|vb| Flow::load(vb, &d.flow, noise).unwrap());
    // checkpoint.md: flow.pt ≈ 155.80 M parameters in 605 tensors (623,466,603 bytes of fp32)
    assert_eq!(tensors, 605);
    assert!((155_700_000..155_900_000).contains(&params), "flow parameters {params}");
    // the original HiFT: 328 tensors, 20,821,295 parameters
    let (tensors, params) =
        count(|vb| HiftGenerator::load(vb, &HiftConfig::original(), None).unwrap());
    assert_eq!((tensors, params), (328, 20_821_295));
}

/// A convolution's columns (with the ones row for its bias) times the weight (with the bias as
/// its last column) are the convolution, at every padding and dilation the vocoder uses.
#[test]
fn conv_columns_times_the_weight_are_the_convolution() {
    use antiphon_models::code2wav::conv_cols::conv_cols;
    let dev = Device::Cpu;
    let (b, c, o, t) = (2, 3, 4, 17);
    let x = Tensor::randn(0f32, 1., (b, c, t), &dev).unwrap();
    for (k, d, pad_l, pad_r) in [(3, 1, 2, 0), (7, 3, 18, 0), (11, 5, 25, 25), (3, 1, 1, 1)] {
        let w = Tensor::randn(0f32, 1., (o, c, k), &dev).unwrap();
        let bias = Tensor::randn(0f32, 1., o, &dev).unwrap();
        let want = x
            .pad_with_zeros(2, pad_l, pad_r)
            .unwrap()
            .conv1d(&w, 0, 1, d, 1)
            .unwrap()
            .broadcast_add(&bias.reshape((1, o, 1)).unwrap())
            .unwrap();
        let wc = antiphon_models::code2wav::conv_cols::cols_weight(&w, Some(&bias)).unwrap();
        let got = wc
            .broadcast_left(b)
            .unwrap()
            .matmul(&conv_cols(&x, k, d, pad_l, pad_r).unwrap())
            .unwrap();
        assert_eq!(got.dims(), want.dims(), "k {k}, d {d}");
        let diff = common::max_abs_diff(
            &got.flatten_all().unwrap().to_vec1().unwrap(),
            &want.flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert!(diff < 1e-4, "k {k}, d {d}, padding ({pad_l}, {pad_r}): max diff {diff}");
    }
}

/// The same with a stride and with a nearest upsampling of the input first (the causal vocoder's
/// downsampling and upsampling convolutions), against candle's conv1d on the upsampled, padded
/// input.
#[test]
fn strided_and_upsampled_conv_columns_are_the_convolution() {
    use antiphon_models::code2wav::conv_cols::{conv_cols_with, Cols};
    let dev = Device::Cpu;
    let (b, c, o, t) = (2, 3, 4, 47);
    let x = Tensor::randn(0f32, 1., (b, c, t), &dev).unwrap();
    for (k, d, pad_l, pad_r, stride, up) in [
        (30, 1, 14, 0, 15, 1),
        (6, 1, 2, 0, 3, 1),
        (16, 1, 15, 0, 1, 8),
        (7, 1, 6, 0, 1, 3),
        (5, 1, 0, 4, 1, 1),
        (4, 2, 3, 1, 2, 2),
    ] {
        let w = Tensor::randn(0f32, 1., (o, c, k), &dev).unwrap();
        let bias = Tensor::randn(0f32, 1., o, &dev).unwrap();
        let xu = x
            .unsqueeze(3)
            .unwrap()
            .broadcast_as((b, c, t, up))
            .unwrap()
            .reshape((b, c, t * up))
            .unwrap();
        let want = xu
            .pad_with_zeros(2, pad_l, pad_r)
            .unwrap()
            .conv1d(&w, 0, stride, d, 1)
            .unwrap()
            .broadcast_add(&bias.reshape((1, o, 1)).unwrap())
            .unwrap();
        let wc = antiphon_models::code2wav::conv_cols::cols_weight(&w, Some(&bias)).unwrap();
        let cols = conv_cols_with(&x, Cols { k, d, pad_l, pad_r, stride, up }).unwrap();
        let got = wc.broadcast_left(b).unwrap().matmul(&cols).unwrap();
        assert_eq!(got.dims(), want.dims(), "k {k}, stride {stride}, up {up}");
        let diff = common::max_abs_diff(
            &got.flatten_all().unwrap().to_vec1().unwrap(),
            &want.flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert!(
            diff < 1e-4,
            "k {k}, d {d}, padding ({pad_l}, {pad_r}), stride {stride}, up {up}: max diff {diff}"
        );
    }
}

/// A burst's references prepared in one batch (host front ends side by side, device work queued
/// together) give each voice exactly what it gets alone.
#[test]
fn references_prepared_in_one_batch_match_references_prepared_alone() {
    let c2w = synth::code2wav_in_memory(Preset::Tiny, 5, DType::F32, &Device::Cpu).unwrap();
    let a = reference();
    let b = Reference::materialize(&reference().samples[..24_000 * 2], 24_000).unwrap();
    let c = Reference::materialize(
        &reference().samples.iter().map(|s| 0.5 * s).collect::<Vec<_>>(),
        24_000,
    )
    .unwrap();
    let together = c2w.prepare_batch(&[&a, &b, &c]);
    assert_eq!(together.len(), 3);
    for (r, got) in [&a, &b, &c].into_iter().zip(&together) {
        let want = c2w.prepare(r).unwrap();
        let got = got.as_ref().expect("each voice prepared");
        assert_eq!(got.codes, want.codes);
        // (CAM++ over a batch may sum in another order than over one voice)
        assert!(
            common::max_abs_diff(
                &got.speaker.to_vec1::<f32>().unwrap(),
                &want.speaker.to_vec1::<f32>().unwrap()
            ) < 1e-5
        );
        assert_eq!(got.mel.to_vec2::<f32>().unwrap(), want.mel.to_vec2::<f32>().unwrap());
    }
    assert_ne!(
        together[0].as_ref().unwrap().codes,
        together[1].as_ref().unwrap().codes,
        "different voices, different codes"
    );
}
