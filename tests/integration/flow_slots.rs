//! The flow's attention caches in a slot pool (`code2wav::slots`): streams in slots get what
//! streams with caches of their own get, chunk by chunk, through the reference's trim; a slot
//! holds exactly the reference's cache; slots run out, come back, and give their cache back when
//! a chunk does not fit.

use crate::common;

use antiphon_assets::synth::{self, Preset};
use antiphon_models::code2wav::dit::GraphPolicy;
use antiphon_models::code2wav::dit_attention::PoolAttention;
use antiphon_models::code2wav::prompt::Reference;
use antiphon_models::code2wav::{Code2Wav, StreamState};
use candle_core::{DType, Device, Tensor};
use common::streams::{codes, due, payloads, reference, samples};

/// On the parity tests' device (`ANTIPHON_TEST_DEVICE`, the CPU by default), so the GPU run checks
/// the CUDA kernels of pooled and mixed steps (`conv_tails_at`, the pooled graphs) too.
fn tiny() -> Code2Wav {
    synth::code2wav_in_memory(Preset::Tiny, 5, DType::F32, device()).unwrap()
}

/// One device for every test of this binary (a CUDA device opened twice is two devices whose
/// tensors do not mix).
fn device() -> &'static Device {
    static DEVICE: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEVICE.get_or_init(common::device)
}

/// How near a batched result must come to the stream alone: on the CPU the same sums in the same
/// order; on a GPU the batch size picks other kernels (other summation orders).
fn tol() -> f32 {
    if device().is_cpu() {
        1e-4
    } else {
        2e-3
    }
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn assert_near(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let d = common::max_abs_diff(got, want);
    assert!(d < tol, "{what}: max diff {d}");
    eprintln!("{what}: max diff {d} (< {tol})");
}

/// Three streams (two voices, one a chunk behind) through six chunks (the caches trim from the
/// fourth on), in batches, on a Code2Wav with a pool of `slots` slots, each chunk against the same
/// stream alone with caches of its own.
fn pooled_batches_match_own_caches(slots: usize, graphs: bool, mode: PoolAttention) {
    let own = tiny();
    let mut pooled = own.clone();
    pooled.set_pool_attention(mode);
    pooled.set_slots(slots, 512, 25).unwrap();
    if graphs {
        // (no capture on the CPU: the graph path's fixed buffers and power-of-two padding, op by
        // op)
        pooled.set_graphs(Some(GraphPolicy::default()), None);
    }
    let f = own.prepare(&reference()).unwrap();
    let short: Vec<f32> = reference().samples[..24_000 * 2].to_vec();
    let g = own.prepare(&Reference::materialize(&short, 24_000).unwrap()).unwrap();
    let (sf, sg) = (own.setup(&f).unwrap(), own.setup(&g).unwrap());
    let feats = [(&f, &sf), (&g, &sg), (&f, &sf)];
    let lag = [0usize, 0, 1];
    let sizes = [25, 25, 25, 25, 25, 10];
    let pay: Vec<Vec<Vec<u32>>> =
        (0..3).map(|s| payloads(&codes(135, s as u32 + 7), &sizes)).collect();
    let mut together: Vec<StreamState> =
        feats.iter().map(|(f, s)| pooled.start(f, s).unwrap()).collect();
    let mut alone: Vec<StreamState> = feats.iter().map(|(f, s)| own.start(f, s).unwrap()).collect();
    let pool = pooled.pool().expect("a pool").clone();
    assert_eq!(
        together.iter().filter(|s| s.flow.slot.is_some()).count(),
        slots.min(3),
        "streams took the free slots"
    );
    assert_eq!(pool.free_slots(), slots.saturating_sub(3));
    let mut trimmed = false;
    for round in 0..sizes.len() + 1 {
        for last in [false, true] {
            let members = due(round, last, &lag, sizes.len());
            if members.is_empty() {
                continue;
            }
            let mut refs: Vec<&mut StreamState> = together
                .iter_mut()
                .enumerate()
                .filter(|(s, _)| members.iter().any(|m| m.0 == *s))
                .map(|(_, t)| t)
                .collect();
            let cs: Vec<&[u32]> = members.iter().map(|&(s, i)| pay[s][i].as_slice()).collect();
            let out = pooled.chunk_batch(&mut refs, &cs, last).unwrap();
            for (&(s, i), y) in members.iter().zip(&out) {
                let want = samples(&own.chunk(&mut alone[s], &pay[s][i], last).unwrap());
                assert_near(&format!("stream {s}, chunk {i}"), &samples(y), &want, tol());
                if let Some(slot) = &together[s].flow.slot {
                    assert_eq!(
                        slot.len(),
                        alone[s].flow.estimator.len(),
                        "stream {s}, chunk {i}: cache length"
                    );
                    trimmed |= slot.len() == together[s].flow.prompt_frames + 100;
                }
            }
        }
    }
    assert!(trimmed, "the caches were trimmed to prompt + history");
    drop(together);
    assert_eq!(pool.free_slots(), slots, "every slot back once its stream is gone");
}

#[test]
fn pooled_streams_match_streams_with_caches_of_their_own() {
    // two slots for three streams: a batch mixes pooled streams and one with its own caches
    pooled_batches_match_own_caches(2, false, PoolAttention::Gathered);
}

#[test]
fn pooled_streams_padded_to_a_graph_batch_match_too() {
    // three pooled streams run as a batch of four (one scratch row)
    pooled_batches_match_own_caches(3, true, PoolAttention::Gathered);
}

#[test]
fn pooled_streams_attending_in_place_match_too() {
    // the pool read in place by pointer-array products (CUDA; the gathered path elsewhere),
    // through the graphs
    pooled_batches_match_own_caches(3, true, PoolAttention::InPlace);
}

/// Four streams whose chunks differ in length and in being the last (a small first chunk, full
/// chunks, last chunks of 28 and 13 codes), at different points of their histories, each step in
/// one batch (one flow solve over the pool, every chunk padded to the step's longest), on a
/// Code2Wav with `slots` slots: each gets what it gets alone with caches of its own, and the slots
/// hold what the reference holds.
fn mixed_steps_match_each_stream_alone(slots: usize, graphs: bool, held_lengths: bool) {
    let own = tiny();
    let mut pooled = own.clone();
    pooled.set_slots(slots, 512, 25).unwrap();
    if graphs {
        pooled.set_graphs(Some(GraphPolicy::default()), None);
    }
    if held_lengths {
        // solves padded up to the warm-up's lengths: 16, 50 and 56 frames
        pooled.set_solve_payloads(&[(11, false), (28, false), (28, true)]);
        assert_eq!(
            [10, 16, 17, 26, 50, 56, 60].map(|f| pooled.flow.solve_length(f)),
            [16, 16, 50, 50, 50, 56, 60]
        );
    }
    let f = own.prepare(&reference()).unwrap();
    let short: Vec<f32> = reference().samples[..24_000 * 2].to_vec();
    let g = own.prepare(&Reference::materialize(&short, 24_000).unwrap()).unwrap();
    let (sf, sg) = (own.setup(&f).unwrap(), own.setup(&g).unwrap());
    let feats = [(&f, &sf), (&g, &sg), (&f, &sf), (&g, &sg)];
    // (new codes per chunk; a stream's first chunk comes at round `lag`)
    let sizes: [&[usize]; 4] =
        [&[8, 25, 25, 10], &[25, 25, 25], &[25, 25, 25, 25, 25], &[25, 25, 10]];
    let lag = [0usize, 0, 1, 2];
    let pay: Vec<Vec<Vec<u32>>> =
        (0..4).map(|s| payloads(&codes(sizes[s].iter().sum(), s as u32 + 11), sizes[s])).collect();
    let mut together: Vec<StreamState> =
        feats.iter().map(|(f, s)| pooled.start(f, s).unwrap()).collect();
    let mut alone: Vec<StreamState> = feats.iter().map(|(f, s)| own.start(f, s).unwrap()).collect();
    let (mut mixed_lengths, mut mixed_flags) = (0, 0);
    for round in 0usize..8 {
        let members: Vec<(usize, usize)> = (0..4)
            .filter_map(|s| round.checked_sub(lag[s]).filter(|&i| i < pay[s].len()).map(|i| (s, i)))
            .collect();
        if members.is_empty() {
            continue;
        }
        let lasts: Vec<bool> = members.iter().map(|&(s, i)| i == pay[s].len() - 1).collect();
        let cs: Vec<&[u32]> = members.iter().map(|&(s, i)| pay[s][i].as_slice()).collect();
        mixed_lengths += usize::from(cs.iter().any(|c| c.len() != cs[0].len()));
        mixed_flags += usize::from(lasts.iter().any(|&l| l != lasts[0]));
        let mut refs: Vec<&mut StreamState> = together
            .iter_mut()
            .enumerate()
            .filter(|(s, _)| members.iter().any(|m| m.0 == *s))
            .map(|(_, t)| t)
            .collect();
        let out = pooled.chunk_mixed(&mut refs, &cs, &lasts).unwrap();
        for ((&(s, i), y), &last) in members.iter().zip(&out).zip(&lasts) {
            let want = samples(&own.chunk(&mut alone[s], &pay[s][i], last).unwrap());
            assert_near(
                &format!("round {round}: stream {s}, chunk {i} (last {last})"),
                &samples(y),
                &want,
                tol(),
            );
            if let Some(slot) = &together[s].flow.slot {
                let (got, want) = (slot.materialize().unwrap(), &alone[s].flow.estimator.att);
                assert_eq!(got.dims(), want.dims(), "round {round}: stream {s}'s cache shape");
                assert_near(
                    &format!("round {round}: stream {s}'s cache"),
                    &flat(&got),
                    &flat(want),
                    tol(),
                );
            }
        }
    }
    assert!(
        mixed_lengths >= 3 && mixed_flags >= 2,
        "steps mixed chunk lengths {mixed_lengths} times, last and not {mixed_flags} times"
    );
    assert!(together.iter().all(|s| s.finished), "every stream ended");
}

#[test]
fn a_step_of_mixed_chunk_lengths_and_last_chunks_is_one_pooled_solve() {
    // four pooled streams as a batch of four (graph padding, op by op on the CPU)
    mixed_steps_match_each_stream_alone(4, true, false);
}

#[test]
fn a_mixed_step_padded_up_to_a_held_length_matches_too() {
    // every pooled solve at 16, 50 or 56 frames, whatever its chunks (a 13-code last one: 50)
    mixed_steps_match_each_stream_alone(4, true, true);
}

#[test]
fn a_mixed_step_with_streams_outside_the_pool_matches_too() {
    // two slots: the other two streams solve over their own caches, one solve per chunk length
    mixed_steps_match_each_stream_alone(2, false, false);
}

/// A chunk the flow cannot take is named before it joins a batch.
#[test]
fn a_chunk_outside_the_vocabulary_or_too_short_is_refused_alone() {
    let c = tiny();
    assert!(c.check_chunk(&[4218, 4218, 4218, 1, 2, 3], false).is_ok());
    assert!(c.check_chunk(&[1, 2], true).is_ok(), "a last chunk takes zero look-ahead");
    let e = c.check_chunk(&[1, 9999, 2, 3, 4, 5], false).unwrap_err().to_string();
    assert!(e.contains("9999"), "{e}");
    assert!(c.check_chunk(&[1, 2, 3, 4], false).is_err(), "no room for the look-ahead");
    assert!(c.check_chunk(&[1], true).is_err());
}

/// What a slot holds, read back in the reference's layout and order, is the reference's cache:
/// the same entries in the same order (up to the order of the attention's sums).
#[test]
fn a_slot_holds_the_reference_cache_in_its_order() {
    let own = tiny();
    let mut pooled = own.clone();
    pooled.set_slots(1, 512, 25).unwrap();
    let f = own.prepare(&reference()).unwrap();
    let setup = own.setup(&f).unwrap();
    let (mut a, mut b) = (pooled.start(&f, &setup).unwrap(), own.start(&f, &setup).unwrap());
    let slot_cache =
        |s: &StreamState| s.flow.slot.as_ref().expect("in a slot").materialize().unwrap();
    assert_near("after setup", &flat(&slot_cache(&a)), &flat(&b.flow.estimator.att), 1e-6);
    // (a small first chunk: the trim then cuts through chunks, not between them)
    for (i, p) in payloads(&codes(133, 3), &[8, 25, 25, 25, 25, 25]).iter().enumerate() {
        pooled.chunk(&mut a, p, false).unwrap();
        own.chunk(&mut b, p, false).unwrap();
        let (got, want) = (slot_cache(&a), &b.flow.estimator.att);
        assert_eq!(got.dims(), want.dims(), "chunk {i}: shape");
        assert_near(&format!("chunk {i}"), &flat(&got), &flat(want), tol());
    }
}

/// A chunk larger than what the slot's ring has room for: the stream takes its cache out of the
/// slot (which goes back to the pool) and goes on with what it would have got.
#[test]
fn a_chunk_the_slot_cannot_take_moves_the_cache_out() {
    let own = tiny();
    let mut pooled = own.clone();
    // 100 history + 300 prompt frames + a 28-code chunk (56 frames) + 1: room for little more
    pooled.set_slots(1, 457, 25).unwrap();
    let f = own.prepare(&reference()).unwrap();
    let setup = own.setup(&f).unwrap();
    let (mut a, mut b) = (pooled.start(&f, &setup).unwrap(), own.start(&f, &setup).unwrap());
    assert!(a.flow.slot.is_some());
    let pool = pooled.pool().unwrap().clone();
    let pay = payloads(&codes(85, 9), &[25, 60]);
    for (i, p) in pay.iter().enumerate() {
        let got = samples(&pooled.chunk(&mut a, p, i == 1).unwrap());
        let want = samples(&own.chunk(&mut b, p, i == 1).unwrap());
        assert_near(&format!("chunk {i}"), &got, &want, tol());
    }
    assert!(a.flow.slot.is_none(), "the long chunk moved the cache out of the slot");
    assert_eq!(pool.free_slots(), 1, "and the slot is free again");
}

/// A voice whose prompt would not leave room for a chunk gets no slot; a pool too small for the
/// history is refused.
#[test]
fn a_voice_that_does_not_fit_keeps_its_own_caches() {
    let mut pooled = tiny();
    assert!(pooled.set_slots(2, 120, 25).is_err(), "no room for 100 history frames and a chunk");
    pooled.set_slots(2, 420, 25).unwrap();
    let f = pooled.prepare(&reference()).unwrap();
    let setup = pooled.setup(&f).unwrap();
    let st = pooled.start(&f, &setup).unwrap();
    assert!(st.flow.slot.is_none(), "300 prompt frames + a chunk do not fit 320 ring positions");
    assert_eq!(pooled.pool().unwrap().free_slots(), 2);
}

/// Warming the graphs takes every batch size through each payload sequence (twice, so each shape
/// is held after), skips a batch larger than the free slots, and gives every slot back.
#[test]
fn graph_warm_up_runs_each_batch_size_and_frees_its_slots() {
    let seqs = vec![vec![(11, false), (28, false), (28, true)]];
    let own = tiny();
    assert_eq!(
        own.warm_graphs(
            &own.prepare(&reference()).unwrap(),
            &own.setup(&own.prepare(&reference()).unwrap()).unwrap(),
            &[1],
            &seqs
        )
        .unwrap(),
        0,
        "no graphs: nothing to warm"
    );
    let mut c = tiny();
    c.set_slots(2, 512, 25).unwrap();
    c.set_graphs(Some(GraphPolicy::default()), Some(8));
    let f = c.prepare(&reference()).unwrap();
    let setup = c.setup(&f).unwrap();
    let runs = c.warm_graphs(&f, &setup, &[1, 2, 4], &seqs).unwrap();
    assert_eq!(runs, 2 * 2 * 3, "batches 1 and 2, twice, three chunks each; 4 skipped");
    assert_eq!(c.pool().unwrap().free_slots(), 2);
    let (flow, vocoder) = c.graphs_held();
    assert!(flow >= 2 && vocoder >= 1, "shapes held: flow {flow}, vocoder {vocoder}");
}

/// After the warm-up Code2Wav runs (the engine's payload sequences), the requests the Talker's
/// chunkers make, an idle turn, a busy one and a duplex one, bring no shape that is not held
/// already: running each twice (a shape is captured at its second sighting) captures nothing.
/// (The warm-up once ran payloads three codes longer than any chunker makes, so every real
/// shape was captured while requests waited.)
#[test]
fn the_warm_up_holds_every_shape_the_chunkers_make() {
    use antiphon_engine::chunker::{warm_sequences, Chunker};
    use antiphon_engine::EngineConfig;
    let cfg = EngineConfig::default().with(|c| {
        c.code2wav.first_chunk_codes = 8;
        c.code2wav.small_first_chunk_streams = Some(1);
    });
    let mut c = tiny();
    c.set_slots(2, 512, 25).unwrap();
    c.set_graphs(Some(GraphPolicy::default()), Some(64));
    let f = c.prepare(&reference()).unwrap();
    let setup = c.setup(&f).unwrap();
    c.warm_graphs(&f, &setup, &[1, 2], &warm_sequences(&cfg)).unwrap();
    let held = c.graphs_held();
    for (first, turn, n) in [(8, true, 83), (25, true, 100), (25, false, 50), (25, false, 25)] {
        for _ in 0..2 {
            let mut ch = Chunker::for_stream(&cfg, first, turn);
            let mut payloads: Vec<_> =
                (0..n as u32).filter_map(|i| ch.push(i * 7 % 6561)).collect();
            payloads.extend(ch.flush());
            let mut st = c.start(&f, &setup).unwrap();
            for p in payloads {
                c.chunk_batch(&mut [&mut st], &[p.codes.as_slice()], p.last).unwrap();
            }
        }
        assert_eq!(
            c.graphs_held(),
            held,
            "a request (first {first}, turn {turn}, {n} codes) \
            brought a shape the warm-up did not hold"
        );
    }
}

/// What capacity from memory counts a stream's flow slot as (`Code2Wav::slot_bytes`) is what the
/// pool allocates: its slots and its scratch slot.
#[test]
fn a_flow_pool_holds_what_its_slots_are_counted_as() {
    let mut c = tiny();
    c.set_slots(3, 512, 25).unwrap();
    assert!(c.slot_bytes(512) > 0);
    assert_eq!(c.pool().unwrap().bytes(), 4 * c.slot_bytes(512));
}

/// The DiT's attention over a slot pool (`dit_attention::pool_attention`: on CUDA in 16-bit the
/// tensor-core kernel; `pool_attention_in_place`: on CUDA the pointer-array products over the pool
/// in place; elsewhere both their op-by-op twin) against the same sum written out in f64 over
/// the stored values: rows of another slot order, a query count and a capacity that are not whole
/// tiles, and masks with holes, a masked prefix (the slot's ring) and one fully open.
#[test]
fn attention_over_the_pool_is_the_masked_softmax_of_each_rows_slot() {
    use antiphon_models::code2wav::dit_attention::{
        pool_attention, pool_attention_in_place, pool_attention_ops,
    };
    let (n, h, t, d, slots, cap) = (3usize, 2usize, 37usize, 64usize, 5usize, 176usize);
    let rows = [4u32, 0, 2];
    // row 0 sees every position, row 1 the first 70 but every fifth, row 2 only 100.. (a prefix
    // masked)
    let open = |r: usize, j: usize| match r {
        0 => true,
        1 => j < 70 && !j.is_multiple_of(5),
        _ => j >= 100,
    };
    let dev = device();
    for (dt, tol) in [(DType::F32, 1e-4f32), (DType::F16, 1e-2), (DType::BF16, 6e-2)] {
        let q = Tensor::randn(0f32, 0.125, (n, h, t, d), dev).unwrap().to_dtype(dt).unwrap();
        let pk = Tensor::randn(0f32, 1.0, (slots, h, cap, d), dev).unwrap().to_dtype(dt).unwrap();
        let pv = Tensor::randn(0f32, 1.0, (slots, h, cap, d), dev).unwrap().to_dtype(dt).unwrap();
        let m: Vec<f32> = (0..n)
            .flat_map(|r| (0..cap).map(move |j| if open(r, j) { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(m, (n, 1, 1, cap), dev).unwrap().to_dtype(dt).unwrap();
        let rows_t = Tensor::new(&rows[..], dev).unwrap();
        let vals = |x: &Tensor| flat(&x.to_dtype(DType::F32).unwrap());
        let (qv, kv, vv) = (vals(&q), vals(&pk), vals(&pv));
        let mut want = vec![0f32; n * t * h * d];
        for r in 0..n {
            let s = rows[r] as usize;
            for hh in 0..h {
                let plane = (s * h + hh) * cap * d;
                for i in 0..t {
                    let qi = &qv[((r * h + hh) * t + i) * d..][..d];
                    let sc: Vec<f64> = (0..cap)
                        .map(|j| {
                            if open(r, j) {
                                (0..d).map(|e| qi[e] as f64 * kv[plane + j * d + e] as f64).sum()
                            } else {
                                f64::NEG_INFINITY
                            }
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                    let z: f64 = w.iter().sum();
                    for e in 0..d {
                        let o: f64 =
                            (0..cap).map(|j| w[j] * vv[plane + j * d + e] as f64).sum::<f64>() / z;
                        want[(r * t + i) * h * d + hh * d + e] = o as f32;
                    }
                }
            }
        }
        for (what, got) in [
            ("pool_attention", pool_attention(&q, &pk, &pv, &rows_t, &mask)),
            ("in place", pool_attention_in_place(&q, &pk, &pv, &rows_t, &mask)),
            ("its twin", pool_attention_ops(&q, &pk, &pv, &rows_t, &mask)),
        ] {
            let got = got.unwrap();
            assert_eq!(got.dims(), [n, t, h * d], "{what} {dt:?}: shape");
            assert_near(&format!("{what} in {dt:?}"), &vals(&got), &want, tol);
        }
    }
}

/// `masked_softmax` (the op-by-op attention's, a warp a row on CUDA for rows up to
/// `MASKED_SOFTMAX_WARP_ROW`, a block a row beyond) is the softmax of the scores plus each row's
/// mask, written out in f64: rows of the DiT's length at B32 (480), one not a multiple of 32, one
/// past the warp's reach, masks with holes and a masked prefix, a row count that is not a whole
/// block of rows.
#[test]
fn masked_softmax_is_the_softmax_of_the_scores_plus_the_mask() {
    use antiphon_models::code2wav::dit_ops::{masked_softmax, MASKED_SOFTMAX_WARP_ROW};
    let dev = device();
    for l in [480usize, 37, MASKED_SOFTMAX_WARP_ROW, MASKED_SOFTMAX_WARP_ROW + 76] {
        let (n, h, t) = (3usize, 2usize, 5usize);
        let open = |r: usize, j: usize| match r {
            0 => true,
            1 => !j.is_multiple_of(3),
            _ => j >= l / 2,
        };
        let m: Vec<f32> = (0..n)
            .flat_map(|r| (0..l).map(move |j| if open(r, j) { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        // (bf16: on the CPU the twin's softmax sums in bf16; our kernels sum in f32)
        let bf16_tol = if dev.is_cpu() { 1e-1 } else { 8e-3 };
        for (dt, tol) in [(DType::F32, 1e-5f32), (DType::BF16, bf16_tol)] {
            let att = (Tensor::randn(0f32, 3.0, (n, h, t, l), dev).unwrap()).to_dtype(dt).unwrap();
            let mask =
                Tensor::from_vec(m.clone(), (n, 1, 1, l), dev).unwrap().to_dtype(dt).unwrap();
            let a = flat(&att.to_dtype(DType::F32).unwrap());
            let mut want = vec![0f32; n * h * t * l];
            for (i, row) in a.chunks(l).enumerate() {
                let r = i / (h * t);
                let s: Vec<f64> = row
                    .iter()
                    .enumerate()
                    .map(|(j, v)| if open(r, j) { *v as f64 } else { f64::NEG_INFINITY })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|v| (v - mx).exp()).sum();
                for (j, v) in s.iter().enumerate() {
                    want[i * l + j] = ((v - mx).exp() / z) as f32;
                }
            }
            let got = masked_softmax(&att, &mask).unwrap();
            assert_eq!(got.dims(), [n, h, t, l]);
            assert_near(
                &format!("masked_softmax, rows of {l}, {dt:?}"),
                &flat(&got.to_dtype(DType::F32).unwrap()),
                &want,
                tol,
            );
        }
    }
    // a mask of another shape is refused
    let att = Tensor::zeros((2, 1, 1, 8), DType::F32, dev).unwrap();
    assert!(masked_softmax(&att, &Tensor::zeros((2, 1, 1, 7), DType::F32, dev).unwrap()).is_err());
}

/// `causal_im2col` reads a conv's two cached frames where they lie in the DiT's conv cache
/// (`[N, 2, 2C]`: conv 1's channels, then conv 2's) and gives each frame with the two before it,
/// written out by hand: both halves, without a tail, channels in 16-byte pieces (the kernel's
/// vector path) and not (its scalar path), f32 and bf16 (a copy: exact); a tail the channels do
/// not fit is refused.
#[test]
fn causal_im2col_reads_each_convs_tail_in_place() {
    use antiphon_models::code2wav::dit_ops::causal_im2col;
    let dev = device();
    for c in [16usize, 5] {
        let (n, t) = (3usize, 4usize);
        let x: Vec<f32> = (0..n * t * c).map(|i| i as f32).collect();
        let cache: Vec<f32> = (0..n * 2 * 2 * c).map(|i| -1.0 - i as f32).collect();
        for dt in [DType::F32, DType::BF16] {
            let xt = Tensor::from_vec(x.clone(), (n, t, c), dev).unwrap().to_dtype(dt).unwrap();
            let ct =
                Tensor::from_vec(cache.clone(), (n, 2, 2 * c), dev).unwrap().to_dtype(dt).unwrap();
            let (xs, cs) =
                (flat(&xt.to_dtype(DType::F32).unwrap()), flat(&ct.to_dtype(DType::F32).unwrap()));
            for off in [None, Some(0), Some(c)] {
                let mut want = Vec::with_capacity(n * t * 3 * c);
                for b in 0..n {
                    for f in 0..t {
                        for k in 0..3 {
                            for ch in 0..c {
                                let j = f as isize + k as isize - 2;
                                want.push(match (j, off) {
                                    (j, _) if j >= 0 => xs[(b * t + j as usize) * c + ch],
                                    (_, None) => 0.0,
                                    (j, Some(o)) => cs[(b * 2 + (2 + j) as usize) * 2 * c + o + ch],
                                });
                            }
                        }
                    }
                }
                let got = causal_im2col(&xt, off.map(|o| (&ct, o))).unwrap();
                assert_eq!(got.dims(), [n, t, 3 * c]);
                assert_eq!(
                    flat(&got.to_dtype(DType::F32).unwrap()),
                    want,
                    "C {c}, {dt:?}, tail from channel {off:?}"
                );
            }
            assert!(causal_im2col(&xt, Some((&ct, c + 1))).is_err(), "past the cache's channels");
        }
    }
}
