//! The Thinker's decode step late in a long call: the batched step (a graph per batch size on
//! CUDA) over slots that hold a whole conversation, every stream at the same late position, so
//! that attention reads thousands of held positions a row (issue 44's long calls; the rows of
//! `profile.rs` decode at position 200).

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

const ROW: &str = "thinker decode step (slots, graph) at position 8192 + ids to host";

/// Times [`ROW`] at each of `batches` up to [`MAX_BATCH`] (when the row is wanted and the model's
/// context holds the position).
pub(super) fn time_late_decode(
    llm: &Qwen3,
    rows: &mut Rows,
    iters: usize,
    batches: &[usize],
) -> Result<()> {
    let context = LONG_SLOT_CONTEXT.min(llm.decoder().config().max_positions);
    if !rows.wants(ROW) || context <= LATE_POSITION {
        return Ok(());
    }
    let mut g = llm.clone();
    g.set_decode_mode(DecodeMode::Graph);
    g.set_ragged_prefill(true);
    let vocab = llm.embed(&[0])?.dim(1)?.clamp(2, 250) as u32;
    let fill: Vec<u32> = (0..FILL_ROWS as u32).map(|i| (i * 7919) % vocab).collect();
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
        rows.time(ROW, b, iters, || {
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
    }
    Ok(())
}
