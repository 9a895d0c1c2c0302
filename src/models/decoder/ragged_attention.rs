//! The attention of a ragged step (`batch.rs`, `ragged_batch`): prompt chunks beside one-position
//! rows, every stream in a slot of the pool.
//!
//! The decode kernel gives every row its own pass over the positions it attends, so a prompt
//! chunk of n rows over a conversation of L positions reads the chunk's K/V n times over: on a
//! GPU, ~95 rows over 12k positions made a Thinker prefill step ~160 ms. Here the rows of a
//! stream that advances by at least [`SPAN_ROWS`] positions attend as matrix products over their
//! slot's positions with the causal mask among themselves ([`crate::attention::attend`], the
//! attention of the op-by-op path), in blocks of rows that bound the scores' memory; the other
//! rows go through the decode kernel together, as before.

use candle_core::{DType, Device, Result, Tensor};

use crate::attention::{attend, causal_mask, CausalMask};
use crate::batch_decode::decode_attention_batch;

/// A stream that advances by at least this many positions in a step attends by matrix products.
pub const SPAN_ROWS: usize = 16;

/// The most score elements one block of rows makes (each of `hq` heads × rows × positions): a
/// long chunk over a long conversation is cut into blocks of rows so that its scores stay within
/// this (64 Mi elements: 128 MiB in bf16).
const SCORES_PER_BLOCK: usize = 64 << 20;

/// One stream's rows in the step: rows `start..start + n` of the batch, its slot, and the position
/// of its first row (the positions its cache held before the step).
#[derive(Debug, Clone, Copy)]
pub(super) struct StreamRows {
    pub start: usize,
    pub n: usize,
    pub slot: usize,
    pub first: usize,
}

/// What a ragged step's attention runs, in row order; made once per step (the masks included)
/// and used by every layer.
pub(super) struct RaggedPlan {
    parts: Vec<Part>,
}

enum Part {
    /// Rows `start..start + n` through the decode kernel (the highest position among them known).
    Kernel { start: usize, n: usize, max_pos: usize },
    /// Rows `start..start + n` of one stream, attending its slot's first `held` positions; the
    /// rows are the last `n` of them.
    Block { start: usize, n: usize, slot: usize, held: usize, mask: CausalMask },
}

impl RaggedPlan {
    /// The plan of a step with these streams (in row order), or `None` when no stream advances
    /// by [`SPAN_ROWS`] (the decode kernel alone then).
    pub(super) fn new(
        streams: &[StreamRows],
        heads: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Option<Self>> {
        if !streams.iter().any(|s| s.n >= SPAN_ROWS) {
            return Ok(None);
        }
        let mut parts = Vec::new();
        let mut run: Option<(usize, usize, usize)> = None;
        for s in streams {
            if s.n < SPAN_ROWS {
                let last = s.first + s.n - 1;
                run = Some(match run {
                    Some((start, n, max_pos)) => (start, n + s.n, max_pos.max(last)),
                    None => (s.start, s.n, last),
                });
                continue;
            }
            if let Some((start, n, max_pos)) = run.take() {
                parts.push(Part::Kernel { start, n, max_pos });
            }
            let held = s.first + s.n;
            let rows = (SCORES_PER_BLOCK / (heads * held).max(1)).clamp(SPAN_ROWS, s.n);
            let mut done = 0;
            while done < s.n {
                let n = rows.min(s.n - done);
                let held = s.first + done + n;
                let mask = causal_mask(n, held, dtype, dev)?;
                parts.push(Part::Block { start: s.start + done, n, slot: s.slot, held, mask });
                done += n;
            }
        }
        if let Some((start, n, max_pos)) = run {
            parts.push(Part::Kernel { start, n, max_pos });
        }
        Ok(Some(Self { parts }))
    }

    /// The attention of every row (`heads: [rows, hq + 2 hkv, d]`, K/V already in the slots of
    /// `kc`, `vc: [slots + 1, hkv, cap, d]`): `[rows, hq, d]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend(
        &self,
        heads: &Tensor,
        hq: usize,
        hkv: usize,
        kc: &Tensor,
        vc: &Tensor,
        slots: &Tensor,
        pos: &Tensor,
    ) -> Result<Tensor> {
        let mut out = Vec::with_capacity(self.parts.len());
        for part in &self.parts {
            match part {
                &Part::Kernel { start, n, max_pos } => out.push(decode_attention_batch(
                    &heads.narrow(0, start, n)?,
                    hq,
                    hkv,
                    kc,
                    vc,
                    &slots.narrow(0, start, n)?,
                    &pos.narrow(0, start, n)?,
                    Some(max_pos),
                )?),
                Part::Block { start, n, slot, held, mask } => {
                    let q = heads.narrow(0, *start, *n)?.narrow(1, 0, hq)?.transpose(0, 1)?;
                    let k = kc.get(*slot)?.narrow(1, 0, *held)?;
                    let v = vc.get(*slot)?.narrow(1, 0, *held)?;
                    out.push(attend(&q, &k, &v, mask)?.transpose(0, 1)?);
                }
            }
        }
        if out.len() == 1 {
            out.pop().expect("one part").contiguous()
        } else {
            Tensor::cat(&out, 0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(spec: &[(usize, usize)]) -> Vec<StreamRows> {
        let mut start = 0;
        spec.iter()
            .enumerate()
            .map(|(slot, &(first, n))| {
                let s = StreamRows { start, n, slot, first };
                start += n;
                s
            })
            .collect()
    }

    fn shape(plan: &RaggedPlan) -> Vec<(char, usize, usize, usize)> {
        plan.parts
            .iter()
            .map(|p| match *p {
                Part::Kernel { start, n, max_pos } => ('k', start, n, max_pos),
                Part::Block { start, n, held, .. } => ('m', start, n, held),
            })
            .collect()
    }

    #[test]
    fn short_rows_share_the_kernel_and_prompt_chunks_go_in_blocks() -> Result<()> {
        let dev = Device::Cpu;
        let none = RaggedPlan::new(&rows(&[(5, 1), (0, 15), (9, 1)]), 8, DType::F32, &dev)?;
        assert!(none.is_none(), "no stream advances by {SPAN_ROWS}");
        // decode rows, a 20-row prompt chunk, two more decode rows
        let plan = RaggedPlan::new(
            &rows(&[(5, 1), (7, 1), (40, 20), (3, 1), (8, 1)]),
            8,
            DType::F32,
            &dev,
        )?
        .expect("a plan");
        assert_eq!(
            shape(&plan),
            vec![('k', 0, 2, 7), ('m', 2, 20, 60), ('k', 22, 2, 8)],
            "rows in order, each run's highest position"
        );
        // a chunk whose scores exceed a block: blocks of rows, each attending up to its last row
        let heads = SCORES_PER_BLOCK / 1000;
        let plan = RaggedPlan::new(&rows(&[(900, 40)]), heads, DType::F32, &dev)?.expect("a plan");
        let got = shape(&plan);
        assert!(got.len() > 1, "{got:?}");
        assert_eq!(got.iter().map(|p| p.2).sum::<usize>(), 40);
        assert_eq!(got.last().map(|p| p.3), Some(940));
        assert!(got.windows(2).all(|w| w[1].1 == w[0].1 + w[0].2 && w[1].3 == w[0].3 + w[1].2));
        Ok(())
    }

    /// Every row's attention from the plan equals the decode kernel's (its twin here) over the
    /// same slots: prompt chunks in one block and in several, beside one-position rows.
    #[test]
    fn the_plan_attends_as_the_decode_kernel_does() -> Result<()> {
        let dev = Device::Cpu;
        let (hq, hkv, d, cap) = (8, 2, 16, 96);
        let kc = Tensor::randn(0f32, 1.0, (4, hkv, cap, d), &dev)?;
        let vc = Tensor::randn(0f32, 1.0, (4, hkv, cap, d), &dev)?;
        let streams = rows(&[(5, 1), (30, 40), (0, 17), (60, 1)]);
        // each row's q at random, its k and v those its slot holds at its position (the step
        // stored them there before attention)
        let mut heads = Vec::new();
        let (mut slots, mut pos) = (Vec::new(), Vec::new());
        for s in &streams {
            for i in 0..s.n {
                let p = s.first + i;
                let q = (Tensor::randn(0f32, 0.3, (hq, d), &dev)?).contiguous()?;
                let k = kc.get(s.slot)?.narrow(1, p, 1)?.squeeze(1)?;
                let v = vc.get(s.slot)?.narrow(1, p, 1)?.squeeze(1)?;
                heads.push(Tensor::cat(&[q, k, v], 0)?);
                slots.push(s.slot as u32);
                pos.push(p as u32);
            }
        }
        let heads = Tensor::stack(&heads, 0)?;
        let slots = Tensor::new(slots.as_slice(), &dev)?;
        let pos = Tensor::new(pos.as_slice(), &dev)?;
        let want = decode_attention_batch(&heads, hq, hkv, &kc, &vc, &slots, &pos, None)?;
        for block_heads in [hq, SCORES_PER_BLOCK / (SPAN_ROWS * 20)] {
            let plan = RaggedPlan::new(&streams, block_heads, DType::F32, &dev)?.expect("a plan");
            let got = plan.attend(&heads, hq, hkv, &kc, &vc, &slots, &pos)?;
            assert_eq!(got.dims(), want.dims());
            let values = got.flatten_all()?.to_vec1::<f32>()?;
            assert!(values.iter().all(|x| x.is_finite()), "a NaN or Inf in the plan's attention");
            let diff = (&got - &want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(diff.is_finite() && diff < 1e-5, "{} parts: {diff}", plan.parts.len());
        }
        Ok(())
    }
}
