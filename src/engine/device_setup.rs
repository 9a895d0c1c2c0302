//! The models on their devices, before any stage runs: how many streams the GPU holds
//! (`capacity.rs`), the stream priorities, which steps run as CUDA graphs, and the captures and
//! warm-ups that are done once (the Thinker's reference encoding in every batch size). It runs on
//! the thread that calls [`crate::Engine::start`] (the server: a blocking thread, before it binds).
//! Left to the stages: their batched decode graphs are captured as each stage is made
//! (`caches.rs`), Code2Wav's flow and vocoder graphs at its first voice (`code2wav/start.rs`), and
//! the server sends one request through all stages before it is ready.

use antiphon_models::decoder::DecodeMode;
use antiphon_models::Models;
use anyhow::Result;

use crate::{capacity, chunker, EngineConfig};

/// Shapes of the vocoder's streaming steps kept as CUDA graphs (chunk 0's, the steady chunks', a
/// few last chunks'; each graph holds only small buffers).
pub(crate) const VOCODER_GRAPHS: usize = 64;

/// Sets the models up for `cfg` on their devices (and sizes `cfg`'s streams from memory when it
/// asks for that). Blocking: seconds on a GPU.
pub fn prepare(models: &mut Models, cfg: &mut EngineConfig) -> Result<()> {
    if cfg.streams_from_memory {
        capacity::size_streams_from_memory(models, cfg)?;
    }
    // A capture records everything issued to its stream, from any thread: a stage may capture
    // only when no other stage issues work to the same stream (`streams = "per_stage"`).
    let (d0, d1, d2) = (
        models.thinker.llm.decoder().device().clone(),
        models.talker.decoder().device().clone(),
        models.code2wav.device().clone(),
    );
    let own_stream = |d: &candle_core::Device, others: [&candle_core::Device; 2]| {
        d.is_cuda() && !others.iter().any(|o| d.same_device(o))
    };
    if cfg.stage_priorities {
        // before any capture: the Thinker's and the Talker's graphs go ahead of Code2Wav's
        // (with `talker_first`, the Talker's one level above the Thinker's: a Talker step is
        // ~1-2 ms and makes some stream's next codes)
        let thinker_below = i32::from(cfg.talker_first);
        for (name, d, others, below) in
            [("thinker", &d0, [&d1, &d2], thinker_below), ("talker", &d1, [&d0, &d2], 0)]
        {
            if own_stream(d, others) {
                match antiphon_models::cuda_graph::raise_priority(d, below) {
                    Some(p) => tracing::info!("{name}: graphs run at stream priority {p}"),
                    None => tracing::warn!(
                        "{name}: no stream priorities on this device; its \
                        graphs keep the default one"
                    ),
                }
            }
        }
    }
    if cfg.decode_graphs && own_stream(&d0, [&d1, &d2]) {
        models.thinker.llm.set_decode_mode(DecodeMode::Graph);
        models.thinker.llm.set_prefill_graph_rows(cfg.thinker.prefill_graph_rows);
        models.thinker.llm.set_prefill_graph_raised(cfg.thinker.prefill_graph_raised);
        // the references it hears (cut to 6 s) as a graph, captured now rather than at the
        // second new voice
        let n = (16_000.0 * antiphon_models::code2wav::prompt::PROMPT_SECONDS) as usize;
        models.thinker.set_clip_graphs(Some(n));
        // (and a burst of them, every batch size, heard together)
        let silence = vec![0.0; n];
        let batches =
            (0..).map(|i| 1usize << i).take_while(|&b| b <= antiphon_models::thinker::CLIP_BATCH);
        for b in batches {
            for _ in 0..2 {
                if let Err(e) = models.thinker.encode_clips(&vec![silence.as_slice(); b]) {
                    tracing::warn!(
                        "thinker: reference encoding warm-up ({b} at once) failed: {e:#}"
                    );
                }
            }
        }
    }
    if cfg.decode_graphs && own_stream(&d1, [&d0, &d2]) {
        models.talker.set_decode_mode(DecodeMode::Graph);
        models.talker.set_prefill_graph_rows(cfg.talker.prefill_graph_rows);
        models.talker.set_prefill_graph_raised(cfg.talker.prefill_graph_raised);
    }
    if cfg.gpu_tf32 && [&d0, &d1, &d2].iter().any(|d| d.is_cuda()) {
        candle_core::cuda::set_gemm_reduced_precision_f32(true);
    }
    antiphon_models::attention::set_causal_softmax_kernel(cfg.causal_softmax_kernel);
    antiphon_models::batch_decode::set_decode_attention_teams(cfg.decode_attention_teams);
    if cfg.code2wav.graphs && own_stream(&d2, [&d0, &d1]) {
        let policy = antiphon_models::code2wav::dit::GraphPolicy {
            max_batch: cfg.code2wav.graph_batch,
            max_graphs: cfg.code2wav.graph_count,
            pool_batch: cfg.code2wav.max_batch.next_power_of_two(),
            pool_graphs: cfg.code2wav.pool_graphs,
            ..Default::default()
        };
        models.code2wav.set_graphs(Some(policy), Some(VOCODER_GRAPHS));
        // mixed steps: a step's one solve padded up to a length the warm-up captures (a last
        // chunk of any length rides a held graph)
        if cfg.code2wav.mixed_steps && antiphon_models::cuda_graph::can_capture(&d2) {
            models.code2wav.set_solve_payloads(&chunker::warm_sequences(cfg).concat());
        }
    }
    models.code2wav.set_pool_attention(cfg.code2wav.pool_attention);
    models.code2wav.set_vocoder_half_columns(cfg.code2wav.vocoder_half_columns)?;
    models.code2wav.set_slots(
        cfg.code2wav.slots,
        cfg.code2wav.slot_frames,
        cfg.max_chunk_codes(),
    )?;
    Ok(())
}
