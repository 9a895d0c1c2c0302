//! The Thinker's steps late in a long call, over slots that hold a whole conversation, every
//! stream at the same late position, so that attention reads thousands of held positions a row
//! (issue 44's long calls; the rows of `profile.rs` run at position 200): the batched decode step
//! (a graph per batch size on CUDA), and a prefill step of a new turn's positions (a ragged step,
//! its prompt chunks attending by matrix products), as the server runs them.

use anyhow::Result;
use candle_core::Tensor;

use super::timing::Rows;
use antiphon_models::decoder::{DecodeMode, KvCache, StreamStep};
use antiphon_models::qwen3::Qwen3;

/// Positions each slot holds (a conversation of ~130 turns at ~95 positions a turn).
const LONG_SLOT_CONTEXT: usize = 12288;
/// Where each stream decodes (turn ~85 of such a conversation).
const LATE_POSITION: usize = 8192;
/// Positions a prefill step writes while the caches fill up.
const FILL_ROWS: usize = 2048;
/// The largest batch measured: 8 slots of 12288 positions are ~14 GB of a full-size Thinker's KV.
const MAX_BATCH: usize = 8;
/// A new turn's positions in the prefill row (a spoken or text turn of a long call is ~95).
const TURN_ROWS: usize = 96;

const DECODE_ROW: &str = "thinker decode step (slots, graph) at position 8192 + ids to host";
const PREFILL_ROW: &str =
    "thinker prefill step in slots: b prompts x 96 positions at position 8192 + logits";

/// Times [`DECODE_ROW`] and [`PREFILL_ROW`] at each of `batches` up to [`MAX_BATCH`] (those
/// wanted, when the model's context holds the positions).
pub(super) fn time_long_call(
    llm: &Qwen3,
    rows: &mut Rows,
    iters: usize,
    batches: &[usize],
) -> Result<()> {
    let context = LONG_SLOT_CONTEXT.min(llm.decoder().config().max_positions);
    let wanted = rows.wants(DECODE_ROW) || rows.wants(PREFILL_ROW);
    if !wanted || context <= LATE_POSITION + TURN_ROWS {
        return Ok(());
    }
    let mut g = llm.clone();
    g.set_decode_mode(DecodeMode::Graph);
    g.set_ragged_prefill(true);
    // (ids below 250: every vocabulary holds them)
    let fill: Vec<u32> = (0..FILL_ROWS as u32).map(|i| (i * 7919) % 250).collect();
    let fill = llm.embed(&fill)?;
    let tok = llm.embed(&[42])?;
    for &b in batches.iter().filter(|&&b| b <= MAX_BATCH) {
        let pool = g.decoder().slot_pool(b, context)?;
        g.decoder().warm_pool(&pool)?;
        let mut caches: Vec<KvCache> = (0..b)
            .map(|_| pool.take()?.ok_or_else(|| candle_core::Error::Msg("no free slot".into())))
            .collect::<candle_core::Result<_>>()?;
        for c in caches.iter_mut() {
            while c.len() < LATE_POSITION {
                let n = FILL_ROWS.min(LATE_POSITION - c.len());
                g.forward(&mut [StreamStep { cache: c, embeds: fill.narrow(0, 0, n)? }])?;
            }
        }
        rows.time(DECODE_ROW, b, iters, || {
            let mut steps: Vec<StreamStep> =
                caches.iter_mut().map(|c| StreamStep { cache: c, embeds: tok.clone() }).collect();
            let h = g.forward(&mut steps)?;
            let ids = g.logits(&Tensor::cat(&h, 0)?)?.argmax_keepdim(1)?.flatten_all()?;
            std::hint::black_box(ids.to_vec1::<u32>()?);
            for c in caches.iter_mut() {
                c.truncate(LATE_POSITION);
            }
            Ok(())
        })?;
        let turn = fill.narrow(0, 0, TURN_ROWS)?;
        rows.time(PREFILL_ROW, b, iters, || {
            let mut steps: Vec<StreamStep> =
                caches.iter_mut().map(|c| StreamStep { cache: c, embeds: turn.clone() }).collect();
            let h = g.forward(&mut steps)?;
            // (each prompt's last row to the logits, as the server samples a turn's first token)
            let last: Vec<Tensor> = h
                .iter()
                .map(|x| x.narrow(0, TURN_ROWS - 1, 1))
                .collect::<candle_core::Result<_>>()?;
            let ids = g.logits(&Tensor::cat(&last, 0)?)?.argmax_keepdim(1)?.flatten_all()?;
            std::hint::black_box(ids.to_vec1::<u32>()?);
            for c in caches.iter_mut() {
                c.truncate(LATE_POSITION);
            }
            Ok(())
        })?;
    }
    Ok(())
}
