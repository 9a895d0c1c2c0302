//! The flow's attention caches in a pool of fixed slots, allocated once: every stream that holds
//! a slot keeps its keys and values at fixed addresses, so a chunk's solve writes each block's
//! new keys in place and attends over the slot under a mask, with no cache copied, concatenated
//! or trimmed per chunk, and one CUDA graph per batch size serves any mix of streams.
//!
//! Layout: keys and values `[steps, depth, 2 (S + 1), h, cap, hd]` each; row `c (S + 1) + s` is
//! slot `s`'s CFG half `c` (0 = conditional, 1 = unconditional); slot `S` is scratch (a padded
//! batch's spare rows).
//!
//! What a slot holds is exactly the reference's cache (`EstimatorCache::trim`): call the cache in
//! the reference's order (newest chunk first) `Seq`; a slot stores `Seq` reversed, entry by entry
//! in the order they were appended (each chunk's frames last to first). The reference's trim keeps
//! `Seq`'s first `P` entries (P = prompt frames) and its last `H` (H = history): here the first
//! `H` entries ever appended, which stay where they are, and the last `P` appended, which live in
//! a ring of `cap - H` positions. Attention is order-free, so attending over the valid positions
//! gives what the reference gives (up to the order of a sum).

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor};

use super::dit::EstimatorCache;
use super::flow::FlowConfig;

/// The pool.
pub struct FlowPool {
    k: Tensor,
    v: Tensor,
    slots: usize,
    cap: usize,
    history: usize,
    max_chunk: usize,
    free: Mutex<Vec<usize>>,
}

impl std::fmt::Debug for FlowPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowPool")
            .field("slots", &self.slots)
            .field("cap", &self.cap)
            .finish_non_exhaustive()
    }
}

impl FlowPool {
    /// What one slot of `cap` positions takes of the device's memory (keys and values of every
    /// Euler step and block, both CFG halves), as [`FlowPool::new`] allocates it.
    pub fn slot_bytes(cfg: &FlowConfig, cap: usize, dtype: DType) -> usize {
        2 * Self::plane_shape(cfg, 1, cap).iter().product::<usize>() * dtype.size_in_bytes()
    }

    /// The keys' (and the values') shape for `slots` slots of `cap` positions.
    fn plane_shape(cfg: &FlowConfig, slots: usize, cap: usize) -> [usize; 6] {
        let e = &cfg.estimator;
        [cfg.n_timesteps, e.depth, 2 * slots, e.num_heads, cap, e.head_dim]
    }

    /// `slots` slots of `cap` positions each; a stream takes a slot only if its prompt plus a chunk
    /// of `max_chunk` frames fits the ring.
    pub fn new(
        cfg: &FlowConfig,
        slots: usize,
        cap: usize,
        max_chunk: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Arc<Self>> {
        if slots == 0 || cap <= cfg.history_frames + max_chunk {
            candle_core::bail!(
                "flow pool: {slots} slots of {cap} positions cannot hold {} history frames and a \
                chunk of {max_chunk}",
                cfg.history_frames
            );
        }
        // (and the scratch slot)
        let shape = Self::plane_shape(cfg, slots + 1, cap);
        Ok(Arc::new(Self {
            k: Tensor::zeros(&shape, dtype, dev)?,
            v: Tensor::zeros(&shape, dtype, dev)?,
            slots,
            cap,
            history: cfg.history_frames,
            max_chunk,
            free: Mutex::new((0..slots).rev().collect()),
        }))
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The device memory the pool holds (its scratch slot too).
    pub fn bytes(&self) -> usize {
        (self.k.elem_count() + self.v.elem_count()) * self.k.dtype().size_in_bytes()
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Slots free now.
    pub fn free_slots(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The ring's length (positions after the `H` fixed ones).
    fn ring(&self) -> usize {
        self.cap - self.history
    }

    /// The pool row of slot `s`'s CFG half `c`.
    pub fn row(&self, s: usize, c: usize) -> u32 {
        (c * (self.slots + 1) + s) as u32
    }

    /// Euler step `step`'s keys and values, `[depth, 2 (S + 1), h, cap, hd]` each.
    pub fn step_planes(&self, step: usize) -> Result<(Tensor, Tensor)> {
        Ok((self.k.get(step)?, self.v.get(step)?))
    }

    /// A slot for a stream whose setup caches are `setup` with `prompt_frames` prompt frames,
    /// loaded with them; `None` if no slot is free or the prompt does not fit.
    pub fn lease(
        self: &Arc<Self>,
        setup: &EstimatorCache,
        prompt_frames: usize,
    ) -> Result<Option<FlowSlot>> {
        if prompt_frames + self.max_chunk > self.ring()
            || setup.len() > self.history + prompt_frames
        {
            return Ok(None);
        }
        let Some(index) = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop() else {
            return Ok(None);
        };
        let mut slot = FlowSlot {
            lease: Arc::new(Lease { pool: self.clone(), index }),
            appended: 0,
            keep_from: 0,
        };
        slot.load(setup)?;
        Ok(Some(slot))
    }

    /// The rows, new positions, key mask and frame ends of one step for `slots`, stream `i`'s chunk
    /// holding `frames[i]` frames, every chunk padded to `t` (the longest) and the batch to `pad`
    /// streams with scratch rows (rows `[cond of each stream; uncond of each]`). A chunk's padding
    /// goes where the stream's next entries will (masked now, overwritten then), so a stream
    /// whose slot [fits](FlowSlot::fits) `t` loses nothing to it.
    pub fn batch(
        &self,
        slots: &[&FlowSlot],
        frames: &[usize],
        t: usize,
        pad: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<PoolBatch> {
        let b = slots.len();
        if pad < b
            || frames.len() != b
            || t > self.max_chunk.max(self.ring())
            || frames.iter().any(|&f| f > t || f < 2)
        {
            candle_core::bail!(
                "flow pool batch: {b} streams of {frames:?} frames padded to {pad} streams of {t}"
            );
        }
        let n = 2 * pad;
        let (mut rows, mut pos, mut mask, mut ends) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n * t),
            Vec::with_capacity(n * self.cap),
            Vec::with_capacity(n),
        );
        for c in 0..2 {
            for i in 0..pad {
                match slots.get(i).zip(frames.get(i)) {
                    Some((s, &f)) => {
                        rows.push(self.row(s.index(), c));
                        pos.extend(s.new_positions(f, t));
                        mask.extend(s.mask_after(f));
                        ends.push(f as u32);
                    }
                    None => {
                        rows.push(self.row(self.slots, c));
                        pos.extend(0..t as u32);
                        mask.extend((0..self.cap).map(|j| {
                            if j < t {
                                0f32
                            } else {
                                f32::NEG_INFINITY
                            }
                        }));
                        ends.push(t as u32);
                    }
                }
            }
        }
        Ok(PoolBatch {
            rows: Tensor::new(rows.as_slice(), dev)?,
            pos: Tensor::from_vec(pos, (n, t), dev)?,
            mask: Tensor::from_vec(mask, (n, 1, 1, self.cap), dev)?.to_dtype(dtype)?,
            ends: Some(Tensor::new(ends.as_slice(), dev)?),
        })
    }
}

/// A chunk's view of the pool: `rows: [N]` u32, `pos: [N, T]` u32 (where each new frame goes),
/// `mask: [N, 1, 1, cap]` (0 where a key is valid after the new ones are stored, -inf elsewhere),
/// `ends: [N]` u32 (how many of the `T` frames are the row's chunk, the rest padding; `None` when
/// every row's chunk is all `T`: the conv caches are then the last frames).
#[derive(Debug, Clone)]
pub struct PoolBatch {
    pub rows: Tensor,
    pub pos: Tensor,
    pub mask: Tensor,
    pub ends: Option<Tensor>,
}

/// A slot taken; back in the pool when the last holder lets go.
struct Lease {
    pool: Arc<FlowPool>,
    index: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pool.free.lock().unwrap_or_else(|e| e.into_inner()).push(self.index);
    }
}

/// A stream's slot and what it holds (clones share the slot: a snapshot may be replayed, two
/// copies may not both go on).
#[derive(Clone)]
pub struct FlowSlot {
    lease: Arc<Lease>,
    /// Entries appended so far.
    appended: usize,
    /// Entries below this (and at or above `H`) were trimmed.
    keep_from: usize,
}

impl std::fmt::Debug for FlowSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowSlot")
            .field("index", &self.lease.index)
            .field("appended", &self.appended)
            .field("keep_from", &self.keep_from)
            .finish()
    }
}

impl FlowSlot {
    pub fn index(&self) -> usize {
        self.lease.index
    }

    pub fn pool(&self) -> &Arc<FlowPool> {
        &self.lease.pool
    }

    fn h(&self) -> usize {
        self.lease.pool.history
    }

    /// Valid entries appended after the fixed ones.
    fn ring_valid(&self) -> usize {
        self.appended.saturating_sub(self.h().max(self.keep_from))
    }

    /// The cache's length (the reference's `EstimatorCache::len`).
    pub fn len(&self) -> usize {
        self.appended.min(self.h()) + self.ring_valid()
    }

    pub fn is_empty(&self) -> bool {
        self.appended == 0
    }

    /// Whether a chunk of `t` frames fits beside what the ring holds.
    pub fn fits(&self, t: usize) -> bool {
        self.ring_valid() + t <= self.lease.pool.ring()
    }

    fn pos_of(&self, j: usize) -> u32 {
        let (h, ring) = (self.h(), self.lease.pool.ring());
        (if j < h { j } else { h + (j - h) % ring }) as u32
    }

    /// Where a chunk's frames `0..t` go (entries appended last frame first), and the frames
    /// `t..padded` of its padding (where the entries after them will go: not valid until then).
    fn new_positions(&self, t: usize, padded: usize) -> Vec<u32> {
        (0..padded)
            .map(|i| self.pos_of(if i < t { self.appended + t - 1 - i } else { self.appended + i }))
            .collect()
    }

    /// Valid entries, oldest appended first, once `t` more are appended.
    fn valid_after(&self, t: usize) -> impl DoubleEndedIterator<Item = usize> {
        let n = self.appended + t;
        let h = self.h();
        (0..n.min(h)).chain(h.max(self.keep_from)..n)
    }

    fn mask_after(&self, t: usize) -> Vec<f32> {
        let mut m = vec![f32::NEG_INFINITY; self.lease.pool.cap];
        for j in self.valid_after(t) {
            m[self.pos_of(j) as usize] = 0.0;
        }
        m
    }

    /// After a chunk of `t` frames: the entries are in, and the reference's trim to
    /// `prompt_frames + H` applies.
    pub fn advance(&mut self, t: usize, prompt_frames: usize) {
        self.appended += t;
        if self.len() > prompt_frames + self.h() {
            self.keep_from = self.appended - prompt_frames;
        }
    }

    /// Writes a cache in the reference's layout (`att: [steps, depth, 2, h, L, 2 hd]`) into this
    /// (empty) slot.
    fn load(&mut self, est: &EstimatorCache) -> Result<()> {
        let l = est.len();
        if l == 0 {
            return Ok(());
        }
        let pool = &self.lease.pool;
        let &[steps, depth, two, h, _, hd2] = est.att.dims() else {
            candle_core::bail!("flow cache of shape {:?}", est.att.shape())
        };
        let hd = hd2 / 2;
        let planes = steps * depth;
        let kp = pool.k.reshape((planes, 2 * (pool.slots + 1), h, pool.cap, hd))?;
        let vp = pool.v.reshape((planes, 2 * (pool.slots + 1), h, pool.cap, hd))?;
        let k = est.att.narrow(5, 0, hd)?.contiguous()?.reshape((planes, two, h, l, hd))?;
        let v = est.att.narrow(5, hd, hd)?.contiguous()?.reshape((planes, two, h, l, hd))?;
        // Seq[i] is entry l - 1 - i
        let pos: Vec<u32> = (0..l).map(|i| self.pos_of(l - 1 - i)).collect();
        let dev = pool.k.device();
        let rows = Tensor::new(&[pool.row(self.index(), 0), pool.row(self.index(), 1)], dev)?;
        let pos = Tensor::from_vec([pos.clone(), pos].concat(), (2, l), dev)?;
        crate::fused::kv_rows_store(&kp, &vp, &k, &v, &rows, &pos)?;
        self.appended = l;
        self.keep_from = 0;
        Ok(())
    }

    /// The slot's cache in the reference's layout and order, `[steps, depth, 2, h, L, 2 hd]`.
    pub fn materialize(&self) -> Result<Tensor> {
        let pool = &self.lease.pool;
        let order: Vec<u32> = self.valid_after(0).map(|j| self.pos_of(j)).rev().collect();
        let idx = Tensor::new(order.as_slice(), pool.k.device())?;
        let part = |t: &Tensor| -> Result<Tensor> {
            let halves = (0..2)
                .map(|c| {
                    t.narrow(2, pool.row(self.index(), c) as usize, 1)?
                        .contiguous()?
                        .index_select(&idx, 4)
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&halves, 2)
        };
        Tensor::cat(&[part(&pool.k)?, part(&pool.v)?], 5)
    }
}
