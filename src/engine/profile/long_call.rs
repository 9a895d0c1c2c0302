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
/// Where each stream decodes (turn ~85 of such a conversation), or the last whole 1024 positions
/// before a smaller model's context ends (its turn and the decode row after it fit).
const LATE_POSITION: usize = 8192;
/// Positions a prefill step writes while the caches fill up.
const FILL_ROWS: usize = 2048;
/// The largest batch measured: 8 slots of 12288 positions are ~14 GB of a full-size Thinker's KV.
const MAX_BATCH: usize = 8;
/// A new turn's positions in the prefill row (a spoken or text turn of a long call is ~95).
const TURN_ROWS: usize = 96;

/// Times the rows (the decode step, the prefill step; each named with its position) at each of
/// `batches` up to [`MAX_BATCH`] (those wanted, when the model's context holds 1024 positions and
/// a turn).
pub(super) fn time_long_call(
    llm: &Qwen3,
    rows: &mut Rows,
    iters: usize,
    batches: &[usize],
) -> Result<()> {
    // (a profile row's positions, not a request's fit: src/engine/fit.rs has no say here)
    let slot_positions = LONG_SLOT_CONTEXT.min(llm.decoder().config().max_positions);
    let late = LATE_POSITION.min(slot_positions.saturating_sub(TURN_ROWS + 1) / 1024 * 1024);
    let decode_row = format!("thinker decode step (slots, graph) at position {late} + ids to host");
    let prefill_row = format!(
        "thinker prefill step in slots: b prompts x {TURN_ROWS} positions at position {late} \
        + logits"
    );
    if late == 0 || !(rows.wants(&decode_row) || rows.wants(&prefill_row)) {
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
        let pool = g.decoder().slot_pool(b, slot_positions)?;
        g.decoder().warm_pool(&pool)?;
        let mut caches: Vec<KvCache> = (0..b)
            .map(|_| pool.take()?.ok_or_else(|| candle_core::Error::Msg("no free slot".into())))
            .collect::<candle_core::Result<_>>()?;
        for c in caches.iter_mut() {
            while c.len() < late {
                let n = FILL_ROWS.min(late - c.len());
                g.forward(&mut [StreamStep { cache: c, embeds: fill.narrow(0, 0, n)? }])?;
            }
        }
        // one step of `embeds` for every stream, each stream's last row to the logits and its id
        // to the host (as the server samples), then every cache back at the late position
        let mut step_and_rewind = |embeds: &Tensor| -> Result<()> {
            let mut steps: Vec<StreamStep> = caches
                .iter_mut()
                .map(|c| StreamStep { cache: c, embeds: embeds.clone() })
                .collect();
            let h = g.forward(&mut steps)?;
            let last: Vec<Tensor> = h
                .iter()
                .map(|x| x.narrow(0, x.dim(0)? - 1, 1))
                .collect::<candle_core::Result<_>>()?;
            std::hint::black_box(super::greedy_ids(&g.logits(&Tensor::cat(&last, 0)?)?)?);
            for c in caches.iter_mut() {
                c.truncate(late);
            }
            Ok(())
        };
        rows.time(&decode_row, b, iters, || step_and_rewind(&tok))?;
        let turn = fill.narrow(0, 0, TURN_ROWS)?;
        rows.time(&prefill_row, b, iters, || step_and_rewind(&turn))?;
    }
    Ok(())
}
