//! Numerical parity of the Thinker and the Talker with the reference implementations
//! (transformers' Qwen3ForCausalLM, WhisperEncoder, LlamaModel, and the Talker's modules in plain
//! torch), through the real checkpoint loader. Fixtures: `tests/parity/make_lm_fixtures.py`.

use crate::common;

use std::collections::HashMap;

use antiphon_assets::checkpoint::{load_models, Checkpoint};
use antiphon_models::decoder::{CachePool, DecodeMode, KvCache, StreamStep};
use antiphon_models::mel::WhisperLogMel;
use antiphon_models::talker::{ConditionMode, Talker};
use antiphon_models::thinker::{AudioMarkers, Thinker};
use candle_core::{DType, Tensor};
use common::{assert_close, ids, load_io, load_meta};

mod attention;
mod talker;

const TOL: f32 = 1e-4;
const FIX: &str = "parity_lm";

fn models() -> (Thinker, Talker) {
    let ck = Checkpoint::open(&common::fixture_dir(FIX)).expect("open the fixture checkpoint");
    ck.load_models(DType::F32, &common::device()).expect("load through the real loader")
}

/// The fixture tokenizer's audio markers (the placeholder is its `<unk>`).
fn markers(meta: &serde_json::Value) -> AudioMarkers {
    AudioMarkers {
        start: meta["audio_start"].as_u64().unwrap() as u32,
        end: meta["audio_end"].as_u64().unwrap() as u32,
        placeholder: meta["unk"].as_u64().unwrap() as u32,
    }
}

fn samples(t: &Tensor) -> Vec<f32> {
    t.to_vec1::<f32>().unwrap()
}

#[test]
fn parity_thinker_log_mel() {
    let io = load_io(FIX);
    let mel = WhisperLogMel::new(80);
    let (m, frames) = mel.compute(&samples(&io["clip"]));
    let got = Tensor::from_vec(m, (80, frames), &common::device()).unwrap();
    assert_close("whisper log-mel", &got, &io["clip_mel"], TOL);
}

#[test]
fn parity_thinker_encoder_whole_clip() {
    let io = load_io(FIX);
    let (thinker, _) = models();
    let mel = thinker.log_mel(&samples(&io["clip"])).unwrap();
    let enc = thinker.apm.forward_clip(&mel).unwrap();
    assert_close("encoder output", &enc, &io["clip_encoder"], TOL);
    let emb = thinker.encode_clip(&samples(&io["clip"])).unwrap();
    assert_close("projected + pooled embeddings", &emb, &io["clip_embeds"], TOL);
    assert_eq!(emb.dim(0).unwrap(), thinker.audio_embeddings_for(io["clip"].dim(0).unwrap()));
    // as the server hears a reference of the graphed length: over fixed buffers (a CUDA graph from
    // the second run on a GPU), every run the reference's numbers
    let mut thinker = thinker;
    thinker.set_clip_graphs(Some(io["clip"].dim(0).unwrap()));
    for run in 0..3 {
        let again = thinker.encode_clip(&samples(&io["clip"])).unwrap();
        assert_close(&format!("graphed clip, run {run}"), &again, &io["clip_embeds"], TOL);
    }
    // a shorter clip than the graphed length (a reference voice under 6 s) is encoded padded to
    // it with the padding masked out: still the reference's numbers, and as many embeddings
    let n = io["clip"].dim(0).unwrap();
    thinker.set_clip_graphs(Some(n + 2 * 1600 + 480));
    for run in 0..3 {
        let padded = thinker.encode_clip(&samples(&io["clip"])).unwrap();
        assert_close(
            &format!("clip padded to a longer graph, run {run}"),
            &padded,
            &io["clip_embeds"],
            TOL,
        );
    }
    let enc = thinker.apm.forward_clip(&mel).unwrap();
    assert_close("encoder output after the padded runs", &enc, &io["clip_encoder"], TOL);
    // an odd number of frames (conv2's last window reaches past the clip) against its own shapes
    let odd = &samples(&io["clip"])[..n - 100];
    let (mut alone, _) = models();
    alone.set_clip_graphs(None);
    let want = alone.encode_clip(odd).unwrap();
    assert_eq!(want.dim(0).unwrap(), alone.audio_embeddings_for(odd.len()));
    assert_close("odd-length clip, padded", &thinker.encode_clip(odd).unwrap(), &want, TOL);
    // a burst of references heard together (padded to a batch of 4, one graph): each what it
    // gets alone
    let clip = samples(&io["clip"]);
    for run in 0..3 {
        let got = thinker.encode_clips(&[&clip, odd, &clip]).unwrap();
        assert_eq!(got.len(), 3);
        assert_close(&format!("burst, clip 0, run {run}"), &got[0], &io["clip_embeds"], TOL);
        assert_close(&format!("burst, odd clip, run {run}"), &got[1], &want, TOL);
        assert_close(&format!("burst, clip 2, run {run}"), &got[2], &io["clip_embeds"], TOL);
    }
}

#[test]
fn parity_thinker_encoder_streaming_units() {
    let io = load_io(FIX);
    let (thinker, _) = models();
    let mut cache = thinker.apm.new_cache();
    for k in 0..4 {
        let unit = samples(&io[&format!("unit{k}")]);
        let mel = thinker.log_mel(&unit).unwrap();
        let mut steps = [antiphon_models::whisper::EncoderStep { cache: Some(&mut cache), mel }];
        let enc = thinker.apm.forward(&mut steps).unwrap().pop().unwrap();
        assert_close(
            &format!("unit {k} encoder output"),
            &enc,
            &io[&format!("unit{k}_encoder")],
            TOL,
        );
        let emb = thinker.project(&enc).unwrap();
        assert_close(&format!("unit {k} embeddings"), &emb, &io[&format!("unit{k}_embeds")], TOL);
        assert_eq!(emb.dim(0).unwrap(), 10, "10 embeddings per second");
    }
    // 150 positions max: unit 2 started a fresh cache, unit 3 continued it.
    assert_eq!(cache.len(), 100);
    // The batched entry point with the same units from a fresh cache gives the same rows.
    let mut cache2 = thinker.apm.new_cache();
    for k in 0..4 {
        let unit = samples(&io[&format!("unit{k}")]);
        let emb = thinker.encode_units(&mut [(&mut cache2, &unit[..])]).unwrap().pop().unwrap();
        assert_close(
            &format!("unit {k} via encode_units"),
            &emb,
            &io[&format!("unit{k}_embeds")],
            TOL,
        );
    }
}

#[test]
fn parity_thinker_llm_prefill_with_spliced_audio() {
    let io = load_io(FIX);
    let meta = load_meta(FIX);
    let (thinker, _) = models();
    let markers = markers(&meta);
    let prompt = ids(&meta["llm_audio_ids"]);
    let audio = thinker.encode_clip(&samples(&io["clip"])).unwrap();
    let embeds = thinker.embed_with_audio(&prompt, &markers, &[audio]).unwrap();
    let mut cache = thinker.llm.new_cache();
    let hidden = thinker
        .llm
        .forward(&mut [StreamStep { cache: &mut cache, embeds }])
        .unwrap()
        .pop()
        .unwrap();
    assert_close("llm hidden (after final norm)", &hidden, &io["llm_audio_hidden"], TOL);
    let logits = thinker.llm.logits(&hidden).unwrap();
    assert_close("llm logits", &logits, &io["llm_audio_logits"], TOL);
    // A wrong number of audio rows is refused, naming the mismatch.
    let short = thinker
        .encode_units(&mut [(&mut thinker.apm.new_cache(), &vec![0f32; 16000][..])])
        .unwrap();
    let err = thinker.embed_with_audio(&prompt, &markers, &short).unwrap_err().to_string();
    assert!(err.contains("placeholders"), "{err}");
}

/// A prompt's embeddings from any position are the whole prompt's from there, asking only for the
/// audio runs that reach past it; a clip's rows are known before it is encoded, windows included.
#[test]
fn prompt_embeddings_from_a_held_prefix_match_the_whole() {
    let meta = load_meta(FIX);
    let (thinker, _) = models();
    let markers = markers(&meta);
    let window = thinker.apm.config().max_source_positions * 2 * WhisperLogMel::HOP;
    for n in [100, 16_000, window, window + 3_000] {
        let clip: Vec<f32> = (0..n).map(|i| 0.2 * (i as f32 * 0.01).sin()).collect();
        assert_eq!(
            thinker.encode_clip(&clip).unwrap().dim(0).unwrap(),
            thinker.clip_embeddings_for(n),
            "{n} samples"
        );
    }
    let clips: Vec<Tensor> =
        [20_000, 12_000].iter().map(|&n| thinker.encode_clip(&vec![0.1f32; n]).unwrap()).collect();
    let mut prompt = vec![5, 6, markers.start];
    prompt.extend(std::iter::repeat_n(markers.placeholder, clips[0].dim(0).unwrap()));
    prompt.extend([markers.end, 7, markers.start]);
    prompt.extend(std::iter::repeat_n(markers.placeholder, clips[1].dim(0).unwrap()));
    prompt.extend([markers.end, 8, 9]);
    let whole = thinker.embed_with_audio(&prompt, &markers, &clips).unwrap();
    for from in [0, 1, 3, 5, 3 + clips[0].dim(0).unwrap() + 2, prompt.len() - 1] {
        let mut asked = Vec::new();
        let mut audio = |k: usize| {
            asked.push(k);
            Ok(clips[k].clone())
        };
        let part = thinker.embed_with_audio_from(&prompt, &markers, from, &mut audio).unwrap();
        assert_close(
            &format!("from {from}"),
            &part,
            &whole.narrow(0, from, prompt.len() - from).unwrap(),
            0.0,
        );
        let past: Vec<usize> = (0..2)
            .filter(|&k| {
                if k == 0 {
                    from < 3 + clips[0].dim(0).unwrap()
                } else {
                    from < prompt.len() - 3
                }
            })
            .collect();
        assert_eq!(asked, past, "from {from}");
    }
}

#[test]
fn parity_thinker_llm_chunked_prefill_then_decode() {
    thinker_chunked_prefill_then_decode(DecodeMode::Eager);
}

/// The one-token steps over fixed-address buffers (on CUDA: captured graphs, replayed).
#[test]
fn parity_thinker_llm_decode_static_and_graph() {
    thinker_chunked_prefill_then_decode(DecodeMode::Static);
    thinker_chunked_prefill_then_decode(DecodeMode::Graph);
}

fn thinker_chunked_prefill_then_decode(mode: DecodeMode) {
    let io = load_io(FIX);
    let meta = load_meta(FIX);
    let (mut thinker, _) = models();
    thinker.llm.set_decode_mode(mode);
    let tids = ids(&meta["llm_text_ids"]);
    let mut cache = thinker.llm.new_cache();
    let mut rows = Vec::new();
    // prefill 10, a chunk of 5, then one token at a time
    let mut pos = 0;
    for n in [10usize, 5].into_iter().chain(std::iter::repeat_n(1, tids.len() - 15)) {
        let embeds = thinker.llm.embed(&tids[pos..pos + n]).unwrap();
        rows.push(
            thinker
                .llm
                .forward(&mut [StreamStep { cache: &mut cache, embeds }])
                .unwrap()
                .pop()
                .unwrap(),
        );
        pos += n;
    }
    assert_eq!(cache.len(), tids.len());
    let hidden = Tensor::cat(&rows, 0).unwrap();
    assert_close("incremental hidden", &hidden, &io["llm_text_hidden"], TOL);
    assert_close(
        "incremental logits",
        &thinker.llm.logits(&hidden).unwrap(),
        &io["llm_text_logits"],
        TOL,
    );
}

#[test]
fn parity_thinker_batched_streams_match_single() {
    let io = load_io(FIX);
    let meta = load_meta(FIX);
    let (thinker, _) = models();
    let tids = ids(&meta["llm_text_ids"]);
    // Three streams at different lengths: prefixes of 4, 9 and 13 tokens, then each decodes the
    // rest of the sequence together, one token per step (stream 0 also gets a 3-token chunk).
    let starts = [4usize, 9, 13];
    let llm = &thinker.llm;
    let mut caches: Vec<KvCache> = starts.iter().map(|_| llm.new_cache()).collect();
    let mut got: Vec<Vec<Tensor>> = vec![vec![]; 3];
    {
        let mut steps: Vec<StreamStep> = caches
            .iter_mut()
            .zip(starts)
            .map(|(c, s)| StreamStep { cache: c, embeds: llm.embed(&tids[..s]).unwrap() })
            .collect();
        for (i, h) in llm.forward(&mut steps).unwrap().into_iter().enumerate() {
            got[i].push(h);
        }
    }
    let mut pos = starts;
    while pos.iter().any(|&p| p < tids.len()) {
        let mut steps = Vec::new();
        let mut who = Vec::new();
        for (i, c) in caches.iter_mut().enumerate() {
            if pos[i] >= tids.len() {
                continue;
            }
            let n = if i == 0 && pos[i] == 4 { 3 } else { 1 };
            steps.push(StreamStep {
                cache: c,
                embeds: llm.embed(&tids[pos[i]..pos[i] + n]).unwrap(),
            });
            who.push((i, n));
        }
        for ((i, n), h) in who.into_iter().zip(llm.forward(&mut steps).unwrap()) {
            got[i].push(h);
            pos[i] += n;
        }
    }
    for (i, rows) in got.iter().enumerate() {
        let h = Tensor::cat(rows, 0).unwrap();
        assert_close(&format!("stream {i} batched vs reference"), &h, &io["llm_text_hidden"], TOL);
        // and against the same stream stepped alone
        let mut alone = llm.new_cache();
        let single = llm
            .forward(&mut [StreamStep { cache: &mut alone, embeds: llm.embed(&tids).unwrap() }])
            .unwrap()
            .pop()
            .unwrap();
        assert_close(&format!("stream {i} batched vs alone"), &h, &single, 1e-5);
    }
}

/// Static/graph one-token steps against op-by-op ones past a capacity growth (64 -> 128
/// positions), with a batched step and a truncation in between: the same rows.
#[test]
fn thinker_graph_decode_across_growth_batching_and_truncation() {
    let meta = load_meta(FIX);
    let tids = ids(&meta["llm_text_ids"]);
    let seq: Vec<u32> = tids.iter().cycle().take(80).copied().collect();
    let run = |mode: DecodeMode| -> Vec<Tensor> {
        let (mut thinker, _) = models();
        thinker.llm.set_decode_mode(mode);
        let llm = &thinker.llm;
        let (mut a, mut b) = (llm.new_cache(), llm.new_cache());
        let mut out = vec![];
        let step = |c: &mut KvCache, ids: &[u32]| {
            llm.forward(&mut [StreamStep { cache: c, embeds: llm.embed(ids).unwrap() }])
                .unwrap()
                .pop()
                .unwrap()
        };
        out.push(step(&mut a, &seq[..58]));
        out.push(step(&mut b, &seq[..5]));
        for p in 58..62 {
            out.push(step(&mut a, &seq[p..p + 1]));
        }
        // a batched step of both streams (op by op in every mode), then alone again
        let mut both = [
            StreamStep { cache: &mut a, embeds: llm.embed(&seq[62..63]).unwrap() },
            StreamStep { cache: &mut b, embeds: llm.embed(&seq[5..6]).unwrap() },
        ];
        out.extend(llm.forward(&mut both).unwrap());
        // drop two positions and write them again, then run past the first capacity (64)
        a.truncate(61);
        for p in 61..75 {
            out.push(step(&mut a, &seq[p..p + 1]));
        }
        out.push(step(&mut b, &seq[6..7]));
        out
    };
    let eager = run(DecodeMode::Eager);
    for mode in [DecodeMode::Static, DecodeMode::Graph] {
        let got = run(mode);
        assert_eq!(got.len(), eager.len());
        for (i, (g, e)) in got.iter().zip(&eager).enumerate() {
            assert_close(&format!("{mode:?} row {i}"), g, e, 1e-5);
        }
    }
}

/// A stream that starts in a pooled cache (stale positions from its predecessor, the same
/// buffers, the same static step / graph) decodes exactly like one in a fresh cache, including a
/// prompt prefix loaded into it.
#[test]
fn pooled_caches_carry_their_decode_step_to_the_next_stream() {
    let meta = load_meta(FIX);
    let tids = ids(&meta["llm_text_ids"]);
    let seq: Vec<u32> = tids.iter().cycle().take(60).copied().collect();
    let other: Vec<u32> = seq.iter().rev().copied().collect();
    for mode in [DecodeMode::Static, DecodeMode::Graph] {
        let (mut thinker, _) = models();
        thinker.llm.set_decode_mode(mode);
        let llm = &thinker.llm;
        let step = |c: &mut KvCache, ids: &[u32]| {
            llm.forward(&mut [StreamStep { cache: c, embeds: llm.embed(ids).unwrap() }])
                .unwrap()
                .pop()
                .unwrap()
        };
        let decode = |c: &mut KvCache, ids: &[u32], from: usize, to: usize| -> Vec<Tensor> {
            (from..to).map(|p| step(c, &ids[p..p + 1])).collect()
        };
        // the truth: fresh caches, op by op
        let (mut eager, _) = models();
        eager.llm.set_decode_mode(DecodeMode::Eager);
        let want = {
            let e = &eager.llm;
            let mut c = e.new_cache();
            e.forward(&mut [StreamStep { cache: &mut c, embeds: e.embed(&seq[..30]).unwrap() }])
                .unwrap();
            (30..40)
                .map(|p| {
                    e.forward(&mut [StreamStep {
                        cache: &mut c,
                        embeds: e.embed(&seq[p..p + 1]).unwrap(),
                    }])
                    .unwrap()
                    .pop()
                    .unwrap()
                })
                .collect::<Vec<_>>()
        };
        let pool = CachePool::new(2);
        let dec = llm.decoder();
        // stream 1 fills the cache with other tokens and leaves
        {
            let mut c = pool.take(dec, 100).unwrap();
            assert!(c.capacity() >= 100 && c.is_empty());
            step(&mut c, &other[..20]);
            decode(&mut c, &other, 20, 45);
        }
        assert_eq!(pool.idle(), 1, "{mode:?}: the finished stream's cache is back in the pool");
        // stream 2 starts in it from a cached prefix (20 positions), prefills 10, decodes 10
        let mut prefix = llm.new_cache();
        step(&mut prefix, &seq[..20]);
        let mut c = pool.take(dec, 100).unwrap();
        assert_eq!(pool.idle(), 0);
        let before = c.decode_step_capacity();
        assert_eq!(
            before,
            Some(c.capacity()),
            "{mode:?}: the predecessor's decode step came with the cache"
        );
        c.load_prefix(&prefix, 20).unwrap();
        assert_eq!(c.len(), 20);
        step(&mut c, &seq[20..30]);
        let got = decode(&mut c, &seq, 30, 40);
        assert_eq!(c.decode_step_capacity(), before, "{mode:?}: no new decode step");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(&format!("{mode:?} pooled row {i}"), g, w, 1e-5);
        }
    }
}

/// Streams in slots of a pool, stepped in batches of 3, 2 and 1 (batched decode step, captured per
/// batch size on CUDA), with a step that mixes one stream's prefill into the others' decode and
/// a slot handed back and taken again: every row equals the stream decoded alone, op by op.
#[test]
fn slot_pool_batched_decode_matches_streams_alone() {
    let meta = load_meta(FIX);
    let tids = ids(&meta["llm_text_ids"]);
    let seq: Vec<u32> = tids.iter().cycle().take(60).copied().collect();
    let prompts = [&seq[..7], &seq[3..23], &seq[10..43]];
    let (mut eager, _) = models();
    eager.llm.set_decode_mode(DecodeMode::Eager);
    let alone: Vec<Vec<Tensor>> = prompts
        .iter()
        .map(|p| {
            let llm = &eager.llm;
            let mut c = llm.new_cache();
            let mut rows = vec![llm
                .forward(&mut [StreamStep { cache: &mut c, embeds: llm.embed(p).unwrap() }])
                .unwrap()
                .pop()
                .unwrap()];
            for t in 0..6 {
                rows.push(
                    llm.forward(&mut [StreamStep {
                        cache: &mut c,
                        embeds: llm.embed(&seq[t..t + 1]).unwrap(),
                    }])
                    .unwrap()
                    .pop()
                    .unwrap(),
                );
            }
            rows
        })
        .collect();
    // (with prompt rows in a bucket's step of up to 32 rows: the first step's 27 prompt rows go
    // through it, the second's 35 rows do not fit and run as the ragged step)
    for (mode, graph_rows) in
        [(DecodeMode::Static, 0), (DecodeMode::Graph, 0), (DecodeMode::Graph, 32)]
    {
        let (mut thinker, _) = models();
        thinker.llm.set_decode_mode(mode);
        thinker.llm.set_prefill_graph_rows(graph_rows);
        // (the default on CUDA; on the CPU it is off, and on here so that the CPU checks it too)
        thinker.llm.set_ragged_prefill(true);
        let llm = &thinker.llm;
        let pool = llm.decoder().slot_pool(3, 64).unwrap();
        // (what capacity from memory counts a stream's slot as: three and the scratch slot)
        assert_eq!(pool.bytes(), 4 * llm.decoder().slot_bytes(64));
        {
            let lease = pool.take().unwrap().expect("a free slot");
            assert_eq!(pool.free(), 2);
            drop(lease);
            assert_eq!(pool.free(), 3, "a dropped cache hands its slot back");
        }
        let mut c: Vec<KvCache> =
            (0..3).map(|_| pool.take().unwrap().expect("a free slot")).collect();
        assert!(pool.take().unwrap().is_none(), "every slot is taken");
        let mut got: Vec<Vec<Tensor>> = vec![vec![]; 3];
        // streams 0 and 1 prefill in one step (one ragged batch of 7 + 20 rows); then stream 2
        // prefills in the same step as their first decode
        {
            let (a, b) = c.split_at_mut(1);
            let rows = llm
                .forward(&mut [
                    StreamStep { cache: &mut a[0], embeds: llm.embed(prompts[0]).unwrap() },
                    StreamStep { cache: &mut b[0], embeds: llm.embed(prompts[1]).unwrap() },
                ])
                .unwrap();
            for (i, r) in rows.into_iter().enumerate() {
                got[i].push(r);
            }
        }
        assert_eq!(
            pool.buckets().contains(&32),
            graph_rows == 32,
            "{mode:?}, {graph_rows} graph rows: buckets {:?}",
            pool.buckets()
        );
        let (a, rest) = c.split_at_mut(1);
        let (b, cc) = rest.split_at_mut(1);
        let mixed = llm
            .forward(&mut [
                StreamStep { cache: &mut a[0], embeds: llm.embed(&seq[0..1]).unwrap() },
                StreamStep { cache: &mut b[0], embeds: llm.embed(&seq[0..1]).unwrap() },
                StreamStep { cache: &mut cc[0], embeds: llm.embed(prompts[2]).unwrap() },
            ])
            .unwrap();
        for (i, r) in mixed.into_iter().enumerate() {
            got[i].push(r);
        }
        // stream 2's first decode position is 0; streams 0 and 1 are at 1: three batched steps
        // of all three streams at different positions, then two, then one
        let mut next = [1usize, 1, 0];
        for who in [&[0usize, 1, 2][..], &[0, 1, 2], &[0, 1, 2], &[1, 2], &[2]] {
            let mut steps: Vec<StreamStep> = Vec::new();
            for (i, cache) in c.iter_mut().enumerate() {
                if who.contains(&i) {
                    steps.push(StreamStep {
                        cache,
                        embeds: llm.embed(&seq[next[i]..next[i] + 1]).unwrap(),
                    });
                }
            }
            let rows = llm.forward(&mut steps).unwrap();
            for (&i, r) in who.iter().zip(rows) {
                got[i].push(r);
                next[i] += 1;
            }
        }
        for (i, (g, want)) in got.iter().zip(&alone).enumerate() {
            for (k, row) in g.iter().enumerate() {
                let what = format!("{mode:?} ({graph_rows} graph rows) stream {i} row {k}");
                assert_close(&what, row, &want[k], 1e-5);
            }
        }
    }
}

/// Each row's best logits found on the test device (a kernel of ours on CUDA) are what the host
/// twin finds in the same rows: ids, values and order, ties (coarse values) to the larger id.
#[test]
fn top_k_on_the_device_matches_the_host_twin() {
    use antiphon_models::top_k::{top_k_host, Logits, TOP_K};
    let dev = common::device();
    for (n, v, dtype) in [(7, 151_936, DType::BF16), (3, 6562, DType::F32), (2, 10, DType::BF16)] {
        let data: Vec<f32> =
            (0..n * v).map(|i| ((i * 7919 % 997) as f32 / 8.0).floor() - 40.0).collect();
        let t = Tensor::from_vec(data, (n, v), &dev).unwrap().to_dtype(dtype).unwrap();
        let logits = Logits::new(t.clone(), TOP_K).unwrap();
        let rows = t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        for (i, r) in rows.iter().enumerate() {
            let want = top_k_host(r, TOP_K.min(v));
            assert_eq!(logits.row(i).top(), &want[..], "{n}×{v} {dtype:?}, row {i}");
            assert!(want.iter().all(|(_, x)| x.is_finite()));
        }
    }
}

/// Idle caches stay within their pool's byte budget: the largest go first, and a cache larger
/// than the whole budget is freed when its stream ends.
#[test]
fn idle_caches_stay_within_the_byte_budget() {
    let (thinker, _) = models();
    let dec = thinker.llm.decoder();
    let one = dec.cache_with_capacity(64).unwrap().bytes();
    let pool = CachePool::with_budget(8, 64, 3 * one);
    {
        let caches: Vec<_> =
            [64, 64, 128, 64].iter().map(|&n| pool.take(dec, n).unwrap()).collect();
        assert_eq!(caches[2].bytes(), 2 * one);
    }
    // 1 + 1 + 2 + 1 units came back to a budget of 3: the 128-position cache went
    assert_eq!((pool.idle(), pool.idle_bytes()), (3, 3 * one));
    drop(pool.take(dec, 64 * 4).unwrap());
    assert_eq!(pool.idle_bytes(), 3 * one, "a cache larger than the budget is not kept");
}
