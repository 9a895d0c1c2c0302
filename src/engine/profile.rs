//! `antiphon profile`: each stage's step on its own, on the configured device and dimensions —
//! the breakdown behind the bench's end-to-end figures. Every timing ends with a device
//! synchronize; each is the median of `iters` runs after two warm-up runs.

use anyhow::Result;
use candle_core::{DType, Tensor};

use crate::{EngineConfig, Models};
use antiphon_models::code2wav::dit::GraphPolicy;
use antiphon_models::code2wav::prompt::Reference;
use antiphon_models::code2wav::SILENCE_CODE;
use antiphon_models::decoder::{DecodeMode, KvCache, StreamStep};
use antiphon_models::sampling::{Sampler, SamplingParams};
use antiphon_models::top_k::{Logits, TOP_K};
use timing::Rows;
pub use timing::Timing;
use voice::{contended_preparation, prepare_parts};

mod long_call;
mod timing;
mod voice;

/// Positions each Thinker slot holds in the slot rows (a conversation of many turns).
const SLOT_CONTEXT: usize = 4096;

/// The largest batch of the steady-chunk rows (the GPU configuration's Code2Wav batch).
const MAX_STEADY_BATCH: usize = 64;

/// Each row's argmax, on the device; only the ids come to the host.
fn greedy_ids(logits: &Tensor) -> candle_core::Result<Vec<u32>> {
    logits.argmax_keepdim(1)?.flatten_all()?.to_vec1::<u32>()
}

/// One prefill step of `chunk` for every cache, the last row's hidden state brought to the host
/// (as the server's step reads its logits), then every cache cut back to `prefix` positions for
/// the next iteration.
fn prefill_chunk_step(
    g: &antiphon_models::qwen3::Qwen3,
    caches: &mut [KvCache],
    chunk: &Tensor,
    prefix: usize,
) -> Result<()> {
    let mut steps: Vec<StreamStep> =
        caches.iter_mut().map(|c| StreamStep { cache: c, embeds: chunk.clone() }).collect();
    let h = g.forward(&mut steps)?;
    let last = chunk.dim(0)? - 1;
    std::hint::black_box(h[0].narrow(0, last, 1)?.to_dtype(DType::F32)?.to_vec2::<f32>()?);
    for c in caches.iter_mut() {
        c.truncate(prefix);
    }
    Ok(())
}

/// Runs every measurement; `batches` are the decode batch sizes.
/// Only the rows whose names contain one of `only`'s strings run (all when it is empty).
pub fn run(
    m: &Models,
    ecfg: &EngineConfig,
    iters: usize,
    batches: &[usize],
    reference: (&[f32], u32),
    only: &[String],
) -> Result<Vec<Timing>> {
    let devs = [
        m.thinker.llm.decoder().device().clone(),
        m.talker.decoder().device().clone(),
        m.code2wav.device().clone(),
    ];
    let mut rows = Rows { only, devs: &devs, out: Vec::new() };
    // ---- the Thinker
    let llm = &m.thinker.llm;
    let vocab = m.tokenizer.vocab_size().min(llm.embed(&[0])?.dim(1)?.max(1));
    let prompt: Vec<u32> = (0..200u32).map(|i| (i * 7919) % vocab.max(300) as u32 % 250).collect();
    let prefilled = |n: usize| -> Result<Vec<KvCache>> {
        (0..n)
            .map(|_| {
                let mut c = llm.new_cache();
                llm.forward(&mut [StreamStep { cache: &mut c, embeds: llm.embed(&prompt)? }])?;
                Ok(c)
            })
            .collect()
    };
    rows.time("thinker prefill 200 tokens", 1, iters, || {
        let mut c = llm.new_cache();
        llm.forward(&mut [StreamStep { cache: &mut c, embeds: llm.embed(&prompt)? }])?;
        Ok(())
    })?;
    {
        // what a new voice costs the Thinker before its prefill: the reference heard (the first
        // 6 s at 16 kHz through the audio encoder and its projection)
        let r16 = antiphon_audio::resample(reference.0, reference.1, 16_000)?;
        let clip = &r16[..r16.len().min(6 * 16_000)];
        rows.time("thinker encode the reference (6 s)", 1, iters, || {
            std::hint::black_box(
                m.thinker.encode_clip(clip)?.to_dtype(DType::F32)?.to_vec2::<f32>()?,
            );
            Ok(())
        })?;
        // as the server hears them: padded to the fixed 6 s, a graph per batch (where the device
        // captures), a burst of new voices together (the row's time is the whole batch's)
        let mut heard = m.thinker.clone();
        heard.set_clip_graphs(Some(6 * 16_000));
        for b in [1, antiphon_models::thinker::CLIP_BATCH] {
            let clips = vec![clip; b];
            rows.time("thinker hear references, graph (server config)", b, iters, || {
                for e in heard.encode_clips(&clips)? {
                    std::hint::black_box(e.to_dtype(DType::F32)?.to_vec2::<f32>()?);
                }
                Ok(())
            })?;
        }
    }
    {
        // a prompt-prefix cache hit as the server serves it: the cached system turn's KV copied,
        // the user turn prefilled, the last row's logits to the host
        let mut prefix = llm.new_cache();
        llm.forward(&mut [StreamStep { cache: &mut prefix, embeds: llm.embed(&prompt[..170])? }])?;
        let turn = llm.embed(&prompt[170..])?;
        rows.time("thinker prefix hit: copy 170 + prefill 30 + logits", 1, iters, || {
            let mut c = prefix.copy_prefix(170, 30 + 40)?;
            let h = llm.forward(&mut [StreamStep { cache: &mut c, embeds: turn.clone() }])?;
            let last = h[0].narrow(0, h[0].dim(0)? - 1, 1)?;
            std::hint::black_box(llm.logits(&last)?.to_dtype(DType::F32)?.to_vec2::<f32>()?);
            Ok(())
        })?;
        rows.time("thinker prefix copy only (170 positions)", 1, iters, || {
            std::hint::black_box(prefix.copy_prefix(170, 30 + 40)?);
            Ok(())
        })?;
    }
    for &b in batches {
        let mut caches = prefilled(b)?;
        let tok = llm.embed(&[42])?;
        rows.time("thinker decode step (forward only)", b, iters, || {
            let mut steps: Vec<StreamStep> =
                caches.iter_mut().map(|c| StreamStep { cache: c, embeds: tok.clone() }).collect();
            llm.forward(&mut steps)?;
            for c in caches.iter_mut() {
                c.truncate(200);
            }
            Ok(())
        })?;
        rows.time("thinker decode step + logits to host", b, iters, || {
            let mut steps: Vec<StreamStep> =
                caches.iter_mut().map(|c| StreamStep { cache: c, embeds: tok.clone() }).collect();
            let h = llm.forward(&mut steps)?;
            let rows: Vec<Tensor> = h
                .iter()
                .map(|x| x.narrow(0, x.dim(0)? - 1, 1))
                .collect::<candle_core::Result<_>>()?;
            let l = llm.logits(&Tensor::cat(&rows, 0)?)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            std::hint::black_box(l);
            for c in caches.iter_mut() {
                c.truncate(200);
            }
            Ok(())
        })?;
    }
    // one stream, one position: the step over fixed buffers, captured as a graph on CUDA
    if batches.contains(&1) {
        let mut g = llm.clone();
        g.set_decode_mode(DecodeMode::Graph);
        let mut c = llm.new_cache();
        g.forward(&mut [StreamStep { cache: &mut c, embeds: llm.embed(&prompt)? }])?;
        let tok = llm.embed(&[42])?;
        rows.time("thinker decode step (graph) + logits to host", 1, iters, || {
            let h = g.forward(&mut [StreamStep { cache: &mut c, embeds: tok.clone() }])?;
            std::hint::black_box(g.logits(&h[0])?.to_dtype(DType::F32)?.to_vec2::<f32>()?);
            c.truncate(200);
            Ok(())
        })?;
    }
    // B streams in slots of a pool, one batched step (a graph per batch size on CUDA), greedy
    // ids to the host: the engine-at-scale decode step
    {
        let mut g = llm.clone();
        g.set_decode_mode(DecodeMode::Graph);
        g.set_ragged_prefill(true);
        for &b in batches {
            let pool =
                g.decoder().slot_pool(b, SLOT_CONTEXT.min(g.decoder().config().max_positions))?;
            g.decoder().warm_pool(&pool)?;
            let mut caches: Vec<KvCache> = (0..b)
                .map(|_| pool.take()?.ok_or_else(|| candle_core::Error::Msg("no free slot".into())))
                .collect::<candle_core::Result<_>>()?;
            for c in caches.iter_mut() {
                g.forward(&mut [StreamStep { cache: c, embeds: llm.embed(&prompt)? }])?;
            }
            let tok = llm.embed(&[42])?;
            rows.time("thinker decode step (slots, graph) + ids to host", b, iters, || {
                let mut steps: Vec<StreamStep> = caches
                    .iter_mut()
                    .map(|c| StreamStep { cache: c, embeds: tok.clone() })
                    .collect();
                let h = g.forward(&mut steps)?;
                std::hint::black_box(greedy_ids(&g.logits(&Tensor::cat(&h, 0)?)?)?);
                for c in caches.iter_mut() {
                    c.truncate(200);
                }
                Ok(())
            })?;
            if b == 1 {
                // a lone stream's whole prompt in its slot, as the server prefills a new voice's
                rows.time(
                    "thinker prefill 200 tokens in a slot (a lone prompt, server path)",
                    1,
                    iters,
                    || {
                        caches[0].truncate(0);
                        let h = g.forward(&mut [StreamStep {
                            cache: &mut caches[0],
                            embeds: llm.embed(&prompt)?,
                        }])?;
                        std::hint::black_box(
                            h[0].narrow(0, 199, 1)?.to_dtype(DType::F32)?.to_vec2::<f32>()?,
                        );
                        Ok(())
                    },
                )?;
            }
            // a prefill step as the server runs it: b prompt chunks of 30 positions, each after a
            // 170-position prefix, in slots (one ragged batch) or in caches of their own (op by
            // op, attention stream by stream)
            let chunk = llm.embed(&prompt[170..])?;
            let mut own: Vec<KvCache> = (0..b).map(|_| llm.new_cache()).collect();
            for (c, o) in caches.iter_mut().zip(own.iter_mut()) {
                c.truncate(170);
                llm.forward(&mut [StreamStep { cache: o, embeds: llm.embed(&prompt[..170])? }])?;
            }
            rows.time(
                "thinker prefill step in slots: b prompts x 30 positions (one batch when b > 1)",
                b,
                iters,
                || prefill_chunk_step(&g, &mut caches, &chunk, 170),
            )?;
            rows.time(
                "thinker prefill step, own caches: b prompts x 30 positions (op by op)",
                b,
                iters,
                || prefill_chunk_step(&g, &mut own, &chunk, 170),
            )?;
            for c in caches.iter_mut() {
                g.forward(&mut [StreamStep { cache: c, embeds: chunk.clone() }])?;
            }
            drop(own);
            // the server's sampling (greedy, presence penalty over the prompt), two ways: every
            // row's logits to the host, or each row's best candidates (top_k.rs)
            let mut samplers: Vec<Sampler> = (0..b)
                .map(|_| {
                    let mut s = Sampler::new(SamplingParams::thinker_greedy(), 0);
                    s.observe(&prompt);
                    s
                })
                .collect();
            rows.time(
                "thinker decode step (slots, graph) + all logits to host, sampled there",
                b,
                iters,
                || {
                    let mut steps: Vec<StreamStep> = caches
                        .iter_mut()
                        .map(|c| StreamStep { cache: c, embeds: tok.clone() })
                        .collect();
                    let h = g.forward(&mut steps)?;
                    let l =
                        g.logits(&Tensor::cat(&h, 0)?)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
                    for (s, row) in samplers.iter_mut().zip(&l) {
                        std::hint::black_box(s.sample(row, &[]));
                    }
                    for c in caches.iter_mut() {
                        c.truncate(200);
                    }
                    Ok(())
                },
            )?;
            rows.time(
                "thinker decode step (slots, graph) + best 16 to host, sampled there (server)",
                b,
                iters,
                || {
                    let mut steps: Vec<StreamStep> = caches
                        .iter_mut()
                        .map(|c| StreamStep { cache: c, embeds: tok.clone() })
                        .collect();
                    let h = g.forward(&mut steps)?;
                    let l = Logits::new(g.logits(&Tensor::cat(&h, 0)?)?, TOP_K)?;
                    for (i, s) in samplers.iter_mut().enumerate() {
                        std::hint::black_box(s.sample_row(&l.row(i), &[])?);
                    }
                    for c in caches.iter_mut() {
                        c.truncate(200);
                    }
                    Ok(())
                },
            )?;
        }
    }
    // the decode and prefill steps late in a long call, over slots that hold the whole conversation
    long_call::time_long_call(llm, &mut rows, iters, batches)?;
    // ---- the Talker
    let talker = &m.talker;
    let hidden = talker.config().hidden_size;
    let cond = Tensor::randn(0f32, 1.0, (40, hidden), talker.decoder().device())?
        .to_dtype(talker.embed_codes(&[0])?.dtype())?;
    if batches.contains(&1) {
        let mut g = talker.clone();
        g.set_decode_mode(DecodeMode::Graph);
        let mut c = talker.new_cache();
        g.forward(&mut [StreamStep { cache: &mut c, embeds: cond.clone() }])?;
        let code = talker.embed_codes(&[17])?;
        rows.time("talker decode step (graph) + logits to host", 1, iters, || {
            let h = g.forward(&mut [StreamStep { cache: &mut c, embeds: code.clone() }])?;
            std::hint::black_box(g.logits(&h[0])?.to_dtype(DType::F32)?.to_vec2::<f32>()?);
            c.truncate(40);
            Ok(())
        })?;
    }
    for &b in batches {
        let mut caches: Vec<KvCache> = (0..b)
            .map(|_| {
                let mut c = talker.new_cache();
                talker.forward(&mut [StreamStep { cache: &mut c, embeds: cond.clone() }])?;
                Ok(c)
            })
            .collect::<Result<_>>()?;
        let code = talker.embed_codes(&[17])?;
        rows.time("talker decode step + logits to host", b, iters, || {
            let mut steps: Vec<StreamStep> =
                caches.iter_mut().map(|c| StreamStep { cache: c, embeds: code.clone() }).collect();
            let h = talker.forward(&mut steps)?;
            let rows: Vec<Tensor> = h
                .iter()
                .map(|x| x.narrow(0, x.dim(0)? - 1, 1))
                .collect::<candle_core::Result<_>>()?;
            std::hint::black_box(
                talker.logits(&Tensor::cat(&rows, 0)?)?.to_dtype(DType::F32)?.to_vec2::<f32>()?,
            );
            for c in caches.iter_mut() {
                c.truncate(40);
            }
            Ok(())
        })?;
    }
    {
        let mut g = talker.clone();
        g.set_decode_mode(DecodeMode::Graph);
        for &b in batches {
            let pool = g.decoder().slot_pool(b, 1024.min(g.decoder().config().max_positions))?;
            g.decoder().warm_pool(&pool)?;
            let mut caches: Vec<KvCache> = (0..b)
                .map(|_| pool.take()?.ok_or_else(|| candle_core::Error::Msg("no free slot".into())))
                .collect::<candle_core::Result<_>>()?;
            for c in caches.iter_mut() {
                g.forward(&mut [StreamStep { cache: c, embeds: cond.clone() }])?;
            }
            let code = talker.embed_codes(&[17])?;
            rows.time("talker decode step (slots, graph) + ids to host", b, iters, || {
                let mut steps: Vec<StreamStep> = caches
                    .iter_mut()
                    .map(|c| StreamStep { cache: c, embeds: code.clone() })
                    .collect();
                let h = g.forward(&mut steps)?;
                std::hint::black_box(greedy_ids(&g.logits(&Tensor::cat(&h, 0)?)?)?);
                for c in caches.iter_mut() {
                    c.truncate(40);
                }
                Ok(())
            })?;
        }
    }
    // ---- Code2Wav
    let mut half = m.code2wav.clone();
    half.set_vocoder_half_columns(ecfg.code2wav.vocoder_half_columns)?;
    let c2w = &half;
    let r = Reference::materialize(reference.0, reference.1)?;
    rows.time("code2wav prepare (S3 codes, CAM++, prompt mel)", 1, iters.min(5), || {
        drop(c2w.prepare(&r)?);
        Ok(())
    })?;
    prepare_parts(&mut rows, c2w, &r, iters.min(5))?;
    let f = c2w.prepare(&r)?;
    rows.time("code2wav setup (flow over the prompt)", 1, iters.min(5), || {
        drop(c2w.setup(&f)?);
        Ok(())
    })?;
    let setup = c2w.setup(&f)?;
    let first: Vec<u32> =
        std::iter::repeat_n(SILENCE_CODE, 3).chain((0..25).map(|i| (i * 97) % 6561)).collect();
    let steady: Vec<u32> = (0..28).map(|i| (i * 131 + 7) % 6561).collect();
    // chunk 0 whole, flow alone, vocoder alone: op by op, then as CUDA graphs (the server's default
    // on a GPU)
    // (graphs and flow slots as the server sets them, with room for the largest batch)
    let steady_max = batches.iter().copied().filter(|&b| b <= MAX_STEADY_BATCH).max().unwrap_or(1);
    let slots = ecfg.code2wav.slots.max(steady_max);
    // (pooled solves captured up to the server's batch, or the largest asked for)
    let pool_batch = ecfg.code2wav.max_batch.max(steady_max).next_power_of_two();
    let mut g2w = c2w.clone();
    g2w.set_graphs(
        Some(GraphPolicy { pool_batch, ..GraphPolicy::default() }),
        Some(crate::device_setup::VOCODER_GRAPHS),
    );
    g2w.set_pool_attention(ecfg.code2wav.pool_attention);
    g2w.set_slots(slots, ecfg.code2wav.slot_frames, ecfg.max_chunk_codes())?;
    rows.time("code2wav setup, graph (server config)", 1, iters.min(5), || {
        drop(g2w.setup(&f)?);
        Ok(())
    })?;
    let mut p2w = c2w.clone();
    p2w.set_pool_attention(ecfg.code2wav.pool_attention);
    p2w.set_slots(slots, ecfg.code2wav.slot_frames, ecfg.max_chunk_codes())?;
    let variants = [
        (
            c2w,
            [
                "code2wav chunk 0 (3 + 25 codes, flow + vocoder)",
                "code2wav chunk 0, flow only (conformer + 10 CFM steps)",
                "code2wav chunk 0, vocoder only (HiFT)",
            ],
        ),
        (
            &g2w,
            [
                "code2wav chunk 0, flow + vocoder as graphs",
                "code2wav chunk 0, flow only (graph)",
                "code2wav chunk 0, vocoder only (graphs)",
            ],
        ),
    ];
    for (c, [whole, flow, vocoder]) in variants {
        rows.time(whole, 1, iters, || {
            c.chunk(&mut c.start(&f, &setup)?, &first, false)?;
            Ok(())
        })?;
        rows.time(flow, 1, iters, || {
            c.flow_chunk(&mut c.start(&f, &setup)?, &first, false)?;
            Ok(())
        })?;
        let mel = c.flow_chunk(&mut c.start(&f, &setup)?, &first, false)?;
        rows.time(vocoder, 1, iters, || {
            c.vocode_chunk(&mut c.start(&f, &setup)?, &mel, false)?;
            Ok(())
        })?;
    }
    eprintln!("(graphs held: flow, vocoder = {:?})", g2w.graphs_held());
    // the small first chunk a lone stream gets in the GPU configuration (3 + 8 codes)
    let small = &first[..11];
    rows.time("code2wav chunk 0 (3 + 8 codes) as graphs", 1, iters, || {
        g2w.chunk(&mut g2w.start(&f, &setup)?, small, false)?;
        Ok(())
    })?;
    // steady chunks of B streams in step (chunk 1 of each): op by op, and as the server runs them
    // (flow graphs up to the default batch, the vocoder's steps as graphs)
    let steady_kinds = [
        (c2w, "code2wav steady chunk (flow + vocoder batched)"),
        (&p2w, "code2wav steady chunk, flow slots op by op"),
        (&g2w, "code2wav steady chunk, graphs (server config)"),
    ];
    let names: Vec<String> = steady_kinds
        .iter()
        .flat_map(|(_, w)| [w.to_string(), format!("{w}: flow only"), format!("{w}: vocoder only")])
        .collect();
    let steady_rows = rows.wants_any(&names);
    for &b in batches.iter().filter(|&&b| b <= MAX_STEADY_BATCH && steady_rows) {
        for (c, what) in steady_kinds {
            let mut streams = (0..b)
                .map(|_| {
                    let mut st = c.start(&f, &setup)?;
                    c.chunk(&mut st, &first, false)?;
                    Ok(st)
                })
                .collect::<Result<Vec<_>>>()?;
            let snapshot = streams.clone();
            let codes: Vec<&[u32]> = (0..b).map(|_| steady.as_slice()).collect();
            rows.time(what, b, iters, || {
                streams = snapshot.clone();
                let mut refs: Vec<_> = streams.iter_mut().collect();
                c.chunk_batch(&mut refs, &codes, false)?;
                Ok(())
            })?;
            // its two parts alone
            rows.time(&format!("{what}: flow only"), b, iters, || {
                streams = snapshot.clone();
                c.flow_batch(&mut streams.iter_mut().collect::<Vec<_>>(), &codes, false)?;
                Ok(())
            })?;
            streams = snapshot.clone();
            let mels = c.flow_batch(&mut streams.iter_mut().collect::<Vec<_>>(), &codes, false)?;
            rows.time(&format!("{what}: vocoder only"), b, iters, || {
                streams = snapshot.clone();
                c.vocode_batch(&mut streams.iter_mut().collect::<Vec<_>>(), &mels, false)?;
                Ok(())
            })?;
        }
    }
    // ---- contention: a Thinker decode step while Code2Wav chunks run on another thread, as in
    // the pipelined server
    const BUSY: &str = "thinker decode + logits, code2wav busy on another thread";
    if rows.wants(BUSY) {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let worker = {
            let (c2w, f, setup, steady, first, stop) = (
                c2w.clone(),
                f.clone(),
                setup.clone(),
                steady.clone(),
                first.clone(),
                stop.clone(),
            );
            std::thread::spawn(move || -> Result<usize> {
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut st = c2w.start(&f, &setup)?;
                    c2w.chunk(&mut st, &first, false)?;
                    c2w.chunk(&mut st, &steady, false)?;
                    n += 2;
                }
                Ok(n)
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(500));
        let mut caches = prefilled(1)?;
        let tok = llm.embed(&[42])?;
        rows.time(BUSY, 1, iters, || {
            let mut steps: Vec<StreamStep> =
                caches.iter_mut().map(|c| StreamStep { cache: c, embeds: tok.clone() }).collect();
            let h = llm.forward(&mut steps)?;
            std::hint::black_box(
                llm.logits(&h[0].narrow(0, 0, 1)?)?.to_dtype(DType::F32)?.to_vec2::<f32>()?,
            );
            for c in caches.iter_mut() {
                c.truncate(200);
            }
            Ok(())
        })?;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let n = worker.join().map_err(|_| anyhow::anyhow!("the code2wav thread panicked"))??;
        eprintln!("(code2wav ran {n} chunks meanwhile)");
    }
    contended_preparation(&mut rows, m, &g2w, &r, &f, ecfg, iters.min(5))?;
    Ok(rows.out)
}
