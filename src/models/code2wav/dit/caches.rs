//! The DiT's caches: where a chunk's attention finds the cached keys and values ([`Att`]), where
//! an evaluation writes its new caches ([`Sink`]), and the per-step caches a batch keeps
//! ([`EstimatorCache`]).

use candle_core::{Result, Tensor};

use super::super::dit_attention::PoolAttention;
use super::DitConfig;

/// Where a chunk's attention finds the cached keys and values: for the whole estimator
/// ([`Dit::forward_kv`](super::Dit::forward_kv): tensors with a leading `depth` axis) or for one
/// block.
#[derive(Debug, Clone, Copy)]
pub enum Att<'a> {
    /// No cache (the prompt's chunk).
    Empty,
    /// Keys and values apart (`[N, h, L, hd]` each, contiguous); the new ones go before them, and
    /// `mask` (`[N, 1, 1, T + L]`, 0 or -inf) over `[new; cache]` masks a padded cache's padding.
    Joined { k: &'a Tensor, v: &'a Tensor, mask: Option<&'a Tensor> },
    /// A slot pool's planes (`[rows, h, cap, hd]` each, see
    /// [`super::slots`](crate::code2wav::slots)): the new keys are stored at `pos` (`[N, T]`) of
    /// rows `rows` (`[N]`), then each row attends over its row under `mask` (`[N, 1, 1, cap]`), the
    /// way `mode` says
    /// ([`super::dit_attention::attend_pool`](crate::code2wav::dit_attention::attend_pool)).
    Pool {
        k: &'a Tensor,
        v: &'a Tensor,
        rows: &'a Tensor,
        pos: &'a Tensor,
        mask: &'a Tensor,
        mode: PoolAttention,
    },
}

impl<'a> Att<'a> {
    /// Block `i`'s share of an estimator-wide cache.
    pub(super) fn block(&self, i: usize) -> Result<BlockAtt<'a>> {
        Ok(match *self {
            Att::Empty => BlockAtt::Empty,
            Att::Joined { k, v, mask } => BlockAtt::Joined { k: k.get(i)?, v: v.get(i)?, mask },
            Att::Pool { k, v, rows, pos, mask, mode } => {
                BlockAtt::Pool { k: k.get(i)?, v: v.get(i)?, rows, pos, mask, mode }
            }
        })
    }
}

/// One block's share of an [`Att`] (owned views).
pub(super) enum BlockAtt<'a> {
    Empty,
    Joined {
        k: Tensor,
        v: Tensor,
        mask: Option<&'a Tensor>,
    },
    Pool {
        k: Tensor,
        v: Tensor,
        rows: &'a Tensor,
        pos: &'a Tensor,
        mask: &'a Tensor,
        mode: PoolAttention,
    },
}

impl BlockAtt<'_> {
    pub(super) fn as_att(&self) -> Att<'_> {
        match self {
            BlockAtt::Empty => Att::Empty,
            BlockAtt::Joined { k, v, mask } => Att::Joined { k, v, mask: *mask },
            BlockAtt::Pool { k, v, rows, pos, mask, mode } => {
                Att::Pool { k, v, rows, pos, mask, mode: *mode }
            }
        }
    }
}

/// Where an estimator evaluation writes its new caches, in place: `cnn` `[depth, N, 2, 2 H]`,
/// `att` `[depth, N, h, T + L, 2 hd]` (K | V on the last axis; `None` for a pool's caches, which
/// are written into the pool), both contiguous (views of a solve's per-step buffers: no copy
/// gathers them afterwards).
#[derive(Debug, Clone)]
pub struct Sink<'a> {
    pub cnn: &'a Tensor,
    pub att: Option<&'a Tensor>,
    /// Where each row's frames end (`[N]` u32), when the rows are chunks of different lengths
    /// padded to the longest: the conv caches are taken there.
    pub ends: Option<&'a Tensor>,
}

/// One block's share of a [`Sink`].
pub(super) struct BlockSink<'a> {
    pub(super) cnn: &'a Tensor,
    pub(super) att: Option<&'a Tensor>,
    pub(super) ends: Option<&'a Tensor>,
}

impl Sink<'_> {
    /// Buffers for `steps` evaluations (a leading axis) over `n` rows of `t` frames with caches of
    /// `l` (no attention buffer with `pooled`), in `like`'s dtype and device.
    pub fn buffers(
        cfg: &DitConfig,
        steps: usize,
        n: usize,
        t: usize,
        l: usize,
        pooled: bool,
        like: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (dt, dev) = (like.dtype(), like.device());
        // SAFETY: left uninitialised because the evaluations write every element before anything
        // reads it: block i of step s writes all of `cnn[s, i]` ([`dit_ops::conv_tails_into`] or a
        // whole-slice `slice_set`) and all of `att[s, i]` ([`dit_ops::kv_join_into`] over every
        // row and position); a solve that fails drops them unread.
        let cnn = unsafe { Tensor::empty((steps, cfg.depth, n, 2, 2 * cfg.hidden_size), dt, dev) }?;
        let att = if pooled {
            None
        } else {
            Some(unsafe {
                Tensor::empty(
                    (steps, cfg.depth, n, cfg.num_heads, t + l, 2 * cfg.head_dim),
                    dt,
                    dev,
                )
            }?)
        };
        Ok((cnn, att))
    }
}

/// Per-step estimator caches of a batch: `att: [steps, depth, N, h, L, 2 hd]`,
/// `cnn: [steps, depth, N, 2, 2 H]` (N = rows of the CFG-doubled batch).
#[derive(Debug, Clone)]
pub struct EstimatorCache {
    pub att: Tensor,
    pub cnn: Tensor,
}

impl EstimatorCache {
    pub fn len(&self) -> usize {
        self.att.dim(4).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The reference's trim (`Token2wav._trim_estimator_cache`): once longer than
    /// `prompt_frames + history`, keep the first `prompt_frames` entries and the last `history`.
    /// (The cache is newest-first, so this keeps the newest frames plus the oldest prompt frames'
    /// tail; reproduced as the reference does it.)
    pub fn trim(&mut self, prompt_frames: usize, history: usize) -> Result<()> {
        let l = self.len();
        if l > prompt_frames + history {
            self.att = Tensor::cat(
                &[
                    &self.att.narrow(4, 0, prompt_frames)?,
                    &self.att.narrow(4, l - history, history)?,
                ],
                4,
            )?;
        }
        Ok(())
    }
}
