//! Numerical parity of Code2Wav with minicpmo-utils 1.0.7 (flow, DiT, CFM, causal and original
//! HiFT), through antiphon's real asset loaders. Fixtures: `tests/parity/make_c2w_fixtures.py`.

use crate::common;

use std::path::PathBuf;

use antiphon_assets::checkpoint::pth_var_builder;
use antiphon_assets::yaml;
use antiphon_models::code2wav::flow::{Flow, FlowState};
use antiphon_models::code2wav::hift::HiftGenerator;
use candle_core::{DType, Tensor};
use common::{assert_close, ids, load_io, load_meta};

mod hift;

const FIX: &str = "parity_c2w";
const TOL: f32 = 1e-4;

fn assets() -> PathBuf {
    common::fixture_dir(FIX).join("token2wav")
}

fn flow() -> Flow {
    let io = load_io(FIX);
    let cfg =
        yaml::flow_config(&std::fs::read_to_string(assets().join("flow.yaml")).unwrap()).unwrap();
    let vb =
        pth_var_builder(&assets().join("flow.pt"), None, DType::F32, &common::device()).unwrap();
    Flow::load(vb, &cfg, io["cfm_noise"].clone()).unwrap()
}

fn setup(flow: &Flow) -> FlowState {
    let io = load_io(FIX);
    let meta = load_meta(FIX);
    let mut codes = ids(&meta["prompt_tokens"]);
    codes.extend([4218u32; 3]);
    flow.setup(&codes, &io["prompt_mel"], &io["spk"]).unwrap()
}

fn causal_hift() -> HiftGenerator {
    let io = load_io(FIX);
    let cfg =
        yaml::causal_hift_config(&std::fs::read_to_string(assets().join("config.yaml")).unwrap())
            .unwrap();
    let vb =
        pth_var_builder(&assets().join("hift.pt"), None, DType::F32, &common::device()).unwrap();
    HiftGenerator::load(vb, &cfg, Some(&io["vocoder_noise_table"])).unwrap()
}

#[test]
fn parity_flow_setup_caches() {
    let io = load_io(FIX);
    let f = flow();
    let st = setup(&f);
    assert_eq!(st.prompt_frames, 40);
    // conformer: the reference packs [token layers repeated ×2 along time; mel layers]
    let c = &st.conformer;
    let want = &io["setup_conformer_att_cache"];
    for (i, t) in c.att_token.iter().enumerate() {
        let packed = Tensor::cat(&[t, t], 2).unwrap();
        assert_close(&format!("conformer token cache {i}"), &packed, &want.get(i).unwrap(), TOL);
    }
    for (i, t) in c.att_mel.iter().enumerate() {
        assert_close(
            &format!("conformer mel cache {i}"),
            t,
            &want.get(c.att_token.len() + i).unwrap(),
            TOL,
        );
    }
    assert_close("conformer cnn cache", &c.cnn, &io["setup_conformer_cnn_cache"], TOL);
    let want_att = &io["setup_estimator_att_cache"]; // Euler steps 0 and 9
    assert_close(
        "estimator att cache, step 0",
        &st.estimator.att.get(0).unwrap(),
        &want_att.get(0).unwrap(),
        TOL,
    );
    assert_close(
        "estimator att cache, step 9",
        &st.estimator.att.get(9).unwrap(),
        &want_att.get(1).unwrap(),
        TOL,
    );
    // (ours time-major, [.., 2, 2 H]; the reference's [.., 2 H, 2])
    assert_close(
        "estimator cnn cache",
        &st.estimator.cnn.transpose(3, 4).unwrap(),
        &io["setup_estimator_cnn_cache"],
        TOL,
    );
}

#[test]
fn parity_flow_dit_step() {
    let io = load_io(FIX);
    let f = flow();
    let st = setup(&f);
    let est = &f.decoder.estimator;
    let att0 = st.estimator.att.get(0).unwrap();
    let cnn0 = st.estimator.cnn.get(0).unwrap();
    let (v, nc, na) = est
        .forward_chunk(
            &io["dit_x"],
            &io["dit_mu"],
            0.3,
            &io["dit_spks"],
            &io["dit_x"].zeros_like().unwrap(),
            Some(&cnn0),
            Some(&att0),
        )
        .unwrap();
    assert_close("DiT velocity", &v, &io["dit_out"], TOL);
    assert_close("DiT new conv cache", &nc.transpose(2, 3).unwrap(), &io["dit_new_cnn"], TOL);
    assert_close("DiT new attention cache", &na, &io["dit_new_att"], TOL);
}

#[test]
fn parity_flow_encoder_and_cfm_chunk() {
    let io = load_io(FIX);
    let meta = load_meta(FIX);
    let f = flow();
    let mut st = setup(&f);
    let p0 = ids(&meta["payloads"][0]);
    let mel = f.chunk(&p0, &io["spk"], &mut st, false).unwrap();
    assert_close("chunk 0 mel (encoder + 10 CFG Euler steps)", &mel, &io["chunk0_mel"], TOL);
    assert_eq!(st.estimator.len(), 90);
}

#[test]
fn parity_flow_stream_utterance_chunk_by_chunk() {
    let io = load_io(FIX);
    let meta = load_meta(FIX);
    let f = flow();
    let mut st = setup(&f);
    let payloads = meta["payloads"].as_array().unwrap();
    for (i, p) in payloads.iter().enumerate() {
        let last = i == payloads.len() - 1;
        let mel = f.chunk(&ids(p), &io["spk"], &mut st, last).unwrap();
        assert_close(&format!("chunk {i} mel"), &mel, &io[&format!("chunk{i}_mel")], TOL);
        let want_len =
            io[&format!("chunk{i}_estimator_att_len")].to_vec1::<f32>().unwrap()[0] as usize;
        assert_eq!(
            st.estimator.len(),
            want_len,
            "estimator cache after chunk {i} (trimmed to prompt + 100)"
        );
    }
    let c = &st.conformer;
    let want = &io["final_conformer_att_cache"];
    for (i, t) in c.att_token.iter().enumerate() {
        assert_close(
            &format!("trimmed token cache {i}"),
            &Tensor::cat(&[t, t], 2).unwrap(),
            &want.get(i).unwrap(),
            TOL,
        );
    }
}

/// The flow chunk over fixed buffers (a CUDA graph on a GPU, op by op on the CPU) gives the
/// reference's mel and the same caches as the op-by-op solve: an utterance streamed three times (a
/// shape is captured the second time it comes, replayed the third), also with room for one graph
/// only (every capture evicts another).
#[test]
fn parity_flow_graphed_chunks_match_reference() {
    use antiphon_models::code2wav::dit::GraphPolicy;
    let io = load_io(FIX);
    let meta = load_meta(FIX);
    let payloads: Vec<Vec<u32>> = meta["payloads"].as_array().unwrap().iter().map(ids).collect();
    let eager = flow();
    for max_graphs in [12, 1] {
        let mut g = flow();
        g.decoder.set_graphs(Some(GraphPolicy {
            max_batch: 2,
            max_graphs,
            ..GraphPolicy::default()
        }));
        for pass in 0..3 {
            let (mut st, mut want) = (setup(&g), setup(&eager));
            for (i, p) in payloads.iter().enumerate() {
                let last = i == payloads.len() - 1;
                let mel = g.chunk(p, &io["spk"], &mut st, last).unwrap();
                let mel_eager = eager.chunk(p, &io["spk"], &mut want, last).unwrap();
                let what = format!("max_graphs {max_graphs}, pass {pass}, chunk {i}");
                assert_close(
                    &format!("{what}: mel vs reference"),
                    &mel,
                    &io[&format!("chunk{i}_mel")],
                    TOL,
                );
                assert_close(&format!("{what}: mel vs op by op"), &mel, &mel_eager, 1e-5);
                assert_close(
                    &format!("{what}: attention cache"),
                    &st.estimator.att,
                    &want.estimator.att,
                    1e-5,
                );
                assert_close(
                    &format!("{what}: conv cache"),
                    &st.estimator.cnn,
                    &want.estimator.cnn,
                    1e-5,
                );
            }
        }
        let held = g.decoder.graphs_held();
        assert!(held >= 1 && held <= max_graphs, "{held} graphs held with room for {max_graphs}");
    }
}

#[test]
fn parity_flow_batched_chunks_match_single() {
    let io = load_io(FIX);
    let meta = load_meta(FIX);
    let f = flow();
    let payloads: Vec<Vec<u32>> = meta["payloads"].as_array().unwrap().iter().map(ids).collect();
    // stream A: the fixture's; stream B: same prompt, another speaker and other codes
    let spk_b = (io["spk"].clone() * -0.5).unwrap();
    let codes_b: Vec<Vec<u32>> =
        payloads.iter().map(|p| p.iter().map(|&c| (c * 7 + 11) % 6561).collect()).collect();
    let (mut a1, mut b1) = (setup(&f), setup(&f));
    let (mut a2, mut b2) = (setup(&f), setup(&f));
    for i in 0..payloads.len() - 1 {
        let together = f
            .chunk_batch(
                &[&payloads[i], &codes_b[i]],
                &[&io["spk"], &spk_b],
                &mut [&mut a1, &mut b1],
                false,
            )
            .unwrap();
        let alone_a = f.chunk(&payloads[i], &io["spk"], &mut a2, false).unwrap();
        let alone_b = f.chunk(&codes_b[i], &spk_b, &mut b2, false).unwrap();
        assert_close(&format!("batched A chunk {i}"), &together[0], &alone_a, 1e-5);
        assert_close(&format!("batched B chunk {i}"), &together[1], &alone_b, 1e-5);
        assert_close(
            &format!("batched A chunk {i} vs reference"),
            &together[0],
            &io[&format!("chunk{i}_mel")],
            TOL,
        );
    }
}

/// Two copies of the fixture's stream, the second one chunk behind (caches of different lengths,
/// padded and masked in one CFM solve), batched for every chunk both have of the same length: each
/// gives the reference's mel.
#[test]
fn parity_flow_ragged_batch_matches_reference() {
    let io = load_io(FIX);
    let meta = load_meta(FIX);
    let f = flow();
    let payloads: Vec<Vec<u32>> = meta["payloads"].as_array().unwrap().iter().map(ids).collect();
    let (mut a, mut b) = (setup(&f), setup(&f));
    let mut ragged = 0;
    for i in 0..payloads.len() {
        // b runs chunk i - 1 beside a's chunk i when their lengths agree, else alone
        let last = i == payloads.len() - 1;
        if i > 0 && payloads[i].len() == payloads[i - 1].len() && !last {
            ragged += usize::from(a.estimator.len() != b.estimator.len());
            let out = f
                .chunk_batch(
                    &[&payloads[i], &payloads[i - 1]],
                    &[&io["spk"], &io["spk"]],
                    &mut [&mut a, &mut b],
                    false,
                )
                .unwrap();
            assert_close(&format!("ahead, chunk {i}"), &out[0], &io[&format!("chunk{i}_mel")], TOL);
            assert_close(
                &format!("behind, chunk {}", i - 1),
                &out[1],
                &io[&format!("chunk{}_mel", i - 1)],
                TOL,
            );
        } else {
            let mel = f.chunk(&payloads[i], &io["spk"], &mut a, last).unwrap();
            assert_close(
                &format!("ahead alone, chunk {i}"),
                &mel,
                &io[&format!("chunk{i}_mel")],
                TOL,
            );
            if i > 0 {
                let mel = f
                    .chunk(&payloads[i - 1], &io["spk"], &mut b, i - 1 == payloads.len() - 1)
                    .unwrap();
                assert_close(
                    &format!("behind alone, chunk {}", i - 1),
                    &mel,
                    &io[&format!("chunk{}_mel", i - 1)],
                    TOL,
                );
            }
        }
    }
    assert!(ragged >= 1, "no batch mixed cache lengths");
}

/// The fixture's stream twice, the second a chunk behind, with their attention caches in slots of
/// a pool (`code2wav::slots`): batched where their chunks agree in length, op by op and (on a GPU)
/// as graphs padded to a power of two, replayed from the third pass on; each chunk gives the
/// reference's mel, and the slot read back is the op-by-op stream's cache.
#[test]
fn parity_flow_pooled_chunks_match_reference() {
    use antiphon_models::code2wav::dit::GraphPolicy;
    use antiphon_models::code2wav::slots::FlowPool;
    let io = load_io(FIX);
    let meta = load_meta(FIX);
    let payloads: Vec<Vec<u32>> = meta["payloads"].as_array().unwrap().iter().map(ids).collect();
    let eager = flow();
    let longest = payloads.iter().map(|p| p.len()).max().unwrap() * eager.up_rate();
    for graphs in [false, true] {
        let mut f = flow();
        if graphs {
            f.decoder.set_graphs(Some(GraphPolicy::default()));
        }
        let st0 = setup(&f);
        let cap = f.config().history_frames + st0.prompt_frames + longest + 4;
        let pool =
            FlowPool::new(f.config(), 2, cap, longest, DType::F32, &common::device()).unwrap();
        for pass in 0..if graphs { 3 } else { 1 } {
            let start = || {
                let mut st = setup(&f);
                st.slot = pool.lease(&st.estimator, st.prompt_frames).unwrap();
                assert!(st.slot.is_some(), "a free slot");
                st
            };
            let (mut a, mut b, mut want) = (start(), start(), setup(&eager));
            let mut batched = 0;
            for i in 0..payloads.len() {
                let last = i == payloads.len() - 1;
                let what = format!("graphs {graphs}, pass {pass}, chunk {i}");
                if i > 0 && payloads[i].len() == payloads[i - 1].len() && !last {
                    batched += 1;
                    let out = f
                        .chunk_batch(
                            &[&payloads[i], &payloads[i - 1]],
                            &[&io["spk"], &io["spk"]],
                            &mut [&mut a, &mut b],
                            false,
                        )
                        .unwrap();
                    assert_close(
                        &format!("{what}: ahead"),
                        &out[0],
                        &io[&format!("chunk{i}_mel")],
                        TOL,
                    );
                    assert_close(
                        &format!("{what}: behind"),
                        &out[1],
                        &io[&format!("chunk{}_mel", i - 1)],
                        TOL,
                    );
                } else {
                    let mel = f.chunk(&payloads[i], &io["spk"], &mut a, last).unwrap();
                    assert_close(
                        &format!("{what}: ahead alone"),
                        &mel,
                        &io[&format!("chunk{i}_mel")],
                        TOL,
                    );
                    if i > 0 {
                        let mel = f.chunk(&payloads[i - 1], &io["spk"], &mut b, false).unwrap();
                        assert_close(
                            &format!("{what}: behind alone"),
                            &mel,
                            &io[&format!("chunk{}_mel", i - 1)],
                            TOL,
                        );
                    }
                }
                eager.chunk(&payloads[i], &io["spk"], &mut want, last).unwrap();
                let slot = a.slot.as_ref().expect("in a slot").materialize().unwrap();
                assert_close(&format!("{what}: the slot's cache"), &slot, &want.estimator.att, TOL);
            }
            assert!(batched >= 1, "no batched chunk");
            assert_eq!(pool.free_slots(), 0);
        }
        assert_eq!(pool.free_slots(), 2, "slots back");
    }
}

/// The pool's slot gather (`fused::rows_gather`, one 16-byte copy per thread on CUDA) gives what
/// index_select gives, rows repeated and out of order, from a view that starts inside a larger
/// buffer, in bf16 and f32; a row that is not whole 16-byte pieces takes index_select itself.
#[test]
fn rows_gather_is_index_select() {
    let dev = common::device();
    let big = Tensor::randn(0f32, 1.0, (2, 5, 3, 8, 4), &dev).unwrap();
    let rows = Tensor::new(&[4u32, 0, 4, 2], &dev).unwrap();
    for dt in [DType::F32, DType::BF16] {
        let pool = big.to_dtype(dt).unwrap().get(1).unwrap();
        let got = antiphon_models::fused::rows_gather(&pool, &rows).unwrap();
        let want = pool.index_select(&rows, 0).unwrap();
        assert_eq!(got.dims(), want.dims());
        let d = (got.to_dtype(DType::F32).unwrap() - want.to_dtype(DType::F32).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(d.iter().all(|x| *x == 0.0), "{dt:?}: rows differ");
    }
    let odd = Tensor::randn(0f32, 1.0, (5, 3), &dev).unwrap();
    let got = antiphon_models::fused::rows_gather(&odd, &rows).unwrap();
    assert_eq!(
        got.to_vec2::<f32>().unwrap(),
        odd.index_select(&rows, 0).unwrap().to_vec2::<f32>().unwrap()
    );
}

/// The columns of Snake's output (`dit_ops::conv_cols_snake`, one kernel on CUDA) times the weight
/// are the convolution of `snake(x)`, zero-padded on the left as the causal residual blocks pad,
/// at the dilations they use, with the input a view inside a larger buffer.
#[test]
fn snake_columns_are_the_convolution_of_snake() {
    use antiphon_models::code2wav::conv_cols::{cols_weight, conv_cols_snake, Cols};
    let dev = common::device();
    let (b, c, o, t) = (2, 5, 3, 41);
    let big = Tensor::randn(0f32, 2.0, (b, c, t + 3), &dev).unwrap();
    let x = big.narrow(2, 3, t).unwrap();
    let alpha = (Tensor::rand(0f32, 1.0, c, &dev).unwrap() + 0.25).unwrap();
    for (k, d) in [(3, 1), (7, 3), (11, 5)] {
        let pad = d * (k - 1);
        let w = Tensor::randn(0f32, 1., (o, c, k), &dev).unwrap();
        let bias = Tensor::randn(0f32, 1., o, &dev).unwrap();
        let s = antiphon_models::fused::snake_twin(&x, &alpha).unwrap();
        let want = s
            .pad_with_zeros(2, pad, 0)
            .unwrap()
            .conv1d(&w, 0, 1, d, 1)
            .unwrap()
            .broadcast_add(&bias.reshape((1, o, 1)).unwrap())
            .unwrap();
        let cols = conv_cols_snake(
            &x,
            Cols { k, d, pad_l: pad, pad_r: 0, stride: 1, up: 1 },
            Some(&alpha),
        )
        .unwrap();
        let got =
            cols_weight(&w, Some(&bias)).unwrap().broadcast_left(b).unwrap().matmul(&cols).unwrap();
        assert_close(&format!("snake columns, k {k}, d {d}"), &got, &want, 1e-4);
    }
    // a wrong alpha is refused
    assert!(conv_cols_snake(
        &x,
        Cols { k: 3, d: 1, pad_l: 2, pad_r: 0, stride: 1, up: 1 },
        Some(&alpha.narrow(0, 0, 2).unwrap())
    )
    .is_err());
}

/// The f16 columns times the f16 weight into f32 sums (`conv_cols_half` and `half_columns_product`:
/// the vocoder's convolutions with `engine.code2wav.vocoder_half_columns`, a kernel and one cuBLAS
/// product on CUDA) are the f32 convolution up to rounding its operands to f16, and exactly the
/// product of the rounded operands up to the order of the sums: Snake in the columns, a dilation, a
/// stride with an upsampling, output lengths that are not multiples of 8, a batch sharing the
/// weight.
#[test]
fn half_columns_are_the_convolution_to_f16_rounding() {
    use antiphon_models::code2wav::conv_cols::{
        cols_weight, conv_cols_half, conv_cols_snake, half_columns_product, Cols,
    };
    use candle_core::DType;
    let dev = common::device();
    let (b, c, o, t) = (3, 48, 40, 37);
    let x = Tensor::randn(0f32, 2.0, (b, c, t), &dev).unwrap();
    let alpha = (Tensor::rand(0f32, 1.0, c, &dev).unwrap() + 0.25).unwrap();
    let round = |t: &Tensor| t.to_dtype(DType::F16).unwrap().to_dtype(DType::F32).unwrap();
    let shapes = [
        (Cols { k: 7, d: 3, pad_l: 18, pad_r: 0, stride: 1, up: 1 }, Some(&alpha)),
        (Cols { k: 3, d: 1, pad_l: 1, pad_r: 1, stride: 1, up: 1 }, None),
        (Cols { k: 5, d: 1, pad_l: 4, pad_r: 0, stride: 2, up: 3 }, None),
    ];
    for (p, a) in shapes {
        let w = (Tensor::randn(0f32, 1., (o, c, p.k), &dev).unwrap() / ((c * p.k) as f64).sqrt())
            .unwrap();
        let wc = cols_weight(&w, Some(&Tensor::randn(0f32, 1., o, &dev).unwrap())).unwrap();
        let cols = conv_cols_snake(&x, p, a).unwrap();
        let exact = wc.broadcast_left(b).unwrap().matmul(&cols).unwrap();
        let rounded = round(&wc)
            .broadcast_left(b)
            .unwrap()
            .contiguous()
            .unwrap()
            .matmul(&round(&cols))
            .unwrap();
        let half_cols = conv_cols_half(&x, p, a).unwrap();
        assert_eq!(half_cols.dtype(), DType::F16);
        assert_eq!(half_cols.dims(), cols.dims(), "{p:?}: the columns' shape");
        let got = half_columns_product(&wc.to_dtype(DType::F16).unwrap(), &half_cols).unwrap();
        assert_eq!(got.dtype(), DType::F32);
        let what = format!("half columns, {p:?}");
        assert_close(&format!("{what} against the rounded operands"), &got, &rounded, 1e-5);
        let e = common::rel_err(&got, &exact);
        assert!(e <= 4e-3, "{what}: relative error {e:e} against f32");
        eprintln!("{what}: relative error {e:.2e} against f32");
    }
    // the wrong dtypes are refused
    assert!(conv_cols_half(&x.to_dtype(DType::BF16).unwrap(), shapes[1].0, None).is_err());
    let wc = cols_weight(&Tensor::zeros((o, c, 3), DType::F32, &dev).unwrap(), None).unwrap();
    assert!(half_columns_product(&wc, &conv_cols_half(&x, shapes[1].0, None).unwrap()).is_err());
}
